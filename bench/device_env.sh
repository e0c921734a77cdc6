# Source (do not pipe) on a GPU machine without network, from the checkout's root: builds /tmp/hy3c-run,
# a tree where `hy3c` is the package as installed (passes/ kernels/ serve/ recipes/ mapped into it by
# symlinks) beside links to tests/, bench/ and pyproject.toml, and cds there; installs wheels carried
# in .whl/ (e.g. pydantic) into /tmp/site.
#   source bench/device_env.sh && python3 -m pytest -m gpu tests/...
# The GPU machine lacks the serving stack; fetch its wheels here first (Python 3.12, x86-64):
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp --no-deps -d .whl \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi starlette \
#     annotated-doc anyio idna uvicorn h11 click httptools uvloop opentelemetry-api
run=/tmp/hy3c-run
# Sourced again from inside the tree it built (a bench script run by a driver that sourced it): done.
if [ "$(pwd)" = "$run" ] && [ -n "${HY3C_RUN_READY:-}" ]; then return 0; fi
repo=$(pwd)
rm -rf "$run" && mkdir -p "$run/hy3c"
for entry in "$repo"/hy3c/*; do ln -s "$entry" "$run/hy3c/$(basename "$entry")"; done
for sub in passes kernels serve recipes; do ln -sfn "$repo/$sub" "$run/hy3c/$sub"; done
for top in tests bench pyproject.toml .whl; do [ -e "$repo/$top" ] && ln -sfn "$repo/$top" "$run/$top"; done
if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$run${PYTHONPATH:+:$PYTHONPATH}
cd "$run" || return 1
export HY3C_RUN_READY=1
python3 -c "import hy3c.kernels, hy3c.passes, torch, triton; print('hy3c ready:', torch.__version__, triton.__version__, torch.cuda.get_device_name())"
