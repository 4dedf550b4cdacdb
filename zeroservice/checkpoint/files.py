"""Atomic files and checksummed segments: the byte-level layer of a checkpoint.

[Note: segments]
A rank file is a plain concatenation of raw arrays. Each array (one parameter's
slice of one kind of state) is a *segment*: the manifest records its file, byte
offset, length, dtype and element range, and a CRC-32 for every block of
``BLOCK_BYTES``. A reader that needs only part of a segment reads and checks only
the blocks it covers, so resharding reads what it needs and still detects any
corruption in it.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, BinaryIO

import torch

from .storage import Location, Reader, storage_for
from .storage import fsync_dir as fsync_dir  # save.py's directory sync

BLOCK_BYTES = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or incompatible; the message names
    the file and what is wrong."""


class SaveFailed(CheckpointError):
    """A save that did not commit (a full disk, an I/O error) on some rank. Every rank
    raises it; nothing of the save is left, the previous checkpoint stays the newest
    complete one, and training may go on and save again later."""


def atomic_file(path: Location) -> contextlib.AbstractContextManager[BinaryIO]:
    """A file (or object) that appears whole at ``path`` when the block ends, or not at
    all: readers see the old one or the new one (see storage.py). On any failure
    nothing of it is left (a full disk must not keep what was half written)."""
    return storage_for(path).write_file(path)


def atomic_write_bytes(path: Location, data: bytes) -> None:
    storage_for(path).write_bytes(path, data)


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy().data)


def write_segment(f: BinaryIO, tensor: torch.Tensor) -> dict[str, Any]:
    """Append one array; return its offset, length and block checksums."""
    offset = f.tell()
    raw = _raw(tensor)
    f.write(raw)
    crcs = [zlib.crc32(raw[i : i + BLOCK_BYTES]) for i in range(0, len(raw), BLOCK_BYTES)]
    return {"offset": offset, "bytes": len(raw), "crc32": crcs, "dtype": _dtype_name(tensor)}


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


def _check_segment(seg: dict[str, Any], dtype: torch.dtype, size: int, where, what: str) -> None:
    """A segment's description agrees with itself: its bytes are its elements in its
    dtype, and masters and optimizer states are floating point. The checksums cover
    the bytes alone, so a dtype edited in the manifest (exp_avg read as float16, a
    master as int32) would otherwise load garbage without a word."""
    elements = seg["end"] - seg["start"]
    if seg["bytes"] != elements * size:
        raise CheckpointError(
            f"{where}: {what} is {seg['bytes']} bytes in the manifest, but {elements} "
            f"elements of {seg['dtype']} are {elements * size}"
        )
    if seg.get("kind") != "buffer" and not dtype.is_floating_point:
        raise CheckpointError(
            f"{where}: {what} is {seg['dtype']} in the manifest; masters and optimizer "
            "states are floating point"
        )


class SegmentReader:
    """Reads element ranges of segments from rank files, checking the blocks it reads."""

    def __init__(self, directory: Location, files: dict[str, int]):
        self.directory = directory
        self.storage = storage_for(directory)
        self.expected_sizes = files
        self._open: dict[str, Reader] = {}

    def check_files(self, names: set[str]) -> None:
        for name in sorted(names):
            path = self.directory / name
            size, want = self.storage.size(path), self.expected_sizes[name]
            if size is None:
                raise CheckpointError(f"{path}: missing (the manifest lists it)")
            if size != want:
                raise CheckpointError(
                    f"{path}: truncated or altered: {size} bytes, manifest says {want}"
                )

    def _file(self, name: str) -> Reader:
        if name not in self._open:
            self._open[name] = self.storage.open_read(self.directory / name)
        return self._open[name]

    def read(
        self,
        seg: dict[str, Any],
        start: int,
        end: int,
        what: str,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elements [start, end) of the segment (segment-relative), checksummed.

        ``out`` (CPU, contiguous, the segment's dtype): read the whole segment straight
        into it, with no staging copy."""
        dtype = dtype_of(seg["dtype"])
        size = torch.empty((), dtype=dtype).element_size()
        _check_segment(seg, dtype, size, self.directory / seg["file"], what)
        lo, hi = start * size, end * size
        first, last = lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES
        block_lo = first * BLOCK_BYTES
        block_hi = min(seg["bytes"], (last + 1) * BLOCK_BYTES)
        whole = out is not None and lo == 0 and hi == seg["bytes"] and out.dtype == dtype
        staging = bytearray(0 if whole else block_hi - block_lo)
        if whole:
            assert out is not None
            view = out.reshape(-1).view(torch.uint8).numpy().data
        else:
            view = memoryview(staging)
        f = self._file(seg["file"])
        f.seek(seg["offset"] + block_lo)
        if f.readinto(view) != len(view):
            raise CheckpointError(f"{self.directory / seg['file']}: ends early, inside {what}")
        for i, block in enumerate(range(first, last + 1)):
            piece = view[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]
            if zlib.crc32(piece) != seg["crc32"][block]:
                raise CheckpointError(
                    f"{self.directory / seg['file']}: checksum mismatch in {what} "
                    f"(block {block} at byte {seg['offset'] + block * BLOCK_BYTES})"
                )
        if whole:
            assert out is not None
            return out
        # A view of the read buffer, no second copy (the tensor keeps the buffer alive).
        raw = torch.frombuffer(staging, dtype=torch.uint8, offset=lo - block_lo, count=hi - lo)
        result = raw.view(dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
