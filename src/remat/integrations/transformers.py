"""Hugging Face transformers: run a model's own gradient checkpointing through remat.

Transformers layers call ``self._gradient_checkpointing_func(layer_call, *args)``
when checkpointing is on; :func:`enable` switches it on the model's own way
(so its bookkeeping, such as input gradients and ``use_cache``, happens) and
then hands every layer remat's function instead of torch's.

It also stays on: ``Trainer`` (``gradient_checkpointing=True``, or
``activation_checkpointing=True`` from transformers 5.23) and users call the
model's own switch again, which would put torch's function back.  :func:`enable`
installs that method on the model instance (transformers calls an instance
override), so those calls keep remat, with their ``*_checkpointing_kwargs``,
``every_n_layers`` and ``offload`` applied.

Tested with transformers 4.44.2, 4.57.6, 5.17.0 and 5.23.0.  What differs across
them is found by feature tests, not version numbers:

* the switch: ``activation_checkpointing_enable`` (5.23; ``gradient_checkpointing_enable``
  is then its deprecated alias) or ``gradient_checkpointing_enable`` (before);
* ``every_n_layers``: ``_set_gradient_checkpointing`` takes it from 5.16; before,
  remat sets the flags of the per-layer ``GradientCheckpointingLayer`` blocks itself
  (4.52 on, model by model).  Models whose layers carry no flag of their own (all
  of them before 4.52) checkpoint every layer or none, so ``every_n_layers > 1``
  raises there.

``chunked_loss=n`` also computes the training loss over ``n`` token chunks
(:func:`remat.chunk_lm_head`): the whole logits are never made, and the output's
``logits`` is ``None`` in training with labels.

The same by hand, with transformers' own switch (undone by the next call to it)::

    model.gradient_checkpointing_enable()          # or activation_checkpointing_enable()
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=remat.checkpoint)
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from ..api.checkpoint import checkpoint
from ..api.chunkedhead import chunk_lm_head
from ..policies.offload import save_on_cpu

__all__ = ["enable"]

_SETTINGS = "_remat_checkpointing"


def enable(model: Any, policy: Any = None, every_n_layers: int = 1, chunked_loss: int | None = None,
           **checkpoint_kwargs: Any) -> Any:
    """Checkpoint a transformers ``PreTrainedModel``'s layers with remat; returns the model.

    ``policy`` (a :mod:`remat.policies` policy) makes each layer selective;
    ``every_n_layers`` checkpoints only every n-th layer (models whose layers are
    transformers' ``GradientCheckpointingLayer``, transformers 4.52 on).  Call
    ``model.train()``: transformers only checkpoints in training mode.  Later calls
    of the model's own switch (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` before transformers 5.23, as ``Trainer``
    makes) keep using remat.  ``chunked_loss=n`` (a causal LM) computes the training loss over ``n``
    token chunks, each chunk's logits recomputed in backward (:func:`remat.chunk_lm_head`).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = enable(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2)), policy=remat.policies.save_matmuls)
        >>> model = enable(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2)), chunked_loss=8)
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing in transformers.")
    _check_every_n_layers(model, every_n_layers)
    if chunked_loss is not None:
        chunk_lm_head(model, chunked_loss)
    setattr(model, _SETTINGS, {"policy": policy, "kwargs": checkpoint_kwargs})
    if hasattr(type(model), "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable = types.MethodType(_activation_checkpointing_enable, model)
        model.activation_checkpointing_enable(every_n_layers=every_n_layers)
    else:
        model.gradient_checkpointing_enable = types.MethodType(_gradient_checkpointing_enable, model)
        model.gradient_checkpointing_enable(every_n_layers=every_n_layers)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache cannot be rebuilt by recomputation
    return model


def _activation_checkpointing_enable(
    model: Any, activation_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1, offload: bool = False
) -> None:
    _check_every_n_layers(model, every_n_layers)
    # transformers' own switch does the bookkeeping (input grads, flags); then the layers get remat's function,
    # which does the offloading itself.
    type(model).activation_checkpointing_enable(model, activation_checkpointing_kwargs, every_n_layers)
    _hand_layers_remat(model, activation_checkpointing_kwargs, every_n_layers, offload)


def _gradient_checkpointing_enable(
    model: Any, gradient_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1, offload: bool = False
) -> None:
    # every_n_layers and offload are applied by remat: transformers' switch takes them only from 5.16 / 5.17.
    _check_every_n_layers(model, every_n_layers)
    type(model).gradient_checkpointing_enable(model, gradient_checkpointing_kwargs)
    _hand_layers_remat(model, gradient_checkpointing_kwargs, every_n_layers, offload)


def _hand_layers_remat(model: Any, call_kwargs: dict | None, every_n_layers: int, offload: bool) -> None:
    settings = getattr(model, _SETTINGS)
    func = functools.partial(checkpoint, policy=settings["policy"], **{**settings["kwargs"], **(call_kwargs or {})})
    if offload:
        func = functools.partial(_checkpoint_with_inputs_on_host, func)
    if "every_n_layers" in inspect.signature(model._set_gradient_checkpointing).parameters:  # transformers >= 5.16
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)
        return
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    if every_n_layers > 1:
        for index, layer in enumerate(_checkpointing_layers(model)):
            layer.gradient_checkpointing = index % every_n_layers == 0


def _checkpointing_layers(model: Any) -> list[Any]:
    """The repeated layers that carry their own checkpointing flag, in order (empty before transformers 4.52)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _check_every_n_layers(model: Any, every_n_layers: int) -> None:
    if every_n_layers < 1:
        raise ValueError(f"every_n_layers must be >= 1, got {every_n_layers}.")
    if every_n_layers > 1 and not _checkpointing_layers(model):
        # The model's stack checks one flag for all its layers: there is no "every n-th" to set.
        raise ValueError(
            f"every_n_layers={every_n_layers} needs layers with their own checkpointing flag (transformers' "
            f"GradientCheckpointingLayer, 4.52 on); {type(model).__name__} has none in this transformers version. "
            "Use every_n_layers=1, or remat.apply_activation_checkpointing with a check_fn that picks the layers."
        )


def _checkpoint_with_inputs_on_host(func: Callable[..., Any], function: Callable[..., Any], *args: Any,
                                    **kwargs: Any) -> Any:
    # transformers' offload=True: what a checkpointed layer keeps (its inputs) lives in host memory.
    # remat's save_on_cpu takes each tensor's own device: no accelerator lookup (torch.accelerator is torch >= 2.6).
    with save_on_cpu(pin_memory=True):
        return func(function, *args, **kwargs)
