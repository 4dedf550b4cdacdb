"""The head and its cross-entropy in vocabulary tiles (models/tiled_head.py): the same
loss and gradients as ``F.cross_entropy`` of the whole logits, and nothing of tokens x
vocabulary ever allocated. Engine parity (every stage against DDP) is in test_parity.py
(the "vocab-tiles" cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from zeroservice.models import GPT, GPTConfig
from zeroservice.models.tiled_head import IGNORE_INDEX, tile_bounds, tiled_cross_entropy
from zeroservice.tensor_parallel import MPGroup


def _inputs(dtype: torch.dtype, tokens: int = 37, dim: int = 16, vocab: int = 101):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[3] = IGNORE_INDEX
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    loss = F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=IGNORE_INDEX)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def _tiled(hidden, weight, targets, tiles):
    loss = tiled_cross_entropy(hidden, weight, targets, tiles)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def test_tile_bounds_cover_the_vocabulary_once():
    for vocab, tiles in [(101, 1), (101, 3), (101, 7), (101, 101), (8, 3)]:
        bounds = tile_bounds(vocab, tiles)
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert len(bounds) <= tiles and all(end > start for start, end in bounds)


@pytest.mark.parametrize("tiles", [1, 3, 7, 101])
def test_fp32_loss_and_gradients_equal_the_whole_logits(tiles):
    """fp32: the same values up to summation order (the log-sum-exp tile by tile)."""
    args = _inputs(torch.float32)
    for got, want in zip(_tiled(*args, tiles), _reference(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tiles", [1, 4])
def test_bf16_within_roundings_of_bf16(tiles):
    """bf16: the loss is taken in fp32 either way. Each tile's share of the input's
    gradient is rounded to bf16 before the fp32 sum over tiles (the whole product once),
    and a logit's gradient may round the other way: the gradients differ by at most a
    few bf16 roundings of the products' magnitudes, |dL/dlogits| @ |W| and
    |dL/dlogits|^T @ |hidden| (bf16 keeps 8 bits)."""
    hidden, weight, targets = _inputs(torch.bfloat16)
    loss, grad_hidden, grad_weight = _tiled(hidden, weight, targets, tiles)
    want_loss, want_hidden, want_weight = _reference(hidden, weight, targets)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    logits = (hidden @ weight.t()).float().detach().requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(logits, targets), (logits,))
    g = g.double().abs()
    bounds = (g @ weight.double().abs(), g.t() @ hidden.double().abs())
    for got, want, bound in zip(
        (grad_hidden, grad_weight), (want_hidden, want_weight), bounds, strict=True
    ):
        assert got.dtype == want.dtype == torch.bfloat16
        error = (got.double() - want.double()).abs()
        assert bool((error <= 2**-6 * bound).all()), (error - 2**-6 * bound).max()


def test_float64_gradients_pass_gradcheck():
    hidden, weight, targets = _inputs(torch.float64, tokens=5, dim=4, vocab=9)
    for tiles in (1, 2, 4, 9):
        assert torch.autograd.gradcheck(
            lambda h, w, k=tiles: tiled_cross_entropy(h, w, targets, k), (hidden, weight)
        )


def test_ignored_targets_count_for_nothing():
    hidden, weight, targets = _inputs(torch.float32)
    targets[:] = IGNORE_INDEX
    targets[0] = 5
    loss, grad_hidden, _ = _tiled(hidden, weight, targets, 3)
    torch.testing.assert_close(loss, _reference(hidden, weight, targets)[0])
    assert torch.count_nonzero(grad_hidden[1:]) == 0 and torch.count_nonzero(grad_hidden[0]) > 0


def test_frozen_weight_gets_no_gradient():
    hidden, weight, targets = _inputs(torch.float32)
    weight.requires_grad_(False)
    loss = tiled_cross_entropy(hidden, weight, targets, 3)
    (grad,) = torch.autograd.grad(loss, (hidden,))
    torch.testing.assert_close(grad, _reference_hidden_only(hidden, weight, targets))


def _reference_hidden_only(hidden, weight, targets):
    loss = F.cross_entropy((hidden @ weight.t()).float(), targets)
    return torch.autograd.grad(loss, (hidden,))[0]


def test_bad_inputs_are_refused():
    hidden, weight, targets = _inputs(torch.float32)
    bad = targets.clone()
    bad[0] = weight.shape[0]
    with pytest.raises(ValueError, match="101 is not a token of the vocabulary"):
        tiled_cross_entropy(hidden, weight, bad, 3)
    with pytest.raises(ValueError, match="tiles: must be >= 1"):
        tiled_cross_entropy(hidden, weight, targets, 0)
    with pytest.raises(ValueError, match=r"expected \(tokens, dim\)"):
        tiled_cross_entropy(hidden, weight[:, :3], targets, 3)
    with pytest.raises(ValueError, match="targets"):
        tiled_cross_entropy(hidden, weight, targets[:-1], 3)
    with pytest.raises(ValueError, match="vocab_tiles: must be in"):
        GPTConfig(vocab_size=64, vocab_tiles=65)
    with pytest.raises(ValueError, match="vocab_tiles: must be in"):
        GPTConfig(vocab_tiles=0)


def test_model_parallel_gpt_refuses_tiles():
    two = MPGroup.__new__(MPGroup)  # checked before any collective: no group needed
    two.size, two.rank = 2, 0
    with pytest.raises(ValueError, match="split over the model-parallel ranks already"):
        GPT(GPTConfig(vocab_size=64, dim=32, n_head=2, vocab_tiles=4), two)


TINY = dict(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=16)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_draws_the_same_weights_and_loss_with_tiles(tie):
    torch.manual_seed(7)
    whole = GPT(GPTConfig(**TINY, tie_weights=tie))
    torch.manual_seed(7)
    tiled = GPT(GPTConfig(**TINY, tie_weights=tie, vocab_tiles=5))
    a, b = whole.state_dict(), tiled.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"]))
    torch.testing.assert_close(tiled(x, x), whole(x, x), rtol=1e-5, atol=0)
    torch.testing.assert_close(tiled(x), whole(x))  # no targets: the whole logits


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returned."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("tiles", [1, 4])
def test_no_tensor_of_the_whole_logits_exists(tiles):
    """A GPT whose tokens x vocabulary (2 x 32 x 512) dwarfs every other tensor (the
    head's 512 x 16, a block's 64 x 64): with tiles, no operator of the forward or the
    backward makes more than tokens x one tile; without, the logits appear."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, vocab_tiles=tiles))
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"]))
    with _LargestTensor() as seen:
        model(x, x).backward()
    tokens = x.numel()
    tile = tile_bounds(TINY["vocab_size"], tiles)[0][1]
    assert seen.largest == tokens * tile, (seen.largest, tokens, tile)
