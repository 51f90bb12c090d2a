"""benchmarks/gpu.py runs end to end on the CPU path (a tiny Llama, three modes): rows, peaks, predictions.

No timing is asserted; the benchmark's numbers are taken by hand on a GPU.
"""

import contextlib
import importlib.util
import json
import pathlib
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
SMALLEST = ["--device", "cpu", "--tiny", "--hidden", "16", "--heads", "2", "--layers", "3", "--intermediate", "32",
            "--vocab", "32", "--batch", "2", "--seq", "64", "--rounds", "1", "--warmup", "0",
            "--profile-repeats", "1"]


@pytest.fixture(scope="module")
def gpu_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_cpu_run_prints_every_row_and_the_plan_predictions(gpu_benchmark, tmp_path, capsys, monkeypatch):
    out = tmp_path / "results.json"
    weights = []  # a parameter as each step found it
    step = gpu_benchmark.Workload.step

    def watched(self, model=None, context=contextlib.nullcontext):
        weights.append(next(self.model.parameters()).detach().clone())
        step(self, model, context)

    monkeypatch.setattr(gpu_benchmark.Workload, "step", watched)
    assert gpu_benchmark.main([*SMALLEST, "--modes", "remat-ckpt", "plan-50", "--json", str(out)]) == 0
    # the step that creates the optimizer's state, then one timed step per mode: each follows an optimizer step
    trained = weights[:4]
    assert all(not torch.equal(before, after) for before, after in zip(trained, trained[1:]))
    table = capsys.readouterr().out
    for label in ("| plain |", "| remat checkpoint, every layer |", "| remat plan 50% ("):
        assert label in table
    assert "predicted vs measured" in table
    rows = {row["key"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "remat-ckpt", "plan-50"]
    assert all(row["failure"] is None and row["median_ms"] > 0 for row in rows.values())
    assert rows["remat-ckpt"]["peak"] < rows["plain"]["peak"]  # the layers really were checkpointed
    assert rows["plan-50"]["predicted_peak"] > 0 and rows["plan-50"]["peak"] > 0
    assert rows["plan-50"]["predicted_extra"] is not None


def test_cpu_run_of_the_chunked_head_row(gpu_benchmark, tmp_path, capsys):
    out = tmp_path / "results.json"
    modes = ["--modes", "remat-ckpt", "remat-ckpt-chunked-head"]
    assert gpu_benchmark.main([*SMALLEST, "--vocab", "2000", *modes, "--json", str(out)]) == 0  # logits to matter
    assert "| remat checkpoint, every layer + head in " in capsys.readouterr().out
    rows = {row["key"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "remat-ckpt", "remat-ckpt-chunked-head"]
    assert all(row["failure"] is None for row in rows.values())
    # the logits (and their float32 copy and gradient) are never whole: below every layer checkpointed alone
    assert rows["remat-ckpt-chunked-head"]["peak"] < rows["remat-ckpt"]["peak"]


def test_without_cuda_it_skips_and_exits_0(gpu_benchmark, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_benchmark.main([]) == 0
    assert "skipped, no CUDA device" in capsys.readouterr().out


def test_an_unknown_mode_is_named(gpu_benchmark):
    with pytest.raises(SystemExit, match="no mode matches plan-40"):
        gpu_benchmark.main(["--device", "cpu", "--modes", "plan-40"])


def test_the_cuda_path_times_with_events_and_reads_the_peak_above_the_start(gpu_benchmark, monkeypatch):
    """Fakes stand in for CUDA: the step's time is the events' elapsed time, its peak the allocator's after a
    reset, less what was allocated when it began."""
    allocator = {"allocated": 1000, "peak": 99_999}  # a higher peak from before the step must not count

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return 12.5  # milliseconds, as CUDA events report

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: allocator.update(peak=allocator["allocated"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])

    def step():
        allocator["peak"] = max(allocator["peak"], 1000 + 4096)

    assert gpu_benchmark._measured(torch.device("cuda"), step) == (0.0125, 4096)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_the_spread_offloaded_input_and_mixed_plan_rows_run_on_both_models(gpu_benchmark, tmp_path, capsys, model):
    out = tmp_path / "results.json"
    modes = ["spread-*", "remat-ckpt-offload", "plan-offload-50", "plan-kept-offload-50", "plan-lowest"]
    assert gpu_benchmark.main([*SMALLEST, "--model", model, "--modes", *modes, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "remat's plans beside the rules, predicted" in printed and "every-k 3 of 3" in printed
    results = json.loads(out.read_text())
    assert results["model"]["family"] == model
    rows = {row["key"]: row for row in results["rows"]}
    assert list(rows) == ["plain", "spread-25", "spread-50", "spread-75", "remat-ckpt-offload", "plan-offload-50",
                          "plan-kept-offload-50", "plan-lowest"]
    assert all(row["failure"] is None and row["median_ms"] > 0 for row in rows.values())
    assert rows["spread-75"]["label"] == "remat checkpoint, 2 of 3 layers spread"
    # checkpointing more layers keeps less; every layer checkpointed (the last plainly) keeps least of them
    assert rows["spread-25"]["peak"] > rows["spread-75"]["peak"] > rows["remat-ckpt-offload"]["peak"]
    assert rows["plan-lowest"]["predicted_peak"] <= rows["plan-offload-50"]["predicted_peak"]


def test_quick_means_fewer_rounds_and_no_compiled_rows(gpu_benchmark):
    args = gpu_benchmark.parse(["--quick"])
    assert (args.rounds, args.warmup, args.profile_repeats, args.compile) == (3, 1, 2, False)
    assert (args.hidden, args.layers) == (2048, 12)
    args = gpu_benchmark.parse(["--quick", "--model", "gpt2", "--rounds", "5"])
    assert (args.rounds, args.hidden, args.layers, args.batch, args.seq) == (5, 1024, 16, 8, 1024)


def test_the_compiled_front_says_where_remat_is_left_of_torch_compiles_budget(gpu_benchmark):
    """Each of torch.compile's budgets beside remat's plan compiled at the peak that budget reached: remat's
    point dominates only when it is as fast and as small (both measured)."""
    def entry(key, ms, peak):
        return {"key": key, "median_ms": ms, "peak": peak}

    table = gpu_benchmark._compiled_front([
        entry("compiled-plain", 70.0, 8 << 30), entry("compiled-match-1", 69.0, 7 << 30),
        entry("compiled-budget-0.5", 80.0, 6 << 30), entry("compiled-match-0.5", 82.0, 5 << 30),
        entry("compiled-budget-0.3", 90.0, 6 << 30),  # no remat row: left out
    ])
    rows = [line for line in table.splitlines()[2:]]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "0.5"]
    assert [row.split("|")[-2].strip() for row in rows] == ["yes", "no"]
    assert gpu_benchmark.select(["compiled-match-*"], compile_rows=True)[1:] == [
        "compiled-match-1", "compiled-match-0.7", "compiled-match-0.5", "compiled-match-0.3"]
