"""The manifest: what a checkpoint holds and where, written last as its commit point.

A checkpoint directory is complete exactly when ``manifest.json`` exists: ranks write
their files first (each atomically), rank 0 writes the manifest after every rank
has reported. A crash at any moment before that leaves a directory without a
manifest, which readers skip.

[Note: the manifest's own digest]
The rank files' blocks carry CRCs, but those CRCs, offsets, element ranges and names
live in the manifest: a flipped digit there (a segment's ``start``, a parameter's
name, two labels exchanged) would read sound bytes into the wrong place, and every
check downstream would pass. So the manifest carries ``digest``, the SHA-256 of its
own content in a canonical form (keys sorted, no spaces, the digest left out), and a
reader refuses a manifest whose content does not hash to it, as damaged: a resume
passes over it to the previous sound checkpoint. The canonical form is taken from
the JSON as read back, so it does not depend on the writer's indentation, and
``json`` writes floats so that they read back exactly. Manifests of format version 2
and later are written with the digest and refused without it (a digest removed would
otherwise switch the check off); a version-1 manifest without the field (written
before it existed) is read as before. The step in the manifest must be the one its
directory is named for.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .files import CheckpointError, atomic_write_bytes
from .storage import Location, Storage, Where, location, storage_for

FORMAT = "zeroservice-checkpoint"
VERSION = 2
"""What this build writes: 2 always carries the digest."""
READ_VERSIONS = (1, 2)
"""What this build reads: 1, from before the digest, with or without it."""
MANIFEST = "manifest.json"
DIGEST = "digest"
STEP_DIR = re.compile(r"^step-(\d+)$")
MP_SLICE_DIR = re.compile(r"^mp-\d+-of-\d+$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def digest(manifest: dict[str, Any]) -> str:
    """The SHA-256 of ``manifest`` without its ``digest`` field, in canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def entry_names(record: dict[str, Any]) -> list[str]:
    """Every name a manifest's parameter or buffer entry is saved under (a tied
    parameter, a buffer two modules register: several; an older entry: its name)."""
    return record.get("names", [record["name"]])


def write_manifest(directory: Location, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` with its digest (see [Note: the manifest's own digest])."""
    # Through JSON once: keys become strings as a reader will see them (a client
    # state's int keys), so the digest is taken over what will be read.
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != DIGEST}))
    signed = body | {DIGEST: digest(body)}
    atomic_write_bytes(directory / MANIFEST, json.dumps(signed, indent=1).encode())


def _no_manifest(store: Storage, directory: Location, path: Location) -> str:
    """Why ``directory`` has no manifest, in the words a user needs: no such directory,
    a root of checkpoints rather than one of them, or a checkpoint never committed."""
    if not store.is_dir(directory):
        return f"{directory}: no such checkpoint directory"
    children = store.list_dirs(directory)
    slices = sorted(d for d in children if MP_SLICE_DIR.match(d))
    if slices:
        return (
            f"{directory}: a model-parallel job's checkpoints, one directory per MP rank "
            f"({', '.join(slices)}): name a step directory under any of them"
        )
    steps = sorted(d for d in children if STEP_DIR.match(d))
    if steps:
        return (
            f"{directory}: holds {len(steps)} step directories, not one checkpoint: "
            f"name one of them (the last: {directory / steps[-1]})"
        )
    return f"{path}: missing: the checkpoint is incomplete (never committed)"


def read_manifest(directory: Where) -> dict[str, Any]:
    """Load and check a manifest; errors name the file and the problem."""
    path = location(directory) / MANIFEST
    store = storage_for(path)
    try:
        if not store.is_file(path):
            raise CheckpointError(_no_manifest(store, location(directory), path))
        manifest = json.loads(store.read_bytes(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zeroservice checkpoint manifest")
    version = manifest.get("version")
    if version not in READ_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {version!r} is not supported (this build reads "
            f"{', '.join(map(str, READ_VERSIONS))})"
        )
    if DIGEST not in manifest and version != 1:
        raise CheckpointError(f"{path}: damaged: its digest is missing (edited or corrupt)")
    if DIGEST in manifest and manifest[DIGEST] != digest(manifest):
        raise CheckpointError(
            f"{path}: damaged: its content does not match its digest (edited or corrupt)"
        )
    for key in ("step", "world_size", "stage", "precision", "params", "segments", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path}: lacks the field {key!r}")
    named = STEP_DIR.match(location(directory).name)
    if named and manifest["step"] != int(named.group(1)):
        raise CheckpointError(
            f"{path}: says step {manifest['step']!r}, but its directory is "
            f"{location(directory).name} (an edited or misplaced manifest)"
        )
    return manifest


def candidates(root: Where) -> list[Location]:
    """Checkpoint directories under ``root``, newest step first (complete or not)."""
    root = location(root)
    store = storage_for(root)
    if store.is_file(root / MANIFEST):
        return [root]
    if not store.is_dir(root):
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if STEP_DIR.match(root.name):  # one checkpoint, named: read_manifest says what it lacks
        return [root]
    found = []
    for name in store.list_dirs(root):
        match = STEP_DIR.match(name)
        if match:
            found.append((int(match.group(1)), name))
    return [root / name for _, name in sorted(found, reverse=True)]
