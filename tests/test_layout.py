"""The layout ARCHITECTURE.md promises, checked on the source.

* No file under ``src/`` is over 600 lines.
* Imports flow one way between the subpackages, in the order of ARCHITECTURE.md's diagram
  (``engine <- policies <- api <- planning <- tools``; ``integrations`` above ``api``; ``models`` imports nothing
  of remat), lazy imports inside functions included, and there is no import cycle between modules.
* Inside ``planning``, no module imports one of a later stage of ARCHITECTURE.md's numbered pipeline, and
  every module is in one stage, in that stage's subpackage.
* Every module has a docstring; every module that defines names lists its public ones in ``__all__``, and
  every name there is defined.
* ``import remat`` and the ``remat`` command's ``--help`` import no torch; the library proper (every module
  of engine, policies, api, planning, and models, which every public name of ``remat`` comes from) imports
  torch and the standard library only: no transformers, rich or matplotlib.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "remat"
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text()
MAX_LINES = 600


# ---- reading the source ---------------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """The remat modules ``name`` imports anywhere in its file (module level, functions, TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import module` imports the module; `from m import name`, m
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    deps = set()
    for target in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            deps.add(target)
    return deps


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def subpackage(name: str) -> str:
    """``remat.planning.solve.plan`` -> ``planning``; ``remat.models`` -> ``models``; ``remat`` -> ``remat``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "remat"


# ---- what ARCHITECTURE.md says ----------------------------------------------------------------------------
def documented_order() -> list[str]:
    """The chain of the diagram, ``engine  <-  policies  <-  ...``, lowest first."""
    line = next((ln for ln in ARCHITECTURE.splitlines() if ln.strip().startswith("engine") and "<-" in ln), None)
    assert line, "ARCHITECTURE.md has no diagram line 'engine  <-  policies  <-  ...'"
    return [part.strip() for part in line.split("<-")]


def documented_stages() -> tuple[dict[str, int], dict[str, str]]:
    """The planning pipeline's numbered list: each ``**module**`` in item N is in stage N, and in the item's
    subpackage where the item opens with one (``1. `basics/`: ...``), else in ``planning`` itself."""
    section = ARCHITECTURE.split("## `remat/planning/`", 1)[1].split("\n## ", 1)[0]
    stages: dict[str, int] = {}
    folders: dict[str, str] = {}
    stage, folder = 0, ""
    for line in section.splitlines():
        numbered = re.match(r"(\d+)\. (?:`([a-z_]+)/`)?", line)
        if numbered:
            stage, folder = int(numbered.group(1)), numbered.group(2) or ""
        if stage:
            for module in re.findall(r"\*\*([a-z_]+)\*\*", line):
                stages.setdefault(module, stage)
                folders.setdefault(module, folder)
    assert stages, "ARCHITECTURE.md's planning section has no numbered stages naming **modules**"
    return stages, folders


def allowed_imports() -> dict[str, set[str]]:
    """For each subpackage, the subpackages it may import."""
    order = documented_order()
    allowed = {package: set(order[:index]) for index, package in enumerate(order)}
    allowed["integrations"] = set(order[: order.index("api") + 1])  # the diagram's arrows: policies and api
    allowed["models"] = set()  # "the built-in GPT; imports nothing of remat"
    allowed["tools"] |= {"models", "integrations"}
    return allowed


# ---- the checks -------------------------------------------------------------------------------------------
def test_no_file_over_the_line_limit():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted(SRC.rglob("*.py"))}
    over = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines (ARCHITECTURE.md: none): {over}"


def test_the_subpackages_are_those_of_the_diagram():
    documented = set(documented_order()) | {"integrations", "models"}
    present = {subpackage(name) for name in MODULES} - {"remat", "__main__"}
    assert present == documented, f"src/remat holds {sorted(present)}; ARCHITECTURE.md describes {sorted(documented)}"


def test_imports_flow_one_way_between_subpackages():
    allowed = allowed_imports()
    wrong = []
    for name, deps in GRAPH.items():
        mine = subpackage(name)
        if mine in ("remat", "__main__"):
            continue  # the public surface (its imports are lazy, by name) and `python -m remat`
        for dep in deps:
            theirs = subpackage(dep)
            # importing the root package reads `remat/__init__.py`, which imports nothing until a name is used
            if theirs not in (mine, "remat") and theirs not in allowed[mine]:
                wrong.append(f"{name} imports {dep} ({mine} may import only {sorted(allowed[mine]) or 'nothing'})")
    assert not wrong, "imports against ARCHITECTURE.md's order:\n" + "\n".join(sorted(wrong))


def test_planning_modules_import_no_later_stage():
    stages, folders = documented_stages()
    planning = {name.rpartition(".")[2]: name for name in MODULES
                if name.startswith("remat.planning.") and MODULES[name].name != "__init__.py"}
    unplaced = sorted(set(planning) - set(stages))
    assert not unplaced, f"planning modules in no stage of ARCHITECTURE.md's pipeline: {unplaced}"
    unknown = sorted(set(stages) - set(planning))
    assert not unknown, f"ARCHITECTURE.md's pipeline names modules planning does not have: {unknown}"
    misplaced = sorted(f"{name} (ARCHITECTURE.md: planning/{folders[short]})" for short, name in planning.items()
                       if name != ".".join(filter(None, ("remat.planning", folders[short], short))))
    assert not misplaced, f"planning modules outside their stage's subpackage: {misplaced}"
    wrong = [
        f"{short} (stage {stages[short]}) imports {dep.rpartition('.')[2]} (stage {stages[dep.rpartition('.')[2]]})"
        for short, name in planning.items()
        for dep in GRAPH[name]
        if dep.startswith("remat.planning.") and stages[dep.rpartition(".")[2]] > stages[short]
    ]
    assert not wrong, "planning imports a later stage:\n" + "\n".join(sorted(wrong))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # a package's __init__ re-exporting its children (policies re-exports rules) is no cycle
    graph = {name: {d for d in deps if not (MODULES[name].name == "__init__.py" and d.startswith(name + "."))}
             for name, deps in GRAPH.items()}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(group) for group in found)


def defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def declared_all(tree: ast.Module) -> list[str] | None:
    """``__all__`` as the module writes it: a literal list, or re-exported from a child (``policies``)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "__all__" for a in node.names):
            return []  # taken from the module it re-exports, which this test checks in its turn
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:  # computed (`remat`'s, from its table): every name is looked up below
                return []
    return None


def test_every_module_has_a_docstring_and_all():
    missing_doc, missing_all, undefined = [], [], []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        if not ast.get_docstring(tree):
            missing_doc.append(name)
        defines = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))
                      for n in tree.body)
        names = declared_all(tree)
        if names is None and defines:
            missing_all.append(name)
        undefined += [f"{name}.{n}" for n in names or [] if n not in defined_names(tree)]
    assert not missing_doc, f"modules without a docstring: {missing_doc}"
    assert not missing_all, f"modules that define names but no __all__: {missing_all}"
    assert not undefined, f"__all__ names a module does not define: {undefined}"


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_remat_and_the_command_start_without_torch():
    out = run_python("""
        import contextlib, io, sys
        import remat
        before = "torch" in sys.modules
        from remat.tools.cli import main
        for argv in (["--help"], ["plan", "--help"], ["check", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main(argv)
        print(before, "torch" in sys.modules)
    """)
    assert out.split() == ["False", "False"], f"torch imported by `import remat` / `remat --help`: {out}"


def test_the_library_imports_torch_and_nothing_else():
    library = [name for name in MODULES if subpackage(name) in ("engine", "policies", "api", "planning", "models")]
    out = run_python(f"""
        import importlib, sys
        import torch
        before = {{name.partition(".")[0] for name in sys.modules}}
        import remat
        for name in remat.__all__:
            getattr(remat, name)
        for name in {library!r}:
            importlib.import_module(name)
        after = {{name.partition(".")[0] for name in sys.modules}}
        print(" ".join(sorted(after - before - set(sys.stdlib_module_names) - {{"remat"}})))
    """)
    assert not out.split(), f"the library imports more than torch (and what torch imports): {out.split()}"
