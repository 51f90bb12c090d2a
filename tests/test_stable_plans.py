"""The same model, inputs and budget give the same plan in fresh processes, quiet or loaded.

Three processes profile and plan the same small GPT at once, beside one another (the machine is loaded by
them); their plans (decisions and every op-level policy) must be identical.  What makes them so: measured
times are kept per machine (:mod:`remat.planning.measure.timecache`), and processes that profile at once wait for
the first and read what it measured.  Measuring afresh replaces those times.
"""

import json
import subprocess
import sys
import warnings

import pytest
import torch

import remat
from remat.planning.measure import opgraph, overheads
from remat.planning.measure.timecache import cache_dir

_PLAN = """
import json
import torch
torch.set_num_threads(1)
import torch.nn.functional as F
import remat
from remat.models import GPT, GPTConfig, synthetic_batch
torch.manual_seed(0)
cfg = GPTConfig(n_layers=3, d_model=32, n_heads=2, seq_len=32, vocab_size=64, dropout=0.1)
model = GPT(cfg)
tokens, targets = synthetic_batch(cfg, 4, torch.Generator().manual_seed(0))
prof = remat.profile(model, tokens, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()),
                     repeats=2)
plans = {budget: prof.plan(budget) for budget in ("70%", "50%")}
print(json.dumps({b: {"decisions": p.decisions, "policies": p.policies} for b, p in plans.items()}, sort_keys=True))
"""


def test_fresh_processes_at_once_make_the_same_plan():
    runs = [subprocess.Popen([sys.executable, "-c", _PLAN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(3)]
    plans = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        plans.append(json.loads(out.strip().splitlines()[-1]))
    assert all(len(p["decisions"]) == 3 for p in plans[0].values())
    assert all(plan == plans[0] for plan in plans), plans


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                      torch.nn.Linear(32, 16)) for _ in range(3)))


def _counted(monkeypatch) -> list[str]:
    """Times each block as before, steady (so that a busy machine does not make it measure again)."""
    timed, real = [], opgraph._time_block
    monkeypatch.setattr(opgraph, "_time_block",
                        lambda *a: timed.append(a[0].name) or opgraph.replace(real(*a), spread=0.0))
    return timed


def test_timings_are_measured_once_per_machine_and_again_when_asked(monkeypatch):
    timed = _counted(monkeypatch)
    x = torch.randn(8, 16, requires_grad=True)
    first = remat.profile_ops(_model(), x, repeats=2)
    assert len(timed) == 1  # three blocks alike: one timing, shared
    again = remat.profile_ops(_model(), x, repeats=2)
    assert len(timed) == 1 and again.blocks["0"].nodes == first.blocks["0"].nodes
    with remat.planning.measure.timecache.measuring_afresh():
        remat.profile_ops(_model(), x, repeats=2)
    assert len(timed) == 2
    assert (cache_dir() / "timings.json").exists()


def test_a_damaged_timings_file_is_measured_over_and_the_cache_can_be_turned_off(monkeypatch):
    x = torch.randn(8, 16, requires_grad=True)
    cache_dir().mkdir(parents=True)
    (cache_dir() / "timings.json").write_text("{not json")
    remat.profile_ops(_model(), x, repeats=1)
    assert json.loads((cache_dir() / "timings.json").read_text())
    monkeypatch.setenv("REMAT_CACHE_DIR", "off")
    assert cache_dir() is None
    timed = _counted(monkeypatch)
    remat.profile_ops(_model(), x, repeats=1)
    remat.profile_ops(_model(), x, repeats=1)
    assert len(timed) == 2


@pytest.mark.parametrize("steady_on_second_try", [True, False])
def test_unsteady_timings_are_measured_again_then_warned_about(monkeypatch, steady_on_second_try):
    real = opgraph._time_block
    rounds = []

    def shaky(record, n, repeats):
        rounds.append(repeats)
        times = real(record, n, repeats)
        steady = steady_on_second_try and len(rounds) > 1
        return opgraph.replace(times, spread=0.0 if steady else 0.5)

    monkeypatch.setattr(opgraph, "_time_block", shaky)
    monkeypatch.setenv("REMAT_UNSTEADY_SPREAD", "0.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.profile_ops(_model(), torch.randn(8, 16, requires_grad=True), repeats=2)
    assert rounds == [2, 5]
    unsteady = [w for w in caught if issubclass(w.category, opgraph.UnsteadyTimings)]
    assert len(unsteady) == (0 if steady_on_second_try else 1)
    if unsteady:
        assert "not cached: profile again on a quieter machine" in str(unsteady[0].message)
        assert "\n" not in str(unsteady[0].message)


# ---- what is cached cannot stick when it is wrong (fake clocks: no test here depends on real timing) ----------
def _scripted(monkeypatch, step_seconds: float, block_forward: float = 1e-3, spread: float = 0.0,
              step_spread: float = 0.0) -> list[str]:
    """This process's step takes ``step_seconds`` and each block's forward ``block_forward``, as scripted; returns
    the names of the blocks timed."""
    from remat.planning.measure import profile as profile_module
    from remat.planning.measure.timecache import StepTime
    from remat.planning.measure.timing import OpTimes

    timed = []

    def time_block(record, n, repeats):
        timed.append(record.name)
        return OpTimes([block_forward / n] * n, [0.0] * n, block_forward, 0.0, 0.0, False, spread)

    monkeypatch.setattr(opgraph, "_time_block", time_block)
    monkeypatch.setattr(profile_module, "_time_steps", lambda *a: StepTime(step_seconds, step_spread))
    monkeypatch.setattr(overheads, "_measure", lambda *a: (_OVERHEADS, 0.0))  # the machinery's, as scripted too
    monkeypatch.setattr(overheads, "measure_overheads", lambda **k: _OVERHEADS)
    monkeypatch.setenv("REMAT_UNSTEADY_SPREAD", "0.1")
    return timed


_OVERHEADS = overheads.Overheads(region=2e-4, per_saved=1e-5, policy_forward=3e-6, policy_replay=2e-6,
                                 copy_per_byte=1e-10)


def _profile():
    return remat.profile(_model(), torch.randn(256, 16), loss_fn=lambda out: out.sum(), repeats=2)


def _entries(kind: str) -> dict:
    return {k: v for k, v in json.loads((cache_dir() / "timings.json").read_text()).items() if k.startswith(kind)}


def test_a_poisoned_cached_timing_is_caught_and_measured_again_with_one_line(monkeypatch):
    monkeypatch.delenv("REMAT_STALE_SPREAD")  # the default limit, which this test checks
    timed = _scripted(monkeypatch, step_seconds=10e-3)
    _profile()
    measured = len(timed)
    entries = json.loads((cache_dir() / "timings.json").read_text())
    for key, value in entries.items():  # the block's forward cached 70 times too slow
        if key.startswith("ops|"):
            value.update(forward=value["forward"] * 70, device=[d * 70 for d in value["device"]])
    (cache_dir() / "timings.json").write_text(json.dumps(entries))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = _profile()
    stale = [w for w in caught if issubclass(w.category, remat.planning.measure.timecache.StaleTimings)]
    assert len(timed) == 2 * measured and len(stale) == 1 and stale[0].filename == __file__
    message = str(stale[0].message)
    assert "\n" not in message and message.startswith("remat.profile: the cached timings of `0` and 2 more blocks are "
                                                      "not this machine's now (their blocks' forwards add up to 210.0 "
                                                      "ms, more than this process's whole training step (10.0 ms));")
    assert prof.ops.blocks["0"].forward_time == pytest.approx(1e-3)
    assert [v["forward"] for v in _entries("ops|").values()] == [pytest.approx(1e-3)] * measured  # mended


def test_poisoned_cached_overheads_are_caught_and_measured_again_with_one_line(monkeypatch):
    monkeypatch.delenv("REMAT_STALE_SPREAD")  # the default limit, which this test checks
    _scripted(monkeypatch, step_seconds=10e-3)
    fresh = _profile().plan(0.7, allow=("checkpoint",))
    assert "checkpoint" in fresh.decisions.values()
    entries = json.loads((cache_dir() / "timings.json").read_text())
    for key, value in entries.items():  # every overhead cached 50 times what this machine measures
        if key.startswith("overheads|"):
            entries[key] = {name: figure * 50 for name, figure in value.items()}
    (cache_dir() / "timings.json").write_text(json.dumps(entries))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = _profile()
    stale = [w for w in caught if issubclass(w.category, remat.planning.measure.timecache.StaleTimings)]
    assert len(stale) == 1 and stale[0].filename == __file__
    message = str(stale[0].message)
    assert "\n" not in message and message == (
        "remat.profile: the cached overheads of the checkpoint machinery are not this machine's now (a region "
        "saving 64 tensors costs 42.000 ms by them, 0.840 ms now); measuring them again.")
    assert prof.plan(0.7, allow=("checkpoint",)).predicted_extra_time == pytest.approx(fresh.predicted_extra_time)
    assert [overheads.Overheads(**v) for v in _entries("overheads|").values()] == [_OVERHEADS]  # mended
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mended: no second line
        _profile()


def test_no_timing_from_an_unsteady_round_is_cached(monkeypatch):
    timed = _scripted(monkeypatch, step_seconds=10e-3, spread=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # UnsteadyTimings: told elsewhere
        _profile()
        _profile()
    assert len(timed) == 4 * len(set(timed))  # measured, again for its spread; in both profiles: nothing kept
    assert not (cache_dir() / "timings.json").exists() or not _entries("ops|") and not _entries("step|")
    timed = _scripted(monkeypatch, step_seconds=10e-3, step_spread=0.5)  # steady blocks, an unsteady step
    _profile()
    assert _entries("ops|") and not _entries("step|")


def test_a_plan_prints_the_share_of_the_step_its_prices_came_from(monkeypatch):
    monkeypatch.delenv("REMAT_STALE_SPREAD")  # the default limit, which this test checks
    _scripted(monkeypatch, step_seconds=10e-3)
    first = _profile()
    timed = _scripted(monkeypatch, step_seconds=13e-3)  # another process, a little busier: the cache stands
    again = _profile()
    assert not timed and again.step_time == first.step_time == pytest.approx(10e-3)
    plans = [prof.plan(0.7, allow=("checkpoint",)) for prof in (first, again)]
    assert "checkpoint" in plans[0].decisions.values()
    assert str(plans[0]).splitlines()[-1] == str(plans[1]).splitlines()[-1] and "%)" in str(plans[0])
    assert plans[0].step_time == plans[1].step_time == pytest.approx(10e-3)
    timed = _scripted(monkeypatch, step_seconds=40e-3)  # four times the step cached with the prices: stale
    with pytest.warns(remat.planning.measure.timecache.StaleTimings, match="the training step measured with them took "
                      "10.0 ms, this process's 40.0 ms"):
        moved = _profile()
    assert timed and moved.step_time == pytest.approx(40e-3)
    assert [v["seconds"] for v in _entries("step|").values()] == [pytest.approx(40e-3)]


def test_a_cached_link_to_host_memory_is_checked_too(monkeypatch):
    from dataclasses import asdict, replace

    from remat.planning.measure.timecache import StaleTimings, TimingCache

    monkeypatch.delenv("REMAT_STALE_SPREAD")  # the default limit, which this test checks
    linked = replace(_OVERHEADS, link_bytes_per_s=20e9)  # an accelerator's, as scripted
    monkeypatch.setattr(overheads, "_measure", lambda *a: (_OVERHEADS, 0.0))
    monkeypatch.setattr(overheads, "_link_bandwidth", lambda *a: linked.link_bytes_per_s)
    cache = TimingCache(None, fresh=False)
    cache.put("overheads", "", "cpu", asdict(linked))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert overheads.cached_overheads(cache, "cpu") == linked  # agrees: kept, no line
    cache.put("overheads", "", "cpu", asdict(replace(linked, link_bytes_per_s=0.4e9)))  # 50 times too slow
    with pytest.warns(StaleTimings, match=r"\(a copy of 4\.0 MiB to host memory costs 10\.486 ms by them, 0\.210 ms "):
        assert overheads.cached_overheads(cache, "cpu") == linked


def test_all_gather_times_are_kept_checked_and_measured_again_when_asked(monkeypatch, tmp_path):
    """A partitioned input's all-gather (remat.planning.measure.gathers) is timed once per machine, group size and
    backend: a later profile reads the kept time after one all-gather checks it, ``fresh_timings`` measures again,
    a time far from the kept one's is measured again with one line, and an unsteady one is never kept."""
    from remat.planning.measure.gathers import kept_gather_times
    from remat.planning.measure.timecache import StaleTimings, measuring_afresh, timings_cache

    monkeypatch.delenv("REMAT_STALE_SPREAD")  # the default limits, which this test checks
    monkeypatch.delenv("REMAT_UNSTEADY_SPREAD")
    calls, machine = [], {"seconds": 1e-3, "rounds": None}

    def timed(size: int, rounds: int) -> list[float]:  # what gloo would take: a scripted time per 512 KiB
        calls.append((size, rounds))
        scripted = machine["rounds"] or [machine["seconds"]] * rounds
        return [t * size / (512 << 10) for t in scripted[:rounds]]

    def gathers(expected_calls: list[tuple[int, int]]) -> list[float]:
        calls.clear()
        with timings_cache() as cache:
            seconds = kept_gather_times(cache, {512 << 10, 1 << 20}, "2 ranks (gloo)", "cpu", timed)
        assert calls == expected_calls
        return [seconds[512 << 10], seconds[1 << 20]]

    measured = [(512 << 10, 3), (1 << 20, 3)]
    assert gathers(measured) == pytest.approx([1e-3, 2e-3])
    machine["seconds"] = 1.2e-3  # another process, a little busier: the kept times stand, one all-gather checks them
    assert gathers([(1 << 20, 1)]) == pytest.approx([1e-3, 2e-3])
    with measuring_afresh():  # remat.profile(..., fresh_timings=True)
        assert gathers(measured) == pytest.approx([1.2e-3, 2.4e-3])
    assert gathers([(1 << 20, 1)]) == pytest.approx([1.2e-3, 2.4e-3])  # and replaced what was kept
    machine["seconds"] = 6e-3  # five times the kept time: not this machine's now
    with pytest.warns(StaleTimings, match=r"^remat.profile: the cached times of all-gathers over 2 ranks \(gloo\) "
                                          r"are not this machine's now \(an all-gather of a 1048576-byte shard takes "
                                          r"2\.400 ms by them, 12\.000 ms now\); measuring them again\.$"):
        assert gathers([(1 << 20, 1), *measured]) == pytest.approx([6e-3, 12e-3])
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "another"))
    machine["rounds"] = [1e-3, 1e-3, 3e-3]  # spread twice the median: serves this profile, never kept
    assert gathers(measured) == pytest.approx([1e-3, 2e-3])
    assert gathers(measured) == pytest.approx([1e-3, 2e-3])
