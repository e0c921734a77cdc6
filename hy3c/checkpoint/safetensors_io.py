"""Safetensors reading and writing, one tensor at a time.

* `CheckpointFiles.open(dir)` finds the weight files of a checkpoint (single `model.safetensors` or
  sharded with `model.safetensors.index.json`) and reads every header without touching tensor data.
* `ShardedWriter` writes tensors into size-capped shards plus an index, inside a temporary directory
  that the caller renames into place (`atomic_output_dir`), so a failure never leaves half a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory hy3c cannot load; the message names the file or tensors."""


@dataclass(frozen=True)
class TensorHeader:
    file: Path
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3", "F32"
    shape: tuple[int, ...]


def read_headers(file: Path) -> dict[str, TensorHeader]:
    """name → header of every tensor in one safetensors file (no tensor data is read)."""
    try:
        with safe_open(file, framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(name)
                out[name] = TensorHeader(file, sl.get_dtype(), tuple(sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


@dataclass
class CheckpointFiles:
    root: Path
    headers: dict[str, TensorHeader]

    @classmethod
    def open(cls, root: str | Path, names: tuple[str, str] = (INDEX_NAME, SINGLE_NAME)) -> CheckpointFiles:
        root = Path(root)
        index_name, single_name = names
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory")
        index = root / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
            headers: dict[str, TensorHeader] = {}
            for shard in sorted(set(weight_map.values())):
                path = root / shard
                if not path.is_file():
                    raise CheckpointError(f"{index}: references {shard}, which does not exist")
                headers.update(read_headers(path))
            listed, present = set(weight_map), set(headers)
            if listed != present:
                diff = sorted(listed ^ present)[:5]
                raise CheckpointError(f"{index}: weight_map disagrees with the shard contents (e.g. {diff})")
            for name, shard in weight_map.items():
                if headers[name].file.name != Path(shard).name:
                    raise CheckpointError(
                        f"{index}: {name} is listed in {shard} but stored in {headers[name].file.name}"
                    )
            return cls(root, headers)
        single = root / single_name
        if single.is_file():
            return cls(root, read_headers(single))
        raise CheckpointError(f"{root}: no {single_name} or {index_name}")

    @contextlib.contextmanager
    def reader(self) -> Iterator[Callable[[str], torch.Tensor]]:
        """A `read(name) -> tensor` function over all files (memory-mapped; one tensor copied per call)."""
        handles: dict[Path, Any] = {}
        with contextlib.ExitStack() as stack:

            def read(name: str) -> torch.Tensor:
                file = self.headers[name].file
                try:
                    if file not in handles:
                        handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                    return handles[file].get_tensor(name)
                except SafetensorError as exc:
                    raise CheckpointError(f"{file}: corrupt tensor data for {name} ({exc})") from None

            yield read


def check_output_dir(out: str | Path, overwrite: bool = False, inputs: Iterable[str | Path] = ()) -> None:
    """Refuse an output that exists (unless overwrite) or whose replacement would delete an input."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (--overwrite replaces it)")
    target = out.resolve()
    for source in inputs:
        source = Path(source).resolve()
        if target == source or target in source.parents:
            raise FileExistsError(
                f"{out}: replacing it would delete the input {source}; choose another output"
            )


@contextlib.contextmanager
def atomic_output_dir(
    out: str | Path, overwrite: bool = False, inputs: Iterable[str | Path] = ()
) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; rename it to `out` only if the block succeeds."""
    out = Path(out)
    check_output_dir(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _apply_umask_permissions(tmp)
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _replace(new: Path, out: Path) -> None:
    """Put directory `new` at `out`. An existing `out` is renamed aside first, `new` renamed into its
    place, and only then the old one deleted: an error or interrupt at any step leaves the old or the
    new output at `out` (at worst with a hidden `.<name>.old-*` directory beside it), never neither."""
    if not (out.exists() or out.is_symlink()):
        os.replace(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()  # a free name beside `out` (renaming onto an existing directory is not portable)
    os.rename(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _apply_umask_permissions(root: Path) -> None:
    """mkdtemp and some writers create owner-only entries; give them the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


class ShardedWriter:
    """Accumulate tensors and flush them into shards of at most `max_shard_bytes` (HF naming)."""

    def __init__(
        self,
        directory: Path,
        max_shard_bytes: int = 4 << 30,
        names: tuple[str, str] = (INDEX_NAME, SINGLE_NAME),
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.index_name, self.single_name = names
        self.metadata = metadata or {"format": "pt"}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        stem = self.single_name.removesuffix(".safetensors")  # writers may share a directory
        path = self.directory / f"{stem}-shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata=self.metadata)
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard and the index (if sharded); return the file names written."""
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            path, _ = self._shards[0]
            os.replace(path, self.directory / self.single_name)
            return [self.single_name]
        count = len(self._shards)
        stem = self.single_name.removesuffix(".safetensors")
        weight_map: dict[str, str] = {}
        files = []
        for i, (path, names) in enumerate(self._shards):
            final = f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
            files.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / self.index_name).write_text(json.dumps(index, indent=2, sort_keys=True))
        return [*files, self.index_name]
