"""The command line as a user meets it: every mistake is one `error:` line (no traceback), the pass
table fits a terminal, long steps show progress."""

from __future__ import annotations

import re

import pytest

from hy3c.cli import main
from hy3c.compiler.driver import compile_artifact
from hy3c.compiler.inspect_artifact import TABLE_WIDTH
from hy3c.recipe import load_recipe


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "art"
    compile_artifact(
        load_recipe("h20-w8a8c8", ["quant.activations=dynamic"]), out, tiny_ckpt, dump_graphs=True
    )
    return out


def _cases(art, ckpt, tmp):
    """(argv, text the error line must contain)."""
    return [
        (["--log-level", "foo", "inspect", str(art), "passes"], "unknown level 'foo'"),
        (["generate", "--model", str(tmp / "nope"), "--prompt", "x"], "does not exist"),
        (["generate", "--artifact", str(tmp / "nope"), "--prompt", "x"], "does not exist"),
        (["generate", "--model", str(ckpt / "config.json"), "--prompt", "x"], "not a directory"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--temperature", "-1"], "must be 0 or more"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--temperature", "nan"], "finite number"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--top-p", "0"], "(0, 1]"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--top-k", "-1"], "must be 0 or more"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--min-p", "2"], "[0, 1]"),
        (["generate", "--model", str(ckpt), "--prompt", "x", "--page-size", "0"], "positive integer"),
        (["compile", "--model", str(tmp / "nope"), "--recipe", "cpu-reference", "--out", str(tmp / "o")],
         "does not exist"),
        (["compile", "--model", str(ckpt), "--recipe", "nope", "--out", str(tmp / "o")], "unknown recipe"),
        (["compile", "--model", str(ckpt), "--recipe", "cpu-reference", "--out", str(tmp / "o"),
          "--set", "quant.bogus=1"], "quant.bogus"),
        (["compile", "--model", str(ckpt), "--recipe", "cpu-reference", "--out", str(art)], "--overwrite"),
        (["convert-fp8", "--model", str(tmp / "nope"), "--out", str(tmp / "o")], "does not exist"),
        (["inspect", str(tmp / "nope"), "passes"], "does not exist"),
        (["inspect", str(ckpt), "passes"], "manifest.json"),
        (["inspect", str(art), "graph"], "--after"),
        (["inspect", str(art), "graph", "--after", "lower", "--layer", "99"], "--layer 99"),
        (["inspect", str(art), "ops", "--after", "nope"], "no pass 'nope'"),
        (["inspect", str(art), "diff", "lower"], "two pass names"),
        (["init-checkpoint", "--out", str(tmp / "c"), "--preset", "huge"], "unknown preset"),
        (["serve"], "the following arguments are required: artifact"),
        (["inspect", str(art), "nonsense"], "invalid choice"),
        (["inspect", str(art), "passes", "--bogus"], "unrecognized arguments: --bogus"),
    ]  # fmt: skip


def test_every_mistake_is_one_error_line(artifact, tiny_ckpt, tmp_path, capsys):
    for argv, message in _cases(artifact, tiny_ckpt, tmp_path):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
        err = capsys.readouterr().err
        assert status == 2, (argv, status, err)
        assert "Traceback" not in err, (argv, err)
        assert len(err.splitlines()) == 1 and err.startswith("error:") and message in err, (argv, err)


def test_pass_table_fits_the_terminal_and_lower_row_is_summarised(artifact, capsys):
    assert main(["inspect", str(artifact), "passes"]) == 0
    table = capsys.readouterr().out
    assert max(len(line) for line in table.splitlines()) <= TABLE_WIDTH
    lines = table.splitlines()
    # one table per program: the step program's first, then the MTP draft program's
    starts = [i for i, line in enumerate(lines) if line.startswith("lower")]
    assert len(starts) == 2
    start = starts[0]
    row = [lines[start]]
    for line in lines[start + 1 :]:  # the note wraps under its column
        if not line.startswith(" "):
            break
        row.append(line)
    lower = " ".join(line.strip() for line in row)
    assert "inspect ops --after lower" in lower and "hy3_triton." not in lower
    assert re.search(r"configs: \S", lower)
    assert main(["inspect", str(artifact), "ops", "--after", "lower"]) == 0
    ops = capsys.readouterr().out
    assert "providers (lower):" in ops and "hy3.fused_moe: triton×2" in ops
    assert main(["inspect", str(artifact), "graph", "--after", "lower", "--layer", "1"]) == 0
    layer = capsys.readouterr().out
    assert layer and all(line.endswith("# layers.1") for line in layer.splitlines() if line)


def test_compile_shows_progress_over_the_trace_and_each_pass(tiny_ckpt, tmp_path, capsys):
    recipe = load_recipe("cpu-reference")
    compile_artifact(recipe, tmp_path / "art", tiny_ckpt, progress=True)
    err = capsys.readouterr().err
    assert f"{1 + len(recipe.passes)}/{1 + len(recipe.passes)}" in err and "compile" in err


_HEAVY = ("torch._inductor", "torch._dynamo", "hy3c.passes", "hy3c.compiler.driver", "hy3c.compiler.trace")


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{art}", "passes"],
        ["inspect", "{art}", "cache-key"],
        ["compile", "--model", "{ckpt}", "--recipe", "nope", "--out", "{tmp}/o"],
        ["serve", "{tmp}/missing"],
        ["generate", "--model", "{tmp}/missing", "--prompt", "x"],
        ["--help"],
    ],
)
def test_cheap_commands_do_not_load_the_compiler(argv, artifact, tiny_ckpt, tmp_path):
    """Inspecting, asking for help and simple mistakes answer without importing the compiler or Inductor
    (they cost seconds of CPU before any message)."""
    import json
    import subprocess
    import sys

    args = [a.format(art=artifact, ckpt=tiny_ckpt, tmp=tmp_path) for a in argv]
    probe = (
        "import json, sys\n"
        "from hy3c.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps([m for m in sys.modules if m.startswith({_HEAVY!r})]))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [], run.stderr
