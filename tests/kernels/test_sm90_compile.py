"""Every Triton kernel variant compiles for the H200 (sm_90) on the CPU: tests/kernels/sm90_compile.py run
in a subprocess without the interpreter (which the rest of the suite installs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton.backends import backends


@pytest.mark.skipif("nvidia" not in backends, reason="triton without its NVIDIA backend")
def test_triton_kernels_compile_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    # 15 attention (one of them Gluon), 4 KV store, 22 FusedMoE + 37 W4A8 FusedMoE (the 5 built-in
    # configs: gate-up with and without the e4m3 intermediate, down; with the subnormal widening, gate-up
    # and down; two K blocks of several groups, gate-up and down; the 4 pair-block gate-ups again with
    # their K split in 2 and 4) + 7 Gluon FusedMoE + 12 persistent Gluon FusedMoE GEMMs (gate-up and
    # down, FP8 with two activation scalings each and bf16, 128 and 64 columns), 2 router variants, 6 fused all-reduce + RMSNorm
    # (one-shot and two-shot for 2, 4 and 8 ranks)
    assert len(compiled) == 105, result.stdout
