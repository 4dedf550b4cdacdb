"""What the engine holds idle beside the moments a step peaks: the gather cache keeps no
oversized unit's buffer and nothing after the forward's last gather; the ring's receive
scratch exists only while a backward reduces. The training itself is the parity tests'."""

from __future__ import annotations

import functools

import torch

import zeroservice
from zeroservice.buffers import BufferCache
from zeroservice.config import ZeroConfig
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig

WORLD = 2
BUCKET = 4096
# The untied head and the token embedding (512 x 32 = 16,384 elements) are larger than
# C_B, so each forms an oversized unit; a block's units are smaller.
CFG = GPTConfig(vocab_size=512, seq_len=16, n_layer=3, n_head=2, dim=32, tie_weights=False)
STEPS = 3


def test_cache_keeps_buffers_up_to_largest_kept_and_reuses_them():
    cache = BufferCache(torch.float32, torch.device("cpu"), limit=100, largest_kept=40)
    small, large = cache.take(40), cache.take(50)
    small_ptr = small.data_ptr()
    cache.give(small)
    cache.give(large)
    del small, large
    assert cache.idle_elements == 40  # the 50-element buffer was dropped
    assert cache.largest_idle == 40
    again = cache.take(40)
    assert again.data_ptr() == small_ptr  # reused, not allocated
    assert cache.idle_elements == 0


def test_cache_without_largest_kept_keeps_up_to_its_limit():
    cache = BufferCache(torch.float32, torch.device("cpu"), limit=100)
    buffer = cache.take(60)
    cache.give(buffer)
    assert cache.idle_elements == 60


def _idle_in_rank() -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=3, bucket_elements=BUCKET),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    )
    gatherer = engine.gatherer
    assert gatherer is not None and engine.comm.ring is not None
    seen: dict[str, list] = {"at_head": [], "largest_at_head": [], "scratch_after_backward": []}

    def at_head(module, args, output):
        seen["at_head"].append(gatherer.cached_bytes)
        seen["largest_at_head"].append(gatherer.largest_cached_bytes)

    model.head.register_forward_hook(at_head)
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len, seed=1)
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        x, y = micro_batch(data, step, 0, 2, rank, WORLD, 1)
        engine.backward(engine(x, y))
        seen["scratch_after_backward"].append(engine.comm.ring.held_scratch_bytes)
        engine.step()
    seen["ledger_scratch"] = engine.comm.buffer_bytes()
    seen["units"] = [u.padded_numel for u in engine.units]
    seen["block"] = engine.reducer.block_elements
    engine.close()
    return seen


@functools.cache
def _idle() -> list[dict]:
    return run_local(_idle_in_rank, WORLD)


def test_nothing_idle_beside_the_head_once_the_forward_follows_its_plan():
    for r in _idle():
        assert max(r["units"]) > r["block"]  # the head is an oversized unit
        # The first forward has no recorded order to know its last gather by: the
        # blocks' buffers stay idle until it ends.
        assert r["at_head"][0] > 0
        # From the second on, the cache is emptied once the head's gather is issued,
        # and the head's own buffer is not kept on release.
        assert r["at_head"][1:] == [0] * (STEPS - 1)


def test_no_oversized_buffer_is_kept_idle():
    for r in _idle():
        # Released after its forward, the head's buffer would be the largest idle one
        # (in the first forward too, where the blocks' buffers stay).
        assert max(r["largest_at_head"]) <= r["block"] * 4


def test_ring_scratch_is_let_go_after_each_backward():
    for r in _idle():
        assert r["scratch_after_backward"] == [0] * STEPS
        # The ledger still counts it: C_B / N elements while a backward reduces.
        assert r["ledger_scratch"] == r["block"] // WORLD * 4
