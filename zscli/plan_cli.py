"""``zeroservice plan``: bytes per rank of a ZeRO configuration, Table 1, a recommendation."""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine (and torch) load only when ``plan`` runs
    from zeroservice import planner

_COUNT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_SIZE = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# PlanError fields, as the flags that set them.
_FLAGS = {
    "params": "--params",
    "dp": "--dp",
    "mp": "--mp",
    "stage": "--stage",
    "precision": "--precision",
    "optimizer_bytes": "--optimizer-bytes",
    "bucket_elements": "--bucket-elements",
    "micro_batch": "--micro-batch",
    "quantized_weights": "--quantized-weights",
    "quantized_gradients": "--quantized-gradients",
    "hierarchical_partition": "--hierarchical-partition",
    "ranks_per_node": "--ranks-per-node",
    "quantization_block": "--quantization-block",
    "seq_len": "--seq",
    "layers": "--gpt-layers",
    "dim": "--gpt-dim",
    "heads": "--gpt-heads",
    "vocab": "--vocab",
    "vocab_size": "--vocab",
    "vocab_tiles": "--vocab-tiles",
    "n_layer": "--gpt-layers",
    "n_head": "--gpt-heads",
    "ranks": "--ranks",
    "devices_per_node": "--devices-per-node",
    "device_memory_bytes": "--device-memory",
    "headroom": "--headroom",
    "partition_activations": "--partition-activations",
    "cpu_offload_activations": "--cpu-offload-activations",
    "world": "--ranks",
    "memory_per_rank": "--memory-per-rank",
    "margin": "--margin",
    "model": "--params or --gpt-layers/--gpt-dim/--gpt-heads",
    "mlp_ratio": "--gpt-mlp-ratio",
}


class _UsageError(Exception):
    """Bad input, already worded for the command line."""


def _parse(value: str, units: dict[str, int], what: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
    amount = Decimal(match.group(1)) * units[match.group(2).lower()]
    if amount != amount.to_integral_value() or amount < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    if amount > _LARGEST:
        raise argparse.ArgumentTypeError(f"{value!r} is too large (at most {_LARGEST:.3g})")
    return int(amount)


_LARGEST = 2**63 - 1
"""The largest count or size taken: a signed 64-bit integer, as every byte count here."""


def _count(value: str) -> int:
    return _parse(value, _COUNT, "a count (e.g. 7.5e9 or 7.5B)")


def _size(value: str) -> int:
    return _parse(value, _SIZE, "a size (e.g. 80GiB or 80e9)")


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``zeroservice`` command's sub-parsers."""
    p = subparsers.add_parser(
        "plan",
        help="memory per rank of a ZeRO configuration, the paper's Table 1, a recommendation",
        description=__doc__,
    )
    model = p.add_argument_group("model (--params, or the reference GPT by its shape)")
    model.add_argument("--params", type=_count, help="parameters Ψ, e.g. 7.5e9 or 128B")
    model.add_argument("--gpt-layers", type=int, help="transformer layers")
    model.add_argument("--gpt-dim", type=int, help="hidden size")
    model.add_argument("--gpt-heads", type=int, help="attention heads")
    model.add_argument("--vocab", type=int, help="vocabulary size (GPT default 8192)")
    model.add_argument("--seq", type=int, help="sequence length (GPT default 128)")
    model.add_argument(
        "--vocab-tiles",
        type=int,
        help="the GPT's head and loss in this many vocabulary tiles (default 1: at once)",
    )
    model.add_argument("--gpt-mlp-ratio", type=int, help="MLP width / hidden size (default 4)")
    model.add_argument(
        "--gpt-untied", action="store_true", help="an output head of its own (default: tied)"
    )
    model.add_argument("--gpt-no-bias", action="store_true", help="linear layers without bias")
    run = p.add_argument_group("configuration")
    run.add_argument("--dp", type=int, help="data-parallel ranks N_d")
    run.add_argument(
        "--mp", type=int, help="model-parallel ranks N_m (default 1; with --auto: chosen)"
    )
    run.add_argument("--stage", type=int, help="ZeRO stage 0-3")
    run.add_argument(
        "--precision",
        help="fp32, bf16 or fp16 (default: bf16, the paper's mixed precision; with --auto "
        "fp32, the engine's default, as POST /v1/plan and auto_configure)",
    )
    run.add_argument("--optimizer-bytes", type=int, default=8, help="per element (Adam: 8)")
    run.add_argument(
        "--bucket-elements",
        type=_count,
        default=None,
        help="C_B (default: 2^23, capped so no stage holds more than the one below)",
    )
    run.add_argument("--micro-batch", type=int, help="samples per micro-batch: activations")
    run.add_argument("--offload-optimizer", action="store_true", help="master + states on host")
    run.add_argument("--checkpoint-activations", action="store_true")
    run.add_argument("--partition-activations", action="store_true", help="checkpoints / N_m")
    run.add_argument("--cpu-offload-activations", action="store_true", help="checkpoints on host")
    zpp = p.add_argument_group("ZeRO++ (stage 3; qgZ at stages 1-3)")
    zpp.add_argument("--quantized-weights", action="store_true", help="qwZ: int8 gathers")
    zpp.add_argument("--quantized-gradients", default="none", help="qgZ: none, int8 or int4")
    zpp.add_argument("--hierarchical-partition", action="store_true", help="hpZ: secondary shards")
    zpp.add_argument("--ranks-per-node", type=int, help="L: hpZ's node, qgZ's first hop")
    zpp.add_argument("--quantization-block", type=int, default=256, help="elements per scale")
    modes = p.add_argument_group("other modes")
    modes.add_argument("--paper", action="store_true", help="print the paper's Table 1")
    modes.add_argument("--recommend", action="store_true", help="choose stage, N_d, N_m")
    modes.add_argument("--ranks", type=int, help="recommend, auto: devices in all")
    modes.add_argument("--devices-per-node", type=int, help="recommend: N_m stays in a node")
    modes.add_argument("--device-memory", type=_size, help="recommend: e.g. 80GiB")
    modes.add_argument("--headroom", type=float, default=0.9, help="usable share (0.9)")
    modes.add_argument(
        "--auto",
        action="store_true",
        help="the reference GPT's fastest configuration whose predicted peak fits",
    )
    modes.add_argument("--memory-per-rank", type=_size, help="auto: e.g. 512MiB")
    modes.add_argument("--margin", type=float, default=0.10, help="auto: on the peak (0.10)")
    modes.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="auto: the ranks train on (cuda: --memory-per-rank is GPU memory; offload's "
        "host bytes do not count)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """0: printed; 1: a recommendation (or --auto) found nothing that fits; 2: bad input."""
    from zeroservice import planner

    try:
        _check_mode(args)
        if args.precision is None:
            args.precision = "fp32" if args.auto else "bf16"
        if args.paper:
            return _paper(args)
        model = _model(args)
        if args.auto:
            return _auto(args, model)
        return _recommend(args, model) if args.recommend else _plan(args, model)
    except _UsageError as exc:
        print(f"zeroservice plan: {exc}", file=sys.stderr)
    except (planner.PlanError, ValueError) as exc:
        field, _, rest = str(exc).partition(": ")
        print(f"zeroservice plan: {_FLAGS.get(field, field)}: {rest}", file=sys.stderr)
    return 2


_MODEL = {
    "params",
    "gpt_layers",
    "gpt_dim",
    "gpt_heads",
    "vocab",
    "seq",
    "vocab_tiles",
    "gpt_mlp_ratio",
    "gpt_untied",
    "gpt_no_bias",
}
_PLAN = {
    "dp",
    "mp",
    "stage",
    "precision",
    "optimizer_bytes",
    "bucket_elements",
    "micro_batch",
    "offload_optimizer",
    "checkpoint_activations",
    "partition_activations",
    "cpu_offload_activations",
    "quantized_weights",
    "quantized_gradients",
    "hierarchical_partition",
    "ranks_per_node",
    "quantization_block",
}
_USED = {
    "--paper": set(),
    "--auto": _MODEL
    | {"ranks", "memory_per_rank", "precision", "micro_batch", "mp"}
    | {"margin", "device"},
    "--recommend": _MODEL
    | {"ranks", "devices_per_node", "device_memory", "precision", "seq", "micro_batch"}
    | {"optimizer_bytes", "offload_optimizer", "partition_activations"}
    | {"cpu_offload_activations", "bucket_elements", "headroom"},
    "": _MODEL | _PLAN,
}
"""The flags each mode reads (by argparse dest): one given to a mode that does not read
it is refused, not ignored (``--stage 2 --auto`` would print a choice that is not
stage 2)."""
_DEFAULTS = {
    "optimizer_bytes": 8,
    "quantized_gradients": "none",
    "quantization_block": 256,
    "headroom": 0.9,
    "margin": 0.10,
    "device": "cpu",
}
"""Flags whose absence is a value: given is when they differ from it."""


def _check_mode(args: argparse.Namespace) -> None:
    modes = [m for m in ("--paper", "--auto", "--recommend") if getattr(args, m[2:])]
    if len(modes) > 1:
        raise _UsageError(f"{modes[1]}: not with {modes[0]} (one mode at a time)")
    mode = modes[0] if modes else ""
    for dest in sorted(set().union(*_USED.values()) | set(_DEFAULTS)):
        value = getattr(args, dest)
        given = value != _DEFAULTS[dest] if dest in _DEFAULTS else value not in (None, False)
        if given and dest not in _USED[mode]:
            flag = "--" + dest.replace("_", "-")
            where = f"with {mode}" if mode else "in a plan (give --auto or --recommend)"
            raise _UsageError(f"{flag}: not used {where}")


def _auto(args: argparse.Namespace, model: planner.ModelSpec) -> int:
    from zeroservice.autoconf import auto_configure

    if model.gpt is None:
        raise _UsageError("--auto: describe the reference GPT (--gpt-layers/--gpt-dim/--gpt-heads)")
    for flag, value in (("--ranks", args.ranks), ("--memory-per-rank", args.memory_per_rank)):
        if value is None:
            raise _UsageError(f"{flag}: required with --auto")
    result = auto_configure(
        model.gpt,
        world=args.ranks,
        memory_per_rank=args.memory_per_rank,
        precision=args.precision,
        micro_batch=1 if args.micro_batch is None else args.micro_batch,
        seq_len=args.seq,
        mp=args.mp,
        margin=args.margin,
        device=args.device,
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    elif result.choice is None:
        print(f"zeroservice plan: {result.reason}", file=sys.stderr)
    else:
        print(f"chosen: {result.reason}")
        print(f"engine: {json.dumps(result.choice.engine_config())}")
        kinds = result.choice.peak.breakdown[result.choice.peak.phase]
        for kind, n in kinds.items():
            print(f"  {kind:<20} {n:>15,} bytes")
    return 0 if result.fits else 1


def _model(args: argparse.Namespace) -> planner.ModelSpec:
    from zeroservice import planner

    shape = {"--gpt-layers": args.gpt_layers, "--gpt-dim": args.gpt_dim}
    shape["--gpt-heads"] = args.gpt_heads
    given = [flag for flag, v in shape.items() if v is not None]
    if given and len(given) < len(shape):
        missing = ", ".join(f for f in shape if f not in given)
        raise _UsageError(f"{missing}: required with {', '.join(given)}")
    if args.params is not None:
        for flag, value in (
            ("--vocab-tiles", args.vocab_tiles),
            ("--gpt-mlp-ratio", args.gpt_mlp_ratio),
            ("--gpt-untied", args.gpt_untied or None),
            ("--gpt-no-bias", args.gpt_no_bias or None),
        ):
            if value is not None:
                raise _UsageError(f"{flag}: describes the reference GPT, not --params")
        return planner.ModelSpec(
            args.params, args.gpt_layers, args.gpt_dim, args.gpt_heads, args.seq, args.vocab
        )
    if not given:
        raise _UsageError("--params or --gpt-layers/--gpt-dim/--gpt-heads: describe the model")
    from zeroservice.models import GPTConfig

    fields: dict[str, Any] = {"n_layer": args.gpt_layers, "dim": args.gpt_dim}
    fields["n_head"] = args.gpt_heads
    fields["tie_weights"], fields["bias"] = not args.gpt_untied, not args.gpt_no_bias
    if args.gpt_mlp_ratio is not None:
        fields["mlp_ratio"] = args.gpt_mlp_ratio
    if args.vocab is not None:
        fields["vocab_size"] = args.vocab
    if args.seq is not None:
        fields["seq_len"] = args.seq
    if args.vocab_tiles is not None:
        fields["vocab_tiles"] = args.vocab_tiles
    try:
        return planner.describe(GPTConfig(**fields))
    except ValueError as exc:
        raise planner.PlanError(str(exc)) from None


def _plan(args: argparse.Namespace, model: planner.ModelSpec) -> int:
    from zeroservice import planner

    for flag, value in (("--dp", args.dp), ("--stage", args.stage)):
        if value is None:
            raise _UsageError(f"{flag}: required (or --paper, or --recommend)")
    result = planner.plan(
        model,
        dp=args.dp,
        mp=1 if args.mp is None else args.mp,
        stage=args.stage,
        precision=args.precision,
        optimizer_bytes=args.optimizer_bytes,
        offload_optimizer=args.offload_optimizer,
        activation_checkpointing=args.checkpoint_activations,
        partition_activations=args.partition_activations,
        cpu_offload_activations=args.cpu_offload_activations,
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        bucket_elements=args.bucket_elements,
        quantized_weights=args.quantized_weights,
        quantized_gradients=args.quantized_gradients,
        hierarchical_partition=args.hierarchical_partition,
        ranks_per_node=args.ranks_per_node,
        quantization_block=args.quantization_block,
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0


def _recommend(args: argparse.Namespace, model: planner.ModelSpec) -> int:
    from zeroservice import planner

    flags = {"--ranks": args.ranks, "--devices-per-node": args.devices_per_node}
    flags["--device-memory"] = args.device_memory
    for flag, value in flags.items():
        if value is None:
            raise _UsageError(f"{flag}: required with --recommend")
    result = planner.recommend(
        model,
        ranks=args.ranks,
        devices_per_node=args.devices_per_node,
        device_memory_bytes=args.device_memory,
        precision=args.precision,
        seq_len=args.seq,
        micro_batch=args.micro_batch or 1,
        optimizer_bytes=args.optimizer_bytes,
        offload_optimizer=args.offload_optimizer,
        partition_activations=args.partition_activations,
        cpu_offload_activations=args.cpu_offload_activations,
        bucket_elements=args.bucket_elements,
        headroom=args.headroom,
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    elif result.choice is None:
        print(f"zeroservice plan: {result.reason}", file=sys.stderr)
    else:
        print(f"recommended: {result.reason} ({result.considered} configurations weighed)\n")
        print(format_plan(result.choice.plan))
    return 0 if result.fits else 1


_KINDS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("master", "fp32 master weights"),
    ("optimizer_states", "optimizer states"),
    ("model_states", "model states"),
    ("activations", "activations (device)"),
    ("activations_offloaded", "activations (host)"),
    ("comm_buffers", "gradient staging"),
    ("gathered_params", "gathered parameters"),
    ("secondary_params", "hpZ secondary shards"),
    ("quantization_scratch", "ZeRO++ quantized rows"),
    ("device_total", "device total"),
    ("host_total", "host total"),
)

_ZEROPP_KINDS = {"secondary_params", "quantization_scratch"}
"""Shown only when ZeRO++ holds them."""


def format_plan(plan: planner.MemoryPlan) -> str:
    """The plan as a table of bytes per rank by kind."""
    from zeroservice import planner

    head = (
        f"ZeRO stage {plan.stage}, {plan.precision}, N_d = {plan.dp}, N_m = {plan.mp}: "
        f"Ψ = {plan.psi:,} ({plan.psi_local:,} per model-parallel rank)"
    )
    values = plan.as_dict()
    lines = [head, f"{'kind':<24}{'per rank':>14} {'bytes':>23}"]
    for key, label in _KINDS:
        n = int(values[key])
        if not n and key in _ZEROPP_KINDS:
            continue
        lines.append(f"{label:<24}{planner.human_bytes(n):>14} {n:>23,}")
    return "\n".join(lines)


def _paper(args: argparse.Namespace) -> int:
    from zeroservice import planner

    rows = planner.paper_table()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return 0
    print(format_paper(rows))
    return 0


def format_paper(rows: list[planner.PaperRow]) -> str:
    """Table 1 as the paper lays it out: one row per N_d, a column group per model."""
    models = sorted({r.psi for r in rows})
    names = {7_500_000_000: "7.5B", 128_000_000_000: "128B", 1_000_000_000_000: "1T"}
    cell = 9
    title = "".join(f"{names.get(m, f'{m:.3g}') + ' Model':^{3 * cell}}|" for m in models)
    sub = ("Pos".rjust(cell) + "Pos+g".rjust(cell) + "Pos+g+p".rjust(cell) + "|") * len(models)
    lines = [
        "Model-state memory per device (mixed precision, Adam: K = 12)",
        f"{'DP':>5} |{title}",
        f"{'':>5} |{sub}",
    ]
    for n_d in sorted({r.n_d for r in rows}):
        line = f"{n_d:>5} |"
        for m in models:
            r = next(r for r in rows if r.psi == m and r.n_d == n_d)
            tb = m >= 10**12
            line += "".join(
                _paper_number(gb, tb).rjust(cell) + ("|" if i == 2 else "")
                for i, gb in enumerate((r.p_os, r.p_os_g, r.p_os_g_p))
            )
        lines.append(line)
    lines.append("GB = 1e9 bytes; TB = 1e12 bytes (the 1T model, as the paper prints it)")
    return "\n".join(lines)


def _paper_number(gb: float, tb: bool) -> str:
    """Three significant digits, at most two decimals, halves rounded up, as printed."""
    unit = ""
    if tb and gb >= 1000:
        gb, unit = gb / 1000, " TB"
    elif tb:
        unit = " GB"
    value = Decimal(repr(gb))
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    text = str(value.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text + unit
