"""zeroservice: the ZeRO engine, a library that knows only torch and torch.distributed.

engine = zeroservice.initialize(model, ZeroConfig(stage=2, precision="bf16"),
                                optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
loss = engine(x, y); engine.backward(loss); engine.step()
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import ConfigError, LossScaleConfig, ScheduleConfig, ZeroConfig
from .construct import RESTORED, InitSource, deferred_init
from .deepspeed_config import from_deepspeed
from .engine import Engine, StepReport
from .memory import MemoryLedger, expected_model_state_bytes
from .optim import OptimizerFactory
from .state import TrainingState
from .topology import Topology, TopologyError, build_topology

__all__ = [
    "ConfigError",
    "Engine",
    "LossScaleConfig",
    "MemoryLedger",
    "RESTORED",
    "ScheduleConfig",
    "StepReport",
    "Topology",
    "TopologyError",
    "TrainingState",
    "ZeroConfig",
    "build_topology",
    "deferred_init",
    "expected_model_state_bytes",
    "from_deepspeed",
    "initialize",
]


def initialize(
    model: nn.Module,
    config: ZeroConfig | dict[str, Any] | None = None,
    optimizer: OptimizerFactory | None = None,
    group=None,
    init: InitSource = None,
    topology: Topology | None = None,
) -> Engine:
    """Wrap ``model`` in an engine over ``group`` (default: the whole world).

    With model parallelism pass ``topology`` (``build_topology(mp)``): ZeRO then
    partitions over its DP group and the gradient norm spans its MP group too.

    ``config`` may be a ZeroConfig or a dict of its fields. ``optimizer`` is a factory
    called with the engine's fp32 shard tensors. torch.distributed must already be
    initialised (torchrun, or ``init_process_group``).

    ``init`` sets the initial weights: a path to a full state-dict file (read slice by
    slice), or, for a model built under ``deferred_init()``, a function
    ``init(qualified_name, module)`` run after each module's ``reset_parameters``.
    By default the model's own weights (rank 0's) are used.
    """
    if config is None:
        config = ZeroConfig()
    elif isinstance(config, dict):
        config = ZeroConfig.from_dict(config)
    elif not isinstance(config, ZeroConfig):
        raise ConfigError(f"config: expected ZeroConfig or dict, got {type(config).__name__}")
    else:
        # Checked again, and the engine's own copy: a field set after the config was
        # built (cfg.stage = 2.0) skipped every check, and the engine read some fields
        # live from the caller's object.
        config = ZeroConfig.from_dict(config.to_dict())
    if optimizer is None:
        raise ConfigError(
            "optimizer: pass a factory, e.g. optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4)"
        )
    mp_group = None
    if topology is not None:
        if group is not None:
            raise ConfigError("group: pass either group or topology, not both")
        group, mp_group = topology.dp_group, topology.mp_group
    return Engine(model, config, optimizer, group, init, mp_group)
