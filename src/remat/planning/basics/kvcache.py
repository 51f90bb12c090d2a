"""Hugging Face KV caches under checkpointing: off in training, as transformers does.

A model whose config says ``use_cache=True`` (the default of most Hugging Face configs) appends each
layer's keys and values to a cache in every forward.  A checkpointed layer rerun in backward would append
them again, so transformers turns the cache off in training when gradient checkpointing is on (with a
warning).  remat does the same: :func:`cache_off` while profiling, and :func:`cache_off_in_training` on a
model a plan is applied to (training-mode forwards run with ``use_cache=False``; evaluation keeps the cache).
The configs are left as they were.  One warning per model tells the user: a plan applied to a model whose
profile warned says nothing more, and an encoder-only model (BERT: ``is_decoder=False``) never caches, so it
is neither switched nor warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from .userline import user_stacklevel

__all__ = ["cache_off", "cache_off_in_training", "caching_configs", "restore_cache"]

_HOOKS = "_remat_cache_hooks"
_CONFIGS = "_remat_cache_configs"
_SWITCHED = "_remat_cache_switched"
_TOLD = "_remat_cache_told"


def caching_configs(model: nn.Module, on_only: bool = True) -> list[Any]:
    """The distinct configs of ``model`` and its submodules with ``use_cache`` on (any ``use_cache`` with
    ``on_only=False``).

    Example:
        >>> caching_configs(LlamaForCausalLM(LlamaConfig()))  # [the model's LlamaConfig]
    """
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        use_cache = getattr(config, "use_cache", None)
        if (use_cache is True or (not on_only and isinstance(use_cache, bool))) and not _encoder_only(config):
            found.setdefault(id(config), config)
    return list(found.values())


def _encoder_only(config: Any) -> bool:
    """A config that says it is no decoder (BERT's ``is_decoder=False``, not part of an encoder-decoder): its
    layers build no KV cache whatever ``use_cache`` says.  Decoder-only configs (Llama's) carry no
    ``is_decoder``."""
    return getattr(config, "is_decoder", None) is False and not getattr(config, "is_encoder_decoder", False)


@contextmanager
def cache_off(model: nn.Module, kwargs: dict[str, Any], who: str) -> Iterator[dict[str, Any]]:
    """Within the block, ``model``'s configs have ``use_cache=False``; yields ``kwargs`` with ``use_cache``
    off if it was given on.  Warns once (naming ``who``) when it changed anything.

    Example:
        >>> with cache_off(model, {"input_ids": ids}, "remat.profile") as kwargs:
        ...     model(**kwargs)
    """
    configs = caching_configs(model)
    asked = bool(kwargs.get("use_cache"))
    if configs or asked:
        warnings.warn(f"{who}: use_cache=True is incompatible with checkpointing in training; profiling "
                      f"{type(model).__name__} with use_cache=False, as transformers trains with gradient "
                      "checkpointing, and a plan applied to it trains it so too (its config is left as it was; "
                      "evaluation keeps the cache).", stacklevel=user_stacklevel())
        model.__dict__[_TOLD] = True  # Plan.apply on this model says nothing more
    for config in configs:
        config.use_cache = False
    try:
        yield {**kwargs, "use_cache": False} if asked else kwargs
    finally:
        for config in configs:
            config.use_cache = True


def cache_off_in_training(model: nn.Module) -> None:
    """Run ``model``'s training-mode forwards with ``use_cache=False`` from now on (until
    :func:`restore_cache`), warning once now if its config has the cache on.  Idempotent; nothing to do
    for a model without a Hugging Face-style ``config.use_cache``.  The configs are the model's own (looked
    up at each call) and those its submodules have now (a submodule swapped in later with a config of its
    own is not switched).

    Example:
        >>> cache_off_in_training(model)   # Plan.apply does this
    """
    configs = caching_configs(model, on_only=False)
    if not configs or getattr(model, _HOOKS, None) is not None:
        return
    if any(config.use_cache for config in configs) and not model.__dict__.get(_TOLD):
        warnings.warn(f"remat.Plan.apply: {type(model).__name__} has use_cache=True, which is incompatible with "
                      "checkpointing in training; its training-mode forwards will run with use_cache=False, as "
                      "transformers does with gradient checkpointing (evaluation keeps the cache).",
                      stacklevel=user_stacklevel())
    # The configs are filed on the model, found once (walking the modules costs ~0.4 ms a step on a Llama):
    # a deep copy of the model (an EMA copy) copies them with it and switches its own, and the model still
    # pickles.  Module-level hooks, for the same reasons.
    model.__dict__[_CONFIGS] = configs
    setattr(model, _HOOKS, (model.register_forward_pre_hook(_cache_off_before, with_kwargs=True),
                            model.register_forward_hook(_cache_back_after, with_kwargs=True, always_call=True)))


def _cache_off_before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    switched = []
    if module.training:
        configs = module.__dict__.get(_CONFIGS, [])
        own = getattr(module, "config", None)  # the model's own config may have been replaced since
        if isinstance(getattr(own, "use_cache", None), bool) and all(own is not c for c in configs):
            configs = [*configs, own]
        switched = [config for config in configs if config.use_cache is True]
    for config in switched:
        config.use_cache = False
    module.__dict__.setdefault(_SWITCHED, []).append(switched)  # a stack: forwards may nest
    if module.training and kwargs.get("use_cache"):
        return args, {**kwargs, "use_cache": False}
    return None


def _cache_back_after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    stack = module.__dict__.get(_SWITCHED)
    for config in stack.pop() if stack else ():
        config.use_cache = True


def restore_cache(model: nn.Module) -> None:
    """Undo :func:`cache_off_in_training`.

    Example:
        >>> restore_cache(model)   # Plan.remove does this
    """
    for handle in getattr(model, _HOOKS, None) or ():
        handle.remove()
    for name in (_HOOKS, _CONFIGS, _SWITCHED):
        model.__dict__.pop(name, None)
