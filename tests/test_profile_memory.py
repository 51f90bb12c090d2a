"""Profiling holds nothing after it returns: profile + plan in a loop keeps memory flat."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import remat
from remat.models import GPT, GPTConfig, synthetic_batch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


class _Storages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.refs:
                    self.refs[id(storage)] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        """Bytes of the tracked storages still alive, those in ``exclude`` (by id) left out."""
        gc.collect()
        return sum(nbytes for ref, nbytes in self.refs.values()
                   if (storage := ref()) is not None and id(storage) not in exclude)


@pytest.mark.parametrize("device", DEVICES)
def test_profile_and_plan_in_a_loop_hold_nothing(device):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=32, vocab_size=64)
    model = GPT(cfg).to(device)
    tokens, targets = synthetic_batch(cfg, 2, device=device)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # Views and detached aliases of the weights share their storages, which live on with the model.
    own = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    left, allocated = [], []
    for _ in range(4):
        storages = _Storages()
        with storages:
            prof = remat.profile(model, tokens, loss_fn=loss_fn, repeats=1)  # with the op graphs
            prof.plan(0.9)
        del prof
        left.append(storages.alive_bytes(own))
        if device == "cuda":
            allocated.append(torch.cuda.memory_allocated())
    # The first call may fill process-wide caches; no later one leaves anything it made alive.
    assert left[1:] == [0, 0, 0], f"bytes left alive by each call: {left}"
    assert len(set(allocated[1:])) <= 1, f"CUDA bytes allocated after each call: {allocated}"
