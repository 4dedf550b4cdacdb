"""The job spec: one validated schema for a training job, used by the supervisor and
accepted as is by the REST API.

Every model is strict (``extra="forbid"``): an unknown or misspelt field is an error
naming it, never silently ignored. Cross-field rules (dp × mp, heads and vocabulary
divisible by mp, min_dp ≤ dp ≤ max_dp, the engine config) are checked here, so a bad
job is refused at submission, before any resource is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zeroservice.config import ConfigError, ZeroConfig
from zeroservice.models import GPTConfig

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SUB_DIR = re.compile(r"^[\w.\-]+(/[\w.\-]+)*$", re.ASCII)
S3_SCHEME = "s3://"


def _plain_relative(path: str) -> bool:
    """``a/b/c`` of letters, digits and ``_ . -``: no empty, ``.`` or ``..`` component."""
    return bool(_SUB_DIR.match(path)) and not any(p in ("", ".", "..") for p in path.split("/"))


class _Strict(BaseModel):
    """Strict types too: ``"2"``, ``true`` or ``2.0`` for a count is an error, not 2 or 1."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
        strict=True,
    )


def _finite_json(value: Any, where: str, depth: int = 0) -> Any:
    """Free-form JSON (factory kwargs, configs) with no NaN or infinity and bounded depth:
    it is stored and sent on as JSON, which has neither."""
    if depth > 16:
        raise ValueError(f"{where}: nested deeper than 16 levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite_json(item, f"{where}.{key}", depth + 1)
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _finite_json(item, f"{where}[{i}]", depth + 1)
    return value


class GPTModelSpec(_Strict):
    """The reference GPT (zeroservice.models.GPT); tensor parallel when mp > 1."""

    kind: Literal["gpt"] = "gpt"
    """Selects the reference GPT (the default when ``kind`` is absent)."""
    vocab_size: int = Field(8192, ge=2, le=1_048_576)
    """Vocabulary size (divisible by mp with model parallelism)."""
    seq_len: int = Field(128, ge=1, le=1_048_576)
    """Tokens per sample (the position table size)."""
    n_layer: int = Field(4, ge=1, le=1024)
    """Transformer blocks."""
    n_head: int = Field(4, ge=1, le=1024)
    """Attention heads (divisible by mp)."""
    dim: int = Field(256, ge=1, le=65_536)
    """Model width (divisible by n_head)."""
    mlp_ratio: int = Field(4, ge=1, le=64)
    """MLP hidden width as a multiple of dim."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability (recomputation replays the same masks)."""
    tie_weights: bool = True
    """Share the token embedding with the output head."""
    bias: bool = True
    """Biases in the linear layers."""
    vocab_tiles: int = Field(1, ge=1, le=1_048_576)
    """The output head and the loss in this many vocabulary tiles, so that the whole
    logits never exist (1: at once); not with model parallelism."""

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> GPTModelSpec:
        if self.dim % self.n_head:
            raise ValueError(f"model.dim: {self.dim} is not divisible by n_head {self.n_head}")
        if self.vocab_tiles > self.vocab_size:
            raise ValueError(
                f"model.vocab_tiles: {self.vocab_tiles} exceeds vocab_size {self.vocab_size}"
            )
        return self

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**self.model_dump(exclude={"kind"}))


class TransformersModelSpec(_Strict):
    """A causal language model from ``transformers``, built from a config (no download)."""

    kind: Literal["transformers"]
    """Selects a transformers model."""
    architecture: str = Field(
        max_length=128, pattern=r"^[A-Za-z][A-Za-z0-9]*ForCausalLM$|^GPT2LMHeadModel$"
    )
    """e.g. GPT2LMHeadModel, LlamaForCausalLM."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the architecture's config class (n_layer, hidden_size, ...)."""
    seq_len: int = Field(128, ge=1, le=1_048_576)
    """Tokens per sample; at most the positions the config states (workers/build.py)."""
    vocab_size: int = Field(ge=2, le=1_048_576)
    """Vocabulary size (must equal the config's)."""

    @field_validator("config")
    @classmethod
    def _finite_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _finite_json(value, "model.config")


class FactoryModelSpec(_Strict):
    """``package.module:function(**kwargs)`` returning an nn.Module whose
    ``forward(inputs, targets)`` returns the mean loss."""

    kind: Literal["factory"]
    """Selects a model built by an importable function."""
    factory: str = Field(max_length=256)
    """``package.module:function``, importable on every worker, in a module the
    service allows."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory (JSON)."""
    seq_len: int = Field(128, ge=1, le=1_048_576)
    """Tokens per sample."""
    vocab_size: int = Field(ge=2, le=1_048_576)
    """Vocabulary size (token ids are checked against it)."""

    @field_validator("kwargs")
    @classmethod
    def _finite_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _finite_json(value, "model.kwargs")

    @field_validator("factory")
    @classmethod
    def _importable_form(cls, value: str) -> str:
        if not _FACTORY.match(value):
            raise ValueError(f"{value!r} is not of the form package.module:function")
        return value


ModelSpec = Annotated[
    GPTModelSpec | TransformersModelSpec | FactoryModelSpec, Field(discriminator="kind")
]


class DataSpec(_Strict):
    """Where tokens come from. ``synthetic``: a learnable Markov chain (no files);
    ``text``: a file read as bytes (vocabulary 256); ``tokens``: a pre-tokenised file
    of little-endian uint16 or uint32 ids."""

    kind: Literal["synthetic", "text", "tokens"] = "synthetic"
    """synthetic, text or tokens."""
    path: str | None = Field(None, min_length=1, max_length=4096)
    """File to read (text and tokens), under the service's data roots (a relative path
    from the first); readable by every worker. Or an object ``s3://bucket/key/...``
    below the tenant's own prefix in the operator's ``ZEROSERVICE_DATA_S3_ROOT``
    (checked by the control plane), read in byte ranges."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Id width of a tokens file."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of the sample order (and of the synthetic chain)."""

    @model_validator(mode="after")
    def _path_when_needed(self) -> DataSpec:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.path: required for data of kind {self.kind!r}")
        if self.kind == "synthetic" and self.path:
            raise ValueError("data.path: synthetic data reads no file")
        uri = self.path or ""
        if uri.startswith(S3_SCHEME) and not _plain_relative(uri.removeprefix(S3_SCHEME)):
            raise ValueError(
                f"data.path: {uri[:64]!r} is not an s3://bucket/key of letters, digits, "
                "_ . - separated by / (no '..')"
            )
        return self


class OptimizerSpec(_Strict):
    type: Literal["adamw", "adam", "sgd"] = "adamw"
    """adamw (decoupled weight decay), adam or sgd."""
    lr: float = Field(3e-4, gt=0, le=10)
    """Base learning rate (the engine schedule multiplies it)."""
    weight_decay: float = Field(0.0, ge=0, le=10)
    """Weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0, le=1)
    """Adam epsilon."""
    momentum: float = Field(0.0, ge=0, lt=1)
    """SGD momentum."""

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_json(cls, value: Any) -> Any:
        """A JSON or YAML array is the pair (strict mode takes only a tuple)."""
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {value}")
        return value


MAX_DP = 4096
"""The most data-parallel replicas a job may name."""
MAX_MP = 64
"""The most model-parallel ranks a replica may have."""


class ResourcesSpec(_Strict):
    dp: int = Field(1, ge=1, le=MAX_DP)
    """Data-parallel replicas; with ``min_dp``/``max_dp`` the default of both: a job
    starts with as many replicas as fit, from min_dp up to max_dp."""
    mp: int = Field(1, ge=1, le=MAX_MP)
    """Model-parallel (tensor-parallel) ranks per replica; packed on one node."""
    min_dp: int | None = Field(None, ge=1, le=MAX_DP)
    """The job shrinks down to this many replicas on worker loss (default: dp)."""
    max_dp: int | None = Field(None, ge=1, le=MAX_DP)
    """The job grows back up to this many replicas when capacity returns (default: dp)."""
    gpus_per_rank: Literal[0, 1] = 0
    """1: each rank takes one GPU (NCCL); 0: CPU ranks (gloo)."""
    cpus_per_rank: float = Field(1.0, ge=0.0001, le=256)
    """CPUs reserved per rank (fractions let ranks share cores, down to Ray's
    precision of 0.0001)."""
    host_allocator: Literal["huge", "mapped", "inherit"] | None = None
    """How the ranks hold host memory, set in their processes before torch loads (as
    if they had started with the variables: [Note: rank settings in process]).
    ``huge`` (unset: the same): torch asks the kernel for transparent huge pages for
    every host block of 2 MiB or more (``THP_MEM_ALLOC_ENABLE=1``, where the kernel's
    THP mode is ``madvise`` or ``always``), so writing fresh memory (a step's new
    tensors, a restore after a lost rank, a host copy) faults once per 2 MiB instead of
    once per 4 KiB page; glibc keeps its default settings. ``mapped``: the same, and the
    ranks run with ``MALLOC_MMAP_THRESHOLD_=131072``, so every block above 128 KiB is
    mapped on its own and returned when freed, and resident memory follows the live
    tensors as the planner predicts it (at a cost in step time). ``inherit``: whatever
    the Ray node's environment says. ``stage: "auto"`` sets ``mapped`` for CPU ranks
    when the job leaves it unset, since the fit it chose rests on the prediction."""

    @property
    def device(self) -> str:
        """Where each rank trains, as the peak model names it: "cuda" or "cpu"."""
        return "cuda" if self.gpus_per_rank else "cpu"

    @model_validator(mode="after")
    def _bounds(self) -> ResourcesSpec:
        lo = self.min_dp if self.min_dp is not None else self.dp
        hi = self.max_dp if self.max_dp is not None else self.dp
        if not lo <= self.dp <= hi:
            raise ValueError(
                f"resources: need min_dp <= dp <= max_dp, got {lo} <= {self.dp} <= {hi}"
            )
        return self

    @property
    def lowest_dp(self) -> int:
        return self.min_dp if self.min_dp is not None else self.dp

    @property
    def highest_dp(self) -> int:
        return self.max_dp if self.max_dp is not None else self.dp


class CheckpointSpec(_Strict):
    interval_steps: int = Field(50, ge=1, le=10**9)
    """Save every this many optimizer steps (and at the end)."""
    keep: int = Field(2, ge=1, le=1000)
    """Complete checkpoints kept (older ones are pruned)."""
    dir: str | None = Field(None, min_length=1, max_length=255)
    """A sub-directory of the tenant's checkpoint directory (``a/b``: letters, digits,
    ``_ . -``; never ``..`` or absolute); default: the job's id. Name the same one
    in a later job to resume from its checkpoints. Or an object-store prefix
    ``s3://bucket/key/...`` below the tenant's own prefix in the operator's
    ``ZEROSERVICE_CHECKPOINT_S3_ROOT`` (checked by the control plane)."""

    @field_validator("dir")
    @classmethod
    def _sub_directory(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not _plain_relative(value.removeprefix(S3_SCHEME)):
            raise ValueError(
                f"checkpoint.dir: {value[:64]!r} is not a relative sub-directory "
                "(letters, digits, _ . - separated by /, no '..') nor an s3://bucket/prefix"
            )
        return value


class TimeoutsSpec(_Strict):
    bootstrap_s: float = Field(120.0, ge=5, le=3600)
    """Placement and process-group start-up must finish within this (at least 5 s: a
    rank's process alone takes seconds to start, so no start would succeed below)."""
    step_s: float = Field(300.0, gt=0, le=86_400)
    """A rank that makes no progress for this long is declared stalled (watchdog)."""


class TrackingSpec(_Strict):
    """Experiment tracking, done where the job runs (workers/tracking.py)."""

    tensorboard: bool = False
    """Write TensorBoard event files under the job's checkpoint directory
    (``tensorboard/<job id>``)."""
    mlflow: bool = False
    """Log the job as an MLflow run: the spec as parameters, the history as metrics,
    the checkpoints as artifacts by reference."""
    mlflow_uri: str | None = Field(None, min_length=1, max_length=512)
    """The MLflow tracking URI; default: the service's (a local file store unless the
    operator set another). A tenant may name only a server the operator allows."""
    experiment: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\w.\- /]+$")
    """The MLflow experiment; default: the tenant's name."""


MAX_LEAF_MODULES = 256
"""The most ``stage3_leaf_modules`` names a job may give (a model has a handful of
leaf classes; each name is matched against every module whenever the spec is read)."""
MAX_NAME_CHARS = 256


def _bounded_names(field: str, names: list | tuple) -> None:
    """Refuse a list of names too long to be a model's, naming the bound: a spec is
    validated wherever it is read (the scheduler's every pass among them)."""
    if len(names) > MAX_LEAF_MODULES:
        raise ValueError(f"{field}: {len(names)} names, at most {MAX_LEAF_MODULES} are taken")
    for i, name in enumerate(names):
        if isinstance(name, str) and len(name) > MAX_NAME_CHARS:
            raise ValueError(f"{field}[{i}]: a name of at most {MAX_NAME_CHARS} characters")


_BLOCK_NAME = re.compile(r"^blocks\.(0|[1-9][0-9]*)(\..+)?$")


@functools.lru_cache(maxsize=64)
def _gpt_leaf_error(config: tuple, leaves: tuple[str, ...]) -> str | None:
    """Why ``leaves`` name no module of the reference GPT of this config (None: they
    do). Cached: a spec is validated again wherever it is read (the scheduler's every
    pass, the supervisor, each rank).

    The model is built with one block, on the meta device: its blocks are alike, so a
    name inside block i < n_layer is checked as the same name inside block 0, and the
    cost does not grow with the depth (a request is validated on the API's event loop,
    and building every block of a 1,024-layer GPT took seconds there)."""
    import torch

    from zeroservice.models import GPT
    from zeroservice.partition import leaf_modules

    cfg = GPTConfig(*config)
    as_checked = {leaf: _in_first_block(leaf, cfg.n_layer) for leaf in leaves}
    with torch.device("meta"):
        model = GPT(dataclasses.replace(cfg, n_layer=min(cfg.n_layer, 1)))
    try:
        leaf_modules(model, [as_checked[leaf] for leaf in leaves])
    except ConfigError as exc:
        message = str(exc)
        for leaf, checked in as_checked.items():
            if checked != leaf:
                message = message.replace(repr(checked), repr(leaf), 1)
        return message
    return None


def warm_up_checks() -> None:
    """Pay the leaf-module check's one-time cost before a service takes requests: the
    first initialisation on the meta device imports torch._dynamo (about 2 s), which
    would otherwise run inside the first such request, on the API's event loop."""
    tiny = GPTConfig(vocab_size=8, seq_len=8, n_layer=1, n_head=1, dim=8)
    _gpt_leaf_error(dataclasses.astuple(tiny), ("Block",))


def _in_first_block(name: str, n_layer: int) -> str:
    """``blocks.<i>.rest`` as ``blocks.0.rest`` where block i exists; any other name
    as it is (a block beyond the model's is then refused, as it should be)."""
    match = _BLOCK_NAME.match(name)
    if match is None or int(match.group(1)) >= n_layer:
        return name
    return f"blocks.0{match.group(2) or ''}"


class JobSpec(_Strict):
    """A training job, as submitted."""

    name: str = Field("job", min_length=1, max_length=128, pattern=r"^[\w.\- ]*[\w.\-][\w.\- ]*$")
    """A label for people (letters, digits, spaces, . _ -; not spaces alone)."""
    model: ModelSpec = Field(default_factory=GPTModelSpec)
    """What to train."""
    data: DataSpec = Field(default_factory=DataSpec)
    """What to train on."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """ZeroConfig fields (stage, precision, buckets, prefetch, activation
    checkpointing, offload, gradient_accumulation_steps, clipping, lr_schedule...);
    ``"stage": "auto"`` lets the service choose (api/auto_config.py)."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """The optimizer run on each rank's fp32 shards."""
    steps: int = Field(100, ge=1, le=10**9)
    """Optimizer steps to train."""
    micro_batch: int = Field(8, ge=1, le=65_536)
    """Samples per DP replica per micro-batch."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Ranks and what each takes."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """When to save and how many to keep."""
    timeouts: TimeoutsSpec = Field(default_factory=TimeoutsSpec)
    """Bootstrap and hang-watchdog limits."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """TensorBoard event files and an MLflow run (off by default)."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Restarts (worker loss, stalls, failed starts) before the job fails."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of the initial weights."""
    peak_tflops: float | None = Field(None, gt=0, le=100_000)
    """Peak dense TFLOPS of one rank's device for MFU (default: from the device table)."""

    @field_validator("model", mode="before")
    @classmethod
    def _gpt_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": "gpt", **value}
        return value

    @field_validator("engine")
    @classmethod
    def _engine_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        _finite_json(value, "engine")
        checked = dict(value)
        if checked.get("stage") == "auto":  # resolved at submission: api/auto_config.py
            checked["stage"] = 0
        try:
            ZeroConfig.from_dict(checked)
        except (ConfigError, TypeError) as exc:
            raise ValueError(f"engine.{exc}") from None
        return value

    @model_validator(mode="after")
    def _parallel_fits_model(self) -> JobSpec:
        mp = self.resources.mp
        if mp > 1:
            if not isinstance(self.model, GPTModelSpec):
                raise ValueError(
                    "resources.mp: model parallelism needs the reference GPT (model.kind gpt)"
                )
            if self.model.n_head % mp:
                raise ValueError(
                    f"model.n_head: {self.model.n_head} is not divisible by resources.mp {mp}"
                )
            if self.model.vocab_size % mp:
                raise ValueError(
                    f"model.vocab_size: {self.model.vocab_size} is not divisible by "
                    f"resources.mp {mp}"
                )
            if self.model.vocab_tiles > 1:
                raise ValueError(
                    f"model.vocab_tiles: {self.model.vocab_tiles} with resources.mp {mp}; "
                    "model parallelism splits the vocabulary already (set it to 1)"
                )
        if self.data.kind == "text" and self.model.vocab_size < 256:
            raise ValueError("model.vocab_size: text data is bytes, needs vocab_size >= 256")
        given = self.engine.get("train_micro_batch_size")
        if given is not None and given != self.micro_batch:
            raise ValueError(
                f"engine.train_micro_batch_size: {given} differs from micro_batch "
                f"{self.micro_batch}, the samples each rank's micro-batch takes; leave it "
                "out (it is micro_batch)"
            )
        self._leaf_modules_exist()
        self._engine_fits_resources()
        return self

    def _engine_fits_resources(self) -> None:
        """Engine settings whose validity depends on the resources, checked for every
        size the job may run at: an elastic job shrinks and grows within
        [min_dp, max_dp], and each rank's engine would refuse a size that breaks them."""
        checked = dict(self.engine)
        if checked.get("stage") == "auto":
            checked["stage"] = 0
        cfg = ZeroConfig.from_dict(checked)
        res = self.resources
        rpn = cfg.ranks_per_node
        if rpn is not None:
            lo, hi = res.lowest_dp, res.highest_dp
            bad = next((d for d in range(lo, hi + 1) if d % rpn), None)
            if bad is not None:
                sizes = f"resources.dp {lo}" if lo == hi else f"min_dp..max_dp {lo}..{hi}"
                raise ValueError(
                    f"engine.ranks_per_node: {rpn} does not divide the data-parallel size "
                    f"{bad}, which the job may run at ({sizes}); every such size must be a "
                    "multiple of it"
                )
            two_level = cfg.hierarchical_partition or cfg.quantized_gradients != "none"
            if two_level and res.mp > 1 and hi > 1:
                raise ValueError(
                    "engine.ranks_per_node: hierarchical ZeRO++ groups (hierarchical_partition, "
                    f"quantized_gradients) are not supported with resources.mp {res.mp}"
                )
        if res.gpus_per_rank and cfg.collectives in ("ring", "shm"):
            raise ValueError(
                f"engine.collectives: {cfg.collectives!r} moves host tensors over gloo, and "
                "GPU ranks (resources.gpus_per_rank 1) train on NCCL; use 'auto' or 'native'"
            )

    def _leaf_modules_exist(self) -> None:
        """The reference GPT's ``stage3_leaf_modules`` are checked at submission (the
        model built on the meta device, no memory): a name that matches nothing would
        otherwise fail every rank at start. Other model kinds are checked where the control
        plane builds them, on the worker that measures them (model_size.py)."""
        leaves = self.engine.get("stage3_leaf_modules")
        if isinstance(leaves, list | tuple):
            _bounded_names("engine.stage3_leaf_modules", leaves)
        if not leaves or not isinstance(self.model, GPTModelSpec):
            return
        error = _gpt_leaf_error(dataclasses.astuple(self.model.gpt_config()), tuple(leaves))
        if error is not None:
            raise ValueError(f"engine.{error}")

    def zero_config(self) -> ZeroConfig:
        if self.engine.get("stage") == "auto":
            raise ConfigError(
                "stage: auto is resolved by the control plane when the job is submitted "
                "(api/auto_config.py); the stored spec names the chosen stage"
            )
        cfg = dict(self.engine)
        cfg.setdefault("train_micro_batch_size", self.micro_batch)
        return ZeroConfig.from_dict(cfg)

    @property
    def world_size(self) -> int:
        return self.resources.dp * self.resources.mp
