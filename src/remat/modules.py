"""Module wrappers: checkpoint a submodule without touching its code or its state_dict keys.

Same shape as PyTorch's distributed wrappers (``CheckpointImpl``,
``ActivationWrapper``, ``CheckpointWrapper``, ``checkpoint_wrapper``,
``apply_activation_checkpointing``).  A wrapper holds the original module as
``_checkpoint_wrapped_module`` but hides that extra level everywhere a user
sees names: ``state_dict``/``load_state_dict`` keys and ``named_parameters``
are those of the unwrapped model, so checkpoints load either way.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .checkpoint import checkpoint
from .offload import offload

__all__ = [
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "OffloadWrapper",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "offload_wrapper",
]

_WRAPPED = "_checkpoint_wrapped_module"
_PREFIX = _WRAPPED + "."


class CheckpointImpl(enum.Enum):
    """Which checkpoint variant a :class:`CheckpointWrapper` uses."""

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


def _strip_wrapper_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_wrapper_keys(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class ActivationWrapper(nn.Module):
    """Base class of wrappers that change how a module's activations are kept.

    Attribute access falls through to the wrapped module, and names (state
    dict keys, ``named_parameters``) are those of the wrapped module.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if isinstance(module, ActivationWrapper):
            raise ValueError(
                f"{type(module).__name__} is already wrapped; wrapping it again would checkpoint it twice. "
                "Wrap the original module once (apply_activation_checkpointing skips wrapped modules)."
            )
        self._checkpoint_wrapped_module = module
        self._register_state_dict_hook(_strip_wrapper_keys)
        self.register_load_state_dict_pre_hook(_add_wrapper_keys)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[_WRAPPED], name)

    def __getitem__(self, index: Any) -> Any:
        return self._checkpoint_wrapped_module[index]

    def _unprefixed(self, items: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, value in items:
            yield name.replace(_PREFIX, ""), value

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._unprefixed(super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._unprefixed(super().named_buffers(*args, **kwargs))


def _kwargs_as_positional(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """Fold kwargs into positional args for the reentrant variant, which takes none."""
    names = list(kwargs)

    def call(*flat: Any) -> Any:
        split = len(flat) - len(names)
        return fn(*flat[:split], **dict(zip(names, flat[split:])))

    return call, (*args, *kwargs.values())


class CheckpointWrapper(ActivationWrapper):
    """Runs the wrapped module under :func:`remat.checkpoint`.

    Example:
        >>> block = CheckpointWrapper(torch.nn.Linear(4, 4))
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable[..., Any] | None = None,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        super().__init__(module)
        self.checkpoint_impl = checkpoint_impl
        if checkpoint_fn is None:
            checkpoint_fn = functools.partial(
                checkpoint,
                use_reentrant=checkpoint_impl is CheckpointImpl.REENTRANT,
                **checkpoint_fn_kwargs,
            )
        elif checkpoint_fn_kwargs:
            checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)
        self.checkpoint_fn = checkpoint_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._checkpoint_wrapped_module
        if kwargs and self.checkpoint_impl is CheckpointImpl.REENTRANT:
            call, flat = _kwargs_as_positional(module, args, kwargs)
            return self.checkpoint_fn(call, *flat)
        return self.checkpoint_fn(module, *args, **kwargs)


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> CheckpointWrapper:
    """Wrap ``module`` so its forward is checkpointed.

    Example:
        >>> block = checkpoint_wrapper(torch.nn.Linear(4, 4), preserve_rng_state=False)
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


class OffloadWrapper(ActivationWrapper):
    """Runs the wrapped module under :class:`remat.offload`: its large saved tensors go to host memory.

    The offloader (and its pinned buffer pool) lives as long as the wrapper, so
    buffers are reused from step to step; ``wrapper.offloader.stats`` counts
    what was moved.

    Example:
        >>> block = OffloadWrapper(torch.nn.Linear(4, 4), min_bytes=0)
    """

    def __init__(self, module: nn.Module, **offload_kwargs: Any) -> None:
        super().__init__(module)
        offload_kwargs.setdefault("modules", [module])
        self.offloader = offload(**offload_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.offloader:
            return self._checkpoint_wrapped_module(*args, **kwargs)


def offload_wrapper(module: nn.Module, **offload_kwargs: Any) -> OffloadWrapper:
    """Wrap ``module`` so the activations it saves are offloaded to host memory.

    Example:
        >>> block = offload_wrapper(torch.nn.Linear(4, 4))
    """
    return OffloadWrapper(module, **offload_kwargs)


def _public_name(qualified: str) -> str:
    return qualified.replace(_PREFIX, "")


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Any = None,
    *,
    every_n: int = 1,
    policy: Any = None,
    use_reentrant: bool = False,
) -> list[str]:
    """Wrap, in place, every ``every_n``-th submodule for which ``check_fn`` is true.

    Only the outermost matching modules are wrapped (a wrapped block's
    children are not wrapped again), and modules already wrapped are left
    alone, so calling it twice never checkpoints anything twice.  ``policy``
    (see :mod:`remat.policies`) makes the wrapped blocks selective.  Returns
    the qualified names of the modules it wrapped.

    Example:
        >>> model = remat.models.GPT()
        >>> apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    """
    if auto_wrap_policy is not None:
        raise NotImplementedError(
            "remat.apply_activation_checkpointing: auto_wrap_policy is not supported; pass check_fn."
        )
    if every_n < 1:
        raise ValueError(f"every_n must be >= 1, got {every_n}.")
    if checkpoint_wrapper_fn is checkpoint_wrapper and (use_reentrant or policy is not None):
        impl = CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT
        extra = {} if policy is None else {"policy": policy}
        checkpoint_wrapper_fn = functools.partial(checkpoint_wrapper, checkpoint_impl=impl, **extra)
    matches: list[tuple[str, nn.Module]] = []
    skip_below: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in skip_below):
            continue
        if isinstance(module, ActivationWrapper):
            skip_below.append(name + ".")
            continue
        if module is not model and check_fn(module):
            matches.append((name, module))
            skip_below.append(name + ".")
    wrapped = []
    for position, (name, module) in enumerate(matches):
        if position % every_n:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module._remat_path = _public_name(name)
        setattr(parent, child, checkpoint_wrapper_fn(module))
        wrapped.append(_public_name(name))
    return wrapped
