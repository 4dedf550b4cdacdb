"""ZeRO++: block quantization, the qwZ / qgZ / hpZ collectives against references the
test computes itself, exact byte counts by link, and the switches' validation."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine import zeropp_scenarios as zs
from zeroservice.config import ConfigError, ZeroConfig
from zeroservice.launch import run_local
from zeroservice.planner import MemoryPlan, plan, qwz_scratch
from zeroservice.quantize import (
    Q_MAX,
    block_scales,
    dequantize,
    packed_bytes,
    pieces,
    quantize,
)
from zeroservice.zeropp import qwz_row_bytes

# -- block quantization ------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
def test_round_trip_error_is_at_most_half_a_scale(bits, numel):
    block = 64
    x = zs.rank_input(3, max(numel, 2 * block))[:numel]
    row = quantize(x, bits, block)
    assert row.numel() == packed_bytes(numel, bits, block)
    scales = block_scales(row, numel, bits, block)
    blocks = -(-numel // block)
    padded = torch.zeros(blocks * block)
    padded[:numel] = x
    # scale = absmax / q_max, per block, exactly.
    expected = padded.view(blocks, block).abs().amax(dim=1) / Q_MAX[bits]
    assert torch.equal(scales, expected)
    per_element = scales.repeat_interleave(block)[:numel]
    err = (dequantize(row, numel, bits, block) - x).abs()
    # |x - round(x/s) s| <= s/2, up to the rounding of x/s in fp32.
    assert bool((err <= per_element / 2 * (1 + 2**-20)).all())
    if numel > 1:  # a lone element is its block's absmax: exact
        assert float((err / per_element.clamp_min(1e-30)).max()) > 0.3


def test_packed_sizes_are_exact():
    assert packed_bytes(1000, 8, 256) == 4 * 256 + 4 * 4
    assert packed_bytes(1000, 4, 256) == 4 * 128 + 4 * 4
    assert packed_bytes(256, 4, 256) == 128 + 4


def test_zero_blocks_and_integer_grids_are_exact():
    for bits in (8, 4):
        x = torch.zeros(200)
        q_max = Q_MAX[bits]
        grid = torch.arange(-q_max, q_max + 1, dtype=torch.float32)[:64]
        x[128 : 128 + grid.numel()] = grid  # absmax q_max: scale 1
        row = quantize(x, bits, 64)
        scales = block_scales(row, 200, bits, 64)
        assert scales.tolist() == [0.0, 0.0, 1.0, 0.0]
        assert torch.equal(dequantize(row, 200, bits, 64), x)


def test_int4_packs_two_values_per_byte():
    x = torch.tensor([1.0, -7.0, 7.0, 0.0] * 16)
    row = quantize(x, 4, 64)
    # scale 1: q + 8 = 9, 1, 15, 8, the even element in the low nibble.
    assert row[:2].tolist() == [9 | (1 << 4), 15 | (8 << 4)]


# -- the collectives, at world 4 as 2 nodes x 2 ranks and at world 2 on one node --------

NUMEL = 4 * 640  # per-rank chunks of 640: ten blocks of 64, one of zeros


def _q(x: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize(quantize(x, bits, zs.BLOCK), x.numel(), bits, zs.BLOCK)


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


@functools.cache
def _collectives(world: int, bits: int, rpn: int | None) -> list[dict]:
    return run_local(zs.collectives, world, NUMEL, bits, rpn)


CASES = [(4, 4, 2), (2, 8, None), (2, 8, 1), (2, 4, 2)]
"""2 nodes x 2 ranks; one node without a topology; one rank per node; one node."""


@pytest.mark.parametrize("world,bits,rpn", CASES)
def test_quantized_gather_gives_every_rank_the_dequantized_shards(world, bits, rpn):
    results = _collectives(world, bits, rpn)
    shards = [zs.rank_input(r, NUMEL).view(world, -1)[r] for r in range(world)]
    expected = torch.cat([_q(s, 8) for s in shards])
    for r in results:
        assert torch.equal(r["gathered"], expected)
        assert r["scratch_left"] == 0


@pytest.mark.parametrize("world,bits,rpn", CASES)
def test_quantized_reduce_scatter_sums_dequantized_slices_in_fp32(world, bits, rpn):
    results = _collectives(world, bits, rpn)
    rows = [zs.rank_input(j, NUMEL).view(world, -1) for j in range(world)]
    for rank, r in enumerate(results):
        if rpn in (None, 1, world):  # one hop: row `rank` of every sender, in rank order
            expected = _sum([_q(rows[j][rank], bits) for j in range(world)])
        else:  # two hops: within each node, then across nodes (see zeropp.py)
            nodes, local = world // rpn, rank % rpn
            partial = [
                _sum(
                    [
                        _q(
                            torch.cat([rows[m * rpn + i][d * rpn + local] for d in range(nodes)]),
                            bits,
                        )
                        for i in range(rpn)
                    ]
                ).view(nodes, -1)
                for m in range(nodes)
            ]
            expected = _sum([_q(partial[m][rank // rpn], bits) for m in range(nodes)])
        assert torch.equal(r["reduced"], expected), rank
    exact = sum(rows[j][0] for j in range(world))
    error = float((results[0]["reduced"] - exact).abs().max() / exact.abs().max())
    # Lossy but close: int4 rounds to 1/14 of a block's range, twice over two hops.
    assert 0 < error < (0.25 if bits == 4 else 0.02)


def test_bytes_by_link_are_exact_at_two_nodes():
    entries = {e["tag"]: e for e in _collectives(4, 4, 2)[0]["entries"]}
    chunk = NUMEL // 4
    row8 = packed_bytes(chunk, 8, zs.BLOCK)
    gather = entries["params-int8"]
    assert gather["payload_bytes"] == 4 * row8
    # One chunk from the node's other rank, two from the other node.
    assert (gather["intra_node_bytes"], gather["cross_node_bytes"]) == (row8, 2 * row8)
    hop1, hop2 = entries["grads-int4-node"], entries["grads-int4-nodes"]
    assert hop1["payload_bytes"] == 2 * packed_bytes(2 * chunk, 4, zs.BLOCK)
    assert (hop1["intra_node_bytes"], hop1["cross_node_bytes"]) == (hop1["payload_bytes"] // 2, 0)
    row4 = packed_bytes(chunk, 4, zs.BLOCK)
    assert hop2["payload_bytes"] == 2 * row4
    assert (hop2["intra_node_bytes"], hop2["cross_node_bytes"]) == (0, row4)


@pytest.mark.parametrize("rpn,tag,link", [(1, "-nodes", "cross"), (2, "-node", "intra")])
def test_a_hop_among_one_rank_is_left_out(rpn, tag, link):
    """One rank per node or one node: the one hop left is the one-hop reduction (the
    same sums, quantized once), its bytes on the link it crosses."""
    entries = {e["tag"]: e for e in _collectives(2, 8, rpn)[0]["entries"]}
    grads = [t for t in entries if t.startswith("grads")]
    assert grads == ["grads-int8" + tag], grads
    row = packed_bytes(NUMEL // 2, 8, zs.BLOCK)
    assert entries[grads[0]]["payload_bytes"] == 2 * row
    assert entries[grads[0]][f"{link}_node_bytes"] == row
    plain = _collectives(2, 8, None)
    assert all(
        torch.equal(a["reduced"], b["reduced"])
        for a, b in zip(_collectives(2, 8, rpn), plain, strict=True)
    )


def test_one_node_has_no_cross_node_bytes():
    entries = {e["tag"]: e for e in _collectives(2, 8, None)[0]["entries"]}
    row = packed_bytes(NUMEL // 2, 8, zs.BLOCK)
    assert entries["grads-int8"]["payload_bytes"] == 2 * row
    assert entries["grads-int8"]["intra_node_bytes"] == row
    assert all(e["cross_node_bytes"] == 0 for e in entries.values())


# -- the engine, tiny GPT at stage 3, world 4 = 2 nodes x 2 ranks --------------------------

BLOCK = 256
TRAIN = {
    "baseline": {"ranks_per_node": 2},
    "qwz": {"quantized_weights": True, "ranks_per_node": 2},
    "qgz": {"quantized_gradients": "int8"},
    "qgz-nodes": {"quantized_gradients": "int4", "ranks_per_node": 2},
    "hpz": {"hierarchical_partition": True, "ranks_per_node": 2},
    "all": {
        "quantized_weights": True,
        "quantized_gradients": "int4",
        "hierarchical_partition": True,
        "ranks_per_node": 2,
    },
}


@functools.cache
def _train() -> dict[str, list[dict]]:
    names = list(TRAIN)
    per_rank = run_local(zs.train_all, 4, [TRAIN[n] for n in names], 4)
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


def _by_tag(r: dict) -> dict[str, dict]:
    return {e["tag"]: e for e in r["entries"]}


def _units(r: dict, which: str) -> list[int]:
    return [r["units"][i][1] for i in r[which]]


@pytest.mark.parametrize("name", list(TRAIN))
def test_trains_and_loss_decreases(name):
    r = _train()[name][0]
    assert r["losses"][-1] < r["losses"][0]


def test_qwz_forward_sees_the_dequantized_shards_on_every_rank():
    ranks = _train()["qwz"]
    for index in ranks[0]["seen"]:
        cuts = ranks[0]["cuts"][index]
        assert any(cuts), "a block's shards are cut where its parameters begin"
        shards = [r["shards"][index] for r in ranks]
        expected = torch.cat([_q_pieces(s, c) for s, c in zip(shards, cuts, strict=True)])
        for r in ranks:
            assert torch.equal(r["seen"][index], expected), index


def _q_pieces(x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Each piece of ``x`` between cuts quantized on its own, in blocks from its start."""
    spans = pieces(x.numel(), cuts)
    return torch.cat([_q_block(x[a:b]) for a, b in spans])


def _q_block(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, 8, BLOCK), x.numel(), 8, BLOCK)


def test_qwz_blocks_never_straddle_two_parameters():
    """A LayerNorm gain (1) beside a small bias: the bias keeps its own scale."""
    gain, bias = torch.ones(100), torch.linspace(-0.004, 0.004, 60)
    flat = torch.cat([gain, bias])
    whole = _q_block(flat)[100:]
    cut = _q_pieces(flat, [100])[100:]
    assert float((whole - bias).abs().max()) > 0.003  # a step of 1/127 rounds it away
    # Within half its own step (plus float32 rounding of the product, below 1e-9).
    assert float((cut - bias).abs().max()) <= 0.004 / 127 / 2 + 1e-9


def test_qwz_gathers_int8_rows_exactly():
    r = _train()["qwz"][0]
    tags = _by_tag(r)
    gathered = r["forward_units"] + r["backward_units"]
    rows = [qwz_row_bytes(r["units"][i][1] // 4, r["cuts"][i], BLOCK) for i in gathered]
    # Each cut adds at most one block and its scale to a row.
    for i, row in zip(gathered, rows, strict=True):
        most = max(len(c) for c in r["cuts"][i])
        assert packed_bytes(r["units"][i][1] // 4, 8, BLOCK) <= row
        assert row <= packed_bytes(r["units"][i][1] // 4, 8, BLOCK) + most * (BLOCK + 4)
    g = tags["params-int8"]
    assert g["calls"] == len(gathered)
    assert g["payload_bytes"] == 4 * sum(rows)
    assert (g["intra_node_bytes"], g["cross_node_bytes"]) == (sum(rows), 2 * sum(rows))
    assert "params" not in tags  # no full-precision gather is left


def test_qgz_all_to_all_bytes_are_exact():
    r = _train()["qgz"][0]
    tags = _by_tag(r)
    units = [p for _, p in r["units"]]
    g = tags["grads-int8"]
    assert g["calls"] == len(units)
    assert g["payload_bytes"] == sum(4 * packed_bytes(p // 4, 8, BLOCK) for p in units)
    assert "grads" not in tags
    assert g["cross_node_bytes"] == 0  # no topology: one node


def test_hpz_backward_gathers_stay_inside_the_node():
    r = _train()["hpz"][0]
    tags = _by_tag(r)
    backward = sum(_units(r, "backward_units"))
    forward = sum(_units(r, "forward_units"))
    node = tags["params-node"]
    assert node["payload_bytes"] == 4 * backward  # fp32, gathered over 2 ranks
    assert (node["intra_node_bytes"], node["cross_node_bytes"]) == (2 * backward, 0)
    # Only the forward gathers still span nodes: half of each comes from the other node.
    assert tags["params"]["payload_bytes"] == 4 * forward
    assert tags["params"]["cross_node_bytes"] == 2 * forward
    # The secondary shards: half of every unit the forward gathered, fp32.
    assert r["memory"]["secondary_params"] == 4 * forward // 2
    assert r["after"]["secondary_params"] == 0  # dropped when backward ends


def test_all_three_cut_cross_node_bytes_below_three_quarters_psi():
    base, r = _train()["baseline"][0], _train()["all"][0]
    psi = r["psi_padded"]
    fp16_psi = 2 * psi

    def cross(run):
        tags = ("params", "grads")
        return sum(e["cross_node_bytes"] for e in run["entries"] if e["tag"].startswith(tags))

    forward = r["forward_units"]
    rows8 = sum(2 * qwz_row_bytes(r["units"][i][1] // 4, r["cuts"][i], BLOCK) for i in forward)
    rows4 = sum(packed_bytes(p // 4, 4, BLOCK) for _, p in r["units"])
    assert cross(r) == rows8 + rows4
    assert cross(r) <= 0.75 * fp16_psi
    # The baseline (fp32): half of each gather and of the reduce-scatter crosses.
    base_volume = sum(_units(base, "forward_units") + _units(base, "backward_units")) + psi
    assert cross(base) == 4 * base_volume // 2
    assert cross(r) < cross(base) / 8
    assert r["memory"]["quantization_scratch_peak"] > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_qgz_replaces_the_reduce_scatter_below_stage3(stage):
    r = run_local(zs.train_below_stage3, 2, stage, {"quantized_gradients": "int8"})[0]
    assert r["losses"][-1] < r["losses"][0]
    tags = _by_tag(r)
    assert "grads" not in tags
    g = tags["grads-int8"]
    assert g["calls"] == len(r["units"])
    assert g["payload_bytes"] == sum(2 * packed_bytes(p // 2, 8, BLOCK) for p in r["units"])


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"stage": 2, "quantized_weights": True}, "quantized_weights"),
        (
            {"stage": 2, "hierarchical_partition": True, "ranks_per_node": 2},
            "hierarchical_partition",
        ),
        ({"stage": 3, "hierarchical_partition": True}, "hierarchical_partition"),
        ({"stage": 3, "quantized_weights": 1}, "quantized_weights"),
        ({"stage": 3, "quantized_gradients": "int2"}, "quantized_gradients"),
        ({"stage": 0, "quantized_gradients": "int8"}, "quantized_gradients"),
        ({"stage": 3, "ranks_per_node": 0}, "ranks_per_node"),
        ({"stage": 3, "ranks_per_node": True}, "ranks_per_node"),
        ({"stage": 3, "quantization_block": 100}, "quantization_block"),
    ],
)
def test_bad_switches_are_refused_by_name(fields, name):
    with pytest.raises(ConfigError, match=f"^{name}:"):
        ZeroConfig(**fields)


def test_ranks_per_node_must_divide_the_world():
    msg = run_local(zs.engine_error, 2, {"ranks_per_node": 3, "quantized_gradients": "int8"})[0]
    assert msg.startswith("ConfigError: ranks_per_node: 3 does not divide"), msg


# -- the planner's ZeRO++ bytes against the engine's memory ledger ------------------------


def _planned(r: dict, config: dict) -> MemoryPlan:
    """The plan of ``config`` for the model ``r`` trained, with C_B its largest unit."""
    return plan(
        r["psi_padded"],
        dp=4,
        stage=3,
        precision="fp32",
        bucket_elements=max(padded for _, padded in r["units"]),
        quantization_block=BLOCK,
        **config,
    )


@pytest.mark.parametrize("name", ["hpz", "all"])
def test_planned_secondary_shards_are_the_ledgers_to_the_byte(name):
    for r in _train()[name]:
        assert _planned(r, TRAIN[name]).secondary_params == r["after"]["secondary_peak"]


@pytest.mark.parametrize("name", ["qgz", "qgz-nodes"])
def test_planned_qgz_rows_are_the_ledgers_to_the_byte(name):
    for r in _train()[name]:
        planned = _planned(r, TRAIN[name]).quantization_scratch
        assert planned == r["after"]["quantization_scratch_peak"]


@pytest.mark.parametrize("name", ["qwz", "all"])
def test_planned_qwz_rows_of_the_gathered_peak_are_within_one_percent(name):
    """qwZ's rows follow the gathered units; the formula's gathered estimate (2Ψ/layers)
    is its own, so the rows are held against the ledger's gathered peak. With hpZ (all)
    they live in forward, qgZ's in backward: the larger is the peak."""
    for r in _train()[name]:
        rows = qwz_scratch(r["after"]["gathered_peak"] // 4, 4, BLOCK)
        if name == "all":
            plain = _planned(r, {**TRAIN[name], "quantized_weights": False})
            rows = max(rows, plain.quantization_scratch)
        measured = r["after"]["quantization_scratch_peak"]
        # The formula does not know where shards are cut: each cut adds at most one block
        # and its scale to the rows (4 of them per unit).
        cuts = sum(max(len(c) for c in unit) for unit in r["cuts"])
        assert measured >= rows - rows // 100, (rows, measured)
        assert measured <= rows + rows // 100 + 4 * cuts * (BLOCK + 4), (rows, measured)
