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

from ..policies.offload import offload
from .checkpoint import checkpoint, resolve_policy

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
        if checkpoint_fn is None and checkpoint_fn_kwargs.get("policy") is not None:
            # told when the model is wrapped rather than at its first forward
            checkpoint_fn_kwargs["policy"] = resolve_policy(checkpoint_fn_kwargs["policy"], "remat.checkpoint_wrapper")
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

    ``checkpoint_fn_kwargs`` go to :func:`remat.checkpoint` (``policy=``, ``offload_inputs=True`` to keep the
    inputs in host memory until backward).

    Example:
        >>> block = checkpoint_wrapper(torch.nn.Linear(4, 4), preserve_rng_state=False)
        >>> first = checkpoint_wrapper(torch.nn.Linear(4, 4), offload_inputs=True)
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


class OffloadWrapper(ActivationWrapper):
    """Runs the wrapped module under :class:`remat.offload`: its large saved tensors go to host memory.

    The offloader lives as long as the wrapper; like every offloader it copies
    through its device type's engine (side stream, pinned host buffers reused
    from step to step, prefetch in backward order across wrappers), and
    ``wrapper.offloader.stats`` counts what was moved.

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


Target = tuple[str, nn.Module, dict]


def _targets_by_check_fn(model: nn.Module, check_fn: Callable[[nn.Module], bool]) -> list[Target]:
    """The outermost modules ``check_fn`` accepts, in definition order (wrapped subtrees skipped)."""
    matches: list[Target] = []
    skip_below: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in skip_below):
            continue
        if isinstance(module, ActivationWrapper):
            skip_below.append(name + ".")
            continue
        if module is not model and check_fn(module):
            matches.append((name, module, {}))
            skip_below.append(name + ".")
    return matches


def _targets_by_wrap_policy(model: nn.Module, auto_wrap_policy: Any) -> list[Target]:
    """The modules an FSDP-style wrap policy picks, children before parents, as FSDP would wrap them."""
    if not callable(auto_wrap_policy):
        pick = getattr(auto_wrap_policy, "_run_policy", None)
        if pick is None:
            raise TypeError(
                f"auto_wrap_policy must be a callable (module, recurse, nonwrapped_numel) -> bool or an FSDP "
                f"wrap policy such as ModuleWrapPolicy or CustomPolicy, got {type(auto_wrap_policy).__name__}."
            )
        # FSDP's non-callable policies (CustomPolicy) list their modules, each with wrapper kwargs.
        done = {m for w in model.modules() if isinstance(w, ActivationWrapper) for m in w.modules()}
        chosen = pick(model, ignored_modules=done, root_kwargs={})
        return [(name, m, chosen[m]) for name, m in model.named_modules() if m in chosen and m is not model]
    found: list[Target] = []

    def visit(name: str, module: nn.Module) -> int:
        # Returns the parameter count wrapped in this subtree, so a parent is asked
        # about what its wrapped children left over (FSDP's nonwrapped_numel).
        size = sum(p.numel() for p in module.parameters())
        if isinstance(module, ActivationWrapper):
            return size
        if not auto_wrap_policy(module=module, recurse=True, nonwrapped_numel=size):
            return 0
        wrapped = sum(visit(f"{name}.{child_name}" if name else child_name, child)
                      for child_name, child in module.named_children())
        if module is not model and auto_wrap_policy(module=module, recurse=False, nonwrapped_numel=size - wrapped):
            found.append((name, module, {}))
            return size
        return wrapped

    visit("", model)
    return found


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Any = None,
    *,
    every_n: int = 1,
    policy: Any = None,
    use_reentrant: bool = False,
    offload_inputs: bool | int = False,
) -> list[str]:
    """Wrap, in place, every ``every_n``-th submodule for which ``check_fn`` is true.

    Only the outermost matching modules are wrapped (a wrapped block's
    children are not wrapped again), and modules already wrapped are left
    alone, so calling it twice never checkpoints anything twice.  ``policy``
    (see :mod:`remat.policies`) makes the wrapped blocks selective.  Returns
    the qualified names of the modules it wrapped.

    ``auto_wrap_policy`` (an FSDP wrap policy: ``ModuleWrapPolicy``,
    ``CustomPolicy``, ``partial(lambda_auto_wrap_policy, ...)``,
    ``partial(size_based_auto_wrap_policy, ...)`` or any callable
    ``(module, recurse, nonwrapped_numel) -> bool``) replaces ``check_fn`` and
    picks modules as FSDP does: bottom-up, a parent being asked about the
    parameters its wrapped children left over, so a parent may be wrapped
    around wrapped children when the policy says so.

    ``offload_inputs`` (see :func:`remat.checkpoint`) moves the inputs of
    every wrapped module but the last to host memory: backward starts with the
    last one, so its inputs' copy back would have nothing to hide behind.

    Example:
        >>> model = remat.models.GPT()
        >>> apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
        >>> apply_activation_checkpointing(remat.models.GPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    """
    if every_n < 1:
        raise ValueError(f"every_n must be >= 1, got {every_n}.")
    if offload_inputs is not False and checkpoint_wrapper_fn is not checkpoint_wrapper:
        raise ValueError("apply_activation_checkpointing: offload_inputs needs the default checkpoint_wrapper_fn; "
                         "pass offload_inputs to your own wrapper instead.")
    if checkpoint_wrapper_fn is checkpoint_wrapper and (use_reentrant or policy is not None):
        impl = CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT
        extra = {} if policy is None else {"policy": policy}
        checkpoint_wrapper_fn = functools.partial(checkpoint_wrapper, checkpoint_impl=impl, **extra)
    if auto_wrap_policy is None:
        targets = _targets_by_check_fn(model, check_fn)
    else:
        targets = _targets_by_wrap_policy(model, auto_wrap_policy)
    # Parents are looked up before anything is wrapped: a policy may wrap a module and, later, its parent.
    placed = [(name, model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], module, kwargs)
              for name, module, kwargs in targets]
    wrapped = []
    last = max(range(0, len(placed), every_n), default=-1)
    for position, (name, parent, child, module, wrapper_kwargs) in enumerate(placed):
        if position % every_n:
            continue
        module._remat_path = _public_name(name)
        if offload_inputs is not False and position != last:
            wrapper_kwargs = {**wrapper_kwargs, "offload_inputs": offload_inputs}
        setattr(parent, child, checkpoint_wrapper_fn(module, **wrapper_kwargs))
        wrapped.append(_public_name(name))
    return wrapped
