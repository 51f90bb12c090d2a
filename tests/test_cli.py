"""The remat command, end to end: output, plots, and one-line errors.

The commands run in this process (``remat.tools.cli.main``, output captured as a terminal-less process's would
be); ``test_the_command_as_its_own_process_*`` runs ``python -m remat`` in a fresh interpreter (its exit status
and stderr), ``test_help_and_argument_errors_answer_without_importing_torch`` the command's first steps in one
(the ``remat`` script itself is run by .ci/run's ``remat demo``)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import remat_cli

import remat
from remat.planning.basics.units import parse_budget
from remat.planning.choices.options import ALLOWED, DEFAULT_ALLOW
from remat.tools import demo
from remat.tools.cli import _ALLOW, _ALLOWED, main
from remat.tools.demo import run_demo

USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    def build():
        return nn.Sequential(*[Block() for _ in range(4)])

    def batch():
        return torch.randn(512, 16)

    def keyword_batch():
        return {"input": torch.randn(512, 16)}

    def broken():
        raise RuntimeError("no weights here")

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(2)])

        def forward(self, x, mask):
            return self.blocks(x * mask)
''')


@pytest.fixture()
def user_module(tmp_path):
    (tmp_path / "usermodel.py").write_text(USER_MODULE)
    return tmp_path


def test_demo_command_prints_the_table_writes_a_png_and_its_modes_agree_bitwise(tmp_path, monkeypatch):
    """One run of the command; what it printed, plotted, and the results it printed them from."""
    made = []

    def recorded(*args, **kwargs):
        made.append(run_demo(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(demo, "run_demo", recorded)
    png = tmp_path / "demo.png"
    out = remat_cli("demo", "--layers", "3", "--steps", "2", "--seq-len", "32", "--d-model", "32", "--heads", "2",
                    "--batch-size", "4", "--vocab-size", "64", "--budget", "60%", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    for header in ("peak above params", "whole peak", "step time", "overhead", "max |Δloss|", "max |Δgrad|",
                   "every block", "save_matmuls", "plan at"):
        assert header in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] > 100
    ((results, prof, _),) = made
    plain = results[0]
    assert [r.name for r in results] == ["no checkpointing", "every block", "save_matmuls", "plan at 60%"]
    for r in results[1:]:
        assert r.max_loss_diff(plain) == 0.0 and r.max_grad_diff(plain) == 0.0, r.name
    assert results[1].peak_above_params < plain.peak_above_params
    assert results[3].peak_above_params <= 1.05 * 0.6 * prof.peak_above_params


def test_profile_and_plan_commands_on_a_user_model(user_module, tmp_path):
    out = remat_cli("profile", "usermodel:build", "--inputs", "usermodel:batch", cwd=user_module)
    assert out.returncode == 0, out.stderr
    assert "activations" in out.stdout and "0" in out.stdout
    out = remat_cli("profile", "usermodel:build", "--input-shape", "512,16", "--json", cwd=user_module)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["rows"]) == 4
    plan_path = tmp_path / "plan.json"
    out = remat_cli("plan", "usermodel:build", "--inputs", "usermodel:batch", "--budget", "85%", "--front", "-o",
                    str(plan_path), cwd=user_module)
    assert out.returncode == 0, out.stderr
    assert "decision" in out.stdout and "Predicted peak" in out.stdout
    assert "beside every-k" in out.stdout and "every-k 4 of 4" in out.stdout
    assert set(json.loads(plan_path.read_text())["decisions"]) == {"0", "1", "2", "3"}
    # keyword inputs, and several budgets from one profile
    out = remat_cli("plan", "usermodel:build", "--inputs", "usermodel:keyword_batch", "--budget", "85%", "1KiB",
                    "100%", cwd=user_module)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Predicted peak") == 2 and "== budget 85% ==" in out.stdout
    assert "refused: " in out.stdout and "smallest peak any plan reaches" in out.stdout
    out = remat_cli("profile", "usermodel:build", "--inputs", "usermodel:batch", "--device", "meta", cwd=user_module)
    assert out.returncode == 0, out.stderr
    assert "estimated from FLOPs" in out.stdout


def test_bench_command_runs_a_case(tmp_path):
    out = remat_cli("bench", "--cases", "tiny", "--repeats", "3", "--warmup", "1",
                    "--variants", "plain", "torch", "remat", "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    assert "remat/torch" in out.stdout and "| tiny |" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["profile", "usermodel", "--input-shape", "2,16"], "must look like package.module:function"),
    (["profile", "nosuchmodule:build", "--input-shape", "2,16"], "cannot import 'nosuchmodule'"),
    (["profile", "usermodel:nothing", "--input-shape", "2,16"], "has no 'nothing'"),
    (["profile", "usermodel:broken", "--input-shape", "2,16"], "raised RuntimeError: no weights here"),
    (["profile", "usermodel:build", "--input-shape", "2,7"], "check --input-shape / --inputs"),
    (["profile", "usermodel:build"], "give the model's inputs"),
    (["plan", "usermodel:build", "--input-shape", "32,16", "--budget", "1KiB"], "smallest peak any plan reaches"),
    (["plan", "usermodel:Masked", "--input-shape", "32,16", "--budget", "50%"],
     "Masked.forward(x, mask) is missing a required argument: 'mask'; --input-shape gives positional float inputs "
     "only: for other inputs give --inputs MODULE:FN returning a dict of keyword inputs, e.g. {'x': ..., 'mask': ...}"),
])
def test_bad_input_is_one_line_and_nonzero(user_module, args, message):
    out = remat_cli(*args, cwd=user_module)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_an_impossible_fraction_is_explained_in_the_users_terms(user_module):
    out = remat_cli("plan", "usermodel:build", "--input-shape", "32,16", "--budget", "5%", cwd=user_module)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert line.startswith("remat plan: error: no plan fits the budget: 5% came to ")
    assert line.count("remat") == 1  # one prefix, not the CLI's and the library's
    assert line.count("above parameters") == 2 and line.count("whole step") == 2
    assert "of the unplanned peak" in line


def test_debug_raises_the_error_itself(user_module, monkeypatch):
    monkeypatch.chdir(user_module)
    with pytest.raises(Exception, match="raised RuntimeError: no weights here") as raised:
        main(["profile", "usermodel:broken", "--input-shape", "2,16", "--debug"])
    assert isinstance(raised.value.__cause__, RuntimeError)
    sys.modules.pop("usermodel", None)


def test_the_command_as_its_own_process_exits_2_with_one_line(user_module):
    here = os.path.dirname(os.path.dirname(remat.__file__))  # the remat this test imported, from any folder
    out = subprocess.run([sys.executable, "-m", "remat", "profile", "usermodel:broken", "--input-shape", "2,16"],
                         capture_output=True, text=True, timeout=300, cwd=user_module,
                         env={**os.environ, "PYTHONPATH": here})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["remat profile: error: the factory 'usermodel:broken' raised RuntimeError: "
                                       "no weights here"]


@pytest.mark.parametrize("command", ["demo", "profile", "plan", "bench"])
def test_every_command_has_help_with_examples(command):
    out = remat_cli(command, "--help")
    assert out.returncode == 0 and "examples:" in out.stdout and "usage: remat" in out.stdout


_QUICK_START = textwrap.dedent('''
    import sys
    from remat.tools.cli import main
    for argv in (["--help"], ["plan", "--help"], ["plan", "m:f", "--budget", "50"], ["profile"]):
        try:
            main(argv)
        except SystemExit:
            pass
    print(sorted(m for m in ("torch", "rich", "remat.planning.workflow") if m in sys.modules))
''')


def test_help_and_argument_errors_answer_without_importing_torch():
    """What makes `remat --help` start at once: nothing heavy is imported before a command runs."""
    out = subprocess.run([sys.executable, "-c", _QUICK_START], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "did you mean 50%?" in out.stderr


def test_the_commands_allow_choices_are_the_planners():
    assert _ALLOW == DEFAULT_ALLOW and _ALLOWED == ALLOWED


@pytest.mark.parametrize("budget", ["50", "150%", "1.5", "0%", "lots", "0", "-1", "0GiB", "5000"])
def test_a_bad_budget_reads_the_same_in_python_and_on_the_command_line(budget, capsys):
    with pytest.raises(ValueError) as python:
        parse_budget(budget)
    with pytest.raises(SystemExit) as exited:
        main(["plan", "usermodel:build", "--input-shape", "8,16", "--budget", budget])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"remat plan: error: argument --budget: {python.value}"


_HF_MODULE = textwrap.dedent('''
    import torch
    import transformers

    def llama():  # a stock config: use_cache=True
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        return transformers.LlamaForCausalLM(cfg)

    def tokens():  # no labels
        return {"input_ids": torch.randint(0, 128, (2, 32))}
''')


def test_a_stock_hugging_face_model_profiles_on_the_meta_device(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "hfmodel.py").write_text(_HF_MODULE)
    out = remat_cli("profile", "hfmodel:llama", "--inputs", "hfmodel:tokens", "--device", "meta", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "LlamaDecoderLayer" in out.stdout and "estimated from FLOPs" in out.stdout
    assert "note: on the meta device, the data checks at transformers/masking_utils.py:" in out.stdout
    warned = [line for line in out.stderr.splitlines() if line.startswith("remat profile: warning: ")]
    assert len(warned) == 2, out.stderr
    assert "use_cache=True is incompatible with checkpointing in training" in warned[0]
    assert "the model returned no loss (no labels among its inputs)" in warned[1]
    assert "return labels from --inputs" in warned[1]


def test_the_plan_command_records_the_op_graphs_partitioned_inputs_are_priced_from(user_module, monkeypatch):
    """``checkpoint_partitioned`` is sized from a block's op graph (the collectives its recomputation reaches):
    without the graphs no block would have the option."""
    import remat.planning.workflow as workflow

    asked, profile = [], workflow.profile

    def recorded(*args, **kwargs):
        asked.append(kwargs["ops"])
        return profile(*args, **kwargs)

    monkeypatch.setattr(workflow, "profile", recorded)
    for allow in (("checkpoint", "checkpoint_partitioned"), ("checkpoint", "selective"), ("checkpoint",)):
        out = remat_cli("plan", "usermodel:build", "--inputs", "usermodel:batch", "--budget", "85%", "--allow",
                        *allow, cwd=user_module)
        assert out.returncode == 0, out.stderr
    assert asked == [True, True, False]
