"""The copy engine behind every offload: device → host in forward, host → device in backward.

One :class:`HostCopies` per device type serves ``remat.offload``, ``offload_wrapper``,
``remat.save_on_cpu`` and a policy's CPU_OFFLOAD alike:

* **A side stream each way, ordered by events.** A copy out waits (on the device) for the compute stream to
  reach the point where the tensor was saved, runs on the outbound stream, and the source is marked as used by
  that stream (``record_stream``) so the allocator cannot hand its memory out before the copy has read it.  A
  copy back waits only for that tensor's copy out, runs on the inbound stream into memory allocated there, and
  the compute stream waits on its event before the tensor is used (which marks the memory as used by the
  compute stream).  Copies out and back share no queue, so backward's copies back never wait behind forward's
  last copies out, and the link's two directions run at once.
* **Bounded copies in flight.** Forward makes activations faster than a host link moves them (an H100 layer
  computes in ~2 ms what takes ~14 ms to copy); the memory of a tensor being copied cannot be reused until the
  allocator sees its copy complete, so a forward far ahead of its copies holds them all.  Once more than
  ``in_flight_limit`` bytes are being copied out, the host waits for the oldest copy (an event, not a device
  synchronize): the device keeps computing what was queued, and the step's peak stays the kept tensors plus
  that window.  Backward is bounded alike: the host runs ahead of the device there too, and each fetch would
  otherwise bring a tensor back long before the compute stream gets to it; once more than the limit was
  brought back beyond where the compute stream is known to be, the host waits for the compute stream to reach
  the oldest fetch.  Otherwise nothing on these paths waits on the host (once the pool holds a step's blocks:
  allocating pinned memory itself can stall the device, so the first step pays for it).
* **A pinned pool** (:class:`~remat.policies.hostpool.HostPool`) reused across steps, by size class; a block
  returns to it with its last copy's event and is reused only once that event has completed, asked lazily.
* **Prefetch in backward order**: fetching the tensor saved n-th starts the copies back of the live tensors
  saved just before it, which backward needs next.
* **No round trip for what is still in the window**: a saved-tensor hook's tensor (laid out as it would come
  back) stays held while its copy out is in the window (its memory could not be reused before the copy has
  read it anyway; a later save lets go of the copies it finds complete), and a fetch serves a held tensor as
  it is.  Backward's first fetches are forward's last saves (a loss's logits, ~1 GiB on a Llama): they wait
  for no copy out and use no copy back.
* **Layouts kept**: a tensor comes back with its exact sizes, strides and alignment, so backward runs the same
  kernels as without offload and gradients are bitwise equal.  The storage span a tensor covers is copied as
  is (dense tensors, broadcasts, small gaps); a tensor that covers much more storage than it has elements
  comes back contiguous.
* **Invisible to dispatch modes**: the engine's own ops run with Python dispatch off and grad mode off, so a
  selective policy's modes, a debug trace or a memory tracker never see them as the region's ops.

The device is reached through a *device model* (streams, events, copies; :mod:`.devicemodels`):
:class:`TorchDevice` wraps a torch device module (``torch.cuda``, ``torch.xpu``), :class:`HostDevice` copies
synchronously (the CPU, where nothing needs moving, and accelerators without streams).
:func:`use_device_model` installs another, e.g. a fake device with simulated streams for tests.

Example:
    >>> engine = engine_for("cuda")
    >>> handle = engine.stash(activation)  # forward: copy out on the side stream
    >>> again = engine.fetch(handle, prefetch=2)  # backward: same values, strides and alignment
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .devicemodels import HostDevice, TorchDevice, default_model
from .hostpool import HostPool

__all__ = ["HostCopies", "HostDevice", "SharedView", "Stashed", "TorchDevice", "engine_for", "use_device_model"]

_ALIGN = 512  # the CUDA caching allocator's block alignment: kernels may pick their path by pointer alignment
_IN_FLIGHT_LIMIT = 256 << 20  # ~5 ms of copying at 50 GB/s: enough to keep the link busy
_python_dispatch_off = torch._C._DisableTorchDispatch


class _Layout:
    """How a tensor sits in its storage: what a copy must reproduce."""

    __slots__ = ("size", "stride", "span", "exact", "pad", "dtype", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.dtype = t.shape, t.dtype
        numel, item = t.numel(), t.element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        # Dense tensors, broadcasts and small gaps travel as the storage span they cover, so they come back
        # with their strides; a thin slice of a large storage comes back contiguous instead.
        self.exact = span <= 2 * numel
        self.stride = t.stride() if self.exact else None
        self.span = span if self.exact else numel
        self.pad = t.storage_offset() * item % _ALIGN if self.exact else 0
        self.nbytes = self.span * item

    def copy_out(self, t: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Destination and source of a copy out into ``flat``: the storage span the tensor covers, or the
        tensor itself into a contiguous layout."""
        if self.exact:
            return flat, t.as_strided((self.span,), (1,))
        return flat.view(self.size), t

    def place(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor laid out in ``flat`` (``span`` elements) as the original was."""
        return flat.as_strided(self.size, self.stride) if self.exact else flat.view(self.size)


def _movable(t: torch.Tensor) -> bool:
    # Subclasses (and fake or functional tensors) must keep their own dispatch; sparse and quantized
    # tensors have no flat storage to copy.
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized
            and not t._is_zerotensor() and t.numel() > 0 and _ALIGN % t.element_size() == 0)


class Stashed:
    """A tensor moved to host memory: its block, layout and device, and the state of its copy back.

    When it dies (its graph was freed, or it was served for the last time) its block returns to the pool
    with the last event that used it; nothing waits.
    """

    __slots__ = ("engine", "block", "pool", "layout", "device", "order", "event", "on_device", "source", "version",
                 "users", "fetches", "back_version", "in_flight", "ahead", "__weakref__")

    def __init__(self, engine: HostCopies, block: torch.Tensor, pool: HostPool, layout: _Layout,
                 device: torch.device, order: int, event: Any, source: weakref.ref | None, version: int) -> None:
        self.engine = engine  # the engine that copies it back
        self.block = block
        self.pool = pool
        self.layout = layout
        self.device = device
        self.order = order
        self.event = event  # the last copy that used the block: out, then back
        self.on_device: torch.Tensor | None = None  # the span brought back, flat (a prefetch starts it early)
        # weak, to the tensor that owns the storage (the base of a view): tells an in-place change after the copy
        # (as autograd would), and which later saves may share this copy
        self.source = source
        self.version = version
        self.users = 1  # saves of these bytes it serves (a layer's input saved by each projection)
        self.fetches = 0
        self.back_version = 0  # the device copy's version when it came back
        # the tensor itself (its storage span, where the layout is exact) while its copy out is in the window:
        # a fetch then serves it as it is, with no copy back
        self.in_flight: torch.Tensor | None = None
        self.ahead: int | None = None  # a plan's: its copy back starts once a fetch is within these bytes of it

    def __del__(self) -> None:
        if self.block is not None:
            self.pool.give_back(self.block, self.event)
            self.block = None


class SharedView:
    """A saved tensor served by an earlier save's copy of the same bytes, laid out its own way."""

    __slots__ = ("stashed", "layout")

    def __init__(self, stashed: Stashed, layout: _Layout) -> None:
        self.stashed = stashed
        self.layout = layout

    @property
    def engine(self) -> HostCopies:
        return self.stashed.engine


class _Window:
    """Bytes in flight behind device events, oldest first: what the host waits for once over a limit.

    ``bounded``: the bytes of entries added under a finite limit, those a limit counts; a plan's scheduled copies
    (limit ``math.inf``) are bounded by its drains instead, so they do not make other copies wait.
    """

    def __init__(self) -> None:
        self.entries: deque[tuple[Any, int, weakref.ref | None, bool]] = deque()
        self.nbytes = 0
        self.bounded = 0

    def let_go(self, done: Any) -> None:
        """Drop the entries whose events have completed, oldest first, and what their handles hold."""
        while self.entries and done(self.entries[0][0]):
            self._pop()

    def _pop(self) -> Any:
        """Drop the oldest entry (its handle lets go of the tensor it holds: the allocator frees the memory once
        the copy has read it); its event."""
        event, size, ref, bounded = self.entries.popleft()
        self.nbytes -= size
        self.bounded -= size if bounded else 0
        held = ref() if ref is not None else None
        if held is not None:
            held.in_flight = None
        return event

    def trim(self, nbytes: int, done: Any) -> Any:
        """Drop the entries whose events have completed, then the oldest others until at most ``nbytes`` remain; the
        event the host must wait for (or None)."""
        self.let_go(done)
        late = None
        while self.entries and self.nbytes > nbytes:
            late = self._pop()
        return late

    def add(self, event: Any, nbytes: int, limit: float, done: Any, handle: Stashed | None = None) -> Any:
        """Count ``nbytes`` behind ``event``; the event the host must wait for to be within ``limit`` (or None).

        Events complete in the order they were added (one stream), so waiting for the newest one over the
        limit is enough; entries whose events have completed leave without a wait.  A stashed ``handle``
        holds its device tensor while its entry is here.  Under ``limit=math.inf`` the entry waits for nothing
        and is not counted against other entries' limits.
        """
        bounded = limit != math.inf
        self.entries.append((event, nbytes, weakref.ref(handle) if handle is not None else None, bounded))
        self.nbytes += nbytes
        self.bounded += nbytes if bounded else 0
        late = None
        while len(self.entries) > 1:  # never the entry just added: a tensor over the limit alone must not wait
            over = self.bounded > limit
            if not over and not done(self.entries[0][0]):
                break
            oldest = self._pop()
            if over:
                late = oldest
        return late


class HostCopies:
    """Moves tensors of one device type to host memory and back; see the module docstring."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.moves = model.separate_memory
        self._pools = {pinned: HostPool(pinned, model.done) for pinned in (True, False)}
        self._lock = threading.Lock()
        self._order = 0
        self._unfetched: dict[int, weakref.ref[Stashed]] = {}  # by save order, for prefetch
        self._by_span: weakref.WeakValueDictionary[tuple, Stashed] = weakref.WeakValueDictionary()
        self._sweep_at = 64
        self._farthest = 0  # the longest prefetch reach a stashed tensor has asked for
        self.in_flight_limit = _IN_FLIGHT_LIMIT
        # Per device (events of one device's stream complete in order; two devices' do not):
        self._out: dict[torch.device, _Window] = {}  # copies out, behind their events
        self._back: dict[torch.device, _Window] = {}  # brought back, behind the compute stream's arrival at a fetch
        self._brought_back: dict[torch.device, int] = {}  # bytes of copies back started since the last fetch

    def __deepcopy__(self, memo: dict) -> HostCopies:
        """The engine itself: a copied model's offloaders (``copy.deepcopy(model)``, an EMA copy) share their device
        type's engine, its streams and pools, as every offloader does.

        Example:
            >>> copy.deepcopy(engine_for("cuda")) is engine_for("cuda")
            True
        """
        return self

    def pool(self, pinned: bool = True) -> HostPool:
        """The pool of pinned (or pageable) host blocks."""
        return self._pools[pinned and self.model.can_pin]

    def stash(self, tensor: torch.Tensor, pinned: bool = True, check_version: bool = False,
              hold_in_flight: bool = False, limit: float | None = None, ahead: int | None = None
              ) -> Stashed | None:
        """Start copying ``tensor`` to host memory; None if it cannot be moved (subclass, sparse, empty).

        ``check_version=True`` makes :meth:`fetch` raise if the tensor is changed in place afterwards
        (saved-tensor hooks: autograd's own check does not run on hooked tensors).  It also lets a later save
        of the same bytes, unchanged, share this copy (:meth:`_saved_before`): they travel once each way, and
        the copy back stays on the device until each save has been fetched.

        ``hold_in_flight=True`` keeps the tensor while its copy out is in the window (the allocator could not
        reuse its memory before the copy has read it anyway).  An entry leaves the window when a later save
        finds its copy complete, so forward's last saves stay on the device into backward, whose first fetches
        they are (a loss's logits): a fetch serves a held tensor as it is, without a round trip over the link.

        ``limit``: the bytes in flight past which the host waits for the oldest copies (default
        ``in_flight_limit``); ``math.inf`` for a plan's copies, bounded at block starts instead (:meth:`drain`).
        ``ahead``: a plan's prefetch reach for this tensor: any fetch within that many bytes of it (counted over the
        live tensors saved after it) starts its copy back, whatever that fetch's own prefetch.
        """
        if not _movable(tensor):
            return None
        layout = _Layout(tensor)
        owner = tensor._base if tensor._base is not None else tensor
        if check_version:
            again = self._saved_before(tensor, owner, layout)
            if again is not None:
                return again
        model = self.model
        with _python_dispatch_off(), torch.no_grad():
            with self._lock:
                pool = self.pool(pinned)
                block = pool.take(layout.nbytes)
                self._order += 1
                order = self._order
            side = model.side_stream(tensor.device, to_host=True)
            # The side stream must see the producer's writes before it reads.
            model.wait_stream(side, model.current_stream(tensor.device))
            # from a detached alias: a held source viewing the tensor itself would hold its grad_fn, and through
            # autograd's graph the handle holding it (a cycle no collection frees, where backward never comes)
            dst, src = layout.copy_out(tensor.detach(), block[: layout.nbytes].view(layout.dtype))
            event = model.copy(dst, src, side, True)
            model.record_stream(tensor, side)
            # Only where the tensor comes back laid out as it left: a fetch must not see another layout
            # depending on whether the copy had completed.
            held = src if hold_in_flight and model.asynchronous and layout.exact else None
        source = weakref.ref(owner) if check_version else None
        handle = Stashed(self, block, pool, layout, tensor.device, order, event, source, tensor._version)
        if check_version and layout.exact and not (tensor.is_conj() or tensor.is_neg()):
            with self._lock:
                self._by_span[_span_key(tensor, layout)] = handle
        if model.asynchronous:
            handle.in_flight = held
            handle.ahead = ahead
            with self._lock:
                self._farthest = max(self._farthest, ahead or 0)
                self._unfetched[order] = weakref.ref(handle)
                if len(self._unfetched) >= self._sweep_at:
                    self._sweep()
                window = self._out.setdefault(tensor.device, _Window())
                late = window.add(event, layout.nbytes, self.in_flight_limit if limit is None else limit,
                                  model.done, handle if hold_in_flight else None)
            if late is not None:
                model.host_wait(late)
        return handle

    def _saved_before(self, tensor: torch.Tensor, owner: torch.Tensor, layout: _Layout
                      ) -> Stashed | SharedView | None:
        """An earlier save's copy holding this tensor's bytes: the same span of the same storage, whose owner
        (the base of the views) is the very object the earlier save had and is unchanged since.

        A layer's input is saved by each projection, each time as a view of its own; all share one copy.  The
        owner being alive is what proves the address still names that storage (a freed one's may be reused).
        """
        if not layout.exact or tensor.is_conj() or tensor.is_neg():  # a lazy conj/neg view: other values
            return None
        with self._lock:
            handle = self._by_span.get(_span_key(tensor, layout))
            if (handle is None or handle.block is None or handle.fetches or handle.source is None
                    or handle.source() is not owner or handle.version != tensor._version):
                return None
            handle.users += 1
        if (layout.size, layout.stride) == (handle.layout.size, handle.layout.stride):
            return handle
        return SharedView(handle, layout)

    def fetch(self, handle: Stashed | SharedView, prefetch: int = 0, prefetch_bytes: int | None = None
              ) -> torch.Tensor:
        """``handle``'s tensor back on its device, usable on the current stream; starts the copies back of the
        ``prefetch`` live tensors stashed just before it (backward needs them next), or with ``prefetch_bytes``
        of as many of them as fit in that many bytes (those already on their way back count)."""
        layout = handle.layout
        if type(handle) is SharedView:
            handle = handle.stashed
        _check_unchanged(handle)
        with self._lock:
            self._unfetched.pop(handle.order, None)
            prefetching = self.model.asynchronous and (prefetch_bytes is not None or prefetch or self._farthest)
            upcoming = self._preceding(handle.order, prefetch, prefetch_bytes) if prefetching else []
            held = handle.in_flight
        if held is None:
            if handle.on_device is not None and handle.on_device._version != handle.back_version:
                handle.on_device = None  # an earlier user wrote into the shared copy: the host block is intact
            if handle.on_device is None:
                self._copy_back(handle)
        for later in upcoming:
            self._copy_back(later)
        if held is not None:
            return self._serve_held(handle, layout, held)
        current = self.model.current_stream(handle.device)
        self.model.wait_event(current, handle.event)
        flat = handle.on_device
        with self._lock:
            handle.fetches += 1
            last = handle.fetches % handle.users == 0
        if last:
            handle.on_device = None  # its last save has it: a second backward copies again
        elif handle.fetches == 1:
            _release_when_backward_ends(handle)
        with _python_dispatch_off(), torch.no_grad():
            tensor = layout.place(flat)
            self.model.record_stream(flat, current)  # allocated on the inbound stream, used on this one
        if self.model.asynchronous:
            arrival = self.model.record_event(current)  # the compute stream gets to this tensor's use
            with self._lock:
                brought = self._brought_back.pop(handle.device, 0)
                window = self._back.setdefault(handle.device, _Window())
                late = window.add(arrival, brought, max(self.in_flight_limit, prefetch_bytes or 0), self.model.done)
            if late is not None:
                self.model.host_wait(late)
        return tensor

    def _serve_held(self, handle: Stashed, layout: _Layout, held: torch.Tensor) -> torch.Tensor:
        """``handle``'s tensor from the device memory it was saved in, as plain autograd would give it: a save
        that writes into it in backward is seen by the others (autograd's version check then refuses them)."""
        with self._lock:
            handle.fetches += 1
            last = handle.fetches % handle.users == 0
        if last:
            handle.in_flight = None  # every save has it (a second backward copies back)
        elif handle.fetches == 1:
            _release_when_backward_ends(handle)
        with _python_dispatch_off(), torch.no_grad():
            return layout.place(held)

    def prefetch(self, handles: Iterable[Stashed]) -> None:
        """Start copying ``handles`` back now, in this order (only where copies run asynchronously)."""
        if not self.model.asynchronous:
            return
        for handle in handles:
            if handle.on_device is None and handle.in_flight is None and handle.block is not None:
                self._copy_back(handle)

    def fence(self, handles: Iterable[Stashed]) -> None:
        """Make the current stream wait (on the device) until the copies out of ``handles`` have completed."""
        last: dict[torch.device, Stashed] = {}
        for handle in handles:
            if handle.device not in last or handle.order > last[handle.device].order:
                last[handle.device] = handle
        for device, handle in last.items():  # copies out of one device complete in order on its side stream
            self.model.wait_event(self.model.current_stream(device), handle.event)

    def release_held(self) -> None:
        """Let go of the tensors saved-tensor hooks hold whose copies out have completed; later fetches bring
        them back over the link.

        The window lets go of them at the next save anyway; call this where backward does not follow forward
        at once (an evaluation in between), to give their device memory back now.

        Example:
            >>> engine_for("cuda").release_held()
        """
        with self._lock:
            for window in self._out.values():
                window.let_go(self.model.done)

    def drain(self, nbytes: int = 0) -> None:
        """Let go of the copies out that have completed, and wait (the host, on events) for the oldest others
        until at most ``nbytes`` are in flight: what a plan's copies may hold on the device where a block starts or
        ends.

        Example:
            >>> engine_for("cuda").drain(0)  # before the loss: every copy out complete, nothing held
        """
        for window in list(self._out.values()):
            with self._lock:
                late = window.trim(nbytes, self.model.done)
            if late is not None:
                self.model.host_wait(late)

    def collect(self) -> None:
        """Put back in the pools the blocks whose copies have completed (never waits)."""
        with self._lock:
            for pool in self._pools.values():
                pool.collect()

    @property
    def live(self) -> int:
        """Stashed tensors alive and not yet fetched (tracked where copies run asynchronously)."""
        with self._lock:
            return sum(ref() is not None for ref in self._unfetched.values())

    def _copy_back(self, handle: Stashed) -> None:
        layout, model = handle.layout, self.model
        with _python_dispatch_off(), torch.no_grad():
            # Allocated on the inbound stream and written there after the tensor's copy out: it waits for
            # nothing the compute stream does (its memory was last used on this stream, in order).
            inbound = model.side_stream(handle.device, to_host=False)
            raw = model.empty(layout.pad + layout.nbytes, handle.device, inbound)
            model.wait_event(inbound, handle.event)
            flat = raw[layout.pad:].view(layout.dtype)
            handle.event = model.copy(flat, handle.block[: layout.nbytes].view(layout.dtype), inbound, False)
            handle.on_device, handle.back_version = flat, flat._version
        with self._lock:
            self._brought_back[handle.device] = self._brought_back.get(handle.device, 0) + layout.nbytes

    def _preceding(self, order: int, count: int, nbytes: int | None = None) -> list[Stashed]:
        """The live tensors stashed before ``order`` whose copies back a fetch of it starts: of the ``count`` just
        before it (with ``nbytes``: as many as fit in those bytes), and of any further back whose own ``ahead``
        reaches it, those not on their way back yet.

        Those already brought back count: each fetch keeps ``count`` tensors ahead, rather than adding
        ``count`` more (which ran the copies back ever further ahead, holding a tensor more per fetch).
        """
        # Save order is insertion order; in backward the newest unfetched entries are the ones needed next.
        found: list[Stashed] = []
        dead: list[int] = []
        seen = reach = 0
        farthest = max(nbytes or 0, self._farthest)
        for key, ref in reversed(self._unfetched.items()):
            if key >= order:
                continue
            handle = ref()
            if handle is None:
                dead.append(key)
                continue
            reach += handle.layout.nbytes
            limit = handle.ahead if handle.ahead is not None else nbytes
            wanted = reach <= limit if limit is not None else seen < count
            if wanted and handle.on_device is None and handle.in_flight is None:
                found.append(handle)
            seen += handle.ahead is None
            if (nbytes is not None or seen >= count) and reach > farthest:
                break
        for key in dead:
            del self._unfetched[key]
        return found

    def _sweep(self) -> None:
        for key in [k for k, ref in self._unfetched.items() if ref() is None]:
            del self._unfetched[key]
        self._sweep_at = max(64, 2 * len(self._unfetched))


def _release_when_backward_ends(handle: Stashed) -> None:
    """A copy shared by several saves is held until each has fetched it; one that is never fetched (a save
    backward does not reach) must not hold it past this backward."""
    if torch._C._current_graph_task_id() == -1:
        return  # fetched outside a backward (by hand): the caller owns the lifetime

    def release() -> None:
        handle.on_device = handle.in_flight = None
        handle.fetches = 0

    torch.autograd.Variable._execution_engine.queue_callback(release)


def _span_key(tensor: torch.Tensor, layout: _Layout) -> tuple:
    item = tensor.element_size()
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset() * item, layout.nbytes,
            tensor.dtype)


def _check_unchanged(handle: Stashed) -> None:
    source = handle.source() if handle.source is not None else None
    if source is None and handle.source is not None:
        source = handle.in_flight  # the tensor is gone, its bytes held: an alias sharing its version counter
    if source is not None and source._version != handle.version:
        raise RuntimeError(
            "remat: a tensor saved for backward was modified in place after it was offloaded to host memory "
            f"(its version went from {handle.version} to {source._version}); plain autograd refuses this too. "
            "Clone the tensor before modifying it, or modify it before the operation that saves it."
        )


_engines: dict[str, HostCopies] = {}
_engines_lock = threading.Lock()


def engine_for(device_type: str) -> HostCopies | None:
    """The process's copy engine for tensors of ``device_type`` (created on first use); None for ``"meta"``.

    Example:
        >>> engine_for("cpu").moves  # CPU tensors are host memory already
        False
    """
    engine = _engines.get(device_type)
    if engine is None and device_type != "meta":
        with _engines_lock:
            engine = _engines.get(device_type)
            if engine is None:
                engine = _engines[device_type] = HostCopies(default_model(device_type))
    return engine


@contextlib.contextmanager
def use_device_model(device_type: str, model: Any) -> Iterator[HostCopies]:
    """Serve tensors of ``device_type`` with a fresh engine over ``model`` while the block runs.

    ``model`` provides what :class:`TorchDevice` does (streams, events, copies).  Offloaders created inside
    the block keep the engine they were created with.

    Example:
        >>> with use_device_model("cpu", FakeDevice()) as engine:  # CPU tensors copied as if on a GPU
        ...     loss = remat.checkpoint(block, x, policy=offload_matmuls)
    """
    engine = HostCopies(model)
    with _engines_lock:
        previous = _engines.get(device_type)
        _engines[device_type] = engine
    try:
        yield engine
    finally:
        with _engines_lock:
            if previous is None:
                _engines.pop(device_type, None)
            else:
                _engines[device_type] = previous
