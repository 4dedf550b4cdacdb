"""The engine: wraps any nn.Module and trains it with ZeRO-DP stages 0 to 3.

Life of a step (``gradient_accumulation_steps`` = A):

    loss = engine(x, y)       forward through the unchanged module
    engine.backward(loss)     loss x scale / A; hooks reduce finished units (stage 2:
                              every micro-batch; stages 0/1: the A-th micro-batch)
    engine.step()             on the A-th call: norm, clip, unscale, optimizer step on
                              this rank's shard, parameters gathered whole again
"""

from __future__ import annotations

import fnmatch
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import comm, construct
from .activations import (
    ActivationCheckpointer,
    CheckpointStore,
    check_not_checkpointed_twice,
    checkpointed_modules,
    turn_cache_off,
)
from .buffers import BufferCache
from .config import ConfigError, ZeroConfig
from .flat import FlatUnit, build_units, padded_size, trainable_parameters
from .forward_writes import ForwardWrites, between_steps_reason, watch_reason
from .gather import ParamGatherer
from .gather_check import ForwardReads, GatherCheck, GatherDigest
from .gathered import GatheredParameters
from .host_memory import HostTrim
from .interrupt import Interrupt, stop_forwards
from .memory import (
    MemoryLedger,
    allocator_stats,
    expected_model_state_bytes,
    optimizer_state_bytes_per_param,
    optimizer_state_tensors,
    tensor_bytes,
)
from .naming import some_names
from .optim import OptimizerFactory, ShardedOptimizer, StepResult, group_of_params
from .optimizer_template import RetiredTemplate
from .placeholder_state import (
    PlaceholderWrites,
    check_not_released,
    guard_placeholders,
    reading_own_state,
)
from .planned_params import PlannedParameters
from .precision import (
    DynamicLossScaler,
    cast_floating,
    check_param_dtypes,
    param_dtype,
    reduce_dtype,
)
from .quantize import BITS
from .reduce import GradReducer
from .redundancy import HostCopies
from .schedule import lr_factor
from .stages import policy_for
from .state import StateCell, TrainingState
from .tensor_parallel import MPGroup, is_mp_sharded, mp_groups_of, mp_split
from .units import plan_layout
from .zeropp import NodeGroups, Scratch, Secondary, build_node_groups, node_of

if TYPE_CHECKING:
    from .checkpoint.background import SaveHandle
    from .checkpoint.load import LoadResult
    from .checkpoint.peers import PeerSnapshot
    from .checkpoint.state import Counters, ShardedState
    from .checkpoint.storage import Location


@dataclass
class StepReport:
    """What the last call to ``step()`` did."""

    applied: bool
    """An optimizer step ran (False before the last micro-batch or on an overflow)."""
    grad_norm: float | None
    skipped: bool
    lr_factor: float
    loss_scale: float


class Engine:
    """Data-parallel training with partitioned optimizer states (and gradients)."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        optimizer: OptimizerFactory,
        group: dist.ProcessGroup | None = None,
        init: construct.InitSource = None,
        mp_group: dist.ProcessGroup | None = None,
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "zeroservice.initialize: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group (torchrun or any launcher does) first"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(module).__name__}")
        if not callable(optimizer):
            raise ConfigError("optimizer: pass a factory, e.g. lambda ps: torch.optim.AdamW(ps)")
        self.module, self.config, self.group = module, config, group
        self.dp_world = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.policy = policy_for(config.stage, self.dp_world)
        self.ledger = comm.CommLedger()
        dtype = param_dtype(config.precision)
        construct.check_unwrapped(module)
        check_not_released(module)
        construct.check_materialised(module)
        construct.check_no_buffer_views(module)
        if self.policy.partitions_params:
            construct.check_no_gradient_hooks(module)
        check_param_dtypes(module, config.precision)
        for p in module.parameters():
            # A gradient from before (a smoke-test backward, gradient-based init) is no
            # step's: DDP's first zero_grad drops it, and the engine's buffers hold each
            # step's gradients from here (stage 2 staged it into the first step).
            p.grad = None
        template, opt_group = group_of_params(optimizer, trainable_parameters(module))
        self.layout = plan_layout(
            module,
            stage=config.stage,
            world=self.dp_world,
            bucket_elements=config.bucket_elements,
            prefetch_elements=config.stage3_prefetch_elements,
            persistence_elements=config.stage3_persistence_elements,
            stage3_grouping=config.stage3_grouping,
            opt_group=opt_group,
            stage3_leaf_modules=config.stage3_leaf_modules,
        )
        """How the model is cut into units, and the sizes that keep each stage below the
        one before it (see [Note: stage order] in units.py)."""
        budget = self.layout.budgets
        # C_B, a multiple of N_d: staging buffers hold it, the ring reduces C_B / N_d
        # columns at a time. See [Note: constant buffers] in reduce.py.
        block = padded_size(budget.unit_elements, self.dp_world)
        rpn = config.ranks_per_node
        if rpn is not None and self.dp_world % rpn:
            raise ConfigError(
                f"ranks_per_node: {rpn} does not divide the data-parallel world {self.dp_world}"
            )
        self._interrupt = Interrupt()
        """Ends every collective wait of this engine (see ``interrupt``)."""
        # Where the shards go (and a deferred model's parameters).
        device = construct.engine_device(module, group)
        self.comm = comm.Communicator(
            group,
            self.ledger,
            config.collectives,
            ring_chunk=block // self.dp_world,
            nodes=[node_of(r, rpn) for r in range(self.dp_world)],
            interrupt=self._interrupt,
            device_type=device.type,
        )
        self.mp_group = mp_group
        self.mp_size = dist.get_world_size(mp_group) if mp_group is not None else 1
        self.node_groups = self._node_groups()
        """The node's and the cross-node communicators (hpZ, two-hop qgZ), or None."""
        self.quant_scratch = Scratch()
        """qwZ/qgZ send and receive buffers (the memory ledger's ``quantization_scratch``)."""
        self.mp_rank = dist.get_rank(mp_group) if mp_group is not None else 0
        self.mp = MPGroup(mp_group, self._interrupt) if self.mp_size > 1 else None
        """The engine's own MP collectives (the gradient norm, P_a's gathers), with their
        ledger (``mp_ledger``); the model's tensor-parallel layers keep theirs."""
        self._model_mp_comms = [g.comm for g in mp_groups_of(module) if g.size > 1]
        """The model's tensor-parallel communicators, given this engine's Interrupt until
        close (see MPGroup); the newest engine over a model holds them."""
        for mp_comm in self._model_mp_comms:
            mp_comm.interrupt = self._interrupt
        sharded_names = {n for n, p in module.named_parameters() if is_mp_sharded(p)}
        self._mp_splits = {
            n: list(split)
            for n, p in module.named_parameters(remove_duplicate=False)
            if (split := mp_split(p)) is not None
        }
        """How each MP-sharded parameter is split, by every name it has: checkpoints
        record it for export (see ``tensor_parallel.mark_sharded``)."""
        deferred = construct.is_deferred(module)
        if callable(init) and not deferred:
            raise ConfigError(
                "init: an initialiser function applies only to a model built under "
                "zeroservice.deferred_init(); this model already has its weights"
            )
        restored = isinstance(init, construct.Restored)
        if restored and not deferred:
            raise ConfigError(
                "init: zeroservice.RESTORED applies only to a model built under "
                "zeroservice.deferred_init(); this model already has its weights"
            )
        self.awaiting_state = restored
        """Built with ``init=RESTORED``: no weights until a load or a restore."""
        self.closed = False
        """After ``close``: every training call is refused by name."""
        shard_rank = self.dp_rank if self.policy.shard_world > 1 else 0
        self.gatherer: ParamGatherer | None = None
        self._placeholder_writes: PlaceholderWrites | None = None
        self._gathered: GatheredParameters | None = None
        """The ``gathered_parameters()`` context open, if any (see gathered.py)."""
        """Stage 3: writes to the placeholders, refused (see [Note: a write to a
        placeholder] in placeholder_state.py)."""
        self._forward_reads: ForwardReads | None = None
        """Stage 3 at N_d > 1: the per-forward consensus on the weights read."""
        self.units: list[FlatUnit]
        if self.policy.partitions_params:
            self.units = construct.empty_units(
                self.layout.chunks, dtype, self.dp_world, shard_rank, device, opt_group
            )
            if isinstance(init, str | os.PathLike):
                construct.fill_from_file(module, self.units, construct.StateDictFile(init))
            elif isinstance(init, construct.Restored):
                pass  # zeroed shards; the state arrives by a load or a restore
            elif deferred:
                construct.fill_from_init(module, self.units, self.comm, init)
            else:
                construct.fill_from_module(self.units, self.comm)
            construct.release_parameters(self.units)
            cast_floating(module, dtype)  # buffers; parameters are empty placeholders by now
            self._sync_initial_state(params=False)
        else:
            # Restored: the parameters go from the meta device straight into zeroed units.
            target = device if restored else None
            if (deferred or init is not None) and not restored:
                construct.materialize(module, init, device)
            cast_floating(module, dtype)
            self.units = build_units(
                self.layout.chunks, dtype, self.policy.shard_world, shard_rank, opt_group, target
            )
            self._sync_initial_state(params=not (restored or isinstance(init, str | os.PathLike)))
        self.trainable_units = [u for u in self.units if not u.frozen]
        """The prefix of ``units`` that trains (see [Note: frozen units] in flat.py)."""
        assert all(a is b for a, b in zip(self.units, self.trainable_units, strict=False))
        self.state = StateCell()
        """Where the engine is inside a step (state.py); the reducer and gatherer read it."""
        grad_comm_dtype = reduce_dtype(config.precision, config.reduce_dtype)
        if self.comm.ring is not None:
            largest_shard = max(u.shard_numel for u in self.units)
            self.comm.ring.reserve(largest_shard, grad_comm_dtype)
        self.host_trim = HostTrim(
            config.trim_host_memory and self.units[0].flat.device.type == "cpu"
        )
        """``trim_host_memory``: freed heap pages back to the system before each pass and
        after each unit's backward. See [Note: host heap trimming] in host_memory.py."""
        trim = self.host_trim if self.host_trim.active else None
        cache = None
        if self.policy.partitions_params:
            # Gathered units and gradient staging share one set of reused buffers.
            largest = max(u.padded_numel for u in self.units)
            limit = max(budget.prefetch_elements, 2 * largest)
            # An oversized unit's buffer is not kept idle: see BufferCache.
            cache = BufferCache(dtype, self.units[0].flat.device, limit, largest_kept=block)
        self.reducer = GradReducer(
            self.trainable_units,
            self.policy,
            grad_dtype=dtype,
            comm_dtype=grad_comm_dtype,
            communicator=self.comm,
            state=self.state,
            overlap=config.overlap_comm,
            param_hooks=not self.policy.partitions_params,
            staging=cache if grad_comm_dtype == dtype else None,
            bucket_elements=budget.unit_elements,
            module=module,
            quantized=(
                (BITS[config.quantized_gradients], config.quantization_block)
                if config.quantized_gradients != "none"
                else None
            ),
            node=self.node_groups if config.quantized_gradients != "none" else None,
            scratch=self.quant_scratch,
            after_unit_backward=trim,
            predivide=config.precision == "fp16",
        )
        if self.policy.partitions_params:
            assert cache is not None
            assert self.layout.groups is not None and self.layout.group_units is not None
            groups = list(zip(self.layout.groups, self.layout.group_units, strict=True))
            self.gatherer = ParamGatherer(
                module,
                [(g.module, idx) for g, idx in groups],
                self.units,
                self.comm,
                self.reducer,
                cache,
                prefetch_elements=budget.prefetch_elements,
                persistence_elements=budget.persistence_elements,
                persistent_total=budget.persistent_total,
                check=GatherCheck(group, self.units) if config.stage3_check_gathers else None,
                digest=(
                    GatherDigest(group, self._interrupt, self.units[0].flat.device)
                    if self.dp_world > 1
                    else None
                ),
                quantize_block=config.quantization_block if config.quantized_weights else None,
                secondary=(
                    Secondary(self.node_groups)
                    if config.hierarchical_partition and self.node_groups is not None
                    else None
                ),
                scratch=self.quant_scratch,
                after_unit_backward=trim,
                leaves=[(g.module, idx) for g, idx in groups if g.leaf],
            )
            if self.dp_world > 1:
                leaf_units = [i for units in self.gatherer.leaves.units_of for i in units]
                self._forward_reads = ForwardReads(
                    group, module, self.units, leaf_units, self._interrupt
                )
            guard_placeholders(module, self.units)
            self._placeholder_writes = PlaceholderWrites(self.units)
        self.optimizer = ShardedOptimizer(
            self.trainable_units,
            self.policy,
            mixed_precision=dtype != torch.float32,
            factory=optimizer,
            communicator=self.comm,
            summed_ranks=self.dp_world // self.reducer.divisor,
            fuse=config.fuse_optimizer,
            mp_comm=self.mp.comm if self.mp is not None else None,
            replicated=[_replicated_ranges(u, sharded_names) for u in self.trainable_units],
            offload=config.offload_optimizer,
            template=template,
        )
        self._template = RetiredTemplate(template)
        """The factory's optimizer: its step refused, its rates watched (see [Note: the
        factory's optimizer after initialize] in optimizer_template.py)."""
        for owner in (module, template):
            owner.zero_grad = partial(_zero_grad, weakref.ref(self), owner.zero_grad)  # type: ignore[method-assign]
        reason = watch_reason(
            config.stage, self.policy.shard_world, config.precision, config.offload_optimizer
        )
        self._forward_writes = (
            ForwardWrites(
                module,
                {id(p): n for n, p in trainable_parameters(module)},
                reason,
                between_steps_reason(config.stage, config.precision, config.offload_optimizer),
            )
            if reason is not None
            else None
        )
        """Trainable parameters a forward changes in place, refused before its backward
        (see [Note: a forward that writes its weights] in forward_writes.py)."""
        self.activations: CheckpointStore | None = None
        self._checkpointer: ActivationCheckpointer | None = None
        if config.activation_checkpointing:
            leaves = [g.name for g in self.layout.groups or [] if g.leaf]
            blocks = checkpointed_modules(module, whole=leaves)
            if not blocks:
                raise ConfigError(
                    "activation_checkpointing: the model has no nn.ModuleList of blocks to "
                    "checkpoint"
                )
            check_not_checkpointed_twice(module)
            turn_cache_off(module)
            self.activations = CheckpointStore(
                self.mp,
                partition=config.partition_activations,
                offload=config.cpu_offload_activations,
                contiguous=config.contiguous_activations,
                blocks=len(blocks),
            )
            recompute, state = None, self.state
            if self.gatherer is not None:
                self.gatherer.checkpoint_blocks([m for _, m in blocks])
                recompute = self.gatherer.recomputing
            self._checkpointer = ActivationCheckpointer(
                blocks,
                self.activations,
                recompute,
                own_backward=lambda: state.value.in_backward,
            )
        self.scaler = DynamicLossScaler(config.loss_scale) if config.precision == "fp16" else None
        self.micro_steps = 0
        """Backward passes since the last optimizer step."""
        self._buffers_due = True
        """Whether the next forward broadcasts rank 0's buffers (see [Note: when buffers
        are broadcast])."""
        self.global_steps = 0
        """Optimizer steps attempted (applied or skipped)."""
        self.applied_steps = 0
        """Optimizer steps applied; drives the learning-rate schedule."""
        self.last_report: StepReport | None = None
        self.host_copies: HostCopies | None = None
        """With ``redundancy="host-copy"``: this rank's and its neighbour's state in host
        memory, refreshed every ``redundancy_interval`` steps (redundancy.py)."""
        if config.redundancy == "host-copy":
            self.host_copies = HostCopies(config.redundancy_interval, self.comm)
        self._saves = 0
        self._weights_written()
        self._pending_save: SaveHandle | None = None
        self._forward_stops = stop_forwards(module, self._interrupt)
        """An interrupted forward ends at the next module (see [Note: a forward given up]
        in interrupt.py)."""
        self._planned = PlannedParameters(module, fixed_storage=not self.policy.partitions_params)
        """The parameters as planned, checked at every training forward (see [Note:
        parameters the engine holds] in planned_params.py)."""

    # -- the training step --------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._require_state("forward")
        if self._placeholder_writes is not None:
            self._placeholder_writes.check("forward")
        if torch.is_grad_enabled():
            self._planned.check()
            self.host_trim()  # what the last step freed: see [Note: host heap trimming]
        if self.config.broadcast_buffers and self._buffers_due:
            self._broadcast_buffers()
        if self._forward_writes is not None and torch.is_grad_enabled():
            self._forward_writes.forward_begins()
        if self.gatherer is not None and torch.is_grad_enabled():
            g = self.gatherer
            with torch.autograd.graph.saved_tensors_hooks(g.saved.pack, g.saved.unpack):
                try:
                    out = self.module(*args, **kwargs)
                except RuntimeError as exc:
                    # An in-place write to a gathered weight may fail in autograd before
                    # the gatherer's own check says what happened: say it instead.
                    found = g.take_in_place_write()
                    if found is not None:
                        raise RuntimeError(found) from exc
                    raise
            self._check_forward_reads()
        else:
            out = self.module(*args, **kwargs)
        self._buffers_due = torch.is_grad_enabled() and self.is_gradient_accumulation_boundary()
        return out

    def _check_forward_reads(self) -> None:
        """Stage 3: every rank's forward read the same weights, or the step is discarded
        before a backward whose collectives would diverge (see [Note: rank-divergent
        control flow] in gather_check.py)."""
        if self._forward_reads is None:
            return
        assert self.gatherer is not None
        try:
            self._forward_reads.check(self.gatherer.forward_reads)
        except ConfigError:
            self.gatherer.forget_forward()
            self._discard_step()
            raise

    def _require_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"{what}: the engine was closed (its hooks and collectives are gone); "
                "initialize a new one to go on (at stages 0-2 engine.module keeps the "
                "trained weights)"
            )

    def _require_state(self, what: str) -> None:
        self._require_open(what)
        if self.awaiting_state:
            raise RuntimeError(
                f"{what}: the engine was built with init=zeroservice.RESTORED and holds no "
                "weights yet; load a checkpoint or restore from peers first"
            )

    def _node_groups(self) -> NodeGroups | None:
        """The two-level topology's groups, when hpZ or qgZ use it (collective)."""
        cfg = self.config
        if cfg.ranks_per_node is None or self.dp_world == 1:
            return None
        if not (cfg.hierarchical_partition or cfg.quantized_gradients != "none"):
            return None
        if self.mp_group is not None and self.mp_size > 1:
            raise ConfigError(
                "ranks_per_node: hierarchical ZeRO++ groups are not supported with model "
                f"parallelism (mp = {self.mp_size})"
            )
        return build_node_groups(
            self.group,
            cfg.ranks_per_node,
            self.ledger,
            cfg.collectives,
            self._interrupt,
            self.comm.device_type,
        )

    # [Note: when buffers are broadcast]
    # DDP's broadcast_buffers copies rank 0's buffers before a forward only when the
    # forward before it built a graph and was to synchronize its gradients (or there was
    # none): the first forward of a step, every forward at one micro-batch per step, and
    # an evaluation forward right after a step. A forward under ``no_sync`` (a
    # micro-batch before the step's last) sets the flag off, and so does one without a
    # graph. The engine keeps the same rule, with "the step's last micro-batch" for
    # "outside no_sync", so that running statistics, and a model whose training forward
    # reads its own buffers, follow DDP under gradient accumulation too. A discarded
    # step starts the next one as a first forward.
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank before a forward (DDP's broadcast_buffers)."""
        if self.dp_world > 1:
            comm.wait_all([self.comm.broadcast(b, "buffers") for b in self.module.buffers()])

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next backward is the last micro-batch of the step."""
        return self.micro_steps == self.config.gradient_accumulation_steps - 1

    def backward(self, loss: torch.Tensor) -> None:
        self._require_open("backward")
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            hint = (
                " (at stage 3 a parameter read outside the model's forward, such as a "
                "temperature used in the loss, is an empty placeholder: read it inside "
                "the forward)"
                if self.gatherer is not None and loss.numel() == 0
                else ""
            )
            raise RuntimeError(
                f"backward: the loss has {loss.numel()} elements; it must be one number "
                f"(reduce it with .mean() or .sum()){hint}"
            )
        if self.micro_steps >= self.config.gradient_accumulation_steps:
            raise RuntimeError(
                f"backward: {self.micro_steps} micro-batches already accumulated "
                f"(gradient_accumulation_steps={self.config.gradient_accumulation_steps}); "
                "call engine.step() after every backward"
            )
        self._planned.check_flags("backward")
        if self._forward_writes is not None:
            self._forward_writes.check_before_backward()
        self._take_stray_gradients("backward")
        reduces = self.policy.reduce_every_micro_batch or self.is_gradient_accumulation_boundary()
        left = self.state.move(TrainingState.REDUCING if reduces else TrainingState.BACKWARD)
        try:
            ck = self._checkpointer
            self.reducer.pre_backward(ck.take_expected_fires(loss) if ck is not None else None)
            if self.gatherer is not None:
                self.gatherer.begin_backward()
            scale = self.loss_scale / self.config.gradient_accumulation_steps
            self.host_trim()  # what the forward freed
            (loss * scale if scale != 1.0 else loss).backward()
            if self.activations is not None:
                self.activations.end_backward()
            self.reducer.finalize_backward()
            self.comm.release_scratch()
            if self.gatherer is not None:
                self.gatherer.end_backward()
        except BaseException:
            self.state.reset_to(left)
            raise
        outside = self.gatherer.take_outside_uses() if self.gatherer is not None else []
        if outside:
            self._discard_step()
            raise RuntimeError(
                f"backward: the loss used {some_names(outside)} outside the "
                "model's forward; "
                "at stage 3 a weight is gathered only inside a forward and is an empty "
                "placeholder elsewhere, so that term trained nothing. Compute it inside the "
                "model's forward (self.parameters() there yields the gathered weights). "
                "The gradients of this step so far were discarded"
            )
        self.micro_steps += 1
        self.state.move(TrainingState.ACCUMULATED)

    def step(self) -> StepReport:
        """Call after every backward; updates the weights after the step's last micro-batch."""
        self._require_open("step")
        if self._gathered is not None:
            raise RuntimeError(
                "step: inside engine.gathered_parameters(), whose exit would write back or "
                "drop the weights it gathered before this step; leave it first"
            )
        if self.state.value is not TrainingState.ACCUMULATED:
            raise RuntimeError("step: no backward since the last step; call engine.backward first")
        self._take_stray_gradients("step")
        factor = lr_factor(self.config.lr_schedule, self.applied_steps)
        if self.micro_steps < self.config.gradient_accumulation_steps:
            return StepReport(False, None, False, factor, self.loss_scale)
        self._check_gather_digest()
        scale = self.loss_scale
        # Before the move: a rate refused here leaves the step to be taken again.
        self._template.check()
        self.optimizer.set_lr_factor(factor)
        self.state.move(TrainingState.STEPPING)
        result: StepResult = self.optimizer.step(
            self.reducer.grad_shards(), scale, self.config.gradient_clipping
        )
        if self.scaler is not None:
            self.scaler.update(result.skipped)
        if not result.skipped:
            self.applied_steps += 1
            pending = self.optimizer.publish_params()
            if self.gatherer is not None:
                pending += self.gatherer.refresh_persistent()
            comm.wait_all(pending)
        self.reducer.zero_grads()
        self.global_steps += 1
        self.micro_steps = 0
        self.state.move(TrainingState.IDLE)
        self._weights_written()
        if self.host_copies is not None:
            self.host_copies.after_step(self._sharded_state())
        self.last_report = StepReport(
            not result.skipped, result.grad_norm, result.skipped, factor, scale
        )
        if self.scaler is not None and self.scaler.exhausted:
            raise RuntimeError(
                f"step: the fp16 gradients overflowed at the minimum loss scale "
                f"({self.scaler.scale:g}, loss_scale.min_scale): no scale keeps them finite, "
                "the run has diverged (the step was skipped, the engine is consistent). "
                "Lower the learning rate, clip gradients, or train in bf16"
            )
        return self.last_report

    def _take_stray_gradients(self, where: str) -> None:
        """[Note: gradients from another backward]
        A backward that is not this engine's can reach its parameters: a GAN's generator
        loss goes through the discriminator, whose engine is between its steps. Under DDP
        the discriminator's ``zero_grad()`` before its next backward drops them; here,
        between steps, they are dropped the same way (stage 2 at once, stages 0/1 by
        zeroing their gradient buffers before the next backward). Inside a step (after
        a backward, before ``step``) they would mix, unreduced, with the step's reduced
        gradients, where DDP would have reduced and added them: the step is refused and
        its gradients discarded. Stage 3 gathers weights only for its own backward and
        refuses such a backward when it happens (``ParamGatherer.post_backward``)."""
        between, inside = self.reducer.take_stray()
        if inside:
            self._discard_step()
            raise RuntimeError(
                f"{where}: a backward that was not this engine's reached "
                f"{some_names(inside)} after this step's backward (another "
                "engine's loss through this model, or loss.backward()); its gradients "
                "cannot be told from the step's own, so this step's gradients were "
                "discarded. Run the other backward after this engine's step, or detach "
                "what it passes through this model"
            )
        if between:
            self.reducer.zero_grads()

    def _check_gather_digest(self) -> None:
        """Stage 3: every rank issued the same gathers this step, or the step is refused
        and its gradients discarded (see [Note: rank-divergent control flow])."""
        digest = self.gatherer.digest if self.gatherer is not None else None
        if digest is None:
            return
        try:
            digest.check()
        except RuntimeError:
            self._discard_step()
            raise

    def _weights_written(self) -> None:
        """The parameters hold what the engine wrote (see [Note: a forward that writes
        its weights] in forward_writes.py)."""
        if self._forward_writes is not None:
            self._forward_writes.step_ended()
        if self._placeholder_writes is not None:
            self._placeholder_writes.written_by_engine()

    def _discard_step(self) -> None:
        """Drop the step's gradients so far; the engine is between steps again."""
        self.reducer.zero_grads()
        self.micro_steps = 0
        self._buffers_due = True
        self.state.reset_to(TrainingState.IDLE)

    # -- ledgers ----------------------------------------------------------------------
    @property
    def psi(self) -> int:
        return sum(u.numel for u in self.trainable_units)

    def memory_ledger(self) -> MemoryLedger:
        """Bytes this rank holds, by kind, beside the paper's formula."""
        big, small = optimizer_state_tensors(self.optimizer.optimizer)
        k = optimizer_state_bytes_per_param(self.optimizer.optimizer)
        psi_padded = sum(u.padded_numel for u in self.trainable_units)
        frozen = [u for u in self.units if u.frozen]
        stage, precision, n_d = self.config.stage, self.config.precision, self.dp_world
        offload = self.config.offload_optimizer
        acts = self.activations

        def expected(psi: int) -> int | None:
            if k is None:
                return None
            return expected_model_state_bytes(stage, precision, psi, n_d, k, offload)

        comm_buffers = (
            self.reducer.pool.resident_bytes
            + self.comm.buffer_bytes()
            + (self.gatherer.cached_bytes if self.gatherer else 0)
        )
        return MemoryLedger(
            stage=stage,
            precision=precision,
            n_d=n_d,
            psi=self.psi,
            psi_padded=psi_padded,
            params=tensor_bytes(u.flat for u in self.trainable_units),
            frozen=tensor_bytes(u.flat for u in frozen),
            frozen_psi=sum(u.numel for u in frozen),
            grads=self.reducer.grad_bytes(),
            master=self.optimizer.master_bytes(),
            optimizer_states=tensor_bytes(big),
            optimizer_other=tensor_bytes(small),
            comm_buffers=comm_buffers,
            comm_buffers_peak=comm_buffers + self.reducer.pool.temporary_peak,
            comm_buffer_largest=max(
                self.reducer.pool.buffer_bytes,
                self.comm.buffer_bytes(),
                self.gatherer.largest_cached_bytes if self.gatherer else 0,
            ),
            expected=expected(self.psi),
            expected_padded=expected(psi_padded),
            gathered_params=self.gatherer.live_bytes if self.gatherer else 0,
            gathered_peak=self.gatherer.peak_live_bytes if self.gatherer else 0,
            mp=self.mp_size,
            offloaded=self.config.offload_optimizer,
            host_grads=self.optimizer.host_grad_bytes(),
            activations=acts.device_bytes if acts else 0,
            activations_host=acts.host_bytes if acts else 0,
            activations_peak=acts.peak_bytes if acts else 0,
            activation_arena=acts.arena_bytes if acts else 0,
            redundancy_host=self.host_copies.nbytes if self.host_copies else 0,
            redundancy_spare=self.host_copies.spare_nbytes if self.host_copies else 0,
            secondary_params=(
                self.gatherer.secondary.bytes if self.gatherer and self.gatherer.secondary else 0
            ),
            secondary_peak=(
                self.gatherer.secondary.peak_bytes
                if self.gatherer and self.gatherer.secondary
                else 0
            ),
            quantization_scratch=self.quant_scratch.current,
            quantization_scratch_peak=self.quant_scratch.peak,
        )

    def reset_memory_peaks(self) -> None:
        """Restart the ledger's ``gathered_peak`` and ``activations_peak`` from what is
        held now: called before a step, the ledger then reports that step's peaks (a
        job's metrics do), not the largest since the engine was built."""
        if self.gatherer is not None:
            self.gatherer.reset_peak()
        if self.activations is not None:
            self.activations.reset_peak()

    def mp_ledger(self) -> comm.CommLedger | None:
        """The engine's collectives over the model-parallel group (None without MP)."""
        return self.mp.ledger if self.mp is not None else None

    def allocator_stats(self) -> dict[str, int] | None:
        """CUDA allocator figures (fragmentation, retries) for this rank's device; None
        on CPU. See memory.allocator_stats."""
        return allocator_stats(self.units[0].flat.device)

    def comm_ledger(self) -> comm.CommLedger:
        """Every collective issued so far: calls, bytes, seconds, bandwidth."""
        return self.ledger

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(
        self, root, client_state: dict | None = None, keep: int = 3, background: bool = False
    ):
        """Every rank writes what it owns under ``root``/step-N; keeps the newest ``keep``.

        ``client_state`` (JSON: e.g. the data position) comes back from the load. With
        ``background`` the state is copied to host memory and written by a thread:
        returns a SaveHandle (``wait()``); otherwise the committed directory. A save
        first waits for the previous background save."""
        from .checkpoint import save_checkpoint
        from .checkpoint.background import save_in_background

        self._require_state("save_checkpoint")
        if self._placeholder_writes is not None:
            self._placeholder_writes.check("save_checkpoint")
        self.wait_for_save()
        self._saves += 1
        root = self._slice_root(root, must_exist=False)
        state = self._sharded_state()
        if background:
            self._pending_save = save_in_background(state, root, client_state, keep, self._saves)
            return self._pending_save
        return save_checkpoint(state, root, client_state, keep)

    def wait_for_save(self):
        """Block until the last background save is committed (collective: every rank
        calls it, as every rank started the save)."""
        handle, self._pending_save = self._pending_save, None
        if handle is None:
            return None
        try:
            if handle.failure_reported:  # the caller's handle.wait() raised it already
                return None
            return handle.wait()
        finally:
            dist.barrier(group=self.group)  # rank 0 returns only after the manifest

    def load_checkpoint(self, path):
        """Load a checkpoint directory, or the newest valid one under a root, at this
        engine's world size and stage; returns a LoadResult (path, step, client_state)."""
        from .checkpoint import CheckpointError, load_checkpoint

        result = load_checkpoint(self._sharded_state(), self._slice_root(path, must_exist=True))
        self._restore(result.counters)
        if result.hyperparameters:
            warnings.warn(
                f"load_checkpoint: the optimizer factory's hyperparameters apply; the "
                f"checkpoint's differ: {'; '.join(result.hyperparameters)} (see [Note: "
                "hyperparameters on load] in checkpoint/load.py)",
                stacklevel=2,
            )
        if self.mp_size > 1:
            # Each MP slice falls back on its own; they must have landed on one step.
            steps: list[int | None] = [None] * self.mp_size
            dist.all_gather_object(steps, result.step, group=self.mp_group)
            if len(set(steps)) > 1:
                raise CheckpointError(
                    f"{path}: the model-parallel slices loaded different steps {steps} "
                    "(a slice's newest checkpoint is damaged); load an explicit step"
                )
        return result

    # -- recovery from peers' host memory (see [Note: restore from peers]) ---------------
    def peer_snapshot(self) -> PeerSnapshot | None:
        """The last complete host copy this rank holds (its own state and its ring
        neighbour's, at one step), or None (redundancy off, or before the first copy).
        It lives in host memory and stays valid after ``close()`` and after the process
        group is destroyed: pass it to the new engine's ``restore_from_peers``. Later
        copies are written to other buffers (see [Note: reused copy buffers])."""
        copies = self.host_copies.hand_out() if self.host_copies is not None else []
        return copies[0] if copies else None

    def peer_snapshots(self) -> list[PeerSnapshot]:
        """Every complete host copy this rank holds, newest first: the last one and the
        one before it (see [Note: reused copy buffers]); none is written again. What a
        surviving rank passes to ``restore_from_peers``: when a peer was lost during a
        refresh, the survivors may stand at two steps, and the one before is the
        newest they cover together."""
        return self.host_copies.hand_out(with_spare=True) if self.host_copies is not None else []

    def snapshot_now(self, lend: bool = False) -> PeerSnapshot:
        """This rank's own state at the current step boundary, in host memory (no
        collective): what existing ranks pass to ``restore_from_peers`` to grow.
        ``lend``: this engine's own host tensors by reference, not a copy, for a caller
        that closes this engine and never trains it again (see [Note: a grow lends its
        state] in checkpoint/peers.py)."""
        from .checkpoint import CheckpointError
        from .checkpoint.peers import take_copy

        self._require_state("snapshot_now")
        if self.micro_steps:
            raise CheckpointError(
                f"snapshot_now: {self.micro_steps} micro-batch(es) accumulated since the "
                "last step; call it after engine.step() completes an optimizer step"
            )
        return take_copy(self._sharded_state(), lend_state=lend)

    def restore_from_peers(
        self, held: PeerSnapshot | list[PeerSnapshot] | None, release: bool = False
    ) -> LoadResult:
        """Restore the newest step the ranks' host copies cover, from memory (a
        collective over this engine's DP group; ``held``: the copies this rank holds,
        ``peer_snapshots()`` or ``peer_snapshot()``; a newcomer passes None). Raises
        PeersIncomplete, changing nothing, when old ranks are missing: then load a
        checkpoint. With model parallelism each slice restores over its own DP group,
        and the slices first agree on one step (see [Note: restore from peers]).

        ``release``: the copies are spent once restored (``PeerSnapshot.release``),
        before this engine takes its own first host copy, so that the old state and the
        new copy never stand side by side; for a caller that reads them no more (on the
        267 M GPT at stage 2, growing 1 -> 2 ranks, the lent state is 4.3 GB beside a
        3.2 GB first copy)."""
        from .checkpoint.peers import restore_from_peers, snapshots_of

        slices = self.mp_group if self.mp_size > 1 else None
        result = restore_from_peers(self._sharded_state(), held, self.comm, slices=slices)
        self._restore(result.counters)
        if release:
            for snapshot in snapshots_of(held):
                snapshot.release()
        if self.host_copies is not None:  # a second failure finds a copy at once
            self.host_copies.refresh(self._sharded_state())
        return result

    def _sharded_state(self) -> ShardedState:
        """What checkpoint/ reads and writes: this rank's tensors by reference, the step
        counters and the run's description (see checkpoint/state.py)."""
        from .checkpoint.state import Counters, ShardedState

        counters = Counters(
            self.global_steps,
            self.applied_steps,
            self.scaler.state_dict() if self.scaler is not None else None,
        )
        return ShardedState(
            units=self.units,
            masters=self.optimizer.masters,
            optimizer=self.optimizer.optimizer,
            module=self.module,
            whole=self.policy.shard_world == 1,
            rank=self.dp_rank,
            world=self.dp_world,
            group=self.group,
            counters=counters,
            pending_micro_steps=self.micro_steps,
            base_lrs=list(self.optimizer.base_lrs),
            rank_buffers=not self.config.broadcast_buffers,
            description={
                "mp": self.mp_size,
                "mp_rank": self.mp_rank,
                "stage": self.config.stage,
                "precision": self.config.precision,
                "psi": self.psi,
                **({"mp_splits": self._mp_splits} if self.mp_size > 1 else {}),
            },
        )

    def _restore(self, counters: Counters) -> None:
        """After a load wrote the masters: the counters, the parameters published from
        the masters (and frozen shards gathered), no gradient held."""
        pending = self.optimizer.publish_params(tag="load")
        frozen = self.units[len(self.trainable_units) :]
        if self.policy.gathers_params:
            pending += [self.comm.all_gather(u.flat, "load") for u in frozen if not u.partitioned]
        if self.gatherer is not None:
            pending += self.gatherer.refresh_persistent()
        comm.wait_all(pending)
        self.awaiting_state = False
        self.global_steps = counters.global_steps
        self.applied_steps = counters.applied_steps
        # Each group's rate as the last step saved ran it: the factory's base (see [Note:
        # hyperparameters on load] in checkpoint/load.py) at the schedule's position.
        if self.applied_steps:
            self.optimizer.set_lr_factor(lr_factor(self.config.lr_schedule, self.applied_steps - 1))
        if self.scaler is not None and counters.loss_scaler:
            self.scaler.load_state_dict(counters.loss_scaler)
        self.reducer.zero_grads()
        self._weights_written()

    def _slice_root(self, path, must_exist: bool) -> Location:
        """With model parallelism each MP slice is a checkpoint of its own over the DP
        group, under ``mp-RR-of-MM``; its degree must match the engine's. ``path``: a
        directory or an object-store URI."""
        from .checkpoint import CheckpointError
        from .checkpoint.storage import location, storage_for

        path = location(path)
        try:
            names = storage_for(path).list_dirs(path)
        except OSError as exc:  # a name too long, a path through a file, no permission
            raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
        slices = sorted(n for n in names if fnmatch.fnmatchcase(n, "mp-*-of-*"))
        mine = f"mp-{self.mp_rank:02d}-of-{self.mp_size:02d}"
        if not slices:
            if self.mp_size == 1:
                return path
            if must_exist:
                raise CheckpointError(
                    f"{path}: no {mine} directory (saved without model parallelism?)"
                )
            return path / mine
        degrees = {int(name.rsplit("-of-", 1)[1]) for name in slices}
        if degrees != {self.mp_size}:
            raise CheckpointError(
                f"{path}: saved with model-parallel degree {max(degrees)}; this engine has "
                f"mp = {self.mp_size} (the data-parallel degree may change, the MP degree not)"
            )
        if must_exist and mine not in slices:
            raise CheckpointError(f"{path}: the slice {mine} is missing")
        return path / mine

    # -- conveniences -------------------------------------------------------------------
    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def gathered_parameters(
        self, params: object = None, modifier_rank: int | None = None
    ) -> GatheredParameters:
        """A context in which ``params`` (a module of the model, a parameter, an iterable
        of them; None: the whole model) hold their whole weights, at stage 3 too: an EMA,
        a weight norm, a copy into another model. Every rank must enter it alike. Writes
        are kept only with ``modifier_rank``: that rank's weights go to every rank on exit.
        See [Note: gathered parameters] in gathered.py."""
        return GatheredParameters(self, params, modifier_rank)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state, as ``module.state_dict()`` would give it unpartitioned.

        At stage 3 every rank must call it: units are gathered one at a time.
        """
        if self.gatherer is not None:  # stages 0-2: the module keeps its weights
            self._require_open("state_dict")
        if self._placeholder_writes is not None:
            self._placeholder_writes.check("state_dict")
        with reading_own_state():  # placeholders read on purpose, replaced below
            state = self.module.state_dict()
        if self.gatherer is None:
            return state
        for unit in self.units:
            full = self.gatherer.gather_copy(unit.index)
            for slot, view in zip(unit.slots, unit.views_of(full), strict=True):
                for name in slot.names:
                    state[name] = view.clone()
        return state

    def interrupt(self, reason: str) -> None:
        """Give up this engine's collectives: every wait on one, in progress or to
        come, raises CommInterrupted(reason) at once. Called from another thread once a
        peer is known lost (its process killed): on gloo a transfer from a peer that
        died mid-message would otherwise wait for the group's timeout. See
        [Note: interrupting a collective] in interrupt.py. Afterwards the engine can
        only be closed; its state is what the host copies held."""
        self._interrupt.fire(reason)

    def close(self) -> None:
        """Remove the hooks and stop the ring thread.

        At stages 0-2 the module stays usable with the trained weights; at stage 3 its
        parameters are empty placeholders (take ``state_dict()`` first). After an
        interrupt a background save is not waited for: it is a collective of the group
        given up, and without its manifest it never counts as a checkpoint."""
        if self.closed:
            return
        if not self._interrupt.fired:
            self.wait_for_save()
        self.closed = True
        self._template.release()
        for owner in (self.module, self._template.template):
            owner.__dict__.pop("zero_grad", None)
        self.reducer.remove_hooks()
        for handle in self._forward_stops:
            handle.remove()
        self._forward_stops.clear()
        if self._checkpointer is not None:
            self._checkpointer.remove()
        if self.gatherer is not None:
            self.gatherer.close()
        for mp_comm in self._model_mp_comms:
            if mp_comm.interrupt is self._interrupt:
                mp_comm.interrupt = None
        self.comm.close()
        if self.node_groups is not None:
            self.node_groups.local.close()
            self.node_groups.cross.close()

    def _sync_initial_state(self, params: bool) -> None:
        """Start every rank from rank 0's weights and buffers, as DDP does."""
        if self.dp_world == 1:
            return
        pending = [self.comm.broadcast(u.flat, "init") for u in self.units] if params else []
        pending += [self.comm.broadcast(b, "init") for b in self.module.buffers()]
        comm.wait_all(pending)


def _zero_grad(engine_ref: weakref.ref, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """The model's and the factory optimizer's ``zero_grad`` while an engine holds them.

    [Note: zero_grad inside a step]
    Under DDP, ``zero_grad()`` between a backward and the optimizer's step drops the
    gradients, and the step then changes nothing. The engine reduces a step's
    gradients from its own buffers and shards, which ``zero_grad`` does not reach: the
    step was taken whole (and with accumulation, the micro-batches before the call
    stayed in). So a ``zero_grad`` while the engine holds a step's gradients is refused
    by name; elsewhere (before a forward) it does what it always did."""
    engine = engine_ref()
    if engine is not None and engine.state.value is TrainingState.ACCUMULATED:
        raise RuntimeError(
            "zero_grad: called between engine.backward and engine.step, where it would "
            "drop the step's gradients under DDP; the engine reduces them from its own "
            "buffers, which zero_grad does not reach. Call zero_grad before the forward, "
            "or not at all: each engine step starts from zero"
        )
    return original(*args, **kwargs)


def _replicated_ranges(unit: FlatUnit, sharded: set[str]) -> list[tuple[int, int]]:
    """Ranges of the unit's gradient shard that hold MP-replicated parameters."""
    lo, hi = unit.shard_range if unit.shard_world > 1 else (0, unit.padded_numel)
    ranges = []
    for slot in unit.slots:
        if slot.names[0] in sharded:
            continue
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            ranges.append((a - lo, b - lo))
    return ranges
