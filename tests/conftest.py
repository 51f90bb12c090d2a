import gc

import pytest
import torch


def hooks_on_stack():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@pytest.fixture(autouse=True, scope="module")
def older_objects_set_aside():
    """Python's collections walk only the objects this module's tests made: what is alive when a module starts
    (libraries, other modules' cached models and profiles) is set aside once (``gc.freeze``).  A walk of the
    whole session's objects takes ~0.4 s once transformers is imported, and Python walks them every few
    thousand allocations; a test's own ``gc.collect()`` still frees all its test made."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_hook_left_behind():
    """Every test must leave the saved-tensor hook stack as it found it: empty."""
    assert hooks_on_stack() is None
    yield
    assert hooks_on_stack() is None, "a saved-tensor hook was left pushed"


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Every test runs its main thread with one intra-op thread, and leaves the count as it found it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Whether a busy machine's timings count as unsteady, or cached ones as stale, depends on the machine: no test's
# output may (the tests of those checks set their own limits).
_MACHINE_FREE = {"REMAT_UNSTEADY_SPREAD": "inf", "REMAT_STALE_SPREAD": "inf"}


@pytest.fixture(autouse=True, scope="session")
def session_timings_cache(tmp_path_factory):
    """Module- and session-scoped fixtures profile before a test's own cache is set: they measure into one of
    the session's, never the machine's (~/.cache/remat), which other runs have filled."""
    import os

    settings = {"REMAT_CACHE_DIR": str(tmp_path_factory.mktemp("remat-cache")), **_MACHINE_FREE}
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def own_timings_cache(tmp_path, monkeypatch):
    """Every test measures into a timings cache of its own (remat.planning.measure.timecache): nothing measured by
    another test, or on this machine before, decides a plan here."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "remat-cache"))
    for name, value in _MACHINE_FREE.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def two_rank_reports(tmp_path_factory):
    """The checks that run under torchrun as two CPU ranks, all in one launch (tests/two_ranks.py): the finished
    run, and each check's report path by its module's name."""
    from helpers import run_two_ranks

    folder = tmp_path_factory.mktemp("two-ranks")
    reports = {name: folder / f"{name}.json" for name in ("dist_worker", "dist_chunked_worker", "broadcast_worker",
                                                          "tp_worker", "ranks_worker", "fakeworld_worker",
                                                          "ecosystem_worker", "tp_plan_worker",
                                                          "tp_llama_worker")}
    return run_two_ranks("two_ranks.py", *(f"{name}={path}" for name, path in reports.items())), reports


@pytest.fixture(scope="session")
def two_rank_report(two_rank_reports):
    """``report(worker)``: what one check of the two-rank launch wrote (every rank's results, as JSON), once the
    launch is known to have ended well (its stderr's end where it did not)."""
    import json

    out, reports = two_rank_reports

    def report(worker: str):
        assert out.returncode == 0, out.stderr[-4000:]
        return json.loads(reports[worker].read_text())

    return report
