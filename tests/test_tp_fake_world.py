"""Plans on a tensor-parallel model in a fake world of two ranks, in one process: an ``nn.Sequential`` of MLP blocks
(column-wise up projection, row-wise down projection, dropout after its all-reduce, so a recomputation reaches it),
planned with segments, the point that keeps what crossed the wire, ``save_matmuls`` and the kept outputs of
collectives, each plan's measured peak its prediction.  The fake process group's collectives complete in line (no
thread holds their buffers), so a step's bytes are deterministic here."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.planning.choices.chain import chain_options
from remat.planning.choices.options import selective_option
from remat.planning.measure.prices import wire_nodes
from remat.planning.solve.solver import plan_of

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WIDTH, HIDDEN, BLOCKS = 64, 512, 4
WRAP = "_c10d_functional._wrap_tensor_autograd.default"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


def _model(mesh) -> nn.Sequential:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(*(_Block() for _ in range(BLOCKS)), nn.Linear(WIDTH, 8))
    for block in list(model)[:BLOCKS]:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _measured(plan: remat.Plan, mesh, x: torch.Tensor, hold_output: bool) -> int:
    model = plan.apply(_model(mesh))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        out = model(x)
        loss = _loss(out)
        if not hold_output:
            del out
        loss.backward()
        opt.step()

    return remat.measure_step(step, model, opt).peak_total


@pytest.mark.parametrize("hold_output", [False, True])
def test_plans_mixing_segments_the_wire_point_and_save_matmuls_peak_where_predicted(hold_output):
    """Blocks keeping every output a policy may keep (a collective's result once, not again as its autograd
    wrapper), every block keeping only what crossed the wire, and segments beside those and save_matmuls: each
    plan's peak is its prediction, and it sends again the collectives it says."""
    from torch.distributed.device_mesh import init_device_mesh

    x = torch.randn(16, 64, WIDTH)
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        prof = remat.profile(_model(mesh), x, loss_fn=_loss, repeats=1, hold_output=hold_output)
        graphs = [prof.ops.blocks[row.name] for row in prof.rows]
        assert all(n.out_bytes == 0 for g in graphs for n in g.nodes if n.op == WRAP)
        every = [selective_option(row, g, g.keepable) for row, g in zip(prof.rows, graphs)]
        wire = [selective_option(row, g, wire_nodes(g)) for row, g in zip(prof.rows, graphs)]
        options = chain_options(prof)
        segment = next(o for o in options[0] if o.name == "segment" and o.span == 2)
        matmuls = next(o for o in options[3] if o.name == "save_matmuls")
        # the last block's recomputation makes the step's peak when it keeps every output: priced from the op graph,
        # whose collective's result is counted once (not again as its autograd wrapper, nor a view of that)
        cases = {"every output": (list(enumerate(every)), 0), "the wire": (list(enumerate(wire)), 0),
                 "mixed": ([(0, segment), (2, wire[2]), (3, matmuls)], 2)}
        for case, (placed, resent) in cases.items():
            plan = plan_of(prof, placed, prof.peak_bytes)
            plan.meta = {**prof.model_meta, **plan.meta}
            assert plan.collectives_rerun == resent, (case, plan.blocks)
            measured = _measured(plan, mesh, x, hold_output)
            assert abs(measured - plan.predicted_peak) <= 1024, (case, measured, plan.predicted_peak)


def test_a_collectives_wrapper_for_autograd_holds_no_bytes_on_meta():
    """On the meta device the wrapper's fake kernel makes a new empty tensor: still the collective's result."""
    from torch.distributed.device_mesh import init_device_mesh

    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = _model(mesh)
        prof = remat.profile(model, torch.empty(16, 64, WIDTH, device="meta"), loss_fn=_loss, device="meta")
    for graph in prof.ops.distinct:
        (wrap,) = [n for n in graph.nodes if n.op == WRAP]
        (reduce,) = [n for n in graph.nodes if n.op == "_c10d_functional.all_reduce.default"]
        assert wrap.out_bytes == 0 and wrap.index not in graph.keepable
        after = graph.nodes[wrap.index + 1:]  # what reads the wrapper's output reads the collective's
        assert any(reduce.index in n.needs for n in after) and not any(wrap.index in n.needs for n in after)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-fused"])
def test_a_saved_plan_of_segments_the_wire_point_and_save_matmuls_checks_bitwise(optimizer, tmp_path):
    """``remat.check_plan`` on the tensor-parallel model (its parameters DTensors and plain tensors, which torch's
    foreach and fused AdamW take only in separate groups), from the plan saved and loaded: every step's gradients
    bitwise equal to the unplanned model's (the fake world's collectives leave their inputs as they are: the same
    values in both), its peak as predicted."""
    from torch.distributed.device_mesh import init_device_mesh

    x = torch.randn(16, 64, WIDTH)
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        prof = remat.profile(_model(mesh), x, loss_fn=_loss, repeats=1, hold_output=False)
        graph = prof.ops.blocks["2"]
        options = chain_options(prof)
        segment = next(o for o in options[0] if o.name == "segment" and o.span == 2)
        matmuls = next(o for o in options[3] if o.name == "save_matmuls")
        plan = plan_of(prof, [(0, segment), (2, selective_option(prof.rows[2], graph, wire_nodes(graph))),
                              (3, matmuls)], prof.peak_bytes)
        plan.meta = {**prof.model_meta, **plan.meta}
        plan.save(tmp_path / "plan.json")
        loaded = remat.Plan.load(tmp_path / "plan.json")
        assert str(loaded) == str(plan) and loaded.collectives_rerun == plan.collectives_rerun == 2
        checked = remat.check_plan(lambda: _model(mesh), tmp_path / "plan.json", x, loss_fn=_loss, steps=2,
                                   optimizer=optimizer)
    assert all(step.grads_equal for step in checked.rows), str(checked)
    assert checked.holds, str(checked)


@pytest.mark.parametrize("hold_output", [False, True])
def test_on_meta_the_plans_peak_where_the_fake_worlds_real_tensors_do(hold_output):
    """The same tensor-parallel model profiled on the meta device and on real tensors, both in a fake world of two
    ranks: the step's peak, and those of plans checkpointing, keeping what crossed the wire, save_matmuls and a
    segment, to the byte."""
    from torch.distributed.device_mesh import init_device_mesh

    profiles = []
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for device in ("cpu", "meta"):
            with torch.device(device):
                model, x = _model(mesh), torch.randn(16, 64, WIDTH)
            profiles.append(remat.profile(model, x, loss_fn=_loss, repeats=1, hold_output=hold_output,
                                          device="meta" if device == "meta" else None))
    peaks = []
    for prof in profiles:
        graphs = [prof.ops.blocks[row.name] for row in prof.rows]
        wire = plan_of(prof, [(i, selective_option(row, g, wire_nodes(g)))
                              for i, (row, g) in enumerate(zip(prof.rows, graphs))], prof.peak_bytes)
        named = [prof.price({"0": "checkpoint", "1": "save_matmuls", "3": "checkpoint"}),
                 prof.price({}, segments=[["1", "2"]])]
        peaks.append([prof.peak_bytes, wire.predicted_peak, *(plan.predicted_peak for plan in named)])
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize("family", ["Qwen2", "Gemma"])
def test_hugging_face_decoders_split_in_attention_and_mlp_peak_where_their_plans_say(family):
    """Transformers' own decoders (a tiny config, random weights), q / k / v / gate / up column-wise and o / down
    row-wise: every block checkpointed, ``save_matmuls`` and keeping what crossed the wire (all but the last block)
    peak where predicted, and a checkpointed block sends its attention's all-reduce again (the down projection's
    comes after its last saved tensor)."""
    transformers = pytest.importorskip("transformers")
    from helpers import split_decoder_layers
    from torch.distributed.device_mesh import init_device_mesh

    extra = {"head_dim": 16} if family == "Gemma" else {}
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_cache=False, **extra)
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))

    def build(mesh):
        torch.manual_seed(0)
        return split_decoder_layers(getattr(transformers, f"{family}ForCausalLM")(config).train(), mesh)

    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        prof = remat.profile(build(mesh), input_ids=ids, labels=ids, repeats=1, hold_output=False)
        assert [(row.collectives, row.tail_collectives) for row in prof.rows] == [(1, 1)] * 3
        names = [row.name for row in prof.rows]
        wired = [(p, selective_option(row, prof.ops.blocks[row.name], wire_nodes(prof.ops.blocks[row.name])))
                 for p, row in enumerate(prof.rows[:-1])]
        plans = [prof.price(dict.fromkeys(names, "checkpoint")), prof.price(dict.fromkeys(names, "save_matmuls")),
                 plan_of(prof, wired, prof.peak_bytes)]
        assert [plan.collectives_rerun for plan in plans] == [3, 0, 0]
        for plan in plans:
            planned = plan.apply(build(mesh))
            opt = torch.optim.SGD(planned.parameters(), lr=0.1)

            def step(planned=planned, opt=opt):
                opt.zero_grad()
                planned(input_ids=ids, labels=ids).loss.backward()
                opt.step()

            measured = remat.measure_step(step, planned, opt).peak_total
            assert abs(measured - plan.predicted_peak) <= 8192, (plan.decisions, measured, plan.predicted_peak)
