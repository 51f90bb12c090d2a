"""The planner's predictions for the Llama of ``benchmarks/gpu.py`` on an NVIDIA H200, from that machine's figures.

No GPU needed: a step profile is built from the measured rows of ``results/h200-39275ba.json`` (HF Llama, 12 x
2048, bf16, SDPA, batch 4 x 2048; torch 2.11, one H200) and planned on remat's own cost model, copies priced on
the timeline of :mod:`remat.planning.measure.copies` with the link measured there.

    python benchmarks/h200_timeline.py                      # the front beside the rules, and the targets
    python benchmarks/h200_timeline.py --no-ops             # layers as sizes only: no op-level or kept-offload options

How the profile follows the figures (peaks above the step's start, as the benchmark measures them):

* a layer's own activations: (plan-70's peak - plan-50's) / 3, the bytes each of the three more layers plan-50
  checkpoints frees; its boundary input: batch x seq x hidden x 2 bytes;
* everything else the peak holds (the logits, the loss's float copies, the gradients): plain's peak less the 12
  layers' activations; the peak sits where forward ends and the loss runs, which the plans' peaks, exact to
  0.0% on the H200 with every layer's activations counted there, confirm;
* a layer's price of checkpointing: plan-30's predicted extra time / 12 (it measured within 1%); its forward:
  the same (a layer's recomputation reruns its forward); backward: twice the forward;
* the stretch between the last layer's forward and its backward: plain's step less three forwards per layer;
* the layers' op graphs (what each op saves, to the byte): the same Llama built on the meta device and profiled
  there by remat (bf16, SDPA, batch 4 x 2048); matmuls and attention scaled by one factor, the other ops by
  another, so that a layer's forward is the figure above and keeping the matmuls' and attention's outputs costs
  what ``remat-save-matmuls`` measured per layer.
  The machinery's per-op price under a policy is the H200's own: (``remat-save-all`` - plain) / (ops of the 12
  layers' forwards and replays), 6 us; its per-region price, (``remat-ckpt`` - plain - 12 layers), is nil.  The
  host is taken to run ahead of the device (the op graphs' host work hidden where the kernels take longer).
  With the op graphs the planner also weighs selective points and ``keep_offload`` (a kept layer's largest
  saved tensors in host memory), copies priced on the engine's timeline (:mod:`remat.planning.measure.copyline`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

from remat.planning.choices.fronts import evaluate
from remat.planning.choices.options import DEFAULT_ALLOW
from remat.planning.measure.copies import Link
from remat.planning.measure.opgraph import BlockGraph, OpProfile
from remat.planning.measure.overheads import Overheads
from remat.planning.measure.profile import ModuleProfile, StepProfile
from remat.planning.measure.timeline import Segment
from remat.planning.solve.rulefront import front
from remat.planning.solve.solver import plan_from_profile
from remat.policies.rules import MATMUL_OPS

RESULTS = Path(__file__).resolve().parent / "results" / "h200-39275ba.json"
TARGETS = {"plan 50%": 0.5, "plan 30%": 0.3}
KEPT_OFFLOAD = ("checkpoint", "checkpoint_offload", "keep_offload")


def h200_profile(figures: dict, device: str = "cuda", graph: BlockGraph | None = None) -> tuple[StepProfile, Link]:
    """A step profile of the benchmark's Llama built from the H200's measured rows, and its measured link; with
    ``graph`` (a layer's op graph, :func:`meta_graph`), every layer has it, timed on the H200's scale."""
    rows = {row["key"]: row for row in figures["rows"]}
    model = figures["model"]
    n = model["layers"]
    own = (rows["plan-70"]["peak"] - rows["plan-50"]["peak"]) // 3
    held = model["batch"] * model["seq"] * model["hidden"] * 2
    rest = rows["plain"]["peak"] - n * (own + held)
    layer_time = rows["plan-30"]["predicted_extra"] / n
    head = rows["plain"]["median_ms"] / 1e3 - 3 * n * layer_time
    profile_rows = [ModuleProfile(
        name=f"model.layers.{i}", cls="LlamaDecoderLayer", act_bytes=own + held, input_bytes=held, output_bytes=held,
        forward_time=layer_time, matmul_time=0.0, matmul_bytes=0, own_bytes=own + held, held_bytes=held,
        recompute_bytes=own + held, checkpoint_time=layer_time, save_matmuls_time=float("inf"))
        for i in range(n)]
    segments, live = [], 0
    for i in range(n):
        segments.append(Segment(f"forward {i}", live + own + held, prefix=i, start=live))
        live += own + held
    segments.append(Segment("loss", live + rest, prefix=n, start=live))
    for i in reversed(range(n)):
        segments.append(Segment(f"backward {i}", live + own + held, prefix=i, block=i, start=live, backward=True))
        live -= own + held
    prof = StepProfile(rows=profile_rows, segments=segments, param_bytes=0, buffer_bytes=0, grad_bytes=0,
                       peak_bytes=max(s.peak for s in segments), device=device,
                       step_time=rows["plain"]["median_ms"] / 1e3, notes=[f"head {head * 1e3:.1f} ms"])
    bandwidth = figures["bandwidth"]
    link = Link(bandwidth["D2H"], bandwidth["H2D"])
    if graph is not None:
        timed = _on_h200_scale(graph, figures, layer_time, link)
        prof.ops = OpProfile({row.name: timed for row in profile_rows}, device)
    return prof, link


def meta_graph(figures: dict) -> BlockGraph:
    """The op graph of one decoder layer of the benchmark's Llama, recorded on the meta device (exact bytes)."""
    import torch
    import transformers

    import remat

    m = figures["model"]
    config = transformers.LlamaConfig(
        hidden_size=m["hidden"], num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
        num_key_value_heads=m["heads"], intermediate_size=m["intermediate"], vocab_size=m["vocab"],
        max_position_embeddings=max(m["seq"], 2048), use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to(getattr(torch, m["dtype"])).train()
    ids = torch.empty(m["batch"], m["seq"], dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the meta device's answered data checks
        prof = remat.profile(model, input_ids=ids, labels=ids, device="meta")
    return prof.ops.blocks["model.layers.0"]


def _on_h200_scale(graph: BlockGraph, figures: dict, layer_time: float, link: Link) -> BlockGraph:
    """``graph`` timed on the H200's scale: matmuls and attention by one factor, every other op by another, so a
    layer's forward takes ``layer_time`` and keeping the matmuls' and attention's outputs costs what
    ``remat-save-matmuls`` measured per layer."""
    rows = {row["key"]: row for row in figures["rows"]}
    n = figures["model"]["layers"]
    per_op = (rows["remat-save-all"]["median_ms"] - rows["plain"]["median_ms"]) / 1e3 / (2 * n * len(graph.nodes))
    overheads = Overheads(region=0.0, per_saved=0.0, policy_forward=per_op, policy_replay=per_op,
                          copy_per_byte=2 / figures["bandwidth"]["D2D"], link_bytes_per_s=min(link.d2h, link.h2d))
    heavy = {n.index for n in graph.nodes if n.op in {str(op) for op in MATMUL_OPS}}
    matmuls = sum(n.kernel_time for n in graph.nodes if n.index in heavy)
    others = sum(n.kernel_time for n in graph.nodes if n.index not in heavy)
    measured = (rows["remat-save-matmuls"]["median_ms"] - rows["plain"]["median_ms"]) / 1e3 / n
    kept = [i for i in graph.keepable if i in heavy]

    def timed(light: float) -> BlockGraph:
        scale = (layer_time - light * others) / matmuls
        nodes = [dataclasses.replace(node, kernel_time=node.kernel_time * (scale if node.index in heavy else light),
                                     wall_time=node.kernel_time * (scale if node.index in heavy else light),
                                     host_time=0.0) for node in graph.nodes]
        return dataclasses.replace(graph, nodes=nodes, forward_time=layer_time, estimated=False,
                                   overheads=overheads, asynchronous=True)

    def price(light: float) -> float:  # on the profile's scale, as the planner's options are priced
        g = timed(light)
        return evaluate(g, "selective", kept).extra_time * layer_time / evaluate(g, "checkpoint").extra_time

    low, high = 0.0, layer_time / others
    for _ in range(60):  # the price rises with the other ops' share of the forward
        middle = (low + high) / 2
        low, high = (middle, high) if price(middle) < measured else (low, middle)
    return timed(low)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="a benchmarks/gpu.py JSON from a GPU")
    parser.add_argument("--no-ops", action="store_true", help="layers as sizes only (no op graphs)")
    args = parser.parse_args(argv)
    figures = json.loads(args.results.read_text())
    prof, link = h200_profile(figures, graph=None if args.no_ops else meta_graph(figures))
    print(f"{figures['device']}, link {link.d2h / 1e9:.1f} / {link.h2d / 1e9:.1f} GB/s; plain step "
          f"{prof.step_time * 1e3:.2f} ms, peak {prof.peak_bytes / 2**20:.0f} MiB above the step's start\n")
    print(front(prof, budgets=tuple(TARGETS.values())))
    print()
    for label, budget in TARGETS.items():
        for allow, how in ((DEFAULT_ALLOW, ""), (KEPT_OFFLOAD, ", checkpoint / kept with offloads only")):
            plan = plan_from_profile(prof, budget, allow=allow)
            print(f"{label}{how}: x{1 + plan.predicted_extra_time / prof.step_time:.3f} at "
                  f"{plan.predicted_peak / prof.peak_bytes:.3f} of plain's peak; {_counts(plan.decisions)}")
    lowest = min(front(prof).plans, key=lambda p: p.peak)
    print(f"lowest plan: x{1 + lowest.extra_time / prof.step_time:.3f} at {lowest.peak / prof.peak_bytes:.3f} "
          f"of plain's peak; {_counts(dict(enumerate(lowest.decisions)))}")
    return 0


def _counts(decisions: dict) -> str:
    names = list(decisions.values())
    return ", ".join(f"{names.count(name)} {name}" for name in dict.fromkeys(names))


if __name__ == "__main__":
    raise SystemExit(main())
