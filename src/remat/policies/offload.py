"""Offload saved activations to host memory during forward; bring them back for backward.

Two saved-tensor hook contexts, both served by the device's copy engine (:mod:`.hostcopy`: copies on a side
stream ordered by events, a pinned pool reused across steps, prefetch in backward order, layouts kept so
gradients are bitwise those of plain autograd):

* :class:`save_on_cpu` — drop-in for ``torch.autograd.graph.save_on_cpu``: every saved accelerator tensor
  goes to host memory (tensors already on the CPU are kept as they are, not copied).
* :class:`offload` — the practical one: it leaves parameters, buffers and small tensors where they are and
  counts what it did in :attr:`offload.stats`.  With ``outputs_of`` it moves only the outputs of chosen op
  calls (an op overload and its call index within one entry of the context, as a
  :class:`~remat.planning.basics.blockpolicy.BlockPolicy` names them): a block runs as plain autograd and its
  largest saved tensors travel, the others stay.  The choice is made afresh on each entry, from that call's
  own ops: nothing of an earlier call decides which tensors of this one move.

Neither copies a tensor whose storage belongs to a leaf that requires grad — a parameter, an input, or a view
of one (a linear layer saves its weight's transpose): the leaf keeps that memory alive anyway, so the copy
would cost the link its bytes twice a step and free nothing (a Llama's weights are a sixth of what it saves).

On a machine without an accelerator nothing needs moving and both behave as plain autograd (the offloader
can be pointed at ``device_type="cpu"`` to exercise its bookkeeping: it then copies through host buffers).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..engine.replay import DefaultDeviceType
from .hostcopy import HostCopies, SharedView, Stashed, engine_for
from .hostpool import HostPool

__all__ = ["OffloadStats", "offload", "save_on_cpu"]

PREFETCH_DEPTH = 2  # tensors whose copies back a fetch keeps started ahead of it


def _owned_by_a_leaf(tensor: torch.Tensor) -> bool:
    """Whether a parameter (frozen ones too) or a leaf that requires grad (an input) owns the tensor's storage:
    moving it frees nothing."""
    owner = tensor._base if tensor._base is not None else tensor
    return owner.is_leaf and (owner.requires_grad or isinstance(owner, nn.Parameter))


class OffloadStats:
    """What an offloading context did: tensors and bytes moved to host, and those kept in place.

    ``shared_tensors`` / ``shared_bytes``: offloaded saves an earlier save's copy served (the same bytes saved
    again: they did not travel again), counted in ``offloaded_*`` too.

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
        self.shared_tensors = 0
        self.shared_bytes = 0

    def count(self, tensor: torch.Tensor, offloaded: bool) -> None:
        self.add(tensor.numel() * tensor.element_size(), offloaded)

    def add(self, nbytes: int, offloaded: bool) -> None:
        if offloaded:
            self.offloaded_tensors += 1
            self.offloaded_bytes += nbytes
        else:
            self.kept_tensors += 1
            self.kept_bytes += nbytes

    def __repr__(self) -> str:
        shared = f", {self.shared_tensors} / {self.shared_bytes} B of them shared" if self.shared_tensors else ""
        return (
            f"OffloadStats(offloaded={self.offloaded_tensors} tensors / {self.offloaded_bytes} B{shared}, "
            f"kept={self.kept_tensors} tensors / {self.kept_bytes} B)"
        )


_HANDLES = (Stashed, SharedView)


def _unpack(packed: Any) -> torch.Tensor:
    if type(packed) in _HANDLES:
        return packed.engine.fetch(packed, PREFETCH_DEPTH)
    if type(packed) is tuple:  # a tensor the engine cannot move (e.g. sparse): a plain host copy
        device, host = packed
        return host.to(device)
    return packed


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor a pack hook keeps on its device, packed detached: an op's output packed as itself would hold
    its own grad_fn, a cycle through autograd's graph that no collection frees, so a graph whose backward never runs
    (a forward alone, one that raised) would stay alive with all it saved.  Out of dispatch modes' sight, as the
    engine's own work is (a subclass keeps its own dispatch: packed as it is)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        return tensor
    with torch._C._DisableTorchDispatch():
        return tensor.detach()


class save_on_cpu(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 - drop-in name
    """Copy every saved accelerator tensor to host memory; copy it back in backward.

    ``pin_memory=True`` uses pinned host buffers, so the copies run on a side stream while the device computes.
    ``device_type`` is accepted for compatibility with torch's: each tensor's own device decides.

    Example:
        >>> with save_on_cpu(pin_memory=True):
        ...     loss = model(x).sum()
        >>> loss.backward()
    """

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        def pack(tensor: torch.Tensor) -> Any:
            engine = engine_for(tensor.device.type)
            if engine is None or not engine.moves or _owned_by_a_leaf(tensor):
                return _kept(tensor)
            handle = engine.stash(tensor, pinned=pin_memory, check_version=True, hold_in_flight=True)
            return handle if handle is not None else (tensor.device, tensor.to("cpu"))

        super().__init__(pack, _unpack)


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
        outputs_of: ``{op overload: call indices}``: offload only saved tensors whose storage one of these op
            calls made (counted from zero each time the context is entered, as a block's forward runs them),
            whatever their size; None (the default): every saved tensor of ``min_bytes`` or more.
        prefetch_bytes: prefetch by bytes instead: keep as many of the next tensors on their way back as fit
            in this many bytes (a block ahead, where a plan's timeline says backward has the room); its own
            tensors then start back once any fetch, of any offloader, comes within that many bytes of them.
        in_flight: bytes of copies out in flight past which forward waits for them (default: the engine's
            ``in_flight_limit``); ``math.inf`` where a plan bounds them at block starts (``HostCopies.drain``).

    Every offloader of a device type shares that type's copy engine and host pools, so buffers are reused
    from step to step and across offloaders.

    Example:
        >>> with remat.offload(min_bytes=1 << 20) as off:
        ...     loss = model(x).sum()
        >>> loss.backward()
        >>> off.stats.offloaded_bytes
        >>> with remat.offload(outputs_of={torch.ops.aten.mm.default: {1}}):  # the second mm's output only
        ...     loss = model(x).sum()
    """

    def __init__(
        self,
        min_bytes: int = 1 << 20,
        pin_memory: bool = True,
        prefetch: bool = True,
        *,
        prefetch_depth: int = PREFETCH_DEPTH,
        device_type: str | None = None,
        modules: Iterable[nn.Module] = (),
        outputs_of: Mapping[Any, Collection[int]] | None = None,
        prefetch_bytes: int | None = None,
        in_flight: float | None = None,
    ) -> None:
        self.min_bytes = min_bytes
        self.prefetch_bytes = prefetch_bytes if prefetch else None
        self.in_flight = in_flight
        self.device_type = device_type or DefaultDeviceType.get_device_type()
        self.engine: HostCopies | None = engine_for(self.device_type)
        self.pin_memory = pin_memory
        self.prefetch_depth = prefetch_depth if prefetch else 0
        self.stats = OffloadStats()
        self._skip = {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}
        self.outputs_of = None if outputs_of is None else {op: frozenset(calls) for op, calls in outputs_of.items()}
        self._markers: list[_MarkOutputs] = []  # one per entry: a block run inside its own forward counts apart
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> offload:
        super().__enter__()
        if self.outputs_of is not None:
            marker = _MarkOutputs(self.outputs_of)
            marker.__enter__()
            self._markers.append(marker)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.outputs_of is not None:
            self._markers.pop().__exit__(*exc)
        super().__exit__(*exc)

    @property
    def pool(self) -> HostPool | None:
        """The host buffers this offloader copies into (shared with the device type's other offloaders)."""
        return self.engine.pool(self.pin_memory) if self.engine is not None else None

    def _should_offload(self, tensor: torch.Tensor) -> bool:
        if self.engine is None or tensor.device.type != self.device_type:
            return False
        if self.outputs_of is not None:  # the chosen ops' outputs only (never a parameter or an input)
            return bool(self._markers) and tensor.untyped_storage() in self._markers[-1].made
        return (
            not _owned_by_a_leaf(tensor)
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            and tensor.untyped_storage().data_ptr() not in self._skip
        )

    def _pack(self, tensor: torch.Tensor) -> Any:
        handle = None
        if self._should_offload(tensor):
            handle = self.engine.stash(tensor, pinned=self.pin_memory, check_version=True, hold_in_flight=True,
                                       limit=self.in_flight, ahead=self.prefetch_bytes)
        self.stats.count(tensor, offloaded=handle is not None)
        if type(handle) is SharedView or (handle is not None and handle.users > 1):
            self.stats.shared_tensors += 1
            self.stats.shared_bytes += tensor.numel() * tensor.element_size()
        return _kept(tensor) if handle is None else handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) in _HANDLES:
            if self.prefetch_bytes is None:
                return self.engine.fetch(packed, self.prefetch_depth)
            return self.engine.fetch(packed, prefetch_bytes=self.prefetch_bytes)
        return packed


class _MarkOutputs(TorchDispatchMode):
    """Marks the storages that chosen op calls make, counting each op's calls from zero: what an offloader with
    ``outputs_of`` moves when autograd saves them (a view of one included)."""

    def __init__(self, outputs_of: Mapping[Any, frozenset[int]]) -> None:
        super().__init__()
        self.outputs_of = outputs_of
        self.counts = dict.fromkeys(outputs_of, 0)
        # weak: a storage freed before it was saved leaves, so a later one at its address is not taken for it
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        calls = self.outputs_of.get(func)
        if calls is not None:
            index = self.counts[func]
            self.counts[func] = index + 1
            if index in calls:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.made[t.untyped_storage()] = True
        return out
