"""What ``benchmarks/gpu.py`` measured, as rows, and how it prints and saves them.

A :class:`Row` holds one mode's seconds per timed round, its peak and, for a plan, its predictions;
:func:`summarize` turns the rows into entries (medians, per-round ratios to plain), which the tables print
and :func:`save` writes as JSON with the run's header.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Row", "format_plans", "format_table", "mib", "print_header", "report", "save", "summarize"]


@dataclass
class Row:
    key: str
    label: str
    seconds: dict[int, float] = field(default_factory=dict)  # by timed round
    peak: int | None = None
    failure: str | None = None
    predicted_peak: int | None = None  # above parameters and buffers
    predicted_extra: float | None = None
    predicted_step: float | None = None


def summarize(rows: dict[str, Row], plain: Row) -> list[dict[str, Any]]:
    """Per row: median ms, median per-round ratio to plain, peak, its ratio to plain's, predictions."""
    out = []
    for row in rows.values():
        entry = asdict(row)
        timed = [(s, plain.seconds[r]) for r, s in row.seconds.items() if r in plain.seconds]
        if row.failure is None and timed:
            entry["median_ms"] = statistics.median(s for s, _ in timed) * 1e3
            entry["ratio"] = statistics.median(s / p for s, p in timed)
            entry["extra_ms"] = statistics.median(s - p for s, p in timed) * 1e3
            entry["plain_ms"] = statistics.median(p for _, p in timed) * 1e3
        if row.peak is not None and plain.peak:
            entry["peak_ratio"] = row.peak / plain.peak
        out.append(entry)
    return out


def mib(nbytes: int | None) -> str:
    if nbytes is None:
        return "—"
    mebibytes = nbytes / 2**20
    return f"{mebibytes:.0f}" if mebibytes >= 100 else f"{mebibytes:.2f}"


def format_table(entries: list[dict[str, Any]]) -> str:
    lines = ["| mode | step ms | × plain | peak MiB | × plain's peak |", "|---|---|---|---|---|"]
    for e in entries:
        if "median_ms" not in e:
            lines.append(f"| {e['label']} | {e['failure'] or '—'} | | | |")
            continue
        ratio = f"{e['peak_ratio']:.2f}" if "peak_ratio" in e else "—"
        lines.append(f"| {e['label']} | {e['median_ms']:.1f} | {e['ratio']:.3f} | {mib(e['peak'])} | {ratio} |")
    return "\n".join(lines)


def format_plans(entries: list[dict[str, Any]]) -> str:
    lines = ["| plan | predicted peak MiB | measured | error | predicted extra ms | measured extra ms | error |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        if e["predicted_peak"] is None:
            continue
        pred_peak, peak = e["predicted_peak"], e["peak"]
        peak_error = f"{pred_peak / peak - 1:+.1%}" if peak else "—"
        pred_ms = e["predicted_extra"] * 1e3
        pred = f"{pred_ms:+.1f} ({e['predicted_extra'] / e['predicted_step']:+.0%})" if e["predicted_step"] else \
            f"{pred_ms:+.1f}"
        if "extra_ms" in e:
            measured = f"{e['extra_ms']:+.1f} ({e['extra_ms'] / e['plain_ms']:+.0%})"
            time_error = f"{pred_ms / e['extra_ms'] - 1:+.0%}" if e["extra_ms"] else "—"
        else:
            measured, time_error = e["failure"] or "—", "—"
        lines.append(f"| {e['label']} | {mib(pred_peak)} | {mib(peak)} | {peak_error} | {pred} | {measured} | "
                     f"{time_error} |")
    return "\n".join(lines)


def print_header(info: dict[str, Any]) -> None:
    m = info["model"]
    print(f"device: {info['device']}; torch {info['torch']}, transformers {info['transformers']}, "
          f"CUDA {info['cuda'] or 'none'}, remat {info['remat']}")
    print(f"LlamaForCausalLM: hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, intermediate "
          f"{m['intermediate']}, vocab {m['vocab']} ({m['parameters'] / 1e6:.1f} M parameters), {m['dtype']}, SDPA; "
          f"batch {m['batch']} x seq {m['seq']}; {info['rounds']} interleaved rounds after {info['warmup']} warm-up; "
          f"{info['optimizer']} stepped after every step, untimed")
    if "bandwidth" in info:
        bw = info["bandwidth"]
        print(f"pinned copies: {bw['D2H'] / 1e9:.1f} GB/s device->host, {bw['H2D'] / 1e9:.1f} GB/s host->device; "
              f"device copy {bw['D2D'] / 1e12:.2f} TB/s (bytes copied per second)")
    else:
        print("pinned copies: not measured (no accelerator); time from the CPU's clock, peaks from the profiler's "
              "allocation events")


def save(entries: list[dict[str, Any]], info: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump({**info, "rows": entries}, f, indent=2, default=str)


def report(entries: list[dict[str, Any]], info: dict[str, Any], path: str | None) -> None:
    """Print the rows' table (and the plans' predictions, if any); save them to ``path`` as JSON."""
    print(format_table(entries))
    if any(e["predicted_peak"] is not None for e in entries):
        print("\nremat's plans, predicted vs measured (peak above the step's start; extra time over plain):")
        print(format_plans(entries))
    sys.stdout.flush()
    if path is not None:
        save(entries, info, path)
