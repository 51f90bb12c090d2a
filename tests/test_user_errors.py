"""A new user's bad inputs, each answered in one line in the user's terms: a clear exception in Python, exit code 2
and one line on the command line (run in-process here: test_cli runs the command in subprocesses)."""

import copy
import json
import logging
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.planning.basics.units import parse_budget
from remat.planning.solve.plan import PlanFileError, describe_model
from remat.planning.workflow import SummedLossWarning
from remat.tools.cli import main


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Masked(nn.Module):
    """A model whose forward needs a keyword argument besides its input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block(), Block())

    def forward(self, x, mask):
        return self.blocks(x * mask)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def _run(argv, capsys) -> tuple[int, str]:
    """The command's exit code and its one line on stderr."""
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    return code, _one_line(capsys.readouterr().err)


_USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])

        def forward(self, x, mask):
            return self.blocks(x * mask)

    def masked():
        return Masked()

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])

        def forward(self, ids):
            return self.blocks(self.embed(ids))

    def nothing():
        return None

    def tokens_like_masked():
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])

    def prewrapped():
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        return nn.Sequential(*[checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.ReLU())) for _ in range(3)])
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A module of user code, importable by the command as ``user_errors_model:...``."""
    (tmp_path / "user_errors_model.py").write_text(_USER_MODULE)
    monkeypatch.chdir(tmp_path)
    yield "user_errors_model"
    sys.modules.pop("user_errors_model", None)


# ---- 1. plan files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("content, reason", [
    ('{"decisions": {"0": "checkpoint"}, "predicted_peak": 1', "truncated JSON"),
    ('{"hello": 1}', "unknown field 'hello'"),
    ("[1, 2]", "a JSON array, not an object"),
    ('{"decisions": {"0": "checkpoint"}}', "no field 'predicted_peak'"),
])
def test_a_file_that_is_not_a_plan_is_named_with_what_is_wrong_and_what_to_do(tmp_path, capsys, content, reason):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanFileError) as refused:
        remat.Plan.load(str(path))
    line = _one_line(str(refused.value))
    assert line.startswith(f"remat.Plan.load: {path} is not a remat plan ({reason}")
    assert "`remat plan" in line and ".save(path)" in line
    assert isinstance(refused.value, ValueError) and refused.value.__cause__ is None  # no JSON traceback chained
    code, line = _run(["show", str(path)], capsys)
    assert code == 2 and line.startswith(f"remat show: error: {path} is not a remat plan ({reason}")


def test_show_prints_a_saved_plan_and_a_missing_file_in_one_line(tmp_path, capsys):
    model = nn.Sequential(Block(), Block())
    plan = _plan_for(model, {"arg 0": "4x8"})
    plan.save(str(tmp_path / "plan.json"))
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "at inputs arg 0 4x8" in out and "Predicted peak" in out
    missing = tmp_path / "missing.json"
    code, line = _run(["show", str(missing)], capsys)
    assert code == 2 and line == (f"remat show: error: cannot read the plan {missing} (No such file or directory); "
                                  f"make one with `remat plan ... -o {missing}`")


def test_json_s_own_at_is_not_doubled_in_the_reason(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"decisions": {"0": "checkpoint"},\n "note": "a\tb",\n "x": 1}')  # a raw tab in a string
    with pytest.raises(PlanFileError) as refused:
        remat.Plan.load(str(path))
    assert "(not JSON: Invalid control character at line 2, column 12)" in str(refused.value)
    assert "at at" not in str(refused.value)


@pytest.mark.parametrize("content", ['{"decisions": {"0": "checkpoint"}, "predicted_peak": 1', "[1, 2]", None])
def test_show_and_check_word_a_bad_plan_file_alike_and_check_prints_nothing_before(
        tmp_path, capsys, user_module, content):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    lines = {}
    for command in ("show", "check"):
        argv = [command, str(path)] if command == "show" else \
            [command, f"{user_module}:masked", "--plan", str(path), "--input-shape", "4,8"]
        try:
            code = main(argv)
        except SystemExit as exited:
            code = exited.code
        captured = capsys.readouterr()
        assert code == 2 and captured.out == ""
        lines[command] = _one_line(captured.err).removeprefix(f"remat {command}: error: ")
    assert lines["show"] == lines["check"]


def test_check_with_a_plan_for_another_model_prints_its_error_and_no_blank_line(tmp_path, capsys, user_module):
    plan = _plan_for(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)), {"arg 0": "4x8"})
    plan.save(str(tmp_path / "plan.json"))
    argv = ["check", f"{user_module}:tokens_like_masked", "--plan", str(tmp_path / "plan.json"),
            "--input-shape", "4,8"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_line(captured.err).startswith("remat check: error: block `0` has other parameters than in the plan")


def test_a_dot_where_the_colon_belongs_is_told_with_the_fix(capsys):
    code, line = _run(["plan", "mymodels.seqcnn", "--budget", "50%"], capsys)
    assert code == 2
    assert line == ("remat plan: error: MODULE:FACTORY must look like package.module:function, got "
                    "'mymodels.seqcnn'; did you mean mymodels:seqcnn?")


# ---- 2. inputs that do not fit the forward -----------------------------------------------------------
def test_a_forward_missing_a_keyword_argument_is_told_before_anything_runs():
    with pytest.raises(TypeError) as refused:
        remat.profile(Masked(), torch.randn(4, 8))
    line = _one_line(str(refused.value))
    assert line.startswith("remat.profile: Masked.forward(x, mask) is missing a required argument: 'mask'; ")
    assert "mask=mask" in line


def test_the_command_says_what_inputs_the_model_needs(user_module, capsys):
    code, line = _run(["plan", f"{user_module}:masked", "--input-shape", "4,8", "--budget", "90%"], capsys)
    assert code == 2
    assert line.startswith("remat plan: error: Masked.forward(x, mask) is missing a required argument: 'mask'; ")
    assert "--inputs MODULE:FN returning a dict of keyword inputs, e.g. {'x': ..., 'mask': ...}" in line
    code, line = _run(["profile", f"{user_module}:masked", "--inputs", f"{user_module}:nothing"], capsys)
    assert code == 2 and "returned no tensor (NoneType)" in line
    code, line = _run(["profile", f"{user_module}:Tokens", "--input-shape", "2,4"], capsys)
    assert code == 2 and line.startswith("remat profile: error: running the model on the given inputs failed (")
    assert line.endswith("--input-shape gives random floats: for token ids give --inputs")


@pytest.mark.parametrize("model, args, kwargs, words", [
    (lambda x: x, (torch.ones(2),), {}, "the model must be a torch.nn.Module, got function"),
    (Block(), (torch.ones(2, 8).numpy(),), {}, "input 0 is a NumPy ndarray; pass tensors, e.g. torch.from_numpy"),
    (Masked(), ({"x": torch.ones(2, 8), "mask": torch.ones(2, 8)},), {}, "unpack it: remat.profile(model, **batch)"),
    (Block(), (torch.ones(2, 8),), {"scale": 2.0}, "got an unexpected keyword argument 'scale'"),
])
def test_a_model_or_inputs_remat_cannot_profile_is_refused_in_one_line(model, args, kwargs, words):
    with pytest.raises(TypeError) as refused:
        remat.profile(model, *args, **kwargs)
    assert words in _one_line(str(refused.value))


def test_a_misspelt_block_name_is_told_with_the_names_close_to_it():
    model = nn.Sequential(Block(), Block())
    with pytest.raises(ValueError) as refused:
        remat.profile(model, torch.ones(2, 8), modules=["3"])
    assert _one_line(str(refused.value)).startswith(
        "remat.profile: Sequential has no module named '3' (it has 0, 1); name modules as model.named_modules() does")


def test_a_plan_applied_to_something_else_than_a_module_says_so():
    plan = _plan_for(nn.Sequential(Block(), Block()), {})
    with pytest.raises(TypeError, match=r"^remat.Plan.apply: expected the torch.nn.Module .*got Tensor"):
        plan.apply(torch.ones(2))


def _torch_wrapped(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def _hf_llama(switch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    if switch == "remat.enable":
        from remat.integrations.transformers import enable

        enable(model)
    else:
        switch = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        switch()  # transformers' own, under its name in this version
    return model


@pytest.mark.parametrize("how, words", [
    ("remat", "blocks.0 and 2 more of Masked already checkpoint (remat's checkpoint/offload wrappers or a plan)"),
    ("torch", "blocks.0 and 2 more of Masked already checkpoint (torch's checkpoint_wrapper)"),
    ("transformers", "LlamaForCausalLM has transformers' gradient checkpointing on (model.layers.0 and 1 more;"),
    ("remat.enable", "LlamaForCausalLM has transformers' gradient checkpointing on (model.layers.0 and 1 more;"),
])
@pytest.mark.parametrize("who", ["remat.profile", "remat.plan"])
def test_a_model_whose_blocks_already_checkpoint_is_told_so_with_the_fix(how, words, who):
    if how in ("remat", "torch"):
        model, inputs = Masked(), {"x": torch.randn(4, 8), "mask": torch.ones(4, 8)}
        if how == "remat":
            remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        else:
            _torch_wrapped(model)
    else:
        model = _hf_llama(how)
        ids = torch.randint(0, 64, (2, 8))
        inputs = {"input_ids": ids, "labels": ids}
    with pytest.raises(ValueError) as refused:
        if who == "remat.profile":
            remat.profile(model, **inputs, repeats=1)
        else:
            remat.plan(model, **inputs, budget="50%")
    line = _one_line(str(refused.value))
    assert line.startswith(f"{who}: {words}"), line
    fix = "_checkpointing_disable() first" if how in ("transformers", "remat.enable") else "plan.remove(model)"
    assert fix in line and "the plan does the checkpointing" in line.replace("it does the", "the plan does the")


def test_the_command_tells_a_model_that_already_checkpoints_in_one_line(user_module, capsys):
    code, line = _run(["plan", f"{user_module}:prewrapped", "--input-shape", "4,8", "--budget", "50%"], capsys)
    assert code == 2
    assert line.startswith("remat plan: error: 0 and 2 more of Sequential already checkpoint (torch's "
                           "checkpoint_wrapper)"), line


# ---- 3 and 4. budgets --------------------------------------------------------------------------------
def test_a_bare_50_is_refused_alike_in_python_and_on_the_command_line(capsys):
    with pytest.raises(ValueError) as as_int:
        parse_budget(50)
    with pytest.raises(ValueError) as as_text:
        parse_budget("50")
    assert str(as_int.value) == str(as_text.value)
    assert "did you mean 50%?" in _one_line(str(as_int.value))
    with pytest.raises(ValueError, match=r"did you mean 50%\?"):
        remat.plan(nn.Sequential(Block(), Block()), torch.ones(2, 8), budget=50)  # refused before profiling
    with pytest.raises(ValueError, match=r"got 50 \(did you mean 50%\?"):
        parse_budget(50.0)
    assert parse_budget(4096).nbytes == 4096  # a computed size (InfeasibleBudget.smallest) stays bytes


@pytest.mark.parametrize("budget, words", [
    ("0", "budget 0 is no memory at all"),
    ("-1", "budget -1 is negative"),
    ("0GiB", "budget 0GiB is no memory at all"),
    ("5000", "budget 5000 would be 4.9 KiB: write a size with its unit"),
])
def test_zero_negative_and_unitless_budgets_give_the_valid_forms_and_range(budget, words, capsys):
    code, line = _run(["plan", "m:f", "--input-shape", "8,16", "--budget", budget], capsys)
    assert code == 2 and line.startswith(f"remat plan: error: argument --budget: {words}")
    assert "(0, 1]" in line and "50%" in line and "GiB" in line
    assert "did you mean 0%" not in line


# ---- 5. policies by name -----------------------------------------------------------------------------
def test_a_ready_made_policy_is_taken_by_its_name():
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    by_name = remat.checkpoint(block, x, policy="save_matmuls")
    (expected,) = torch.autograd.grad(remat.checkpoint(block, x, policy=remat.policies.save_matmuls).sum(), x)
    (got,) = torch.autograd.grad(by_name.sum(), x)
    assert torch.equal(got, expected)
    wrapped = remat.checkpoint_wrapper(Block(), policy="save_nothing")
    wrapped(x).sum().backward()


@pytest.mark.parametrize("policy, error, words", [
    ("save_matmul", ValueError, "no policy is named 'save_matmul'; did you mean 'save_matmuls'? the ready-made "
                                "policies are 'save_collectives' and 'save_matmuls' and 'save_nothing'"),
    ("save_names", ValueError, "'save_names' needs the names of the tensors it applies to"),
    (5, TypeError,
     "policy must be the name of a ready-made policy ('save_collectives' or 'save_matmuls' or 'save_nothing')"),
])
def test_a_policy_that_is_none_is_refused_with_the_choices(policy, error, words):
    with pytest.raises(error) as refused:
        remat.checkpoint(Block(), torch.randn(2, 8, requires_grad=True), policy=policy)
    line = _one_line(str(refused.value))
    assert line.startswith("remat.checkpoint: ") and words in line
    assert "policy_fn_or_list" not in line
    with pytest.raises(error, match="^remat.checkpoint_wrapper: "):  # told when wrapping, not at the forward
        remat.checkpoint_wrapper(Block(), policy=policy)


# ---- 6. a plan run at other shapes -------------------------------------------------------------------
def _plan_for(model: nn.Module, inputs: dict) -> remat.Plan:
    names = [name for name, _ in model.named_children()]
    return remat.Plan(decisions=dict.fromkeys(names, "checkpoint"), predicted_peak=0, predicted_extra_time=0.0,
                      budget=0, baseline_peak=0, param_bytes=0, meta={**describe_model(model, names), "inputs": inputs})


def test_a_plan_records_the_shapes_it_was_profiled_at(tmp_path):
    model = nn.Sequential(Block(), Block())
    prof = remat.profile(model, torch.randn(2, 64, 8), loss_fn=lambda out: out.sum(), repeats=1, ops=False)
    plan = prof.plan(1.0, allow=("checkpoint",))
    assert plan.meta["inputs"] == {"arg 0": "2x64x8"}
    plan.save(str(tmp_path / "plan.json"))
    assert remat.Plan.load(str(tmp_path / "plan.json")).meta["inputs"] == {"arg 0": "2x64x8"}


def test_the_first_forward_at_another_shape_warns_once_naming_both_shapes():
    model = nn.Sequential(Block(), Block())
    plan = _plan_for(model, {"arg 0": "2x64x8"})
    plan.apply(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 256, 8)).sum().backward()
        model(torch.randn(2, 256, 8)).sum().backward()
        model(torch.randn(2, 64, 8))
    shapes = [w for w in caught if issubclass(w.category, remat.InputShapeWarning)]
    assert len(shapes) == 1 and issubclass(shapes[0].category, UserWarning)
    line = _one_line(str(shapes[0].message))
    assert "arg 0 2x256x8 (the plan was made at 2x64x8)" in line
    assert "predicted peak and extra time do not hold" in line and "plan again at this shape" in line
    assert shapes[0].filename == __file__  # pointed at the user's call


def _unsteady(monkeypatch):
    """Every block's timed forwards vary by half their median: the profile warns (UnsteadyTimings)."""
    from remat.planning.measure import opgraph

    real = opgraph._time_block
    monkeypatch.setattr(opgraph, "_time_block", lambda *a: opgraph.replace(real(*a), spread=0.5))
    monkeypatch.setenv("REMAT_UNSTEADY_SPREAD", "0.1")


@pytest.mark.parametrize("what", ["unsteady timings", "summed loss", "blocks left out"])
def test_remat_s_warnings_name_the_user_s_line(what, monkeypatch):
    model = nn.Sequential(Block(), Block(), Block())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if what == "unsteady timings":
            _unsteady(monkeypatch)
            remat.profile(model, torch.randn(4, 8), loss_fn=lambda out: out.sum(), repeats=1)
            category = remat.UnsteadyTimings
        elif what == "summed loss":
            remat.profile(model, torch.randn(4, 8), repeats=1, ops=False)
            category = SummedLossWarning
        else:
            plan = _plan_for(nn.Sequential(Block(), Block()), {})
            plan.meta.pop("candidates", None)
            plan.apply(model)
            category = UserWarning
    told = [w for w in caught if issubclass(w.category, category)]
    assert told and all(w.filename == __file__ for w in told), [(w.filename, w.lineno) for w in told]


def test_the_same_shapes_an_old_plan_file_and_a_removed_plan_warn_nothing(tmp_path):
    model = nn.Sequential(Block(), Block())
    plan = _plan_for(model, {"arg 0": "2x64x8"})
    old = tmp_path / "old.json"
    plan.save(str(old))
    data = json.loads(old.read_text())
    del data["meta"]["inputs"]  # a plan saved before the shapes were recorded
    old.write_text(json.dumps(data))
    copied = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.apply(model)
        model(torch.randn(2, 64, 8))
        remat.Plan.load(str(old)).apply(copied)
        copied(torch.randn(2, 256, 8))
        plan.remove(plan.apply(model))
        model(torch.randn(2, 256, 8))
    assert not [w for w in caught if issubclass(w.category, remat.InputShapeWarning)]


# ---- 7. warnings from what remat calls ---------------------------------------------------------------
class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _smallest_plan(prof: remat.Profile) -> remat.Plan:
    """The plan at the smallest peak any plan reaches: it checkpoints blocks (switching a KV cache off)."""
    try:
        prof.plan("1B", allow=("checkpoint",))
    except remat.InfeasibleBudget as refused:
        plan = prof.plan(refused.smallest, allow=("checkpoint",))
    assert "checkpoint" in plan.decisions.values()
    return plan


@pytest.fixture()
def transformers_log():
    """What transformers logs while the test runs, its log-once memory cleared so that no earlier test hides it."""
    transformers = pytest.importorskip("transformers")
    logging.Logger.warning_once.cache_clear()
    handler = _Logged()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield transformers, handler.messages
    logger.removeHandler(handler)


def test_a_stock_llama_profiles_plans_and_trains_with_one_warning(transformers_log):
    transformers, logged = transformers_log
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).train()  # use_cache=True, as the README's stock config
    ids = torch.randint(0, 128, (2, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _smallest_plan(remat.profile(model, input_ids=ids, labels=ids, repeats=1)).apply(model)
        model(input_ids=ids, labels=ids).loss.backward()
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not [m for m in logged if "deprecated" in m]
    assert [str(w.message).split(";")[0] for w in caught] == [
        "remat.profile: use_cache=True is incompatible with checkpointing in training"]


def test_an_encoder_only_model_gets_no_cache_warning_nor_memtracker_noise(transformers_log):
    transformers, logged = transformers_log
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, max_position_embeddings=64, attn_implementation="eager")
    model = transformers.BertForMaskedLM(cfg).train()
    assert cfg.use_cache is True  # BERT's stock config says so, and its layers build no cache
    ids = torch.randint(0, 128, (2, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _smallest_plan(remat.profile(model, input_ids=ids, labels=ids, repeats=1, ops=False)).apply(model)
        remat.measure_step(lambda: model(input_ids=ids, labels=ids).loss.backward(), model)
    assert [str(w.message) for w in caught] == []
    assert not [m for m in logged if "deprecated" in m]


# ---- 8. the version ----------------------------------------------------------------------------------
def test_the_command_prints_its_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"remat {remat.__version__}"


# ---- the other commands' arguments -------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["demo", "--heads", "0"], "argument --heads: must be at least 1, got 0"),
    (["demo", "--layers", "1"], "argument --layers: must be at least 2 (the planner chooses among repeated blocks)"),
    (["demo", "--dropout", "1.5"], "argument --dropout: must be in [0, 1) such as 0.1, got 1.5"),
    (["demo", "--plot", "no/such/folder/demo.png"], "argument --plot: the folder no/such/folder does not exist"),
    (["bench", "--repeats", "1"], "argument --repeats: must be at least 2 (a median and a spread need two rounds)"),
    (["plan", "m:f", "--budget", "50%", "-o", "no/such/folder/plan.json"], "argument -o/--output: the folder"),
])
def test_a_bad_argument_is_refused_in_one_line_before_anything_runs(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, line = _run(argv, capsys)
    assert code == 2 and line.startswith(f"remat {argv[0]}: error: {words}")


def test_partition_inputs_without_a_process_group_or_with_offload_is_refused_in_one_line():
    block = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="partition_inputs needs torch.distributed's process group") as refused:
        remat.checkpoint(block, x, partition_inputs=object())
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="offload_inputs or partition_inputs, not both"):
        remat.checkpoint(block, x, partition_inputs=object(), offload_inputs=True)
    with pytest.raises(ValueError, match="partition_inputs needs use_reentrant=False"):
        remat.checkpoint(block, x, partition_inputs=object(), use_reentrant=True)
