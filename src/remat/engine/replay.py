"""State that a recomputation must reproduce: RNG streams, autocast, and the buffers forward wrote.

A checkpointed region is run twice: once in forward, once when backward needs
its activations.  Dropout and every other random op must draw the same numbers
both times, autocast must pick the same dtypes, and a module's buffers must
hold what forward found in them (:mod:`.buffers`), or the recomputed
activations differ from the ones autograd would have saved.

:class:`ReplayState` captures that state when a region starts and restores it
around the recomputation, leaving the caller's RNG and the buffers exactly
where they were.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .buffers import RegionBuffers

__all__ = [
    "DefaultDeviceType",
    "ReplayState",
    "get_device_states",
    "set_device_states",
]


class DefaultDeviceType:
    """The device type whose RNG is preserved when no argument names one.

    When every tensor argument of a checkpointed function lives on the CPU,
    remat still needs to know which accelerator's RNG stream the function may
    use.  This defaults to the current accelerator (``"cpu"`` when there is
    none) and can be set explicitly.

    Example:
        >>> DefaultDeviceType.set_device_type("cuda")
        >>> DefaultDeviceType.get_device_type()
        'cuda'
        >>> DefaultDeviceType.set_device_type(None)  # back to auto-detection
    """

    _device_type: str | None = None

    @staticmethod
    def set_device_type(device: str | None = "cuda") -> None:
        """Set the fallback device type (``None`` restores auto-detection)."""
        DefaultDeviceType._device_type = device

    @staticmethod
    def get_device_type() -> str:
        """Return the fallback device type."""
        if DefaultDeviceType._device_type is None:
            DefaultDeviceType._device_type = _current_accelerator_type()
        return DefaultDeviceType._device_type


def _current_accelerator_type() -> str:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:  # torch < 2.6: CUDA is the accelerator it can name
        return "cuda" if torch.cuda.is_available() else "cpu"
    # check_available=True: report an accelerator only if one is usable,
    # which never initializes a device context.
    try:
        current = accelerator.current_accelerator(True)
    except TypeError:  # torch < 2.7 has no check_available argument
        current = accelerator.current_accelerator() if accelerator.is_available() else None
    return "cpu" if current is None else current.type


def _device_module(device_type: str) -> Any:
    return getattr(torch, device_type, None)


def tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of lists, tuples and dicts (HF model outputs are dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensor_leaves(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensor_leaves(item)


def infer_device_type(tensors: Iterable[torch.Tensor]) -> str:
    """The accelerator type among ``tensors`` (CUDA first), else the default type."""
    found: list[str] = []
    for t in tensors:
        kind = t.device.type
        if kind != "cpu" and kind not in found:
            found.append(kind)
    if not found:
        return DefaultDeviceType.get_device_type()
    if len(found) > 1:
        warnings.warn(
            f"remat: checkpointed tensors live on several device types {found}; only the RNG of "
            f"{'cuda' if 'cuda' in found else found[0]!r} is replayed. Random ops on the others may "
            "differ in recomputation.",
            stacklevel=4,
        )
    return "cuda" if "cuda" in found else found[0]


def get_device_states(*args: Any) -> tuple[list[int], list[torch.Tensor]]:
    """RNG states of every accelerator device that holds a tensor in ``args``.

    Example:
        >>> ids, states = get_device_states(torch.ones(2))  # CPU only
        >>> ids, states
        ([], [])
    """
    tensors = list(tensor_leaves(args))
    device_type = infer_device_type(tensors)
    ids: list[int] = []
    for t in tensors:
        if t.device.type not in ("cpu", "meta") and t.get_device() not in ids:
            ids.append(t.get_device())
    return ids, _device_rng_states(device_type, ids)


def set_device_states(
    devices: list[int], states: list[torch.Tensor], *, device_type: str | None = None
) -> None:
    """Restore RNG states taken by :func:`get_device_states`.

    Example:
        >>> set_device_states(*get_device_states(torch.ones(2)))
    """
    device_type = device_type or DefaultDeviceType.get_device_type()
    if device_type == "meta":
        return
    module = _device_module(device_type)
    for device_id, state in zip(devices, states, strict=True):
        with module.device(device_id):
            module.set_rng_state(state)


def _autocast_settings(device_type: str) -> tuple[bool, torch.dtype, bool] | None:
    if not torch.amp.is_autocast_available(device_type):
        return None
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


def _autocast_context(device_type: str, settings: tuple[bool, torch.dtype, bool] | None):
    # Entering autocast is only needed when the ambient state differs from the
    # captured one; that is the rare case (backward run under autocast).
    if settings is None or _autocast_settings(device_type) == settings:
        return contextlib.nullcontext()
    enabled, dtype, cache = settings
    return torch.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)


class ReplayState:
    """RNG and autocast state captured at the start of a checkpointed region.

    ``preserve_rng=False`` skips the RNG stash (cheaper, but random ops then
    draw fresh numbers in recomputation).  The RNG of an accelerator is only
    captured if that accelerator is already initialized: capturing would
    otherwise initialize it by accident.

    Example:
        >>> x = torch.ones(4)
        >>> state = ReplayState.capture([x], preserve_rng=True)
        >>> a = torch.rand(1)
        >>> with state.replay():
        ...     b = torch.rand(1)
        >>> bool(a == b)
        True
    """

    __slots__ = ("device_type", "device_was_up", "cpu_rng", "device_ids", "device_rngs", "device_autocast",
                 "cpu_autocast", "buffers")

    def __init__(self) -> None:
        self.device_type = "cpu"
        self.device_was_up = False  # the accelerator's context existed when the region began
        self.cpu_rng: torch.Tensor | None = None
        self.device_ids: list[int] = []
        self.device_rngs: list[torch.Tensor] = []
        self.device_autocast: tuple[bool, torch.dtype, bool] | None = None
        self.cpu_autocast: tuple[bool, torch.dtype, bool] | None = None
        self.buffers: RegionBuffers | None = None

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor], preserve_rng: bool, fn: Any = None) -> ReplayState:
        """Capture the state that the region about to run (``fn``, whose modules' buffers are copied) will see."""
        tensors = list(tensors)
        state = cls()
        state.buffers = RegionBuffers.before_forward(fn)
        state.device_type = infer_device_type(tensors)
        state.cpu_autocast = _autocast_settings("cpu")
        if state.device_type != "cpu":
            state.device_autocast = _autocast_settings(state.device_type)
        if preserve_rng:
            state.cpu_rng = torch.get_rng_state()
            state.device_was_up = state.device_initialized()
            if state.device_was_up:
                state.device_ids, state.device_rngs = get_device_states(*tensors)
        return state

    def forward_done(self) -> None:
        """The region's forward ended: keep only what it wrote of the buffers."""
        if self.buffers is not None:
            self.buffers.after_forward()
            if not self.buffers.written:
                self.buffers = None

    def device_initialized(self) -> bool:
        """Whether the accelerator of this region has an initialized context."""
        if self.device_type in ("cpu", "meta"):
            return False
        module = _device_module(self.device_type)
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is not None:
            return bool(is_initialized())
        return bool(getattr(module, "_initialized", False))

    def check_device_not_initialized_by(self, where: str) -> None:
        """Fail if the region initialized its accelerator, so its RNG was never stashed.

        Decided from the state at the region's start: a region whose inputs are all on the CPU, run in a
        process whose accelerator was already up, initialized nothing (and PyTorch's checkpoint runs it too).
        """
        if self.cpu_rng is not None and not self.device_was_up and self.device_initialized():
            raise RuntimeError(
                f"remat: the {self.device_type} device was first initialized inside {where}, so its RNG "
                "state could not be stashed for recomputation. Initialize the device before the "
                "checkpointed call (e.g. move a tensor to it), or pass preserve_rng_state=False."
            )

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body under the captured state; restore the caller's RNG afterwards."""
        saved_cpu = saved_devices = None
        if self.cpu_rng is not None:
            saved_cpu = torch.get_rng_state()
            torch.set_rng_state(self.cpu_rng)
            if self.device_ids:
                saved_devices = _device_rng_states(self.device_type, self.device_ids)
                set_device_states(self.device_ids, self.device_rngs, device_type=self.device_type)
        try:
            with (
                _autocast_context(self.device_type, self.device_autocast),
                _autocast_context("cpu", self.cpu_autocast),
                self.buffers.as_forward_found() if self.buffers is not None else contextlib.nullcontext(),
            ):
                yield
        finally:
            if saved_cpu is not None:
                torch.set_rng_state(saved_cpu)
            if saved_devices is not None:
                set_device_states(self.device_ids, saved_devices, device_type=self.device_type)


def _device_rng_states(device_type: str, device_ids: list[int]) -> list[torch.Tensor]:
    module = _device_module(device_type)
    states = []
    for device_id in device_ids:
        with module.device(device_id):
            states.append(module.get_rng_state())
    return states
