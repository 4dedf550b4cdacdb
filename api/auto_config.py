"""``engine: {"stage": "auto"}``: the control plane chooses the job's configuration.

A job whose engine names ``"stage": "auto"`` is resolved when it is submitted (and by
``POST /v1/plan``) with ``zeroservice.autoconf.auto_configure``: the fastest
configuration (stage, N_m, activation checkpointing, offload, bucket and prefetch
sizes) whose predicted peak, with a 10% margin, fits the memory per rank the job is held
to (see [Note: automatic configuration] in zeroservice/autoconf.py). The stored spec is
the resolved one, so the ranks never see "auto", and the job's first events say what
was chosen and why. Nothing fits: the submission is refused with the numbers.

What auto may change: the fields in ``CHOSEN`` and, for a job of one fixed size, the
split of its ranks (``resources.dp`` × ``resources.mp`` stays the same world). CPU ranks
get ``resources.host_allocator: mapped``, and a job naming another allocator is refused:
the predicted peak is the resident memory with glibc's mapping threshold at 128 KiB,
and under glibc's default settings ranks hold up to 40% more, beyond the margin
(docs/operations.md, "Host memory of CPU ranks"). An elastic
job (min_dp < max_dp) keeps its N_m and is sized at its fewest replicas, where each rank
holds the most. The choice rests on the reference GPT's peak model, so a job it does
not cover (another model, optimizer, fp16, accumulation, host copies, ZeRO++) is
refused naming the field, not guessed at.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pydantic import ValidationError

from workers.spec import MAX_DP, MAX_MP, GPTModelSpec, JobSpec
from zeroservice.autoconf import auto_configure
from zeroservice.config import ZeroConfig

from .plan import uncovered, uncovered_at_stage3

CHOSEN = (
    "stage",
    "activation_checkpointing",
    "partition_activations",
    "offload_optimizer",
    "bucket_elements",
    "stage3_prefetch_elements",
)
"""The engine fields auto decides: a job naming one besides ``"stage": "auto"`` is refused."""


class AutoRefused(Exception):
    """Auto cannot configure the job; ``detail`` is the API's error body."""

    def __init__(self, detail: dict[str, Any]):
        super().__init__(detail["message"])
        self.detail = detail

    @property
    def nothing_fits(self) -> bool:
        """The job is modelled but no configuration fits (``detail["auto"]`` says what
        was weighed); otherwise the job itself is outside what auto configures."""
        return "auto" in self.detail


def is_auto(spec: JobSpec) -> bool:
    return spec.engine.get("stage") == "auto"


def resolve(spec: JobSpec, memory_per_rank: int) -> tuple[JobSpec, dict[str, Any]]:
    """The spec with the chosen configuration, and the choice (what was weighed, the
    reason); raises AutoRefused when nothing fits or the job is outside the model."""
    if not isinstance(spec.model, GPTModelSpec):
        _refuse(
            "engine.stage: auto needs the reference GPT (model.kind gpt): peaks are "
            "predicted for it only; name a stage (0-3) for this model"
        )
    named = sorted(k for k in CHOSEN if k != "stage" and k in spec.engine)
    if named:
        _refuse(
            f"engine.{named[0]}: stage auto chooses {', '.join(named)} itself; leave "
            "them out or name a stage (0-3)"
        )
    concrete = ZeroConfig.from_dict({**spec.engine, "stage": 0})
    # Auto may choose stage 3: what the peak model lacks there (leaf modules) counts too.
    gap = uncovered(spec, concrete) or uncovered_at_stage3(concrete)
    if gap is not None:
        _refuse(f"engine.stage: auto is not modelled for this job: {gap}")
    res = spec.resources
    if res.gpus_per_rank == 0 and res.host_allocator not in (None, "mapped"):
        _refuse(
            f"resources.host_allocator: {res.host_allocator!r}: auto's predicted peaks are "
            "resident memory under 'mapped' (ranks hold up to 40% more under glibc's "
            "defaults, beyond auto's margin); leave host_allocator out (auto sets "
            "'mapped') or name a stage (0-3)"
        )
    elastic = res.lowest_dp != res.highest_dp
    world = res.lowest_dp * res.mp
    try:
        choice = auto_configure(
            spec.model.gpt_config(),
            world=world,
            memory_per_rank=memory_per_rank,
            precision=concrete.precision,
            micro_batch=spec.micro_batch,
            seq_len=spec.model.seq_len,
            mp=res.mp if elastic else None,
            max_mp=MAX_MP,
            max_dp=MAX_DP,
            device=res.device,
            collectives=concrete.collectives,
            persistence_elements=concrete.stage3_persistence_elements,
        )
    except ValueError as exc:  # a split the job fixes that the model refuses (vocab_tiles)
        _refuse(f"engine.stage: auto: {exc}")
    weighed = choice.as_dict()
    if choice.choice is None:
        _refuse(
            f"engine.stage auto: {choice.reason}",
            auto=weighed,
            needed_bytes=choice.need(choice.smallest),
            available_bytes=memory_per_rank,
        )
    chosen = choice.choice
    engine = {k: v for k, v in spec.engine.items() if k != "stage"}
    engine.update(chosen.engine_config())
    resources = res.model_dump()
    if res.gpus_per_rank == 0 and res.host_allocator is None:
        resources["host_allocator"] = "mapped"  # the setting the predicted peak holds for
    if not elastic:
        resources.update(dp=chosen.config.dp, mp=chosen.config.mp, min_dp=None, max_dp=None)
    weighed["host_allocator"] = resources["host_allocator"]
    data = spec.model_dump(mode="json")
    data.update(engine=engine, resources=resources)
    try:
        return JobSpec.model_validate(data), weighed
    except ValidationError as exc:  # the chosen split breaks one of the spec's own rules
        why = exc.errors()[0]["msg"].removeprefix("Value error, ")
        _refuse(f"engine.stage auto chose {chosen.describe()}, which the spec refuses: {why}")


def configured_event(weighed: dict[str, Any]) -> dict[str, Any]:
    """The job's event saying what auto chose and why (``kind`` configured)."""
    choice = weighed["choice"]
    return {
        "kind": "configured",
        "reason": "auto",
        "message": weighed["reason"],
        "data": {
            "engine": choice["engine"],
            "dp": choice["dp"],
            "mp": choice["mp"],
            "peak_bytes": choice["peak_bytes"],
            "budget_bytes": weighed["budget_bytes"],
            "considered": weighed["considered"],
            "host_allocator": weighed.get("host_allocator"),
        },
    }


def _refuse(message: str, **extra: Any) -> NoReturn:
    raise AutoRefused({"message": message, "fits": False, **extra})
