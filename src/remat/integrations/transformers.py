"""Hugging Face transformers: run a model's own gradient checkpointing through remat.

Transformers layers call ``self._gradient_checkpointing_func(layer_call, *args)``
when checkpointing is on; :func:`enable` switches it on the model's own way
(so its bookkeeping, such as input gradients and ``use_cache``, happens) and
then hands every layer remat's function instead of torch's.

The same by hand, with transformers' own switch::

    model.gradient_checkpointing_enable()          # or activation_checkpointing_enable()
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=remat.checkpoint)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..checkpoint import checkpoint

__all__ = ["enable"]


def enable(model: Any, policy: Any = None, every_n_layers: int = 1, **checkpoint_kwargs: Any) -> Any:
    """Checkpoint a transformers ``PreTrainedModel``'s layers with remat; returns the model.

    ``policy`` (a :mod:`remat.policies` policy) makes each layer selective;
    ``every_n_layers`` checkpoints only every n-th layer.  Call ``model.train()``:
    transformers only checkpoints in training mode.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = enable(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2)), policy=remat.policies.save_matmuls)
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing in transformers.")
    if every_n_layers < 1:
        raise ValueError(f"every_n_layers must be >= 1, got {every_n_layers}.")
    switch = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    switch()
    func = functools.partial(checkpoint, policy=policy, **checkpoint_kwargs)
    if "every_n_layers" in inspect.signature(model._set_gradient_checkpointing).parameters:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)
    else:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing") and m is not model]
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index % every_n_layers == 0
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache cannot be rebuilt by recomputation
    return model
