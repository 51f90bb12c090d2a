"""Op-level policies on real models from transformers (tiny configs, random weights).

A few models run by default; the whole zoo runs with ``REMAT_ZOO=all python -m pytest tests/test_opzoo.py``.
For every model :func:`remat.profile_ops` records the blocks discovery finds, blocks share a graph only
when they run the same ops, and three points of every block's front installed on every block at once —
the checkpoint end, the middle point and the point nearest 75% of what autograd keeps — give gradients and
buffers (BatchNorm statistics) bitwise equal to the plain model's, keep exactly the bytes the graph
predicts, and put MemTracker's whole-step peak between checkpointing every block and the plain model.
"""

import copy
import gc

import pytest
import torch
import zoo
from helpers import assert_bitwise
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

import remat
from remat.planning.basics.blockpolicy import BlockPolicy, apply_block_policies, remove_block_policies
from remat.planning.basics.discovery import candidate_modules
from remat.planning.choices.fronts import block_front, policy_for
from remat.planning.measure.overheads import Overheads
from remat.policies.decisions import SAC_IGNORED_OPS

# By default a decoder and a convnet with batch norm: the encoder-decoder's front takes a minute here, and
# tests/test_zoo.py plans it.
MODELS = zoo.model_params(fast=("llama", "mobilenet_v2"))
POINTS = ("checkpoint end", "middle", "near 75%")
_FIXED = Overheads(region=2e-5, per_saved=1e-6, policy_forward=1e-6, policy_replay=5e-7, copy_per_byte=4e-10)
IGNORED = {str(op) for op in SAC_IGNORED_OPS}

_cache: dict[str, tuple] = {}


def _case_and_profile(name):
    """Build each model and profile its ops once per test session.

    Op times from a roofline and fixed machinery costs: which points of a front these tests install must not
    depend on how fast this machine ran a profile (measured times once picked a "middle" point whose
    recomputation took llama's peak above plain's on one machine).
    """
    if name not in _cache:
        case = zoo.BUILDERS[name]()
        prof = remat.profile_ops(case.model, *case.args, timing="estimate", overheads=_FIXED, **case.kwargs)
        _cache[name] = case, prof
    return _cache[name]


def _points(graph):
    front = block_front(graph)
    near = min(front, key=lambda p: abs(p.kept_bytes - 0.75 * graph.keep_all_bytes))
    return dict(zip(POINTS, (front[0], front[len(front) // 2], near)))


def _policies(prof, label):
    return {name: policy_for(graph, _points(graph)[label]) for name, graph in prof.blocks.items()}


class _Made(TorchDispatchMode):
    """Every storage the ops under it create (weakly), and the ops' names in order."""

    def __init__(self) -> None:
        super().__init__()
        self.storages = WeakIdKeyDictionary()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.storages.setdefault(t.untyped_storage(), t.untyped_storage().nbytes())
        return out


def _block_inputs(case, names):
    """Each block's inputs at its first call in a forward with grad (detached, requires_grad kept)."""
    found = {}

    def grab(name):
        def hook(module, args, kwargs):
            found.setdefault(name, tree_map(
                lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
                (args, kwargs)))
        return hook

    handles = [case.model.get_submodule(n).register_forward_pre_hook(grab(n), with_kwargs=True) for n in names]
    try:
        torch.manual_seed(7)
        case.loss()
    finally:
        for handle in handles:
            handle.remove()
    return found


def _held(module, block, inputs):
    """Bytes the block's forward leaves held by its graph (saved or kept), and the ops it ran.

    The outputs themselves are dropped (their ``grad_fn`` kept), so a returned storage counts only if the
    graph holds it; storages that existed before (inputs, parameters, buffers) never count.
    """
    args, kwargs = inputs
    made = _Made()
    with made:
        torch.manual_seed(0)
        out = module(*args, **kwargs)
    graph = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    del out
    gc.collect()
    before = {id(t.untyped_storage()) for t in [*tree_flatten(inputs)[0], *block.parameters(), *block.buffers()]
              if isinstance(t, torch.Tensor)}
    held = sum(n for s, n in made.storages.items() if id(s) not in before)
    del graph
    return held, made.ops


def _step(case, model):
    """Loss, gradients and buffers after one step of ``model`` from a fixed seed (dropout masks included)."""
    case.model = model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = case.loss()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("name", MODELS)
def test_blocks_are_discoverys_and_share_a_graph_only_when_they_run_the_same_ops(name):
    case, prof = _case_and_profile(name)
    assert list(prof.blocks) == [n for n, _ in candidate_modules(case.model)]
    inputs = _block_inputs(case, list(prof.blocks))
    for block_name, graph in prof.blocks.items():
        block = case.model.get_submodule(block_name)
        _, ops = _held(block, block, inputs[block_name])
        # detach calls depend on how autograd saves (the profile runs under saved-tensor hooks): not compared
        assert [op for op in ops if op not in IGNORED] == [n.op for n in graph.nodes if n.kind != "ignored"]
    by_signature = {}
    for graph in prof.blocks.values():
        assert by_signature.setdefault(graph.signature, graph) is graph
    if name == "t5":  # the first block of each stack computes the position bias the others receive
        assert len(prof.distinct) == 4
        assert prof.blocks["encoder.block.0"] is not prof.blocks["encoder.block.1"]
        assert prof.blocks["encoder.block.1"] is prof.blocks["encoder.block.2"]


@pytest.mark.parametrize("name", MODELS)
def test_front_points_keep_exactly_the_predicted_bytes(name):
    case, prof = _case_and_profile(name)
    first = {}  # blocks sharing a graph are alike: measure the first of each
    for block_name, graph in prof.blocks.items():
        first.setdefault(id(graph), (block_name, graph))
    inputs = _block_inputs(case, [n for n, _ in first.values()])
    for block_name, graph in first.values():
        block = case.model.get_submodule(block_name)
        assert _held(block, block, inputs[block_name])[0] == graph.keep_all_bytes - graph.input_saved_bytes
        for label, point in _points(graph).items():
            wrapped = policy_for(graph, point).wrap(block)
            expected = point.kept_bytes - point.input_bytes if point.mode != "keep" else (
                graph.keep_all_bytes - graph.input_saved_bytes)
            assert _held(wrapped, block, inputs[block_name])[0] == expected, (block_name, label, point)


@pytest.mark.parametrize("name", MODELS)
def test_front_points_match_the_plain_model_bitwise_and_the_middle_peaks_in_between(name):
    case, prof = _case_and_profile(name)
    plain = case.model
    assert plain.training
    start = copy.deepcopy(plain)
    reference = _step(case, copy.deepcopy(start))
    case.model = plain
    peaks = {"plain": zoo.peak_above_params(case)}
    checkpoint_all = {n: BlockPolicy("checkpoint") for n in prof.blocks}
    for label, policies in (("checkpoint all", checkpoint_all), *((p, _policies(prof, p)) for p in POINTS)):
        model = copy.deepcopy(start)
        apply_block_policies(model, policies)
        loss, grads, buffers = _step(case, model)
        assert torch.equal(loss, reference[0]), label
        assert_bitwise(grads, reference[1])
        assert_bitwise(buffers, reference[2])  # BatchNorm statistics updated once, not again in recomputation
        remove_block_policies(model, list(policies))
        apply_block_policies(plain, policies)
        case.model = plain
        try:
            peaks[label] = zoo.peak_above_params(case)
        finally:
            remove_block_policies(plain, list(policies))
    assert peaks["checkpoint all"] == peaks["checkpoint end"]
    assert peaks["checkpoint all"] <= peaks["middle"] <= peaks["plain"], peaks
