"""Consolidate a sharded checkpoint into one file, and describe one for people.

Export streams: it reads one parameter's segments from the rank files, writes them,
and drops them before the next, so its peak memory is one parameter, not the model.
The default output is safetensors (header first, then raw arrays), written here
directly so that the header can be computed from the manifest before any data is
read. ``.pt`` output builds a whole state dict in memory (torch.save needs one).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..tensor_parallel import merge_mp_slices
from .files import CheckpointError, SegmentReader, dtype_of
from .manifest import entry_names, read_manifest
from .storage import Location, Where, location

_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def iter_tensors(directory: Where, kind: str = "master") -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors of one kind (``master``: the fp32 parameters; or an optimizer state,
    e.g. ``exp_avg``), one at a time, checksummed."""
    directory = location(directory)
    manifest = read_manifest(directory)
    reader = SegmentReader(directory, manifest["files"])
    reader.check_files(set(manifest["files"]))
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for seg in manifest["segments"]:
        by_key.setdefault((seg["param"], seg["kind"]), []).append(seg)
    try:
        for p in manifest["params"]:
            segs = sorted(by_key.get((p["name"], kind), []), key=lambda s: s["start"])
            whole = _assemble(reader, segs, p["numel"], p["name"], kind, "float32")
            yield p["name"], whole.view(p["shape"])
    finally:
        reader.close()


def _assemble(
    reader: SegmentReader,
    segs: list[dict[str, Any]],
    numel: int,
    name: str,
    kind: str,
    dtype: str,
) -> torch.Tensor:
    """One tensor whole from its segments; ``dtype``: its own where it has none (a
    tensor of no elements, whose save wrote no segment)."""
    if not segs and numel == 0:
        return torch.empty(0, dtype=dtype_of(dtype))
    if not segs:
        raise CheckpointError(f"{reader.directory}: no {kind} data for {name}")
    out = torch.empty(numel, dtype=dtype_of(segs[0]["dtype"]))
    covered = 0
    for seg in segs:
        reader.read(seg, 0, seg["end"] - seg["start"], name, out=out[seg["start"] : seg["end"]])
        covered += seg["end"] - seg["start"]
    if covered != numel:
        raise CheckpointError(f"{reader.directory}: {kind} of {name} covers {covered}/{numel}")
    return out


class _Entry(NamedTuple):
    """One tensor the export writes: its manifest record, what it is (``master`` or
    ``buffer``), its dtype and whole shape, and the names it is written under."""

    record: dict[str, Any]
    kind: str
    dtype: str
    shape: list[int]
    numel: int
    names: list[str]


class _Slice:
    """One checkpoint's tensors, read whole: the only one, or one MP rank's."""

    def __init__(self, directory: Location, manifest: dict[str, Any]):
        self.manifest = manifest
        self.reader = SegmentReader(directory, manifest["files"])
        self.reader.check_files(set(manifest["files"]))
        self.segments: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for seg in manifest["segments"]:
            if seg["kind"] == "buffer" and seg.get("rank", 0) != 0:
                continue  # a rank's own buffers (``rank_buffers``): the export is rank 0's
            self.segments.setdefault((seg["param"], seg["kind"]), []).append(seg)

    def tensor(self, entry: dict[str, Any], kind: str) -> torch.Tensor:
        name = entry["name"]
        segs = sorted(self.segments.get((name, kind), []), key=lambda s: s["start"])
        dtype = entry.get("dtype", "float32")  # a buffer's own; masters and states: fp32
        whole = _assemble(self.reader, segs, entry["numel"], name, kind, dtype)
        return whole.view(entry["shape"])


def _mp_slices(
    directory: Location, manifest: dict[str, Any]
) -> list[tuple[Location, dict[str, Any]]]:
    """The checkpoint, or with model parallelism the same step of every MP rank
    (``.../mp-RR-of-MM/step-N``, any of them named), in MP-rank order, each checked to
    be the same save."""
    mp = int(manifest.get("mp", 1))
    if mp == 1:
        return [(directory, manifest)]
    if "mp_splits" not in manifest:
        raise CheckpointError(
            f"{directory}: a model-parallel checkpoint that does not record how its "
            "parameters are split (saved by an older version): it cannot be exported whole"
        )
    root, step = directory.parent.parent, directory.name
    out = []
    for r in range(mp):
        where = root / f"mp-{r:02d}-of-{mp:02d}" / step
        m = manifest if where == directory else read_manifest(where)
        if (m.get("mp"), m.get("mp_rank"), m["step"]) != (mp, r, manifest["step"]):
            raise CheckpointError(
                f"{where}: not MP rank {r} of {mp} at step {manifest['step']} "
                f"(it says rank {m.get('mp_rank')} of {m.get('mp')} at step {m['step']})"
            )
        out.append((where, m))
    return out


EXPORT_PREFIX = "export_prefix"
"""The client-state key that names the prefix export strips by default: a caller that
trains a wrapper around the user's model (the service wraps a ``transformers`` model
as ``model``) records it, so that the exported names are the user's model's own."""


def export_checkpoint(
    directory: Where, out: str | Path, fmt: str = "safetensors", prefix: str | None = None
) -> Path:
    """Write the full-precision parameters (and persistent buffers) as one file that
    ``model.load_state_dict`` accepts; ``directory`` may be an object-store URI, ``out``
    is a local file. ``prefix``: only the names under it, written without it (``""``:
    every name as saved); None: the prefix the checkpoint's client state records under
    ``EXPORT_PREFIX``, if any."""
    if fmt not in ("safetensors", "pt"):
        raise CheckpointError(f"format: {fmt!r} is not 'safetensors' or 'pt'")
    directory, out = location(directory), Path(out)
    # Before any byte is read: a destination that cannot be written fails at once.
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a directory: name the file to write", str(out))
    if not out.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory to write into", str(out.parent))
    if out.exists() and not out.is_file():
        # The file is written beside it and renamed over it: a device, a pipe or a
        # socket would be replaced by a regular file.
        raise OSError(errno.EINVAL, "not a regular file: name a file to write", str(out))
    with contextlib.ExitStack() as readers:
        slices = []
        for where, m in _mp_slices(directory, read_manifest(directory)):
            slices.append(_Slice(where, m))
            readers.callback(slices[-1].reader.close)
        _export(slices, directory, out, fmt, prefix)
    return out


def _export(
    slices: list[_Slice], directory: Location, out: Path, fmt: str, prefix: str | None
) -> None:
    """What ``export_checkpoint`` writes, from the checkpoint's one slice or its MP ranks'."""
    manifest = slices[0].manifest
    if prefix is None:
        prefix = str(manifest.get("client_state", {}).get(EXPORT_PREFIX, ""))
    splits: dict[str, list[int]] = manifest.get("mp_splits", {})
    saved: list[_Entry] = []
    for p in manifest["params"]:
        shape, numel = list(p["shape"]), p["numel"]
        if (split := splits.get(p["name"])) is not None:
            shape[split[0]] *= len(slices)
            numel *= len(slices)
        saved.append(_Entry(p, "master", "float32", shape, numel, entry_names(p)))
    for b in manifest.get("buffers", []):
        saved.append(_Entry(b, "buffer", b["dtype"], b["shape"], b["numel"], entry_names(b)))
    entries = _under(saved, prefix, directory)

    def tensor(entry: _Entry) -> torch.Tensor:
        split = splits.get(entry.record["name"]) if entry.kind == "master" else None
        if split is None:
            return slices[0].tensor(entry.record, entry.kind)
        return merge_mp_slices([s.tensor(entry.record, entry.kind) for s in slices], *split)

    _write(_temporary_beside(out), out, fmt, entries, tensor, manifest)


def _temporary_beside(out: Path) -> Path:
    """A new file of its own beside ``out`` (nothing of the user's is overwritten),
    created with mode 0666 so that the kernel applies the umask as to any new file."""
    while True:
        path = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return path
        except FileExistsError:
            continue


def _write(
    tmp: Path, out: Path, fmt: str, entries: list[_Entry], tensor, manifest: dict[str, Any]
) -> None:
    """``tmp`` written, then renamed ``out``; on any failure nothing is left."""
    try:
        if fmt == "pt":
            state = {}
            for entry in entries:
                value = tensor(entry)
                for name in entry.names:
                    state[name] = value
            torch.save(state, tmp)
        else:
            _write_safetensors(tmp, entries, tensor, manifest)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _under(entries: list[_Entry], prefix: str, directory: Location) -> list[_Entry]:
    """The entries under ``prefix``, each named without it; an entry with no name
    under it is left out. A prefix that no name has is an error."""
    out = []
    for entry in entries:
        kept = [n[len(prefix) :] for n in entry.names if n.startswith(prefix) and n != prefix]
        if kept:
            out.append(entry._replace(names=kept))
    if not out:
        first = sorted(e.record["name"] for e in entries)[:3]
        raise CheckpointError(
            f"{directory}: no parameter or buffer name begins with {prefix!r} "
            f"(names begin like {', '.join(first)})"
        )
    return out


def _write_safetensors(path: Path, entries: list[_Entry], tensor, manifest: dict[str, Any]) -> None:
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "zeroservice_step": str(manifest["step"])}
    }
    offset, order = 0, []
    for entry in entries:
        _, _, dtype, shape, numel, names = entry
        nbytes = numel * torch.empty((), dtype=dtype_of(dtype)).element_size()
        for name in names:
            code = _SAFETENSORS_DTYPES.get(dtype)
            if code is None:
                raise CheckpointError(f"{name}: dtype {dtype} has no safetensors code; use pt")
            span = [offset, offset + nbytes]
            header[name] = {"dtype": code, "shape": shape, "data_offsets": span}
            offset += nbytes
            order.append(entry)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for entry in order:  # a tied parameter is written once per name
            value = tensor(entry).contiguous()
            f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy().data))
        f.flush()
        os.fsync(f.fileno())


def _scalars(saved: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The scalar optimizer states: once where every group has the same (or the
    checkpoint kept one set, before they were kept per group), else group by group."""
    groups = [saved] if isinstance(saved, dict) else saved

    def one(specs: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v['value']}" for k, v in specs.items()) or "-"

    if all(g == groups[0] for g in groups[1:]):
        return one(groups[0]) if groups else "-"
    return "; ".join(f"group {i}: {one(g)}" for i, g in enumerate(groups))


def describe(directory: Where, verify: bool = False) -> str:
    """The manifest in readable form; ``verify`` also reads every byte and checks it."""
    directory = location(directory)
    m = read_manifest(directory)
    total = sum(m["files"].values())
    lines = [
        f"checkpoint {directory}",
        f"  format {m['format']} v{m['version']}, written {m.get('created', '?')}",
        f"  step {m['step']} (applied {m['engine']['applied_steps']})",
        f"  ZeRO stage {m['stage']}, {m['precision']}, world {m['world_size']} "
        f"(dp {m['dp']} x mp {m['mp']})",
        f"  {len(m['params'])} parameters, {m['psi']:,} elements; kinds: {', '.join(m['kinds'])}",
        f"  optimizer {m['optimizer']['class']}, scalars {_scalars(m['optimizer']['scalars'])}",
        f"  loss scaler: {m['engine'].get('loss_scaler') or '-'}",
        f"  client state: {json.dumps(m.get('client_state', {}))}",
        f"  files ({total / 2**20:.2f} MiB):",
    ]
    lines += [f"    {name}  {size:,} bytes" for name, size in sorted(m["files"].items())]
    if verify:
        reader = SegmentReader(directory, m["files"])
        try:
            reader.check_files(set(m["files"]))
            for seg in m["segments"]:
                reader.read(seg, 0, seg["end"] - seg["start"], f"{seg['kind']} of {seg['param']}")
        finally:
            reader.close()
        lines.append(f"  verified: {len(m['segments'])} segments, every checksum matches")
    return "\n".join(lines)
