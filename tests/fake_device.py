"""A fake accelerator for the offload engine: CPU tensors, simulated streams and events, a log of every call.

Copies really happen (on the CPU, at once); their *device* times come from the given bandwidths on a simulated
clock.  Each stream has the time its queued work completes (``ready``); a copy starts when its stream is free
and the host has issued it (``now``), a wait makes a stream's later work start after the awaited work, and an
event has completed once the host clock has passed its time.  ``run(seconds)`` queues compute on the compute
stream; ``advance()`` moves the host clock.  Nothing here blocks; the one host wait the fake offers
(``FakeEvent.synchronize``) is logged, so a test can assert the engine never used it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class FakeStream:
    name: str
    ready: float = 0.0  # when the work queued on it so far completes


@dataclass(eq=False)
class FakeEvent:
    device: FakeDevice
    time: float
    copy: int  # index of the copy it follows in device.copies

    def query(self) -> bool:
        return self.device.now >= self.time

    def synchronize(self) -> None:
        self.device.log.append(("host waits", self))
        self.device.now = max(self.device.now, self.time)


@dataclass
class Copy:
    to_host: bool
    nbytes: int
    start: float
    end: float
    source_ptr: int
    dst_ptr: int


@dataclass
class FakeDevice:
    d2h_bytes_per_s: float = 2.0 ** 30
    h2d_bytes_per_s: float = 2.0 ** 30
    now: float = 0.0
    compute: FakeStream = field(default_factory=lambda: FakeStream("compute"))
    side: FakeStream = field(default_factory=lambda: FakeStream("side"))  # copies out
    back: FakeStream = field(default_factory=lambda: FakeStream("back"))  # copies back
    log: list = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)

    separate_memory = True
    asynchronous = True
    can_pin = False

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.compute

    def side_stream(self, device: torch.device, to_host: bool = True) -> FakeStream:
        return self.side if to_host else self.back

    def empty(self, nbytes: int, device: torch.device, stream: FakeStream) -> torch.Tensor:
        self.log.append(("empty", stream.name))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def host_wait(self, event: FakeEvent) -> None:
        event.synchronize()

    def record_event(self, stream: FakeStream) -> FakeEvent:
        event = FakeEvent(self, max(stream.ready, self.now), -1)
        self.log.append(("record_event", stream.name, event))
        return event

    def wait_stream(self, waiter: FakeStream, stream: FakeStream) -> None:
        self.log.append(("wait_stream", waiter.name, stream.name))
        waiter.ready = max(waiter.ready, stream.ready)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(("wait_event", stream.name, event))
        stream.ready = max(stream.ready, event.time)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream, to_host: bool) -> FakeEvent:
        dst.copy_(src)
        nbytes = dst.numel() * dst.element_size()
        start = max(stream.ready, self.now)
        stream.ready = start + nbytes / (self.d2h_bytes_per_s if to_host else self.h2d_bytes_per_s)
        self.copies.append(Copy(to_host, nbytes, start, stream.ready, src.data_ptr(), dst.data_ptr()))
        event = FakeEvent(self, stream.ready, len(self.copies) - 1)
        self.log.append(("copy", "d2h" if to_host else "h2d", stream.name, event))
        return event

    def done(self, event: FakeEvent) -> bool:
        return event.query()

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name, tensor.data_ptr()))

    def run(self, seconds: float) -> None:
        """Queue ``seconds`` of compute on the compute stream."""
        self.compute.ready = max(self.compute.ready, self.now) + seconds

    def advance(self, seconds: float | None = None) -> None:
        """Move the host clock by ``seconds``, or to when every stream is idle."""
        idle = max(self.now, self.compute.ready, self.side.ready, self.back.ready)
        self.now = self.now + seconds if seconds is not None else idle

    def calls(self, name: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] == name]


class TorchStyleModule:
    """Looks like ``torch.cuda`` to :class:`remat.policies.hostcopy.TorchDevice` (``Stream``, ``current_stream``,
    ``stream()``, streams' ``wait_stream``/``wait_event``/``record_event``, events' ``query``), logging each call.
    Its events have completed at once; ``synchronize`` (a host wait) is logged."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.default = _TorchStyleStream(self, "default")
        self._current = self.default
        self.created = 0

    def Stream(self, device: torch.device | None = None) -> _TorchStyleStream:  # noqa: N802 - torch's name
        self.created += 1
        return _TorchStyleStream(self, f"side{self.created}")

    def current_stream(self, device: torch.device | None = None) -> _TorchStyleStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: _TorchStyleStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self._current = previous
            self.log.append(("exit", stream.name))


@dataclass(eq=False)
class _TorchStyleEvent:
    module: TorchStyleModule
    stream: str

    def query(self) -> bool:
        self.module.log.append(("query", self.stream))
        return True

    def synchronize(self) -> None:
        self.module.log.append(("host waits", self.stream))


@dataclass(eq=False)
class _TorchStyleStream:
    module: TorchStyleModule
    name: str

    def wait_stream(self, other: _TorchStyleStream) -> None:
        self.module.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _TorchStyleEvent) -> None:
        self.module.log.append(("wait_event", self.name, event.stream))

    def record_event(self) -> _TorchStyleEvent:
        self.module.log.append(("record_event", self.name, self.module.current_stream().name))
        return _TorchStyleEvent(self.module, self.name)

    def synchronize(self) -> None:
        self.module.log.append(("host waits", self.name))
