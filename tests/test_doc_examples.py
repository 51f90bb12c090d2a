"""Every example in README.md, ARCHITECTURE.md and docs/*.md runs as printed.

Each fenced ```python, ```bash, ```sh or ```console block is one test, named ``DOC:LINE`` (the line of its
opening fence). Blocks of other languages, and untagged ones (printed output, diagrams), are text.

* **python** blocks of one doc run in order in one namespace, in a temporary folder of that doc's own, as a
  reader pastes them one after another. A test runs the doc's earlier blocks first where this process has not
  (``pytest -n`` may hand the blocks of one doc to two workers).
* **shell** blocks run their ``remat ...`` and ``python -m remat ...`` lines (in this process: ``remat.tools.cli
  .main``) and their ``python ...`` lines (a subprocess), in the same folder; each must exit 0. Other lines are
  recognised and not run, each for the reason in ``NOT_RUN`` (setting up an environment, running the test suite
  or a benchmark, ...); a line the runner does not recognise fails the test.
* A few ``remat`` commands are run smaller than printed, with the extra arguments in ``SMALLER`` appended
  (argparse takes the last value): the printed sizes take minutes; the arguments are the same.

What a doc declares right before a block, in an HTML comment (visible in the doc's source):

* ``<!-- example-setup: CODE -->``: Python run in the doc's namespace before the block: the stand-ins for
  "your model" / "your data" that the text assumes (a tiny model, a batch). The namespace starts with
  ``write_mypkg`` (``tests/doc_models.py``), which writes the package ``mypkg`` the docs' command lines name.
* ``<!-- example-file: NAME -->``: the (python) block is a file the text names; it is written as ``NAME`` in
  the doc's folder instead of being run.

What a block says in its first line, visible to every reader:

* ``# needs CUDA...``: run where CUDA is, skipped elsewhere with that line as the reason.
* ``# not run by the doc tests: REASON``: always skipped with that reason.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from doc_models import write_mypkg

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ("python",)
SHELL = ("bash", "sh", "console")

SMALLER = {
    "demo": ["--layers", "2", "--seq-len", "32", "--d-model", "32", "--heads", "2", "--batch-size", "2",
             "--steps", "2"],
    "bench": ["--cases", "tiny", "--repeats", "2", "--warmup", "0"],
    "check": ["--steps", "2"],
}
"""Arguments appended to ``remat COMMAND`` lines: the same command, a smaller and shorter run."""

NOT_RUN = [
    (r"python3? -m venv\b|\. \S*activate$|source \S*activate$|pip3? install\b",
     "sets up an environment: the tests run in one already set up"),
    (r"git clone\b", "a download"),
    (r"torchrun\b", "needs several processes (tests/test_distributed.py runs remat under torchrun)"),
    (r"(python3? -m )?pytest\b", "runs the test suite, which runs this file: CI runs it directly"),
    (r"python3? benchmarks/", "a benchmark: minutes of timing, run by hand (see BENCHMARKS.md)"),
    (r"ruff\b", "the linter: CI runs it as a step of its own"),
]
"""Shell commands recognised and not run: (pattern at the command's start, reason)."""


# ---- reading the docs -------------------------------------------------------------------------------------
@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    setup: str = ""
    file: str = ""

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def skip_reason(self) -> str | None:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        if re.match(r"#\s*needs CUDA", first) and not torch.cuda.is_available():
            return first.lstrip("# ")
        if re.match(r"#\s*not run by the doc tests:", first):
            return first.lstrip("# ")
        return None


def blocks_of(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks, setup, file, i = [], "", "", 0
    while i < len(lines):
        line = lines[i]
        comment = re.match(r"\s*<!--\s*example-(setup|file):\s?(.*)", line)
        if comment:
            text = [comment.group(2)]
            while "-->" not in text[-1]:
                i += 1
                text.append(lines[i])
            body = "\n".join(text).split("-->")[0].strip()
            if comment.group(1) == "setup":
                setup = body
            else:
                file = body
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            start, i = i, i + 1
            while not lines[i].lstrip().startswith("```"):
                i += 1
            lang = fence.group(1)
            if lang in PYTHON + SHELL:
                blocks.append(Block(doc, start + 1, lang, "\n".join(lines[start + 1 : i]), setup, file))
            elif setup or file:
                raise ValueError(f"{doc.name}:{start + 1}: an example-setup/file comment before a {lang!r} block")
            setup, file = "", ""
        i += 1
    return blocks


BLOCKS = {doc: blocks_of(doc) for doc in DOCS}
ALL = [block for blocks in BLOCKS.values() for block in blocks]


# ---- running them -----------------------------------------------------------------------------------------
@dataclass
class DocRun:
    """One doc's namespace and folder, and how far this process has run its blocks."""

    folder: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__doc_example__", "write_mypkg": write_mypkg})
    done: int = 0
    failed: str = ""


@pytest.fixture(scope="module")
def runs():
    return {}


@contextlib.contextmanager
def inside(folder: Path):
    """Run in ``folder`` with ``tests/`` importable (``doc_models``) and modules written there importable."""
    before, path = os.getcwd(), list(sys.path)
    os.chdir(folder)
    sys.path[:0] = [str(folder), str(ROOT / "tests")]
    try:
        yield
    finally:
        os.chdir(before)
        sys.path[:] = path
        for name, module in list(sys.modules.items()):  # `mypkg` of another doc's folder is another package
            if str(getattr(module, "__file__", None) or "").startswith(str(folder)):
                del sys.modules[name]


def run_python(code: str, block: Block, namespace: dict) -> None:
    padded = "\n" * block.line + code  # tracebacks name the doc's own line numbers
    exec(compile(padded, str(block.doc), "exec"), namespace)


def commands(code: str) -> list[str]:
    """The commands of a shell block: comments and prompts dropped, continuations joined, ``&&`` split."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"^\s*\$ ", "", line)
        words = shlex.split(line, comments=True)
        if not words:
            continue
        command: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                out.append(shlex.join(command))
                command = []
            else:
                command.append(word)
    return out


def run_command(command: str, block: Block) -> str:
    """Run one command of a shell block; return why it was not run, or ''."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"\w+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    text = shlex.join(words)
    for pattern, reason in NOT_RUN:
        if re.match(pattern, text):
            for path in words[1:]:  # what it names must exist, run or not
                if re.match(r"(tests|benchmarks|src)/", path):
                    assert (ROOT / path.split("::")[0]).exists(), f"{block.name}: `{text}` names {path}: no such file"
            return reason
    if words[:1] == ["remat"] or words[:3] in (["python", "-m", "remat"], ["python3", "-m", "remat"]):
        argv = words[1:] if words[0] == "remat" else words[3:]
        run_remat(argv, env, block, text)
    elif words[:1] in (["python"], ["python3"]):
        done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
        assert done.returncode == 0, f"{block.name}: `{text}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    else:
        raise AssertionError(f"{block.name}: the doc tests do not know how to run `{text}`: teach NOT_RUN in "
                             "tests/test_doc_examples.py why not, or mark the block '# not run by the doc tests: ...'")
    return ""


def run_remat(argv: list[str], env: dict, block: Block, text: str) -> None:
    from remat.tools.cli import main

    command = next((a for a in argv if not a.startswith("-")), None)
    argv = [*argv, *SMALLER.get(command, [])]
    for flag, value in zip(argv, argv[1:]):  # an output folder the doc assumes (docs/) exists in the checkout
        if flag in ("--plot", "-o", "--output", "--json") and "/" in value:
            Path(value).parent.mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                code = main(argv)
            except SystemExit as stop:  # --help, --version
                code = stop.code or 0
    finally:
        for key, value in before.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    print(f"$ remat {shlex.join(argv)}\n{out.getvalue()}{err.getvalue()}")
    assert code == 0, f"{block.name}: `{text}` exited {code}:\n{err.getvalue()[-3000:]}{out.getvalue()[-2000:]}"


def run_block(block: Block, run: DocRun) -> list[str]:
    """Run one block in its doc's namespace and folder; return what was not run and why."""
    skipped = []
    with inside(run.folder):
        if block.setup:
            run_python(block.setup, block, run.namespace)
        if block.file:
            (run.folder / block.file).write_text(block.code + "\n")
        elif block.lang in PYTHON:
            run_python(block.code, block, run.namespace)
        else:
            for command in commands(block.code):
                reason = run_command(command, block)
                if reason:
                    skipped.append(f"`{command}`: {reason}")
    return skipped


@pytest.mark.parametrize("block", ALL, ids=[block.name for block in ALL])
def test_doc_block(block: Block, runs: dict[Path, DocRun], tmp_path_factory):
    if block.doc not in runs:
        runs[block.doc] = DocRun(tmp_path_factory.mktemp(block.doc.stem))
    run = runs[block.doc]
    blocks = BLOCKS[block.doc]
    index = blocks.index(block)
    for earlier in blocks[run.done : index]:  # blocks this process has not run yet (another worker ran them)
        if not earlier.skip_reason():
            try:
                run_block(earlier, run)
            except BaseException:
                run.failed = run.failed or earlier.name
        run.done += 1
    if run.failed:
        pytest.skip(f"runs after {run.failed}, which failed")
    run.done = index + 1
    reason = block.skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        skipped = run_block(block, run)
    except BaseException:
        run.failed = block.name
        raise
    for line in skipped:
        print(f"{block.name}: not run: {line}")


# ---- what the docs say besides their examples ------------------------------------------------------------
def test_paths_the_docs_name_exist():
    """Every link (``[cli.md](cli.md)``) resolves from the doc's folder, as a renderer resolves it; every file
    path in backquotes (``remat/engine/buffers.py``, ``tests/zoo.py``) exists, read from the doc's folder, the
    repository root, ``src/`` or ``src/remat/``."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            path = link.split("#")[0]
            if path and not re.match(r"\w+://", path) and not (doc.parent / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {link}")
        for path in re.findall(r"`([\w./-]*/[\w.-]+\.(?:py|md|png|json|txt|toml))`", text):
            if not any((base / path).exists() for base in (doc.parent, ROOT, ROOT / "src", ROOT / "src" / "remat")):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_readme_starts_with_the_two_commands_and_stays_short():
    readme = BLOCKS[ROOT / "README.md"]
    first = commands(readme[0].code)
    assert any(c.startswith("remat demo") for c in first) and any("pytest" in c for c in first), (
        "README.md's first block sets up and runs `remat demo`, and sets up and runs the tests")
    words = len((ROOT / "README.md").read_text().split())
    assert words < 800, f"README.md has {words} words (wc -w); keep it under 800, the rest belongs in docs/"


def test_the_demo_figures_agree_between_readme_and_cli_md():
    """README.md quotes the run of ``remat demo`` that docs/cli.md prints whole: the same peaks per mode."""
    readme = (ROOT / "README.md").read_text()
    cli = (ROOT / "docs" / "cli.md").read_text()
    row = r"^\| ([a-z_]+(?: [a-z0-9_%]+)*)[^|]* \| ([\d.]+ MiB) \((\d+%)\) \| ([\d.]+ MiB) \|"
    rows = re.findall(row, readme, re.M)
    assert len(rows) == 4, f"README.md's demo table: expected 4 modes, read {rows}"
    for mode, above, share, whole in rows:
        line = next((ln for ln in cli.splitlines() if ln.startswith(f"│ {mode} ")), None)
        assert line, f"docs/cli.md's demo output has no row for {mode!r}"
        assert re.search(rf"{re.escape(above)} \({share}\)\s+│\s+{re.escape(whole)}", line), (
            f"{mode}: README.md quotes {above} ({share}), {whole}; docs/cli.md printed {line}")
    predicted = re.search(r"The plan predicted a peak of ([\d.]+ MiB)", readme)
    assert predicted and f"Predicted peak {predicted.group(1)}" in cli, "the predicted peaks differ"


USER_DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in
                                   ("cli", "drop-in", "integrations", "planning", "policies", "gpu"))]


def test_user_docs_name_public_api_only():
    """How-to docs name what ``import remat`` offers (``remat.X``, ``remat.policies.X``,
    ``remat.integrations.transformers``, ``remat.models``), never a module path inside the package; the
    internals are docs/design.md's and ARCHITECTURE.md's."""
    import remat
    import remat.policies

    wrong = []
    for doc in USER_DOCS:
        for path in re.findall(r"\bremat\.([a-z_]+)\.([A-Za-z_][\w.]*)", doc.read_text()):
            package, name = path
            first = name.split(".")[0]
            public = (package == "policies" and first in remat.policies.__all__) or package == "models" or (
                package == "integrations" and first == "transformers")
            if not public:
                wrong.append(f"{doc.relative_to(ROOT)}: remat.{package}.{name}")
        for name in re.findall(r"`remat\.([A-Za-z_]\w*)", doc.read_text()):
            if name not in remat.__all__ and name not in ("policies", "models", "integrations"):
                wrong.append(f"{doc.relative_to(ROOT)}: remat.{name}")
    assert not wrong, "user docs name internals:\n" + "\n".join(wrong)


def test_planning_offload_section_is_a_how_to():
    """The planner's machinery (drains, stretches, offload-first plans, its dynamic program) is design.md's."""
    text = (ROOT / "docs" / "planning.md").read_text()
    section = text[text.index("## Offloading on a GPU"):text.index("## What was tested and measured")]
    for word in ("drain", "stretch by stretch", "offload-first", "dynamic program"):
        assert word not in section, word
    assert "## Copies to host memory in a plan" in (ROOT / "docs" / "design.md").read_text()
    assert "simulated, not measured" in (ROOT / "docs" / "design.md").read_text()
    assert "h200_timeline" not in (ROOT / "docs" / "gpu.md").read_text()


def test_docs_speak_of_the_project_only():
    """What was measured and what was not, never who had which machine when."""
    for doc in [*USER_DOCS, ROOT / "BENCHMARKS.md", ROOT / "docs" / "design.md"]:
        text = doc.read_text().lower()
        for phrase in ("was lent", "this session", "none was lent"):
            assert phrase not in text, f"{doc.relative_to(ROOT)}: {phrase!r}"
