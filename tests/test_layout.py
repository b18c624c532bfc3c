"""The house: the design card's top level, imports that only go down, short functions, one job a module."""

import ast
import functools
import os
from pathlib import Path

import pathspec

ROOT = Path(__file__).resolve().parent.parent
TOP = {"model", "train.py", "sample.py", "data", "configs", "tests", "requirements.txt",  # the design card's
       "README.md", "requirements-dev.txt", "pytest.ini", "docs", "benchmarks", "training",  # and what serves it
       ".ci", ".gitignore"}
# Each package imports only those below it: configs (settings, the command line, UserError) at the
# bottom, then data, the model, the training machinery, the scripts; benchmarks time the scripts' steps.
FLOORS = {"configs": 0, "data": 1, "model": 2, "training": 3, "benchmarks": 5}
SCRIPT_FLOOR = 4


def tracked() -> list[str]:
    """The project's files: the tree less what .gitignore ignores, as `git ls-files --cached --others
    --exclude-standard` lists them, without asking git: a release archive has no .git, and a copy inside
    another repository would get that one's answer."""
    rules = [".git", *(ROOT / ".gitignore").read_text().splitlines()]  # a folder, or in a worktree a file
    if (exclude := ROOT / ".git" / "info" / "exclude").is_file():  # a checkout's own ignores, as git reads them
        rules += exclude.read_text().splitlines()
    ignored = pathspec.GitIgnoreSpec.from_lines(rules)
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        subfolders[:] = [d for d in subfolders if not ignored.match_file(f"{(rel / d).as_posix()}/")]  # not .venv's
        files += [(rel / name).as_posix() for name in names if not ignored.match_file((rel / name).as_posix())]
    return sorted(files)


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every Python file of the project outside tests/."""
    out = {}
    for name in tracked():
        if name.endswith(".py") and not name.startswith("tests/"):
            out[name[:-3].replace("/", ".").removesuffix(".__init__")] = ROOT / name
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


@functools.cache
def imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's __init__ when a name comes from it)."""
    mods, graph = modules(), {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                subs = {f"{base}.{alias.name}" for alias in node.names} & mods.keys()
                found |= subs or {base}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def floor(module: str) -> int:
    top = module.split(".")[0]
    if module.endswith("__main__") and top != "benchmarks":
        return SCRIPT_FLOOR  # python -m model: a script inside its package
    return FLOORS.get(top, SCRIPT_FLOOR)


def test_the_top_level_is_the_design_cards():
    assert {name.split("/")[0] for name in tracked()} == TOP


def test_imports_only_go_down_and_model_imports_nothing_from_training():
    upward = [(a, b) for a, targets in imports().items() for b in targets
              if a.split(".")[0] != b.split(".")[0] and floor(b) >= floor(a)]
    assert upward == []


def test_no_import_circle_and_at_most_7_levels():
    graph, depth, path = imports(), {}, []

    def levels(module: str) -> int:  # the longest chain of imports from module down, counting module
        assert module not in path, f"import circle: {' -> '.join(path[path.index(module):] + [module])}"
        if module not in depth:
            path.append(module)
            depth[module] = 1 + max((levels(m) for m in graph[module]), default=0)
            path.pop()
        return depth[module]

    # benchmarks time the scripts' own steps, so they stand above them: counted from the scripts down
    deepest = max((m for m in graph if not m.startswith("benchmarks")), key=levels)
    assert levels(deepest) <= 7, deepest
    assert levels("train") <= 7 and levels("sample") <= 7 and max(map(levels, graph)) < 12


def test_no_function_over_60_lines():
    long = [f"{path.relative_to(ROOT)}:{node.name} {node.end_lineno - node.lineno + 1}"
            for path in modules().values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert long == []


def test_every_module_says_its_one_job_in_its_first_line():
    unsaid = [name for name, path in modules().items()
              if not (doc := ast.get_docstring(ast.parse(path.read_text())) or "").strip()
              or len(doc.splitlines()[0]) > 100 or not doc.splitlines()[0].endswith(".")]
    assert unsaid == []
