"""Configuration errors name their field; DeepSpeed configs translate or are refused by name."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import zeroservice
from zeroservice import ConfigError, ZeroConfig, from_deepspeed
from zeroservice.config import KNOWN_MOE_LEAVES, LossScaleConfig, ScheduleConfig
from zeroservice.launch import run_local
from zeroservice.precision import DynamicLossScaler
from zeroservice.schedule import lr_factor


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"stage": 5}, "stage"),
        ({"stage": "2"}, "stage"),
        ({"precision": "fp8"}, "precision"),
        ({"reduce_dtype": "int8"}, "reduce_dtype"),
        ({"bucket_elements": 10}, "bucket_elements"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"lr_schedule": {"kind": "cosine"}}, "lr_schedule.total_steps"),
        ({"lr_schedule": {"kind": "step"}}, "lr_schedule.kind"),
        ({"loss_scale": {"backoff_factor": 2.0}}, "loss_scale.backoff_factor"),
        ({"train_micro_batch_size": 0}, "train_micro_batch_size"),
        ({"stage3_grouping": "layers"}, "stage3_grouping"),
        ({"stage3_prefetch_elements": -1}, "stage3_prefetch_elements"),
        ({"stage3_persistence_elements": 1.5}, "stage3_persistence_elements"),
        ({"trim_host_memory": "yes"}, "trim_host_memory"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        ZeroConfig(**kwargs)


def test_unknown_field_is_refused():
    with pytest.raises(ConfigError, match="offload_everything: unknown ZeroConfig field"):
        ZeroConfig.from_dict({"stage": 1, "offload_everything": True})


def test_config_round_trips_through_dict():
    cfg = ZeroConfig(stage=1, precision="bf16", lr_schedule=ScheduleConfig("cosine", 2, 10))
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_initialize_without_process_group_says_so():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        zeroservice.initialize(nn.Linear(2, 2), ZeroConfig(), optimizer=torch.optim.AdamW)


def test_initialize_without_optimizer_says_so():
    with pytest.raises(ConfigError, match="^optimizer:"):
        zeroservice.initialize(nn.Linear(2, 2), ZeroConfig())


def test_deepspeed_config_translates():
    ds = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
    }
    settings = from_deepspeed(ds, world_size=4)
    cfg = settings.config
    assert (cfg.stage, cfg.precision, cfg.reduce_dtype) == (2, "bf16", "fp32")
    assert cfg.gradient_accumulation_steps == 2 and cfg.train_micro_batch_size == 4
    assert cfg.bucket_elements == 50_000_000 and cfg.gradient_clipping == 0.5
    assert cfg.lr_schedule.kind == "cosine" and cfg.lr_schedule.total_steps == 100
    opt = settings.optimizer([nn.Parameter(torch.zeros(3))])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)


@pytest.mark.parametrize(
    ("scheduler", "message"),
    [
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_num_steps": 3}},
            "warmup_type: unset means DeepSpeed's default, 'log'",
        ),
        ({"type": "WarmupLR", "params": {}}, "warmup_type: unset means DeepSpeed's default"),
        (
            {"type": "WarmupLR", "params": {"warmup_type": "log"}},
            r"warmup_type='log': only 'linear'",
        ),
        (
            {"type": "WarmupCosineLR", "params": {"warmup_type": "linear"}},
            "total_num_steps: WarmupCosineLR needs it",
        ),
    ],
)
def test_deepspeed_scheduler_refusals(scheduler, message):
    """DeepSpeed warms up logarithmically unless told otherwise; a translation that
    warmed up linearly instead would train another schedule without a word."""
    with pytest.raises(ConfigError, match=message):
        from_deepspeed({"scheduler": scheduler})


def test_deepspeed_cosine_without_warmup_needs_no_warmup_type():
    params = {"total_num_steps": 9, "warmup_num_steps": 0}
    cfg = from_deepspeed({"scheduler": {"type": "WarmupCosineLR", "params": params}}).config
    assert cfg.lr_schedule.kind == "cosine" and cfg.lr_schedule.warmup_steps == 0


def test_deepspeed_stage3_translates():
    cfg = from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_max_live_parameters": 1e8,
                "stage3_param_persistence_threshold": 1e4,
            }
        }
    ).config
    assert cfg.stage == 3
    assert cfg.stage3_prefetch_elements == 100_000_000
    assert cfg.stage3_persistence_elements == 10_000


def test_deepspeed_zeropp_keys_translate():
    zero = {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_nontrainable_weights": False,
    }
    cfg = from_deepspeed({"zero_optimization": zero}).config
    assert cfg.quantized_weights and cfg.quantized_gradients == "int4"
    assert cfg.hierarchical_partition and cfg.ranks_per_node == 2
    plain = from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    assert not plain.config.hierarchical_partition and plain.config.ranks_per_node is None
    assert plain.config.quantized_gradients == "none" and not plain.config.quantized_weights
    stage2 = from_deepspeed({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}})
    assert stage2.config.quantized_gradients == "int4"


@pytest.mark.parametrize(
    "zero,message",
    [
        ({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights: needs stage 3"),
        ({"stage": 0, "zero_quantized_gradients": True}, "zero_quantized_gradients: needs stage"),
        ({"stage": 2, "zero_hpz_partition_size": 4}, "zero_hpz_partition_size=4: needs stage 3"),
        ({"stage": 3, "zero_hpz_partition_size": 0}, "zero_hpz_partition_size=0: must be"),
        ({"stage": 3, "zero_hpz_partition_size": 2.0}, "zero_hpz_partition_size=2.0: must be"),
        ({"stage": 3, "zero_quantized_weights": "yes"}, "zero_quantized_weights='yes': must be"),
        (
            {"stage": 3, "zero_quantized_nontrainable_weights": True},
            "zero_quantized_nontrainable_weights=True",
        ),
    ],
)
def test_deepspeed_zeropp_keys_are_refused_by_name(zero, message):
    with pytest.raises(ConfigError, match=f"^zero_optimization\\.{message}"):
        from_deepspeed({"zero_optimization": zero})


def test_deepspeed_leaf_modules_translate():
    def leaves(leaf_module) -> list[str]:
        zero = {"stage": 3, "leaf_module": leaf_module}
        return from_deepspeed({"zero_optimization": zero}).config.stage3_leaf_modules

    assert from_deepspeed({}).config.stage3_leaf_modules == list(KNOWN_MOE_LEAVES)
    dotted = "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"
    # classes replace the default list (as in DeepSpeed); names are added to it
    assert leaves({"classes": [dotted, "MyMoE"]}) == ["MixtralSparseMoeBlock", "MyMoE"]
    assert leaves({"classes": "MyMoE"}) == ["MyMoE"]
    assert leaves({"names": ["model.layers.0.mlp"]}) == [*KNOWN_MOE_LEAVES, "model.layers.0.mlp"]
    assert leaves({"classes": [], "name_suffixes": []}) == []


@pytest.mark.parametrize(
    "leaf_module,message",
    [
        ({"name_suffixes": ["mlp"]}, "leaf_module.name_suffixes: not supported"),
        ({"classes": [3]}, "leaf_module.classes=[3]: must be a list of names"),
        ({"names": ""}, "leaf_module.names='': must be a list of names"),
        ({"types": ["X"]}, "leaf_module.types: not supported by zeroservice"),
        ("MyMoE", "leaf_module: expected an object"),
    ],
)
def test_deepspeed_leaf_modules_are_refused_by_name(leaf_module, message):
    with pytest.raises(ConfigError, match="^" + re.escape(f"zero_optimization.{message}")):
        from_deepspeed({"zero_optimization": {"stage": 3, "leaf_module": leaf_module}})


def test_deepspeed_offload_and_activation_checkpointing_translate():
    cfg = from_deepspeed(
        {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "activation_checkpointing": {
                "partition_activations": True,
                "cpu_checkpointing": True,
                "contiguous_memory_optimization": False,
            },
        }
    ).config
    assert cfg.offload_optimizer
    assert cfg.activation_checkpointing and cfg.partition_activations
    assert cfg.cpu_offload_activations and not cfg.contiguous_activations


def test_deepspeed_fp16_section():
    cfg = from_deepspeed(
        {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50}}
    ).config
    assert cfg.precision == "fp16"
    assert cfg.loss_scale.initial_scale == 4096 and cfg.loss_scale.growth_interval == 50


@pytest.mark.parametrize(
    "ds,name",
    [
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.device",
        ),
        ({"activation_checkpointing": {"number_checkpoints": 4}}, "number_checkpoints"),
        ({"activation_checkpointing": {"foo": 1}}, "activation_checkpointing.foo"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
        ({"zero_optimization": {"reduce_scatter": False}}, "zero_optimization.reduce_scatter"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1, "foo": 2}}}, "optimizer.params.foo"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled"),
        ({"zero_optimization": {"stage": 4}}, "stage"),
        ({"zero_optimization": {"stage3_foo": 5}}, "zero_optimization.stage3_foo"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "train_batch_size"),
    ],
)
def test_deepspeed_unsupported_keys_are_refused_by_name(ds, name):
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        from_deepspeed(ds, world_size=2 if "train_batch_size" not in ds else None)


@pytest.mark.parametrize(
    "ds,name",
    [
        ({"train_batch_size": "auto"}, "train_batch_size"),
        ({"gradient_clipping": "auto"}, "gradient_clipping"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
        (
            {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
            "zero_optimization.reduce_bucket_size",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, "optimizer.params.betas"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
            "scheduler.params.warmup_num_steps",
        ),
    ],
)
def test_deepspeed_auto_values_are_refused_saying_who_fills_them_in(ds, name):
    """The Hugging Face Trainer replaces "auto" before DeepSpeed reads the config; read as
    it is, "auto" was a truthy bf16.enabled (bf16 without a word) or a ValueError."""
    with pytest.raises(ConfigError, match=f"^{re.escape(name)}='auto': 'auto' is filled in by"):
        from_deepspeed(ds)


@pytest.mark.parametrize(
    "ds,message",
    [
        ({"zero_optimization": [2]}, "zero_optimization: expected an object, got list"),
        ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage=2.5: must be an integer"),
        (
            {"zero_optimization": {"stage": True}},
            "zero_optimization.stage=True: must be an integer",
        ),
        ({"zero_optimization": {"overlap_comm": 1}}, "zero_optimization.overlap_comm=1: must be"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping='1.0': must be a finite number"),
        ({"gradient_clipping": -1}, "gradient_clipping=-1: must be a finite number >= 0"),
        ({"fp16": {"enabled": "true"}}, "fp16.enabled='true': must be true or false"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0: must be"),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.2]}}},
            r"optimizer.params.betas=\[0.9, 1.2\]: must be two numbers in \[0, 1\)",
        ),
        ({"optimizer": {"type": "SGD", "params": {"nesterov": "yes"}}}, "nesterov='yes'"),
        ({"activation_checkpointing": {"cpu_checkpointing": 1}}, "cpu_checkpointing=1: must"),
        ({"zero_optimization": {"sub_group_size": "big"}}, "sub_group_size='big': must be"),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor=0: must be a finite"),
        ({"gradient_predivide_factor": True}, "gradient_predivide_factor=True: must be a"),
        ({"prescale_gradients": 1}, "prescale_gradients=1: must"),
        (
            {"fp16": {"enabled": True, "initial_scale_power": 2000}},
            "fp16.initial_scale_power=2000: at most 64",
        ),
        (
            {"activation_checkpointing": {"synchronize_checkpoint_boundary": 0}},
            "synchronize_checkpoint_boundary=0: not supported",
        ),
        ({"activation_checkpointing": {"profile": 0}}, "profile=0: not supported"),
    ],
)
def test_deepspeed_values_of_the_wrong_type_are_refused_by_key(ds, message):
    with pytest.raises(ConfigError, match=message):
        from_deepspeed(ds)


def test_deepspeed_keys_without_effect_are_accepted_listed_and_warned():
    """A sample ZeRO-3 config from DeepSpeed's documentation: the keys that change only
    DeepSpeed's logging or memory and time trade-offs are accepted, listed with why,
    and the config is what it is without them."""
    zero = {"stage": 3, "overlap_comm": True, "stage3_max_live_parameters": 1e9}
    extra = {
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "round_robin_gradients": False,
    }
    sample = {"zero_optimization": {**zero, **extra}, "steps_per_print": 2000}
    sample |= {"wall_clock_breakdown": False, "prescale_gradients": True}
    sample["gradient_predivide_factor"] = 2.0
    with pytest.warns(UserWarning, match="accepted without effect here: steps_per_print"):
        settings = from_deepspeed(sample)
    assert set(settings.without_effect) == {
        "steps_per_print",
        "wall_clock_breakdown",
        "prescale_gradients",
        "gradient_predivide_factor",
        *(f"zero_optimization.{k}" for k in extra),
    }
    assert all(settings.without_effect.values())
    assert settings.config == from_deepspeed({"zero_optimization": zero}).config


def test_deepspeed_adam_decays_nothing_unless_told():
    """DeepSpeed's Adam (FusedAdam, DeepSpeedCPUAdam) defaults weight_decay to 0; torch's
    AdamW, built here, to 0.01. With torch_adam DeepSpeed builds torch's own."""
    shard = [nn.Parameter(torch.zeros(3))]
    for kind in ("Adam", "AdamW"):
        opt = from_deepspeed({"optimizer": {"type": kind, "params": {"lr": 1e-3}}}).optimizer
        assert opt(shard).defaults["weight_decay"] == 0.0, kind
    torch_adam = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    assert (
        from_deepspeed({"optimizer": torch_adam}).optimizer(shard).defaults["weight_decay"]
        == torch.optim.AdamW(shard).defaults["weight_decay"]
    )
    given = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
    assert from_deepspeed({"optimizer": given}).optimizer(shard).defaults["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("ds", "world", "accum", "micro"),
    [
        ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, 2, 4),
        ({"train_batch_size": 16}, 2, 1, 8),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2, 2, 4),
    ],
)
def test_deepspeed_batch_sizes_derive_what_is_left_out(ds, world, accum, micro):
    cfg = from_deepspeed(ds, world_size=world).config
    assert (cfg.gradient_accumulation_steps, cfg.train_micro_batch_size) == (accum, micro)


@pytest.mark.parametrize(
    ("ds", "world"),
    [
        ({"train_batch_size": 10, "gradient_accumulation_steps": 4}, 2),
        ({"train_batch_size": 3, "gradient_accumulation_steps": 2}, 2),
        ({"train_batch_size": 3}, 2),
        (
            {
                "train_batch_size": 16,
                "gradient_accumulation_steps": 3,
                "train_micro_batch_size_per_gpu": 4,
            },
            None,
        ),
    ],
)
def test_deepspeed_batch_sizes_that_cannot_agree_are_refused(ds, world):
    with pytest.raises(ConfigError, match="^train_batch_size=.* is not a multiple"):
        from_deepspeed(ds, world_size=world)


def test_deepspeed_defaults_written_out_are_accepted():
    """Keys DeepSpeed users write at their defaults: pinned host copies (a speed hint),
    non-consecutive hysteresis (DeepSpeed's own), WarmupLR from 0 to the optimizer's
    lr; a consecutive hysteresis restores the allowance after each clean step."""
    ds = {
        "zero_optimization": {
            "stage": 1,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
        },
        "fp16": {"enabled": True, "consecutive_hysteresis": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_type": "linear"},
        },
    }
    cfg = from_deepspeed(ds).config
    assert cfg.offload_optimizer and not cfg.loss_scale.consecutive_hysteresis
    assert cfg.lr_schedule.warmup_start_ratio == 0.0
    ds["scheduler"]["params"]["warmup_min_lr"] = 0.001
    assert from_deepspeed(ds).config.lr_schedule.warmup_start_ratio == pytest.approx(0.1)
    ds["scheduler"]["params"]["warmup_max_lr"] = 0.02
    with pytest.raises(ConfigError, match="warmup_max_lr=0.02: the warm-up climbs to the opt"):
        from_deepspeed(ds)
    ds["fp16"]["consecutive_hysteresis"] = True
    del ds["scheduler"]
    consecutive = from_deepspeed(ds).config.loss_scale
    s = DynamicLossScaler(consecutive)
    for overflow in (True, False, True, False, True):  # never two in a row: no back-off
        s.update(overflow)
    assert consecutive.consecutive_hysteresis and s.scale == consecutive.initial_scale


@pytest.mark.parametrize(
    ("ds", "key"),
    [
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale"),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500}},
            "zero_optimization.reduce_bucket_size",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 10, "cos_min_ratio": 2, "warmup_num_steps": 0},
                }
            },
            "scheduler.params.cos_min_ratio",
        ),
    ],
)
def test_deepspeed_values_the_engine_refuses_are_named_by_their_key(ds, key):
    with pytest.raises(ConfigError, match=f"^{re.escape(key)} \\(as "):
        from_deepspeed(ds)


def test_deepspeed_batch_size_inconsistent_with_world():
    with pytest.raises(ConfigError, match="train_batch_size=30"):
        from_deepspeed({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)


def test_schedule_shapes():
    cos = ScheduleConfig("cosine", warmup_steps=4, total_steps=14, min_ratio=0.1)
    factors = [lr_factor(cos, s) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and math.isclose(factors[9], 0.55)
    assert factors[14:] == [pytest.approx(0.1)] * 6
    lin = ScheduleConfig("linear", total_steps=10)
    assert lr_factor(lin, 5) == 0.5 and lr_factor(ScheduleConfig(), 1000) == 1.0


def test_loss_scaler_backs_off_with_hysteresis_and_grows_back():
    s = DynamicLossScaler(LossScaleConfig(initial_scale=64, growth_interval=2, hysteresis=2))
    s.update(overflow=True)
    assert s.scale == 64 and s.skipped_steps == 1
    s.update(overflow=True)
    assert s.scale == 32 and s.skipped_steps == 2
    s.update(overflow=True)  # spent: every overflow backs off until the scale grows
    assert s.scale == 16 and s.skipped_steps == 3
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 32
    s.update(overflow=True)  # growth restored the allowance (DeepSpeed, Megatron-LM)
    assert s.scale == 32 and not s.exhausted
    s2 = DynamicLossScaler(LossScaleConfig(initial_scale=2, min_scale=1))
    s2.update(overflow=True)
    assert s2.scale == 1 and not s2.exhausted
    for _ in range(4):
        s2.update(overflow=True)
    assert s2.scale == 1 and s2.exhausted
    s2.update(overflow=False)
    assert not s2.exhausted
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lr_schedule": 5}, r"^lr_schedule: 5 must be an object of its fields$"),
        ({"lr_schedule": {"kind": "cosine", "step": 3}}, r"^lr_schedule: unknown field\(s\) step"),
        ({"lr_schedule": {"kind": "linear", "total_steps": "9"}}, "lr_schedule.total_steps: '9'"),
        ({"loss_scale": "x"}, r"^loss_scale: 'x' must be an object"),
        ({"loss_scale": {"hysteresis": 1.5}}, "loss_scale.hysteresis: 1.5 must be an integer"),
        ({"overlap_comm": {"a": 1}}, r"^overlap_comm: must be true or false$"),
        ({"fuse_optimizer": [1]}, r"^fuse_optimizer: must be true or false$"),
        ({"stage3_check_gathers": "yes"}, r"^stage3_check_gathers: must be true or false$"),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps: True must be an"),
        ({"bucket_elements": 2**1000}, r"^bucket_elements: 10715086071862673\d+\.\.\. must be"),
        (
            {"stage3_prefetch_elements": 2**70},
            r"stage3_prefetch_elements: \d+ must be an integer \(at most 2\*\*53\)",
        ),
        ({"gradient_clipping": "1"}, "gradient_clipping: '1' must be a finite number"),
        ({"gradient_clipping": float("inf")}, "gradient_clipping: inf must be a finite number"),
        ({"precision": ["fp32"]}, r"^precision: \['fp32'\] is not one of 'fp32', 'bf16'"),
    ],
)
def test_fields_of_the_wrong_type_are_refused_by_name(fields, message):
    """A REST body or a YAML file may hold any JSON value in any field; each must be
    named at construction, not fail (or pass) later on the ranks."""
    with pytest.raises(ConfigError, match=message):
        ZeroConfig.from_dict(fields)


def _initialize_mutated(field: str, value) -> str:
    config = ZeroConfig()
    setattr(config, field, value)  # after its checks ran
    try:
        zeroservice.initialize(nn.Linear(4, 4), config, lambda ps: torch.optim.SGD(ps, lr=0.1))
    except ConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("stage", 2.0, "stage: 2.0 must be an integer"),
        ("gradient_clipping", float("nan"), "gradient_clipping: nan must be a finite number"),
        ("precision", "fp8", "precision: 'fp8' is not one of"),
        ("quantized_weights", True, "quantized_weights: needs stage 3"),
    ],
)
def test_a_field_set_after_the_config_was_built_is_checked_at_initialize(field, value, message):
    assert message in run_local(_initialize_mutated, 1, field, value, timeout_s=60)[0]
