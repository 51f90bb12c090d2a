"""Offload saved activations to host memory during forward; bring them back for backward.

Two saved-tensor hook contexts:

* :class:`save_on_cpu` — drop-in for ``torch.autograd.graph.save_on_cpu``:
  every saved accelerator tensor is copied to host memory (tensors already on
  the CPU are kept as they are, not copied).
* :class:`offload` — the practical one: it leaves parameters, buffers and
  small tensors where they are, reuses a pool of pinned host buffers, copies
  on a side stream so compute is not blocked, and when backward starts
  unpacking it prefetches the next tensors in backward order.  It counts what
  it did in :attr:`offload.stats`.

On a machine without an accelerator nothing needs moving and both behave as
plain autograd (the offloader can be pointed at ``device_type="cpu"`` to
exercise its bookkeeping).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..engine.replay import DefaultDeviceType

__all__ = ["OffloadStats", "offload", "save_on_cpu"]


class OffloadStats:
    """What an offloading context did: tensors and bytes moved to host, and those kept in place.

    Example:
        >>> stats = OffloadStats()
        >>> stats.offloaded_bytes
        0
    """

    def __init__(self) -> None:
        self.offloaded_tensors = 0
        self.offloaded_bytes = 0
        self.kept_tensors = 0
        self.kept_bytes = 0

    def count(self, tensor: torch.Tensor, offloaded: bool) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if offloaded:
            self.offloaded_tensors += 1
            self.offloaded_bytes += nbytes
        else:
            self.kept_tensors += 1
            self.kept_bytes += nbytes

    def __repr__(self) -> str:
        return (
            f"OffloadStats(offloaded={self.offloaded_tensors} tensors / {self.offloaded_bytes} B, "
            f"kept={self.kept_tensors} tensors / {self.kept_bytes} B)"
        )


class save_on_cpu(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 - drop-in name
    """Copy every saved accelerator tensor to host memory; copy it back in backward.

    Example:
        >>> with save_on_cpu(pin_memory=True):
        ...     loss = model(x).sum()
        >>> loss.backward()
    """

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        pin = pin_memory and _accelerator_ready(device_type)

        def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
            if tensor.device.type == "cpu":
                return tensor.device, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
            host.copy_(tensor)
            return tensor.device, host

        def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def _accelerator_ready(device_type: str) -> bool:
    module = getattr(torch, device_type, None)
    return device_type != "cpu" and module is not None and module.is_available()


class _PinnedPool:
    """Host buffers reused across steps, by byte size (pinned when an accelerator is present)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = defaultdict(list)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        bucket = self.free[nbytes]
        raw = bucket.pop() if bucket else torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return raw.view(like.dtype).view(like.shape)

    def give_back(self, host: torch.Tensor) -> None:
        raw = host.reshape(-1).view(torch.uint8)
        self.free[raw.numel()].append(raw)


class _Offloaded:
    """One offloaded tensor: its host copy, where it came from, and its copy-back state."""

    __slots__ = ("host", "device", "order", "ready", "event", "owner", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, order: int, event: Any, owner: offload) -> None:
        self.host = host
        self.device = device
        self.order = order
        self.ready: torch.Tensor | None = None
        self.event = event
        self.owner = owner

    def __del__(self) -> None:
        # Unpacked or freed with its graph: the host buffer can serve the next tensor.
        if self.host is not None:
            self.owner._release(self)


class offload(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 - context manager, like save_on_cpu
    """Offload large saved activations to (pinned, pooled) host memory, with prefetch in backward.

    Args:
        min_bytes: tensors smaller than this stay on the device (the copy costs more than it saves).
        pin_memory: use pinned host buffers (only meaningful with an accelerator).
        prefetch: when backward unpacks a tensor, start copying back the next ``prefetch_depth``
            tensors in backward order on the side stream.
        device_type: which device's tensors to offload (default: the accelerator type).
        modules: modules whose parameters and buffers must never be offloaded (parameters of any
            module are recognised anyway).

    Example:
        >>> with remat.offload(min_bytes=1 << 20) as off:
        ...     loss = model(x).sum()
        >>> loss.backward()
        >>> off.stats.offloaded_bytes
    """

    def __init__(
        self,
        min_bytes: int = 1 << 20,
        pin_memory: bool = True,
        prefetch: bool = True,
        *,
        prefetch_depth: int = 2,
        device_type: str | None = None,
        modules: Iterable[nn.Module] = (),
    ) -> None:
        self.min_bytes = min_bytes
        self.device_type = device_type or DefaultDeviceType.get_device_type()
        accelerated = _accelerator_ready(self.device_type)
        self.pool = _PinnedPool(pin_memory and accelerated)
        self._device_module = torch.get_device_module(self.device_type) if accelerated else None
        self.stream = self._device_module.Stream() if accelerated else None
        self.prefetch_depth = prefetch_depth if prefetch and accelerated else 0
        self.stats = OffloadStats()
        self._skip = {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}
        self._in_flight: dict[int, Any] = {}  # order -> weakref of _Offloaded, for prefetch
        self._counter = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> offload:
        super().__enter__()
        return self

    def _should_offload(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == self.device_type
            and not isinstance(tensor, nn.Parameter)
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            and tensor.untyped_storage().data_ptr() not in self._skip
        )

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._should_offload(tensor):
            self.stats.count(tensor, offloaded=False)
            return tensor
        host = self.pool.take(tensor)
        event = None
        if self.stream is not None:
            # The side stream must see the producer's writes; the tensor must outlive the copy.
            self.stream.wait_stream(self._device_module.current_stream())
            with self._device_module.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)
                event = self.stream.record_event()
        else:
            host.copy_(tensor)
        self.stats.count(tensor, offloaded=True)
        self._counter += 1
        handle = _Offloaded(host, tensor.device, self._counter, event, self)
        self._in_flight[self._counter] = weakref.ref(handle)
        return handle

    def _copy_back(self, handle: _Offloaded) -> None:
        if handle.ready is not None:
            return
        if self.stream is None:
            # A copy even on the CPU: the pooled buffer is reused once this handle dies.
            handle.ready = handle.host.to(handle.device, copy=True)
            return
        with self._device_module.stream(self.stream):
            if handle.event is not None:
                self.stream.wait_event(handle.event)
            handle.ready = handle.host.to(handle.device, non_blocking=True)
            handle.event = self.stream.record_event()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        self._copy_back(packed)
        for order in range(packed.order - 1, max(packed.order - 1 - self.prefetch_depth, 0), -1):
            ref = self._in_flight.get(order)
            upcoming = ref() if ref is not None else None
            if upcoming is not None:
                self._copy_back(upcoming)
        if self.stream is not None:
            current = self._device_module.current_stream()
            current.wait_event(packed.event)
            packed.ready.record_stream(current)
        return packed.ready

    def _release(self, handle: _Offloaded) -> None:
        self._in_flight.pop(handle.order, None)
        if self.stream is not None and handle.event is not None:
            handle.event.synchronize()  # the host buffer may still be read by a copy
        self.pool.give_back(handle.host)
        handle.host = None
