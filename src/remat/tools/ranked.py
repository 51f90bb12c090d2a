"""The ``remat`` command under ``torchrun``: the process group it sets up, the rank that speaks, and ``remat
check``'s table for every rank.

Under ``torchrun`` every rank runs the command.  The command sets up the process group from torchrun's
environment before it calls the user's factory, which builds the model and wraps it (DDP, ``fully_shard``)
as it is trained; every rank profiles, plans and checks it, and rank 0 alone prints and writes files.  Started
without ``torchrun`` (or with one process) nothing here does anything.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from ..planning.check import PlanCheck

__all__ = ["another_rank_failed", "built_once", "check_table", "factory_hint", "gathered", "launched", "process_group",
           "rank", "speaking", "where"]


def launched() -> bool:
    """Whether this process is one of several that ``torchrun`` started (its ``WORLD_SIZE`` above 1).

    Example:
        >>> launched()      # a plain `remat plan ...`
        False
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the process group; 0 without one.

    Example:
        >>> rank()
        0
    """
    if not _distributed():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def where() -> str:
    """Where an error happened, for its line: `` on rank N`` on a rank other than 0, else nothing.

    Example:
        >>> where()
        ''
    """
    launched_as = int(os.environ.get("RANK", "0")) if launched() else 0  # the process group may be gone by now
    return f" on rank {launched_as}" if launched_as else ""


def another_rank_failed(error: BaseException) -> bool:
    """Whether ``error`` is a collective broken by another rank leaving (it failed, and said why in its own line).

    Example:
        >>> another_rank_failed(RuntimeError("Connection closed by peer [127.0.0.1]:11969"))   # under torchrun
        True
    """
    import torch.distributed as dist

    broken = isinstance(error, getattr(dist, "DistError", ())) or "Connection closed by peer" in str(error)
    return launched() and broken


def factory_hint(error: BaseException) -> str:
    """The fix for a factory that sets up the process group the command has set up already ('' for other errors).

    Example:
        >>> factory_hint(ValueError("trying to initialize the default process group twice!"))   # under torchrun
        '; the command sets up ...'
    """
    if not (launched() and "process group twice" in str(error)):
        return ""
    return ("; the command sets up torchrun's process group before it calls the factory: set it up there only "
            "`if not torch.distributed.is_initialized()`")


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """The process group torchrun's environment describes, set up for the body (gloo for the CPU, NCCL for CUDA
    devices, each rank on its local device) and ended after it; nothing where the command was not started by
    ``torchrun`` or a group is already set up.

    Example:
        >>> with process_group():        # under torchrun: every rank in one group
        ...     model = build()          # the user's factory may wrap in DDP or shard with fully_shard
    """
    import torch

    if not launched() or not torch.distributed.is_available() or torch.distributed.is_initialized():
        yield
        return
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group()
    try:
        yield
        dist.barrier()  # no rank leaves while another is still in a collective
    finally:
        # A rank that failed leaves at once (a barrier could meet another rank's collective): torchrun ends the
        # others when it exits.
        dist.destroy_process_group()


@contextlib.contextmanager
def speaking() -> Iterator[bool]:
    """Whether this rank speaks (rank 0, or a process alone); the body's standard output is dropped on the
    other ranks, which run the same steps and would print the same lines.

    Example:
        >>> with speaking() as speaks:
        ...     print(plan)                        # once, by rank 0
        ...     if speaks:
        ...         plan.save("plan.json")
    """
    if rank() == 0:
        yield True
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield False


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank (a collective); ``[value]`` alone.

    Example:
        >>> results = gathered(check_plan(build, plan, tokens))   # one PlanCheck per rank
    """
    if not _distributed():
        return [value]
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def built_once(model: nn.Module, factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``factory`` as ``remat check`` hands it to :func:`remat.check_plan`: ``model`` (already built from it) at the
    first call, a new one from ``factory`` at each later call, so a model the factory wraps with FSDP2 (which
    cannot be copied) gets its second copy from the factory.

    Example:
        >>> build = built_once(model, factory)
        >>> build() is model, build() is model
        (True, False)
    """
    built = [model]

    def build() -> nn.Module:
        return built.pop() if built else factory()

    return build


def check_table(results: list[PlanCheck], title: str) -> Any:
    """``remat check``'s table: a row per step (and per rank where several ranks checked), the peak predicted,
    measured (and its error) and unplanned, the times, and whether gradients are equal.

    Example:
        >>> console.print(check_table(gathered(result), "4 adamw steps ..."))
    """
    from rich.table import Table

    from ..planning.basics.units import format_bytes
    from ..planning.check import grads_cell

    by_rank = len(results) > 1
    table = Table(title=title, collapse_padding=by_rank)  # one column more: 130 characters still hold it
    columns = ("step", "peak predicted", "peak measured", "peak unplanned", "time predicted", "time measured",
               "time unplanned", "grads equal")
    for column in ("rank", *columns) if by_rank else columns:
        table.add_column(column, justify="right")
    for index, result in enumerate(results):
        for row in result.rows:
            error = result.peak_error(row)
            style = "" if abs(error) <= result.peak_tolerance else "[red]"
            cells = [str(row.step), format_bytes(result.predicted_peak),
                     f"{style}{format_bytes(row.peak)} ({error:+.1%})", format_bytes(row.unplanned_peak),
                     f"{result.predicted_time(row) * 1e3:,.1f} ms", f"{row.time * 1e3:,.1f} ms",
                     f"{row.unplanned_time * 1e3:,.1f} ms", "yes" if row.grads_equal else f"[red]no: {grads_cell(row)}"]
            table.add_row(*([str(index)] if by_rank else []), *cells)
    return table
