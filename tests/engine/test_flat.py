"""Flat units: grouping, padding, views, and that modules keep working on the views."""

from __future__ import annotations

import torch
from torch import nn

from zeroservice.flat import build_units
from zeroservice.models import GPT, GPTConfig
from zeroservice.units import plan_layout


def _units(model, bucket, world, rank):
    layout = plan_layout(model, stage=1, world=1, bucket_elements=bucket)
    return build_units(layout.chunks, torch.float32, world, rank)


def test_groups_follow_backward_order_and_cap():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 1000))
    groups = plan_layout(model, stage=1, world=1, bucket_elements=150).chunks
    names = [[n[0] for n, _ in g] for g in groups]
    # Reverse registration order; the 10,000-element weight exceeds the cap alone.
    assert names[0] == ["2.bias"] and names[1] == ["2.weight"]
    assert names[2] == ["1.bias", "1.weight", "0.bias"] and names[3] == ["0.weight"]


def test_units_pad_to_world_and_params_become_views():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=101, seq_len=8, n_layer=1, n_head=2, dim=6))
    x = torch.randint(0, 101, (2, 8))
    before = model(x).detach()
    units = _units(model, 500, world=4, rank=3)
    total = sum(u.numel for u in units)
    assert total == sum(p.numel() for p in model.parameters()) == model.cfg.num_params()
    for u in units:
        assert u.padded_numel % 4 == 0 and u.padded_numel - u.numel < 4
        assert u.shard_of(u.flat).numel() == u.shard_numel
        assert u.shard_start == 3 * u.shard_numel
        assert torch.count_nonzero(u.flat[u.numel :]) == 0
        for slot in u.slots:
            assert slot.param.data_ptr() == u.flat[slot.offset :].data_ptr()
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    # Writing a unit's buffer changes the module: the parameters are views of it.
    units[0].flat.zero_()
    assert all(torch.count_nonzero(s.param) == 0 for s in units[0].slots)


def test_tied_parameter_is_one_slot_with_both_names():
    model = GPT(GPTConfig(vocab_size=50, seq_len=4, n_layer=1, n_head=1, dim=4))
    units = _units(model, 10**6, 2, 0)
    slots = [s for u in units for s in u.slots]
    tied = [s for s in slots if "wte.weight" in s.names]
    assert len(tied) == 1 and "head.weight" in tied[0].names
    assert model.head.weight is model.wte.weight
