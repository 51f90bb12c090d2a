"""Timings measured once per machine and reused: the same model, inputs and budget give the same plan.

A plan's choices rest on measured times: each block's per-op times, the machinery's overheads and what the
chunked head adds (:mod:`remat.planning.solve.head`).  Measured
afresh in every process they move with the machine's load (another job on the cores, clock speeds), and a
choice between two near-equal options follows that noise from one run to the next.  As autotuners keep
their measurements, remat keeps these in a small JSON file per machine, keyed by what the time depends on:
the block's op graph (its ops, shapes, dtypes and bytes), the device, the thread count and the torch
version.  A later profile of the same blocks on the same machine reads them instead of measuring again, so
fresh processes plan alike, quiet or loaded.  A measurement is written under a file lock, and processes that
profile at once wait for the first: they read what it measured.  Ranks that profile one model together (FSDP2,
tensor parallel: a timed run may be a collective) do not wait on each other there: rank 0 reads the file and
hands its entries to every rank, all ranks make rank 0's choices of what to time, and rank 0 writes.

The file is ``$REMAT_CACHE_DIR/timings.json`` (default ``~/.cache/remat``); ``REMAT_CACHE_DIR=off`` turns
the cache off, and ``remat.profile(..., fresh_timings=True)`` (``remat plan --fresh-timings``) measures again
and replaces what the file holds for those blocks.

What is cached cannot stick when it is wrong.  A timing whose rounds varied by more than the unsteady limit
(a busy machine) is used by the profile that measured it but never written.  Beside a model's block timings
the file keeps the training step time measured with them; :func:`remat.profile` measures this process's step
afresh every time, and cached timings that cannot be this machine's now (:func:`stale`: the blocks' forwards
add up to more than a whole step, or the step cached with them is more than :data:`STALE` apart from this
one) are measured again, with one :class:`StaleTimings` line.  A plan's "+N%" divides its extra time by the
step time its prices came from (the cached one while they are cached), so one plan reads the same in every
process.

Example:
    >>> with timings_cache() as cache:
    ...     times = cache.get("ops", signature) or cache.put("ops", signature, measure())
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import platform
import statistics
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..basics.ranks import Ranks
from ..basics.userline import user_stacklevel

__all__ = ["STALE", "UNSTEADY", "StaleTimings", "StepTime", "TimingCache", "agrees", "cache_dir", "cached_times",
           "measuring_afresh", "model_key", "spread_of", "stale", "stale_slack", "timings_cache", "unsteady_limit"]

_VERSION = 3  # 3: unsteady timings are not written; a model's step time is kept beside its blocks' timings

STALE = 0.5
"""How far apart (a share, or the rounds' spread where larger) a cached step time and this process's may be
before the timings cached with it are measured again: a loaded machine moves times by tens of percent.
``REMAT_STALE_SPREAD`` sets another share (``inf``: never)."""


class StaleTimings(UserWarning):
    """Cached timings disagree with this process's measured step time, so they are measured again."""


@dataclass(frozen=True)
class StepTime:
    """A training step as this process measured it: the median seconds and the spread of its rounds.

    Example:
        >>> StepTime(0.021, spread=0.03)
    """

    seconds: float
    spread: float = 0.0


def stale(cached_forward: float, step: StepTime, entry: dict[str, float] | None) -> str:
    """Why cached timings cannot be this machine's now, in a phrase ('' when they can be).

    ``cached_forward``: the cached forward seconds of every block of the step, added up; ``step``: this
    process's step; ``entry``: the step time cached with the timings (``{"seconds", "spread"}``) or None.

    Example:
        >>> stale(0.357 * 12, StepTime(0.2), None)
        "their blocks' forwards add up to 4284.0 ms, more than this process's whole training step (200.0 ms)"
    """
    slack = stale_slack(step.spread + (entry or {}).get("spread", 0.0))
    if cached_forward > step.seconds * (1 + slack):
        return (f"their blocks' forwards add up to {cached_forward * 1e3:.1f} ms, more than this process's whole "
                f"training step ({step.seconds * 1e3:.1f} ms)")
    if entry is not None and step.seconds > 0:
        if not agrees(entry["seconds"], step.seconds, slack):
            return (f"the training step measured with them took {entry['seconds'] * 1e3:.1f} ms, this process's "
                    f"{step.seconds * 1e3:.1f} ms")
    return ""


UNSTEADY = 0.10
"""A time whose rounds' interquartile range exceeds this share of their median is measured again, then warned about,
and never written to the file; ``REMAT_UNSTEADY_SPREAD`` sets another share (``inf``: never)."""


def unsteady_limit() -> float:
    """:data:`UNSTEADY`, or ``REMAT_UNSTEADY_SPREAD`` where set.

    Example:
        >>> unsteady_limit()
        0.1
    """
    return float(os.environ.get("REMAT_UNSTEADY_SPREAD", UNSTEADY))


def agrees(kept: float, now: float, slack: float) -> bool:
    """Whether a kept time and the same time measured now are within ``slack`` (a share) of each other, either way.

    Example:
        >>> agrees(0.010, 0.014, stale_slack(0.0)), agrees(0.010, 0.020, 0.5)
        (True, False)
    """
    return kept <= now * (1 + slack) and now <= kept * (1 + slack)


def spread_of(rounds: Sequence[float]) -> float:
    """How far apart timed rounds are: their range over their median (0 where the median is 0).

    Example:
        >>> round(spread_of([1.0, 1.1, 0.9]), 3)
        0.2
    """
    median = statistics.median(rounds)
    return (max(rounds) - min(rounds)) / median if median > 0 else 0.0


def stale_slack(spread: float) -> float:
    """How far apart (a share) a cached time and this process's may be: :data:`STALE` (or
    ``REMAT_STALE_SPREAD``), or ``spread``, the rounds' own spread, where larger.

    Example:
        >>> stale_slack(0.8)
        0.8
    """
    return max(float(os.environ.get("REMAT_STALE_SPREAD", STALE)), spread)


_fresh = contextvars.ContextVar("remat_fresh_timings", default=False)


@contextlib.contextmanager
def measuring_afresh(fresh: bool = True) -> Iterator[None]:
    """Profiles inside measure again (``fresh``) and replace what the timings file holds for their blocks.

    Example:
        >>> with measuring_afresh():
        ...     prof = remat.profile(model, tokens)
    """
    token = _fresh.set(fresh)
    try:
        yield
    finally:
        _fresh.reset(token)


def cache_dir() -> Path | None:
    """Where timings are kept (``REMAT_CACHE_DIR``, default ``~/.cache/remat``); None when turned off.

    Example:
        >>> cache_dir()
        PosixPath('/home/me/.cache/remat')
    """
    configured = os.environ.get("REMAT_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "none") else Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "remat"


def _machine(device: str) -> str:
    """What a time depends on besides the work itself: the device (its name), threads and torch."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
    return f"{kind}:{name}|threads={torch.get_num_threads()}|torch={torch.__version__}|v{_VERSION}"


class TimingCache:
    """The timings file of this machine, read and written while :func:`timings_cache` holds its lock; ``same``:
    rank 0's value on every rank where ranks time together (else the value itself)."""

    def __init__(self, path: Path | None, fresh: bool, same: Callable[[Any], Any] | None = None) -> None:
        self.path = path
        self.fresh = fresh
        self.entries: dict[str, Any] = {}
        self.written: dict[str, Any] = {}
        self.changed = False
        self.same: Callable[[Any], Any] = same or (lambda value: value)
        if path is not None and path.exists():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self.entries = {}  # a damaged file is measured over, not trusted

    def get(self, kind: str, key: str, device: str) -> Any:
        """What was measured for ``key`` on this machine, or None (never read when measuring afresh)."""
        if self.fresh:
            return None
        return self.entries.get(f"{kind}|{key}|{_machine(device)}")

    def put(self, kind: str, key: str, device: str, value: Any) -> Any:
        """Keep ``value`` (plain JSON data) for ``key``; returns it."""
        self.entries[f"{kind}|{key}|{_machine(device)}"] = value
        self.written[f"{kind}|{key}|{_machine(device)}"] = value
        self.changed = True
        return value

    def _write(self) -> None:
        if self.path is None or not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole and renamed into place: a reader never sees half a file.
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".timings-")
        with os.fdopen(handle, "w") as f:
            json.dump(self.entries, f)
        os.replace(temporary, self.path)


@contextlib.contextmanager
def timings_cache(ranks: Ranks | None = None) -> Iterator[TimingCache]:
    """The machine's timings, locked against other processes until the block ends (then written back).

    ``ranks`` that profile together a model whose blocks run collectives (tensor parallel): a timed run there
    is a collective, which must run on every rank in the same order and never while a rank holds the lock
    another waits for.  Rank 0 alone reads the file, under the lock, and hands its entries to every rank, so
    all ranks find the same timings and time the same blocks; the lock is let go before that, and rank 0 takes
    it again at the end to write what was measured.  ``cache.same(value)`` is then rank 0's ``value``.

    Example:
        >>> with timings_cache() as cache:
        ...     cache.get("ops", "3f2a...", "cpu")
    """
    fresh = _fresh.get()
    if ranks is None or not ranks.together:
        with _locked() as path:
            cache = TimingCache(path, fresh)
            yield cache
            cache._write()
        return
    import torch.distributed as dist

    first = dist.get_rank() == 0
    entries: dict[str, Any] = {}
    if first:
        with _locked() as path:
            entries = TimingCache(path, fresh).entries
    cache = TimingCache(None, fresh, ranks.same)
    cache.entries = ranks.same(entries)
    yield cache
    if first and cache.written:
        with _locked() as path:
            kept = TimingCache(path, fresh)
            kept.entries.update(cache.written)
            kept.changed = True
            kept._write()


@contextlib.contextmanager
def _locked() -> Iterator[Path | None]:
    """The timings file's path, its lock held until the block ends; None where the cache is off or cannot be
    written (a read-only home)."""
    directory = cache_dir()
    if directory is None:
        yield None
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / "timings.lock", "a")  # noqa: SIM115 - held for the block, closed below
    except OSError:  # a read-only home: measure as if there were no cache
        yield None
        return
    with lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no advisory locks here (Windows): processes may measure the same blocks twice
        yield directory / "timings.json"


def model_key(model: torch.nn.Module, tensors: list[torch.Tensor]) -> str:
    """What a model's step time depends on besides the machine and its blocks: its class, and the shapes and
    dtypes of its parameters and inputs (``tensors``).

    Example:
        >>> model_key(model, [*model.parameters(), tokens])
    """
    return "|".join([type(model).__qualname__, *(f"{tuple(t.shape)}{t.dtype}" for t in tensors)])


def cached_times(cache: TimingCache, device: str, blocks: dict[str, str], step: StepTime | None, model: str,
                 unsteady: float, measure: Callable[[str], dict[str, Any]]
                 ) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Per signature of ``blocks`` (block name -> signature) its times, cached or ``measure(signature)``d, and
    the step time they go with (None without a ``step``).

    A measurement (a dict with the forward's seconds, ``forward``, and its rounds' ``spread``) is written only
    when its spread is at most ``unsteady``.  Given this process's ``step``, cached times that :func:`stale`
    finds are not this machine's now are measured again, with one :class:`StaleTimings` line; the step time
    returned is the one cached with the times while they all come from the cache, else ``step``'s (written
    beside them when it and they are steady).  ``model``: :func:`model_key`.

    Example:
        >>> times, step_time = cached_times(cache, "cpu", {"blocks.0": "3f2a"}, StepTime(0.02), key, 0.1, measure)
    """
    step = cache.same(step)  # ranks that time together decide alike what is stale
    signatures = dict.fromkeys(blocks.values())
    times = {signature: cache.get("ops", signature, device) for signature in signatures}
    key = hashlib.sha1("|".join([model, *(f"{name}={sig}" for name, sig in blocks.items())]).encode()).hexdigest()[:16]
    entry, step_time = cache.get("step", key, device) if step else None, None
    if step and any(times.values()):
        cached = [name for name, signature in blocks.items() if times[signature]]
        reason = stale(sum(times[blocks[name]]["forward"] for name in cached), step, entry)
        if reason:
            more = f" and {len(cached) - 1} more blocks" if len(cached) > 1 else ""
            warnings.warn(StaleTimings(f"remat.profile: the cached timings of `{cached[0]}`{more} are not this "
                                       f"machine's now ({reason}); measuring them again."),
                          stacklevel=user_stacklevel())
            times = dict.fromkeys(times)
        elif entry and all(times.values()):
            step_time = entry["seconds"]
    steady = True
    for signature in signatures:
        if times[signature] is None:
            times[signature] = measure(signature)
            if times[signature]["spread"] <= unsteady:  # an unsteady round's times serve this profile only
                cache.put("ops", signature, device, times[signature])
            else:
                steady = False
    if step and step_time is None:
        step_time = step.seconds
        if steady and step.spread <= unsteady:
            cache.put("step", key, device, {"seconds": step.seconds, "spread": step.spread})
    return times, step_time
