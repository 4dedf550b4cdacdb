"""Where checkpoint bytes (and training data, data.py) live: a local directory or an object
store, behind one interface.

[Note: storage]
Everything checkpoint/ reads or writes goes through a ``Storage``: write an object
whole and atomically, read a byte range, an object's size, list the step
"directories" under a root, remove a tree. Two implementations:

- ``LocalStorage``: files; a write goes to a temporary name, is fsynced and renamed.
- ``FsspecStorage``: an object store (``s3://bucket/prefix``) through fsspec. An
  object appears whole or not at all: a rank file is a multipart upload completed
  only once every byte is sent (aborted on any error), small objects are one PUT.
  There are no directories: a "directory" is a key prefix, listed by delimiter.

A location is a ``Path`` (local) or an ``ObjectPath`` (a URI); both join with ``/``
and have ``.name`` and ``.parent``, so the layout code is the same for both. The
commit point is the same too: a checkpoint is complete exactly when its manifest
object exists, and the manifest is written last.

Credentials and endpoint: the standard AWS environment variables (or fsspec's
configuration, ``FSSPEC_S3_*``), plus ``ZEROSERVICE_S3_ENDPOINT_URL`` for an
S3-compatible endpoint (MinIO, Ceph...). Nothing here prints them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, Union

ENDPOINT_ENV = "ZEROSERVICE_S3_ENDPOINT_URL"


@dataclass(frozen=True)
class ObjectPath:
    """A location in an object store: ``scheme://bucket/key/prefix`` (no trailing /)."""

    uri: str

    def __post_init__(self) -> None:
        scheme, sep, rest = self.uri.partition("://")
        if not sep or not scheme or not rest.strip("/"):
            raise ValueError(f"{self.uri!r}: not an object-store URI (scheme://bucket/prefix)")
        object.__setattr__(self, "uri", f"{scheme}://{rest.strip('/')}")

    @property
    def scheme(self) -> str:
        return self.uri.partition("://")[0]

    @property
    def key(self) -> str:
        """``bucket/prefix``: the path as fsspec names it."""
        return self.uri.partition("://")[2]

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> ObjectPath:
        head = self.key.rpartition("/")[0]
        return ObjectPath(f"{self.scheme}://{head}") if head else self

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.uri}/{name}")

    def __str__(self) -> str:
        return self.uri


Location = Union[Path, ObjectPath]  # noqa: UP007 (a runtime alias, kept for 3.10)
Where = Union[str, "os.PathLike[str]", ObjectPath]  # noqa: UP007
"""A checkpoint directory or root as callers name it: a path or a URI (``s3://...``)."""


def is_uri(path: Where) -> bool:
    return isinstance(path, ObjectPath) or "://" in str(path)


def location(path: Where) -> Location:
    """``path`` as a location: a URI (``s3://...``) or a local path."""
    if isinstance(path, Path | ObjectPath):
        return path
    return ObjectPath(str(path)) if is_uri(path) else Path(path)


class Reader(Protocol):
    """What a byte-range reader offers: a local file, or an fsspec file."""

    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def readinto(self, buffer: Any, /) -> int | None: ...
    def read(self, size: int = -1, /) -> bytes: ...
    def close(self) -> None: ...


class Storage:
    """The operations checkpoint/ needs (see [Note: storage])."""

    poll_s: float = 0.05
    """How often a background save's rank 0 looks for the other ranks' reports."""

    def write_file(self, loc: Location) -> contextlib.AbstractContextManager[BinaryIO]:
        """A writer whose object appears whole at ``loc`` when the block ends, and not at
        all if the block raises."""
        raise NotImplementedError

    def write_bytes(self, loc: Location, data: bytes) -> None:
        with self.write_file(loc) as f:
            f.write(data)

    def open_read(self, loc: Location) -> Reader:
        """A reader for byte ranges (seek, readinto); the caller closes it."""
        raise NotImplementedError

    def read_bytes(self, loc: Location) -> bytes:
        f = self.open_read(loc)
        try:
            return f.read()
        finally:
            f.close()

    def size(self, loc: Location) -> int | None:
        """The object's size in bytes; None when it does not exist."""
        raise NotImplementedError

    def is_file(self, loc: Location) -> bool:
        return self.size(loc) is not None

    def is_dir(self, loc: Location) -> bool:
        """A directory (a prefix with something under it)."""
        raise NotImplementedError

    def list_dirs(self, loc: Location) -> list[str]:
        """Names of the sub-directories (sub-prefixes) directly under ``loc``."""
        raise NotImplementedError

    def list_entries(self, loc: Location) -> list[tuple[str, bool]]:
        """(name, is a directory) of everything directly under ``loc``."""
        raise NotImplementedError

    def make_dirs(self, loc: Location) -> None:
        raise NotImplementedError

    def remove(self, loc: Location) -> None:
        """Remove one object; a missing one is fine."""
        raise NotImplementedError

    def remove_tree(self, loc: Location) -> None:
        """Remove everything under ``loc``; best effort, errors ignored."""
        raise NotImplementedError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    @contextlib.contextmanager
    def write_file(self, loc: Location) -> Iterator[BinaryIO]:
        """Written under a temporary name, fsynced and renamed over ``loc``; on any failure
        the temporary file is removed (a full disk must not keep what was half written)."""
        path = Path(str(loc))
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_bytes(self, loc: Location, data: bytes) -> None:
        super().write_bytes(loc, data)
        fsync_dir(Path(str(loc)).parent)  # the new name is durable too

    def open_read(self, loc: Location) -> Reader:
        return open(Path(str(loc)), "rb")  # noqa: SIM115 (the caller closes it)

    def size(self, loc: Location) -> int | None:
        path = Path(str(loc))
        return path.stat().st_size if path.is_file() else None

    def is_dir(self, loc: Location) -> bool:
        return Path(str(loc)).is_dir()

    def list_dirs(self, loc: Location) -> list[str]:
        path = Path(str(loc))
        return [c.name for c in path.iterdir() if c.is_dir()] if path.is_dir() else []

    def list_entries(self, loc: Location) -> list[tuple[str, bool]]:
        path = Path(str(loc))
        return [(c.name, c.is_dir()) for c in path.iterdir()] if path.is_dir() else []

    def make_dirs(self, loc: Location) -> None:
        Path(str(loc)).mkdir(parents=True, exist_ok=True)

    def remove(self, loc: Location) -> None:
        Path(str(loc)).unlink(missing_ok=True)

    def remove_tree(self, loc: Location) -> None:
        shutil.rmtree(Path(str(loc)), ignore_errors=True)


@contextlib.contextmanager
def _as_oserror(loc: Location) -> Iterator[None]:
    """An object store's own exceptions (botocore's) as OSError, which a save reports
    as a failed save and a load as a reason to fall back."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        raise OSError(errno.EIO, f"{loc}: {type(exc).__name__}: {exc}") from exc


class FsspecStorage(Storage):
    """An object store through fsspec (s3fs for ``s3://``)."""

    poll_s = 0.25

    def __init__(self, scheme: str, **options: Any):
        import fsspec

        if scheme in ("s3", "s3a") and os.environ.get(ENDPOINT_ENV):
            options.setdefault("endpoint_url", os.environ[ENDPOINT_ENV])
        if scheme in ("s3", "s3a"):
            # Listings must see other ranks' writes at once: no cached listings.
            options.setdefault("use_listings_cache", False)
        self.fs = fsspec.filesystem(scheme, **options)

    @staticmethod
    def _key(loc: Location) -> str:
        if not isinstance(loc, ObjectPath):
            raise TypeError(f"{loc}: not an object-store location")
        return loc.key

    @contextlib.contextmanager
    def write_file(self, loc: Location) -> Iterator[BinaryIO]:
        """A multipart upload completed (the object appears) only after the block
        ends; on any failure it is aborted and nothing appears."""
        with _as_oserror(loc):
            f = self.fs.open(self._key(loc), "wb", autocommit=False)
        try:
            with _as_oserror(loc):
                yield f
                f.close()  # sends what is buffered; commits nothing
                f.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            raise

    def write_bytes(self, loc: Location, data: bytes) -> None:
        with _as_oserror(loc):
            self.fs.pipe_file(self._key(loc), data)  # one PUT

    def open_read(self, loc: Location) -> Reader:
        with _as_oserror(loc):
            # No read-ahead: each read is one ranged GET of exactly the bytes asked for.
            return self.fs.open(self._key(loc), "rb", cache_type="none")

    def read_bytes(self, loc: Location) -> bytes:
        with _as_oserror(loc):
            return self.fs.cat_file(self._key(loc))

    def size(self, loc: Location) -> int | None:
        with _as_oserror(loc):
            try:
                info = self.fs.info(self._key(loc))
            except FileNotFoundError:
                return None
        return int(info["size"]) if info.get("type") == "file" else None

    def is_dir(self, loc: Location) -> bool:
        with _as_oserror(loc):
            try:
                return bool(self.fs.ls(self._key(loc), detail=False))
            except FileNotFoundError:
                return False

    def list_dirs(self, loc: Location) -> list[str]:
        with _as_oserror(loc):
            try:
                entries = self.fs.ls(self._key(loc), detail=True)
            except FileNotFoundError:
                return []
        return [e["name"].rstrip("/").rpartition("/")[2] for e in entries if e["type"] != "file"]

    def list_entries(self, loc: Location) -> list[tuple[str, bool]]:
        with _as_oserror(loc):
            try:
                entries = self.fs.ls(self._key(loc), detail=True)
            except FileNotFoundError:
                return []
        return [(e["name"].rstrip("/").rpartition("/")[2], e["type"] != "file") for e in entries]

    def make_dirs(self, loc: Location) -> None:
        """Nothing: a prefix exists once an object is under it."""

    def remove(self, loc: Location) -> None:
        with _as_oserror(loc), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(loc))

    def remove_tree(self, loc: Location) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm(self._key(loc), recursive=True)


_LOCAL = LocalStorage()
_REMOTE: dict[tuple[str, str | None], FsspecStorage] = {}


def storage_for(loc: Location) -> Storage:
    """The storage holding ``loc``: one fsspec filesystem per scheme and endpoint in a
    process, so a changed ``ZEROSERVICE_S3_ENDPOINT_URL`` reaches the new endpoint
    instead of a cached client of the old one."""
    if not isinstance(loc, ObjectPath):
        return _LOCAL
    key = (loc.scheme, os.environ.get(ENDPOINT_ENV))
    if key not in _REMOTE:
        _REMOTE[key] = FsspecStorage(loc.scheme)
    return _REMOTE[key]


def has_entries(root: Where) -> bool:
    """Whether anything lives under ``root`` (a directory or a prefix): a start-up
    then tries to load its newest checkpoint."""
    loc = location(root)
    return storage_for(loc).is_dir(loc) and (not isinstance(loc, Path) or any(Path(loc).iterdir()))
