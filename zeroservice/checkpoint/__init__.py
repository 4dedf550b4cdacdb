"""Checkpoints that load at any world size and stage: sharded save, resharding load,
streaming export. See files.py (bytes), layout.py (who holds what), manifest.py (the
commit point), save.py, load.py and export.py."""

from .export import describe, export_checkpoint, iter_tensors
from .files import CheckpointError, SaveFailed
from .load import CheckpointMismatch, LoadResult, load_checkpoint
from .manifest import read_manifest
from .peers import PeersIncomplete, PeerSnapshot
from .save import prune, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointMismatch",
    "LoadResult",
    "PeerSnapshot",
    "PeersIncomplete",
    "describe",
    "export_checkpoint",
    "iter_tensors",
    "load_checkpoint",
    "prune",
    "read_manifest",
    "SaveFailed",
    "save_checkpoint",
]
