"""The planner's predictions for the Llama of ``benchmarks/gpu.py`` on an NVIDIA H200, from that machine's figures.

No GPU needed: a step profile is built from the measured rows of ``results/h200-39275ba.json`` (HF Llama, 12 x
2048, bf16, SDPA, batch 4 x 2048; torch 2.11, one H200) and planned on remat's own cost model, copies priced on
the timeline of :mod:`remat.planning.copies` with the link measured there.

    python benchmarks/h200_timeline.py                      # the front beside the rules, and the targets

How the profile follows the figures (peaks above the step's start, as the benchmark measures them):

* a layer's own activations: (plan-70's peak - plan-50's) / 3, the bytes each of the three more layers plan-50
  checkpoints frees; its boundary input: batch x seq x hidden x 2 bytes;
* everything else the peak holds (the logits, the loss's float copies, the gradients): plain's peak less the 12
  layers' activations; the peak sits where forward ends and the loss runs, which the plans' peaks, exact to
  0.0% on the H200 with every layer's activations counted there, confirm;
* a layer's price of checkpointing: plan-30's predicted extra time / 12 (it measured within 1%); its forward:
  the same (a layer's recomputation reruns its forward); backward: twice the forward;
* the stretch between the last layer's forward and its backward: plain's step less three forwards per layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from remat.planning.copies import Link
from remat.planning.profile import ModuleProfile, StepProfile
from remat.planning.rulefront import front
from remat.planning.solver import plan_from_profile
from remat.planning.timeline import Segment

RESULTS = Path(__file__).resolve().parent / "results" / "h200-39275ba.json"
TARGETS = {"plan 50%": 0.5, "plan 30%": 0.3}


def h200_profile(figures: dict, device: str = "cuda") -> tuple[StepProfile, Link]:
    """A step profile of the benchmark's Llama built from the H200's measured rows, and its measured link."""
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
    return prof, Link(bandwidth["D2H"], bandwidth["H2D"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="a benchmarks/gpu.py JSON from a GPU")
    args = parser.parse_args(argv)
    figures = json.loads(args.results.read_text())
    prof, link = h200_profile(figures)
    print(f"{figures['device']}, link {link.d2h / 1e9:.1f} / {link.h2d / 1e9:.1f} GB/s; plain step "
          f"{prof.step_time * 1e3:.2f} ms, peak {prof.peak_bytes / 2**20:.0f} MiB above the step's start\n")
    print(front(prof, budgets=tuple(TARGETS.values())))
    print()
    for label, budget in TARGETS.items():
        plan = plan_from_profile(prof, budget)
        print(f"{label}: x{1 + plan.predicted_extra_time / prof.step_time:.3f} at "
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
