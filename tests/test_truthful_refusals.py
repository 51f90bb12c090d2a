"""Refusals and warnings that tell the truth: options this device cannot have are named with what they need, the
advice lowers the smallest peak it is given for, one smallest peak per refusal, one line per unsteady profile, and
blocks named as the paths they are."""

import sys
import textwrap
import traceback
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.planning.basics.units import Budget
from remat.planning.measure import opgraph
from remat.planning.solve.head import plan_with_head
from remat.planning.solve.solver import plan_from_profile
from remat.tools.cli import main


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


class _Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _mlp_profile() -> remat.Profile:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(4)])
    return remat.profile(model, torch.randn(256, 32), loss_fn=lambda out: out.pow(2).mean(), repeats=1)


_NEEDS = r"an accelerator whose copies run on their own stream \(CUDA\); on cpu"


# ---- options this device cannot have -----------------------------------------------------------------
@pytest.mark.parametrize("allow", [("checkpoint_offload",), ("keep_offload",), ("offload",),
                                   ("checkpoint_offload", "keep_offload")])
def test_offload_options_alone_on_the_cpu_are_refused_with_what_they_need(allow):
    prof = _mlp_profile()
    with pytest.raises(ValueError) as refused:
        prof.plan("60%", allow=allow)
    line = _one_line(str(refused.value))
    assert not isinstance(refused.value, remat.InfeasibleBudget), line
    assert f"{' and '.join(allow)} need" in line and "not available" in line
    assert "allow checkpoint, save_matmuls or selective" in line
    assert "frees memory" not in line and "write in place" not in line


def test_offload_beside_checkpoint_on_the_cpu_is_said_in_one_line_and_checkpoint_plans():
    prof = _mlp_profile()
    with pytest.warns(UserWarning, match=rf"^remat\.plan: offload needs {_NEEDS} it is not available; planning with "
                                         r"checkpoint only\.$") as told:
        plan = prof.plan("60%", allow=("checkpoint", "offload"))
    assert "checkpoint" in plan.decisions.values()
    assert [w.filename for w in told if "offload" in str(w.message)] == [__file__]
    # a refusal says it too, in its one line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(remat.InfeasibleBudget, match=rf"offload needs {_NEEDS} it is not available\. "):
            prof.plan("1%", allow=("checkpoint", "offload"))
    assert not caught  # said once, in the refusal's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default options say nothing: the CPU has what it has
        prof.plan("60%")


_USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn

    def mlp():
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)) for _ in range(3)])
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "truthful_refusals_model.py").write_text(_USER_MODULE)
    monkeypatch.chdir(tmp_path)
    yield "truthful_refusals_model"
    sys.modules.pop("truthful_refusals_model", None)


def test_the_command_refuses_allow_offload_on_the_cpu_in_one_line(user_module, capsys):
    argv = ["plan", f"{user_module}:mlp", "--input-shape", "64,8", "--budget", "60%", "--allow", "offload"]
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("remat plan: error: offload needs an accelerator whose copies run on their own stream "
                           "(CUDA); on cpu it is not available"), line
    argv[-3:] = ["90%", "--allow", "checkpoint", "offload"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert _one_line(captured.err) == ("remat plan: warning: offload needs an accelerator whose copies run on their "
                                       "own stream (CUDA); on cpu it is not available; planning with checkpoint only.")


# ---- advice that lowers the smallest peak ------------------------------------------------------------
class _PreActivation(nn.Module):
    """ReLU first, on the block's input: with inplace=True the block writes in place to its input."""

    def __init__(self, channels: int, inplace: bool) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=inplace)
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.relu(x)))


class _ConvNet(nn.Module):
    def __init__(self, inplace: bool = True, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.blocks = nn.ModuleList(_PreActivation(16, inplace) for _ in range(depth))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def _conv_profile(model: nn.Module) -> remat.Profile:
    torch.manual_seed(0)
    return remat.profile(model.train(), torch.randn(8, 3, 32, 32), loss_fn=lambda out: out.pow(2).mean(), repeats=1)


def _smallest(prof: remat.Profile) -> int:
    with pytest.raises(remat.InfeasibleBudget) as refused:
        prof.plan("1B")
    return refused.value.smallest


def test_in_place_relus_are_named_as_paths_with_inplace_false_and_the_peak_it_gives_is_reached():
    torch.manual_seed(0)
    model = _ConvNet(inplace=True)
    prof = _conv_profile(model)
    assert [row.name for row in prof.rows] == [f"blocks.{i}" for i in range(4)]  # remat's own discovery
    with pytest.raises(remat.InfeasibleBudget) as refused:
        prof.plan("30%")
    line = _one_line(str(refused.value))
    assert "build `blocks.0.relu`, `blocks.1.relu`, `blocks.2.relu` and 1 more with inplace=False" in line
    assert "x.clone()" not in line and "larger blocks" not in line and "frees memory" not in line
    stated = refused.value.reasons["unwritten"]
    assert stated < refused.value.smallest
    # the advice followed: the same weights, every ReLU built with inplace=False
    unwritten = _ConvNet(inplace=False)
    unwritten.load_state_dict(model.state_dict())
    reached = _smallest(_conv_profile(unwritten))
    assert abs(reached - stated) <= 0.01 * reached and reached < refused.value.smallest, (reached, stated)
    assert "the smallest peak would then be about 4.0 MiB above parameters, 73% of the unplanned peak" in line


def _chained_convs(inplace: bool) -> nn.Sequential:
    layers, width = [], 3
    for out in (16, 32, 32):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(inplace=inplace)]
        width = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def test_no_advice_about_writing_blocks_where_stopping_them_lowers_nothing():
    """Runs of an nn.Sequential's children already start before each in-place ReLU: neither inplace=False nor larger
    blocks lower the smallest peak, so the refusal advises neither."""
    torch.manual_seed(0)
    model = _chained_convs(inplace=True)
    prof = _conv_profile(model)
    assert any(row.writes_input for row in prof.rows)
    with pytest.raises(remat.InfeasibleBudget) as refused:
        prof.plan("30%")
    line = _one_line(str(refused.value))
    assert "write in place" not in line and "inplace=False" not in line and "larger blocks" not in line, line
    assert line.endswith("Raise the budget to at least that, or reduce the batch / sequence length.")
    unwritten = _chained_convs(inplace=False)
    unwritten.load_state_dict(model.state_dict())
    assert _smallest(_conv_profile(unwritten)) >= refused.value.smallest


# ---- one smallest peak -------------------------------------------------------------------------------
def test_a_refusal_with_the_chunked_head_states_one_smallest_peak_the_lowest():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 512, (4, 32))
    prof = remat.profile(model, input_ids=ids, labels=ids, repeats=1)
    assert prof.head is not None
    whole = Budget(fraction=0.01).bytes_for(prof.param_bytes + prof.buffer_bytes, prof.peak_above_params)
    floors = []
    for profile in (prof, prof.head.profile):
        with pytest.raises(remat.InfeasibleBudget) as alone:
            plan_from_profile(profile, Budget(nbytes=whole))
        floors.append(alone.value.smallest)
    assert floors[1] < floors[0]  # two floors: the refusal states the lower one, and only it
    with pytest.raises(remat.InfeasibleBudget) as refused:
        plan_with_head(prof, prof.head, 0.01)
    assert refused.value.smallest == min(floors)
    assert sum(refused.value.parts.values()) == refused.value.smallest  # what the lower floor is made of
    told = "".join(traceback.format_exception(refused.value))
    assert told.count("the smallest peak any plan reaches") == 1, told
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


# ---- one line per profile, blocks as paths -----------------------------------------------------------
def test_unsteady_timings_are_one_line_per_profile_naming_blocks_as_paths(monkeypatch):
    real = opgraph._time_block
    monkeypatch.setattr(opgraph, "_time_block", lambda *a: opgraph.replace(real(*a), spread=0.5))
    monkeypatch.setenv("REMAT_UNSTEADY_SPREAD", "0.1")
    model = nn.Sequential(_Block(8), nn.Linear(8, 16), _Block(16), nn.Linear(16, 24), _Block(24))  # 3 signatures
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.profile_ops(model, torch.randn(4, 8), modules=["0", "2", "4"], repeats=1)
    unsteady = [str(w.message) for w in caught if issubclass(w.category, remat.UnsteadyTimings)]
    assert len(unsteady) == 1, unsteady
    assert _one_line(unsteady[0]).startswith("remat.profile: the forward of `0` and 2 more blocks varied by up to 50%")



def test_larger_blocks_are_advised_only_where_runs_of_these_were_not_weighed():
    common = {"budget": 1_000, "smallest": 2_000, "param_bytes": 0, "unplanned_above": 2_000, "nothing_frees": True}
    apart = _one_line(str(remat.InfeasibleBudget(**common)))
    assert "name larger blocks with modules=[...]" in apart
    chained = _one_line(str(remat.InfeasibleBudget(**common, chained=True)))
    assert "larger blocks" not in chained and chained.endswith("nor any run of them as one region: reduce the batch "
                                                               "/ sequence length.")


def test_a_refusal_says_where_the_smallest_peak_falls():
    """What dominates the floor: a large vocabulary's logits and their gradients (no block option changes them),
    or, with a tiny one, a block's own forward or backward."""
    import torch.nn.functional as F

    from remat.models import GPT, GPTConfig, synthetic_batch

    found = {}
    for vocab, width in ((2000, 64), (64, 256)):
        cfg = GPTConfig(n_layers=3, d_model=width, seq_len=64, vocab_size=vocab)
        torch.manual_seed(0)
        model = GPT(cfg)
        tokens, targets = synthetic_batch(cfg, 2)
        prof = remat.profile(model, tokens, loss_fn=lambda out, t=targets: F.cross_entropy(out.flatten(0, 1),
                                                                                           t.flatten()), ops=False)
        with pytest.raises(remat.InfeasibleBudget) as refused:
            prof.plan(0.05)
        found[vocab] = str(refused.value)
        assert "\n" not in found[vocab]
    assert "reaches is" in found[2000] and "in the output layer and loss's backward" in found[2000]
    assert "remat.chunked_lm_loss" in found[2000]
    assert "`blocks." in found[64] and "output layer" not in found[64]
