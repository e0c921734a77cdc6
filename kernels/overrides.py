"""Debugging overrides of the kernel variants a program chose — the one module that reads them from the
environment.

    HY3C_PDL=0|1     programmatic dependent launch off / on
    HY3C_GLUON=0|1   the Gluon kernels (prefill attention over bf16 KV, the one-token FusedMoE) off / on

Which variant each kernel runs is a compile-time choice: the `lower` pass decides it from the recipe
(`passes.lower.pdl`, `passes.lower.gluon`: auto, on or off) and the target, passes it to each kernel op as an
argument (`pdl=`, `gluon=`) and records it in the compile report (`hy3c inspect ART passes`). These
variables exist for A/B measurements and bisecting. Set while compiling, one replaces the recipe's
choice, and manifest.json records it (`overrides`); set while a program runs, it replaces what the
program says at every launch, logged once per process and value. `forced(variable, on)` sets one inside
a block (launches and CUDA-graph captures inside take it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from hy3c.logs import log_event

log = logging.getLogger("hy3c.kernels")

PDL = "HY3C_PDL"
GLUON = "HY3C_GLUON"
# variable → the variant it overrides: the kernel ops' argument and the `lower` config field
VARIANTS = {PDL: "pdl", GLUON: "gluon"}

_logged: set[tuple[str, str]] = set()


def _parse(variable: str, value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"{variable}={value!r}: set it to 0 (off) or 1 (on), or unset it")
    return value == "1"


def active() -> dict[str, bool]:
    """The override variables that are set, as on (True) / off (False); a value other than 0 or 1 is a
    ValueError naming the variable."""
    return {name: _parse(name, os.environ[name]) for name in VARIANTS if name in os.environ}


def variant(variable: str, chosen: bool) -> bool:
    """What a launch runs: `chosen` (the program's variant), unless `variable` is set (logged the first
    time each value is seen)."""
    value = os.environ.get(variable)
    if value is None:
        return chosen
    on = _parse(variable, value)
    if (variable, value) not in _logged:
        _logged.add((variable, value))
        log_event(
            log,
            "kernel_variant_override",
            level=logging.WARNING,
            variable=variable,
            value=value,
            effect=f"{VARIANTS[variable]} {'on' if on else 'off'} in every launch, whatever the program says",
        )
    return on


@contextmanager
def forced(variable: str, on: bool) -> Iterator[None]:
    """`variable` set to on/off inside the block and restored after it (for A/B measurements)."""
    previous = os.environ.get(variable)
    os.environ[variable] = "1" if on else "0"
    try:
        yield
    finally:
        os.environ.pop(variable, None)
        if previous is not None:
            os.environ[variable] = previous
