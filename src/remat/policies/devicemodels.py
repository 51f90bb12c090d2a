"""Device models: how the copy engine (:mod:`.hostcopy`) reaches a device's streams, events and copies.

:class:`TorchDevice` wraps a torch device module (``torch.cuda``, ``torch.xpu``); :class:`HostDevice` copies
synchronously (the CPU, where nothing needs moving, and accelerators without streams).  A test can install
another with :func:`remat.policies.hostcopy.use_device_model` (a fake device with simulated streams).

Example:
    >>> default_model("cpu").asynchronous
    False
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostDevice", "TorchDevice", "default_model"]


class TorchDevice:
    """A device model over a torch device module with streams and events (``torch.cuda``, ``torch.xpu``)."""

    separate_memory = True  # its tensors are not in host memory: moving them frees device memory
    asynchronous = True  # copies run on a side stream, so prefetching ahead overlaps compute
    can_pin = True

    def __init__(self, module: Any) -> None:
        self.module = module
        self._side: dict[tuple[int | None, bool], Any] = {}

    def current_stream(self, device: torch.device) -> Any:
        return self.module.current_stream(device)

    def side_stream(self, device: torch.device, to_host: bool = True) -> Any:
        stream = self._side.get((device.index, to_host))
        if stream is None:
            stream = self._side[(device.index, to_host)] = self.module.Stream(device=device)
        return stream

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        with self.module.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, to_host: bool) -> Any:
        with self.module.stream(stream):
            dst.copy_(src, non_blocking=True)
            return stream.record_event()

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class HostDevice:
    """A device model that copies synchronously: the CPU (nothing to move), or an accelerator without streams."""

    asynchronous = False
    can_pin = False

    def __init__(self, separate_memory: bool = False) -> None:
        self.separate_memory = separate_memory

    def current_stream(self, device: torch.device) -> None:
        return None

    def side_stream(self, device: torch.device, to_host: bool = True) -> None:
        return None

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def host_wait(self, event: Any) -> None:
        pass

    def record_event(self, stream: Any) -> None:
        return None

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, to_host: bool) -> None:
        dst.copy_(src)

    def done(self, event: Any) -> bool:
        return True

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


def default_model(device_type: str) -> Any:
    """The device model for tensors of ``device_type``: a torch device module with streams, else synchronous.

    Example:
        >>> default_model("cuda")  # TorchDevice(torch.cuda)
    """
    if device_type == "cpu":
        return HostDevice()
    module = getattr(torch, device_type, None)
    if module is not None and all(hasattr(module, name) for name in ("Stream", "current_stream", "stream")):
        return TorchDevice(module)
    return HostDevice(separate_memory=True)
