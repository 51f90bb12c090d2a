"""``remat.offload()`` with and without serving saved tensors still in flight, interleaved on one GPU.

Run by hand on a machine with CUDA:

    python benchmarks/offload_inflight.py               # the Llama of benchmarks/gpu.py, 6 rounds
    python benchmarks/offload_inflight.py --layers 4

A saved tensor whose copy to host memory has not completed when backward needs it is served from the device
(no round trip over the link); backward's first needs are forward's last saves (a loss's log-probabilities).
"Off" makes every fetch copy back, as before that change.  Each round runs both, the order alternating; the
first round is a warm-up.  Forward and backward are timed apart with CUDA events; the peak is
``torch.cuda.max_memory_allocated`` above the step's start.  Without CUDA the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import remat
from remat.policies.hostcopy import HostCopies

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpu  # noqa: E402 - the shared Llama workload


def _step(work: gpu.Workload, serve_in_flight: bool) -> tuple[float, float, float]:
    serving = HostCopies._in_flight
    if not serve_in_flight:
        HostCopies._in_flight = lambda self, handle: False
    try:
        work.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        with remat.offload(device_type="cuda"):
            loss = work.model(**work.inputs).loss
        events[1].record()
        loss.backward()
        events[2].record()
        torch.cuda.synchronize()
    finally:
        HostCopies._in_flight = serving
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2]), peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in gpu.FULL.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("offload_inflight.py: skipped, no CUDA device here")
        return 0
    args.dtype = torch.bfloat16
    work = gpu.build(args, torch.device("cuda"))
    rows: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for r in range(args.rounds + 1):
        for on in ((True, False) if r % 2 else (False, True)):
            measured = _step(work, on)
            if r:
                rows[on].append(measured)
    print("| in-flight serve | forward ms | backward ms | step ms | peak MiB |")
    print("|---|---|---|---|---|")
    for on, measured in rows.items():
        forward = statistics.median(m[0] for m in measured)
        backward = statistics.median(m[1] for m in measured)
        print(f"| {'on' if on else 'off'} | {forward:.1f} | {backward:.1f} | {forward + backward:.1f} | "
              f"{max(m[2] for m in measured):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
