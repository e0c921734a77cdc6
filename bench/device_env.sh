# Source on a GPU machine without network (the H200 image): makes `import hy3c` work from this checkout
# without pip (a symlink farm mapping passes/ kernels/ serve/ recipes/ into the hy3c package), and
# installs any wheels carried in .whl/ (e.g. pydantic) into /tmp/site.
#   source bench/device_env.sh
repo=$(pwd)
pkg=/tmp/hy3c-pkg/hy3c
rm -rf /tmp/hy3c-pkg && mkdir -p "$pkg"
for entry in "$repo"/hy3c/*; do ln -s "$entry" "$pkg/$(basename "$entry")"; done
for sub in passes kernels serve recipes; do ln -sfn "$repo/$sub" "$pkg/$sub"; done
export PYTHONPATH=/tmp/hy3c-pkg:$repo${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import hy3c.kernels, hy3c.passes, torch, triton; print('hy3c ready:', torch.__version__, triton.__version__, torch.cuda.get_device_name())"
