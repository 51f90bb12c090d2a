"""Run under torchrun (gloo): the two-rank checks named on the command line, one after another in one process
group.

Each argument is ``MODULE=REPORT``: every rank runs ``MODULE.run(REPORT)`` (tests/dist_worker.py,
dist_chunked_worker.py, broadcast_worker.py, ranks_worker.py, fakeworld_worker.py, ecosystem_worker.py,
tp_worker.py, tp_plan_worker.py, tp_llama_worker.py), whose rank 0 writes the report. One launch serves them all,
as each launch costs a process group and two interpreters that import torch.
"""

import datetime
import importlib
import sys

import torch.distributed as dist
from helpers import leave_process_group


def main(checks: list[str]) -> None:
    # A rank left waiting in a collective fails the run in two minutes rather than gloo's thirty.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for check in checks:
        module, _, report = check.partition("=")
        importlib.import_module(module).run(report)
        dist.barrier()  # the next check starts on every rank after this one has ended on every rank
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
