"""The datasets' sample streams: every seed the spec takes runs, two seeds draw
unrelated streams, and a file's every window (its last one too) can be drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zeroservice.data import ByteText, SyntheticTokens, TokenFile

SEQ = 8


@pytest.mark.parametrize("seed", [0, 18_446_688_733_644, 2**63 - 1])
def test_every_seed_the_spec_takes_draws_samples(seed, tmp_path):
    """A seed times a constant plus the index overflowed torch's seed above ~1.8e13."""
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(64)))
    for ds in (SyntheticTokens(64, SEQ, seed=seed), ByteText(text, SEQ, seed=seed)):
        assert ds.sample(10**12).shape == (SEQ + 1,)


def test_neighbouring_seeds_draw_unrelated_streams():
    """Seed s + 1 was seed s's stream shifted by 1,000,003 samples."""
    a, b = SyntheticTokens(256, SEQ, seed=0), SyntheticTokens(256, SEQ, seed=1)
    b.successors, b._succ = a.successors, a._succ  # the same chain: only the order differs
    for shift in (0, 1_000_003):
        same = sum(torch.equal(b.sample(i), a.sample(i + shift)) for i in range(50))
        assert same == 0, shift


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_every_window_of_a_file_is_drawn_the_last_included(kind, tmp_path):
    """A file of seq_len + 1 tokens is one sample; of seq_len + 3, all three windows
    are drawn (the last was never drawn, and one sample's file was refused)."""

    def dataset(n: int):
        path = tmp_path / f"{kind}{n}"
        if kind == "text":
            path.write_bytes(bytes(range(n)))
            return ByteText(path, SEQ)
        np.arange(n, dtype="<u2").tofile(path)
        return TokenFile(path, SEQ, vocab_size=256)

    one = dataset(SEQ + 1)
    assert one.sample(0).tolist() == list(range(SEQ + 1))
    starts = {int(dataset(SEQ + 3).sample(i)[0]) for i in range(200)}
    assert starts == {0, 1, 2}
    with pytest.raises(ValueError, match=f"too short for seq_len {SEQ} \\(need {SEQ + 1}\\)"):
        dataset(SEQ)
