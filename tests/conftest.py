import pytest
import torch


def hooks_on_stack():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


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


@pytest.fixture(autouse=True)
def own_timings_cache(tmp_path, monkeypatch):
    """Every test measures into a timings cache of its own (remat.planning.timecache): nothing measured by
    another test, or on this machine before, decides a plan here."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "remat-cache"))
    # Whether a busy machine's timings count as unsteady depends on the machine: no test's output may.
    monkeypatch.setenv("REMAT_UNSTEADY_SPREAD", "inf")
