"""Datasets that need no download: a synthetic token stream, byte-level text files and
pre-tokenised id files, on local disk or in object storage (``s3://bucket/key``).

Every sample is a pure function of its index, so any rank (and any reference run)
can produce exactly the batch another rank would see at a given step. An object is
read through checkpoint/storage.py's storage: a text object whole, a token object one
ranged GET per sample (never downloaded whole).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import torch

from .checkpoint.storage import Location, Reader, is_uri, location, storage_for


class TokenDataset(Protocol):
    vocab_size: int
    seq_len: int

    def sample(self, index: int) -> torch.Tensor:
        """``seq_len + 1`` token ids (inputs and the next-token targets)."""
        ...


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The generator of sample ``index`` of a dataset seeded ``seed``: seeded with a
    64-bit hash of the two, so that any seed the spec takes (to 2^63 - 1) runs, and two
    seeds draw unrelated streams (a seed-times-constant-plus-index made seed s + 1 the
    stream of seed s shifted by that constant, and overflowed above about 1.8e13)."""
    key = seed.to_bytes(16, "little", signed=True) + index.to_bytes(16, "little", signed=True)
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def _window_start(g: torch.Generator, length: int, seq_len: int) -> int:
    """A window of ``seq_len + 1`` tokens of ``length``: every start, the last included."""
    return int(torch.randint(length - seq_len, (1,), generator=g))


class SyntheticTokens:
    """Tokens from a fixed random Markov chain: each token has ``branching`` successors.

    Unlike uniform noise it can be learned, so a demo's loss visibly falls from
    ln(vocab) toward ln(branching).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 4):
        if vocab_size < 2 or seq_len < 1 or branching < 1:
            raise ValueError("SyntheticTokens: vocab_size >= 2, seq_len >= 1, branching >= 1")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=g)
        self.branching = branching
        self._succ: list[list[int]] = self.successors.tolist()

    def sample(self, index: int) -> torch.Tensor:
        g = sample_generator(self.seed, index)
        picks = torch.randint(self.branching, (self.seq_len,), generator=g).tolist()
        token = int(torch.randint(self.vocab_size, (1,), generator=g))
        succ, out = self._succ, [token]
        for p in picks:
            token = succ[token][p]
            out.append(token)
        return torch.tensor(out, dtype=torch.long)


class ByteText:
    """A text file read as bytes (vocab 256); sample i starts at a seeded random offset."""

    vocab_size = 256

    def __init__(self, path: str | Path, seq_len: int, seed: int = 0):
        raw = _read_bytes(path)
        if len(raw) < seq_len + 1:
            raise ValueError(
                f"{path}: {len(raw)} bytes is too short for seq_len {seq_len} (need {seq_len + 1})"
            )
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.seq_len, self.seed = seq_len, seed

    def sample(self, index: int) -> torch.Tensor:
        start = _window_start(sample_generator(self.seed, index), len(self.data), self.seq_len)
        return self.data[start : start + self.seq_len + 1].long()


def micro_batch(
    dataset: TokenDataset,
    step: int,
    micro: int,
    batch_size: int,
    dp_rank: int,
    dp_world: int,
    accumulation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for one rank's micro-batch ``micro`` of optimizer step ``step``."""
    first = ((step * accumulation + micro) * dp_world + dp_rank) * batch_size
    rows = torch.stack([dataset.sample(first + i) for i in range(batch_size)])
    return rows[:, :-1], rows[:, 1:]


class TokenFile:
    """A pre-tokenised file of little-endian uint16 or uint32 ids, memory-mapped; sample i
    starts at a seeded random offset (as ByteText). Ids are checked against the
    vocabulary as they are read."""

    def __init__(
        self, path: str | Path, seq_len: int, vocab_size: int, dtype: str = "uint16", seed: int = 0
    ):
        import numpy as np

        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"dtype: {dtype!r} is not uint16 or uint32")
        size = _size(path)
        width = 2 if dtype == "uint16" else 4
        if size % width:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} ids")
        if size // width < seq_len + 1:
            raise ValueError(
                f"{path}: {size // width} tokens is too short for seq_len {seq_len} "
                f"(need {seq_len + 1})"
            )
        ids = np.dtype(dtype).newbyteorder("<")
        self.ids: Any = (
            _ObjectIds(location(path), ids, size // width)
            if is_uri(path)
            else np.memmap(path, dtype=ids, mode="r")
        )
        self.path, self.seq_len, self.vocab_size, self.seed = path, seq_len, vocab_size, seed

    def sample(self, index: int) -> torch.Tensor:
        start = _window_start(sample_generator(self.seed, index), len(self.ids), self.seq_len)
        row = torch.from_numpy(self.ids[start : start + self.seq_len + 1].astype("int64"))
        if int(row.max()) >= self.vocab_size:  # the id itself is the file's content: not shown
            raise ValueError(
                f"{self.path}: a token id near offset {start} is outside the vocabulary "
                f"({self.vocab_size})"
            )
        return row


def _size(path: str | Path) -> int:
    """Bytes of a file or an object; FileNotFoundError naming it when there is none."""
    loc = location(path)
    size = storage_for(loc).size(loc)
    if size is None:
        raise FileNotFoundError(f"{path}: no such {'object' if is_uri(path) else 'file'}")
    return size


def _read_bytes(path: str | Path) -> bytes:
    _size(path)
    loc = location(path)
    return storage_for(loc).read_bytes(loc)


class _ObjectIds:
    """The ids of a token object, sliced as a memory map is: a slice is one ranged GET
    of exactly its bytes."""

    def __init__(self, loc: Location, dtype: Any, length: int):
        self.loc, self.dtype, self.length = loc, dtype, length
        self._reader: Reader | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, window: slice) -> Any:
        import numpy as np

        start, stop, step = window.indices(self.length)
        if step != 1:
            raise ValueError("token objects are read in contiguous windows")
        if self._reader is None:
            self._reader = storage_for(self.loc).open_read(self.loc)
        width = self.dtype.itemsize
        self._reader.seek(start * width)
        data = self._reader.read((stop - start) * width)
        return np.frombuffer(data, dtype=self.dtype)
