"""What the offload tests share on any device: a model that saves tensors of every layout, the four ways to
offload, and the check that each tensor comes back laid out as it left."""

import torch
from torch import nn

import remat
from remat.policies import MATMUL_OPS, Policy
from remat.policies.decisions import CheckpointPolicy

OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD
offload_matmuls = Policy(op_rule=lambda op: OFFLOAD if op in MATMUL_OPS else None, name="offload matmuls")
offload_everything = Policy(op_rule=lambda op: OFFLOAD, name="offload everything")


class Layouts(nn.Module):
    """Saves activations of every layout: transposed, broadcast, with gaps, at an offset, and a thin slice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (8, 16)
        h = self.a(x)
        t = torch.mm(h.t(), h)  # saves h.t() (transposed) and h
        spread = torch.sin(t[:, ::2])  # a view with gaps
        shifted = torch.cos(t.view(-1)[3:])  # a view at an unaligned storage offset
        wide = h[:1].expand(8, 32) * h  # a broadcast (stride 0)
        thin = torch.sin(t[:, :1])  # covers most of t's storage: comes back contiguous
        flipped = torch.exp(torch.sin(h.t()))  # sin's output keeps its input's transposed layout
        return self.b(wide).sum() + spread.sum() + shifted.sum() + thin.sum() + flipped.sum()


def entry_points(device_type: str) -> dict:
    """The four ways to offload, each running ``model(x)`` and returning its output."""

    def run_offload(model, x):
        with remat.offload(min_bytes=0, device_type=device_type):
            return model(x)

    def run_save_on_cpu(model, x):
        with remat.save_on_cpu(pin_memory=True):
            return model(x)

    def run_wrapper(model, x):
        return remat.offload_wrapper(model, min_bytes=0, device_type=device_type)(x)

    def run_policy(model, x):
        return remat.checkpoint(model, x, policy=offload_everything)

    return {"offload": run_offload, "save_on_cpu": run_save_on_cpu, "offload_wrapper": run_wrapper,
            "policy": run_policy}


def record_layouts(engine) -> list:
    """Wrap ``engine``'s stash and fetch (on this instance) to pair each packed tensor's layout with the one it
    comes back with: ((shape, strides, address mod 64, kept exactly), (shape, strides, address mod 64))."""
    packed, pairs = {}, []
    stash, fetch = engine.stash, engine.fetch

    def recording_stash(tensor, *args, **kwargs):
        handle = stash(tensor, *args, **kwargs)
        if handle is not None:
            packed[id(handle)] = (tensor.shape, tensor.stride(), tensor.data_ptr() % 64, handle.layout.exact)
        return handle

    def recording_fetch(handle, *args, **kwargs):
        # one still in flight is served as it was saved: exactly its layout, whatever its kind
        in_flight = getattr(handle, "stashed", handle).in_flight is not None
        tensor = fetch(handle, *args, **kwargs)
        shape, stride, alignment, exact = packed[id(handle)]
        pairs.append(((shape, stride, alignment, exact or in_flight), (tensor.shape, tensor.stride(),
                                                                       tensor.data_ptr() % 64)))
        return tensor

    engine.stash, engine.fetch = recording_stash, recording_fetch
    return pairs


def check_layouts(pairs: list, every_kind: bool) -> None:
    """Every tensor came back with its strides and alignment (a thin slice: contiguous); with ``every_kind``,
    the transposed, broadcast, gapped, offset and thin cases of :class:`Layouts` all occurred."""
    assert pairs
    for (shape, stride, alignment, exact), (shape_back, stride_back, alignment_back) in pairs:
        assert shape == shape_back
        if exact:
            assert (stride, alignment) == (stride_back, alignment_back)
        else:
            assert stride_back == torch.empty(shape).stride()
    if every_kind:
        kinds = {(stride, alignment) for (shape, stride, alignment, exact), _ in pairs
                 if exact and (stride, alignment) != (torch.empty(shape).stride(), 0)}
        assert len(kinds) >= 4  # transposed, broadcast, with gaps, at an offset
        assert any(not exact for (*_, exact), _ in pairs)
