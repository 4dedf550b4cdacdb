"""Build what a job spec describes, on one rank: the model, its data and its optimizer."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zeroservice
from zeroservice.checkpoint.storage import is_uri
from zeroservice.data import ByteText, SyntheticTokens, TokenDataset, TokenFile
from zeroservice.models import GPT
from zeroservice.optim import OptimizerFactory
from zeroservice.tensor_parallel import MPGroup

from .spec import FactoryModelSpec, GPTModelSpec, JobSpec, TransformersModelSpec


class CausalLMLoss(nn.Module):
    """Wraps a ``transformers`` causal LM so that ``forward(inputs, targets)`` is the loss."""

    export_prefix = "model."
    """What the wrapper adds to the causal LM's names: a checkpoint records it, and an
    export strips it, so the exported file loads into the ``transformers`` model itself."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _transformers_model(spec: TransformersModelSpec) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            "model.kind transformers: the transformers package is not installed"
        ) from exc
    cls = getattr(transformers, spec.architecture, None)
    if cls is None:
        raise ValueError(f"model.architecture: transformers has no {spec.architecture}")
    config_cls = cls.config_class
    config = config_cls(**spec.config)
    if getattr(config, "vocab_size", spec.vocab_size) != spec.vocab_size:
        raise ValueError(
            f"model.vocab_size: {spec.vocab_size} differs from the config's {config.vocab_size}"
        )
    _check_positions(spec, config)
    return CausalLMLoss(cls(config))


POSITION_LIMITS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")
"""Config fields that bound the positions a transformers model takes, as families name
them (GPT-2; Llama, OPT, BERT-style; older GPT-2 configs; others)."""


def _check_positions(spec: TransformersModelSpec, config: Any) -> None:
    """A sample longer than the model's positions fails its first forward on every rank
    (a learned position table indexed past its end): refused at submission instead. A
    model with rotary positions states a limit too, and is held to it."""
    for name in POSITION_LIMITS:
        limit = getattr(config, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if spec.seq_len > limit:
                raise ValueError(
                    f"model.seq_len: {spec.seq_len} tokens per sample is more than the "
                    f"model's {limit} positions (model.config.{name}): raise "
                    f"model.config.{name} or lower model.seq_len"
                )
            return


def _factory_model(spec: FactoryModelSpec) -> nn.Module:
    module_name, _, attr = spec.factory.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model.factory: cannot import {spec.factory}: {exc}") from None
    model = fn(**spec.kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model.factory: {spec.factory} returned {type(model).__name__}, not an nn.Module"
        )
    return model


def build_model(spec: JobSpec, mp_group, restoring: bool = False) -> tuple[nn.Module, Any]:
    """The model (built straight into shards at stage 3 for the GPT) and its ``init``.

    ``restoring``: a checkpoint load or a restore from peers follows, so the GPT is
    built without initial weights (``zeroservice.RESTORED``); other model kinds, whose
    construction may read their own weights, are built as usual."""
    model_spec = spec.model
    torch.manual_seed(spec.seed)
    if isinstance(model_spec, GPTModelSpec):
        cfg = model_spec.gpt_config()
        mp = MPGroup(mp_group) if spec.resources.mp > 1 else None
        if restoring:
            with zeroservice.deferred_init():
                model = GPT(cfg, mp)
            return model, zeroservice.RESTORED
        if spec.zero_config().stage == 3:
            with zeroservice.deferred_init():
                model = GPT(cfg, mp)
            return model, GPT.initializer(cfg)
        return GPT(cfg, mp), None
    if isinstance(model_spec, TransformersModelSpec):
        return _transformers_model(model_spec), None
    return _factory_model(model_spec), None


def build_dataset(spec: JobSpec) -> TokenDataset:
    data, seq = spec.data, spec.model.seq_len
    if data.kind == "synthetic":
        return SyntheticTokens(spec.model.vocab_size, seq, seed=data.seed)
    assert data.path is not None
    if is_uri(data.path):
        return _file_dataset(data.path, spec)
    with opened_as_checked(data.path) as path:
        try:
            dataset = _file_dataset(path, spec)
        except ValueError as exc:  # named by the job's path, not by the descriptor read
            raise ValueError(str(exc).replace(path, data.path)) from None
    if isinstance(dataset, TokenFile):
        dataset.path = data.path  # what its later messages name
    return dataset


def _file_dataset(path: str, spec: JobSpec) -> TokenDataset:
    data, seq = spec.data, spec.model.seq_len
    if data.kind == "text":
        return ByteText(path, seq, seed=data.seed)
    return TokenFile(path, seq, spec.model.vocab_size, data.dtype, seed=data.seed)


@contextlib.contextmanager
def opened_as_checked(path: str) -> Iterator[str]:
    """A path that reads the very file ``path`` named when the control plane checked it,
    valid inside the context (the datasets read their file, or map it, when built).

    [Note: a data file opened as checked]
    At submission the control plane resolves ``data.path``, symlinks included, and
    stores the real path only if it lies under the tenant's data roots (api/confine.py).
    A tenant who can rename entries in its own root could afterwards replace a
    directory on that path by a symlink into another tenant's root: opened by name,
    the stored path would then read the other tenant's file. So the rank opens the
    file, asks the kernel which file it opened (``/proc/self/fd``), refuses it unless
    that is the stored path, and builds the dataset through the descriptor it
    checked: no later swap reaches it. Without ``/proc`` the real path is compared
    before opening."""
    wanted = os.path.abspath(path)
    try:
        fd = os.open(wanted, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # said as the datasets say it, by the job's path
        raise FileNotFoundError(f"{path}: no such file") from None
    try:
        proc = f"/proc/self/fd/{fd}"
        try:
            opened = os.readlink(proc)
        except OSError:
            opened, proc = os.path.realpath(wanted), wanted
        if opened != wanted:
            raise ValueError(
                f"data.path: {path} no longer leads to the file checked when the job was "
                "submitted (a directory or link on its way was replaced since); submit the "
                "job again"
            )
        yield proc
    finally:
        os.close(fd)


def optimizer_factory(spec: JobSpec) -> OptimizerFactory:
    o = spec.optimizer
    if o.type == "sgd":
        return lambda ps: torch.optim.SGD(
            ps, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )
    cls = torch.optim.AdamW if o.type == "adamw" else torch.optim.Adam
    return lambda ps: cls(ps, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
