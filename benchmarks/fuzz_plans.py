"""Plan fuzz: thousands of random models, every plan checked in a short training loop.

Run by hand:  PYTHONPATH=src:tests python benchmarks/fuzz_plans.py [--models 2000] [--first 0]

For each seed it builds a random model as a user writes it (tests/fuzz_models.py: Sequential MLPs and CNNs,
some with in-place activation layers, residual blocks, blocks that share one input), profiles it, plans it at
every feasible budget of a grid and takes random assignments of options besides, then trains each distinct
plan for three SGD steps beside the unplanned model (tests/fuzz_check.py, through remat.check_plan).  A plan
holds when every step peaks within 3% of its prediction (MemTracker, bytes above parameters and buffers) with
gradients bitwise equal.  Each model is also profiled on the meta device and compared with its CPU profile, to
the byte (every segment's peak, every block's bytes: ``meta differs`` counts the models where one is not equal).
Misses, errors, meta differences and models that cannot be profiled are printed as they come; a table by
pattern every ``--every`` models and at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzz_check import BUDGETS, check_case, meta_difference  # noqa: E402
from fuzz_models import make_case  # noqa: E402

_COLUMNS = ("models", "unprofiled", "meta differs", "plans", "holds", "misses", "errors", "grads differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=2000, help="how many seeds (models) to run")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--assignments", type=int, default=2, help="random assignments of options per model")
    parser.add_argument("--every", type=int, default=100, help="print the table so far every this many models")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts: dict[str, Counter] = defaultdict(Counter)
    start = time.perf_counter()
    for seed in range(args.first, args.first + args.models):
        result = check_case(make_case(seed), BUDGETS, args.assignments)
        row = counts[result.case.pattern]
        row["models"] += 1
        if result.error:
            row["unprofiled"] += 1
            print(f"cannot profile {result.case}: {result.error}", flush=True)
        else:
            differs = meta_difference(result.case, result.profile)
            row["meta differs"] += bool(differs)
            if differs:
                print(f"{result.case} | meta differs: {differs}", flush=True)
        for plan in result.plans:
            row["plans"] += 1
            row["holds"] += plan.holds
            row["errors"] += bool(plan.error)
            row["misses"] += not plan.error and not plan.peaks_hold
            row["grads differ"] += not plan.error and not plan.grads_equal
            if not plan.holds:
                print(f"{result.case} | {plan}", flush=True)
        done = seed - args.first + 1
        if done % args.every == 0 or done == args.models:
            _table(counts, done, args.first, time.perf_counter() - start)


def _table(counts: dict[str, Counter], models: int, first: int, elapsed: float) -> None:
    """The counts so far by pattern, as a Markdown table."""
    print(f"\n{models} models from seed {first}, {elapsed:.0f} s "
          f"(torch {torch.__version__}, {torch.get_num_threads()} thread)")
    print("| pattern | " + " | ".join(_COLUMNS) + " |")
    print("|---" * (len(_COLUMNS) + 1) + "|")
    total: Counter = Counter()
    for pattern in sorted(counts):
        total.update(counts[pattern])
        print(f"| {pattern} | " + " | ".join(str(counts[pattern][c]) for c in _COLUMNS) + " |")
    print("| all | " + " | ".join(str(total[c]) for c in _COLUMNS) + " |", flush=True)

if __name__ == "__main__":
    main()
