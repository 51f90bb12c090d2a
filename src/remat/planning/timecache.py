"""Timings measured once per machine and reused: the same model, inputs and budget give the same plan.

A plan's choices rest on measured times: each block's per-op times and the machinery's overheads.  Measured
afresh in every process they move with the machine's load (another job on the cores, clock speeds), and a
choice between two near-equal options follows that noise from one run to the next.  As autotuners keep
their measurements, remat keeps these in a small JSON file per machine, keyed by what the time depends on:
the block's op graph (its ops, shapes, dtypes and bytes), the device, the thread count and the torch
version.  A later profile of the same blocks on the same machine reads them instead of measuring again, so
fresh processes plan alike, quiet or loaded.  A measurement is written under a file lock, and processes that
profile at once wait for the first: they read what it measured.

The file is ``$REMAT_CACHE_DIR/timings.json`` (default ``~/.cache/remat``); ``REMAT_CACHE_DIR=off`` turns
the cache off, and ``remat.profile(..., fresh_timings=True)`` (``remat plan --fresh-timings``) measures again
and replaces what the file holds for those blocks.

Example:
    >>> with timings_cache() as cache:
    ...     times = cache.get("ops", signature) or cache.put("ops", signature, measure())
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["TimingCache", "cache_dir", "measuring_afresh", "timings_cache"]

_VERSION = 2  # 2: a policy's cost per op from whole runs under its modes (timing.time_ops)
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
    """The timings file of this machine, read and written while :func:`timings_cache` holds its lock."""

    def __init__(self, path: Path | None, fresh: bool) -> None:
        self.path = path
        self.fresh = fresh
        self.entries: dict[str, Any] = {}
        self.changed = False
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
def timings_cache() -> Iterator[TimingCache]:
    """The machine's timings, locked against other processes until the block ends (then written back).

    Example:
        >>> with timings_cache() as cache:
        ...     cache.get("ops", "3f2a...", "cpu")
    """
    directory, fresh = cache_dir(), _fresh.get()
    if directory is None:
        yield TimingCache(None, fresh=True)
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / "timings.lock", "a")  # noqa: SIM115 - held for the block, closed below
    except OSError:  # a read-only home: measure as if there were no cache
        yield TimingCache(None, fresh=True)
        return
    with lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no advisory locks here (Windows): processes may measure the same blocks twice
        cache = TimingCache(directory / "timings.json", fresh)
        yield cache
        cache._write()
