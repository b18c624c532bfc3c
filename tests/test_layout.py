"""The house: the card's top level, one-way imports, optional parts loaded when asked, size."""

import ast
import graphlib
import os
import re
from pathlib import Path

import pathspec
import pytest
from conftest import ROOT

from benchmarks import size

# The design card's top level (requirements.txt is the card's too).
TOP = set(
    """
model train.py sample.py data configs tests requirements.txt README.md requirements-dev.txt
pytest.ini pyproject.toml docs benchmarks training .ci .gitignore
""".split()
)
# Modules of features a flag asks for: nothing imports them at its top, so a plain run never loads
# them, and each can be deleted with its flag.
# model.hf: --init-from a GPT-2, python -m model.hf export; model.textbook: the write-ups'
# attention, the tests' oracle; model.compiled: sample.py --compile; training.hellaswag:
# --hellaswag; training.tracking: --wandb; data.sources: data.prepare --files, --hf, folders.
OPTIONAL = set(
    """
model.hf model.textbook model.compiled training.hellaswag training.tracking data.sources
""".split()
)


def tracked() -> list[str]:
    """The project's files: the tree less what .gitignore ignores, as git would list them, without
    asking git (a release archive has no .git)."""
    rules = [".git", *(ROOT / ".gitignore").read_text().splitlines()]
    ignored = pathspec.GitIgnoreSpec.from_lines(rules)
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        subfolders[:] = [
            d for d in subfolders if not ignored.match_file(f"{(rel / d).as_posix()}/")
        ]
        files += [p for n in names if not ignored.match_file(p := (rel / n).as_posix())]
    return sorted(files)


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every product module (outside tests/ and benchmarks/)."""
    return {
        name[:-3].replace("/", ".").removesuffix(".__init__"): ROOT / name
        for name in tracked()
        if name.endswith(".py") and not name.startswith(("tests/", "benchmarks/"))
    }


def imports(path: Path) -> set[str]:
    """The project modules a file's module level imports, which load whenever it does (a package's
    __init__ for a name from it)."""
    mods, found = modules(), set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            # from x import y; from .x import y; from . import y
            base = (
                f"{package}.{node.module}" if node.level and node.module else node.module or package
            )
            subs = {f"{base}.{alias.name}" for alias in node.names} & mods.keys()
            found |= subs or {base}
    return found & mods.keys()


def test_the_top_level_is_the_design_cards():
    assert {name.split("/")[0] for name in tracked()} == TOP


def test_no_import_circle_the_model_stands_alone_and_optional_features_load_when_asked():
    """A module's top-level imports load with it; an optional one is loaded by a function when its
    flag asks (model.hf for --init-from)."""
    graph = {name: imports(path) - {name} for name, path in modules().items()}
    list(graphlib.TopologicalSorter(graph).static_order())  # CycleError names a circle
    assert graph["model.gpt"] == set()  # the network needs nothing of the project
    model = {m for n in graph if n.startswith("model") for m in graph[n]}
    assert not any(m.startswith("training") for m in model | graph["sample"])
    assert [(n, m) for n in graph if n not in OPTIONAL for m in graph[n] & OPTIONAL] == []


def test_every_module_says_its_one_job_in_its_first_line():
    """A docstring whose first line is a sentence of at most 100 characters."""
    unsaid = [
        name
        for name, path in modules().items()
        if not re.fullmatch(
            r".{0,99}\.", (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]
        )
    ]
    assert unsaid == []


def test_no_function_but_train_is_over_100_lines():
    """train() tells the run top to bottom; every other function stays a screen or so."""
    long = [
        f"{name}:{node.name}"
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
        and node.end_lineno - node.lineno >= 100
        and node.name != "train"
    ]
    assert long == []


def test_no_object_carries_the_run_and_train_holds_at_most_four_context_managers():
    """Besides the two config dataclasses, no class has more than 12 attributes; train() enters at
    most four context managers with `with`, the ExitStack among them (an atomic write's `with
    replacing(path)` aside: it holds a file for one line)."""
    wide = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in {"GPTConfig", "TrainConfig"}:
                attrs = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)} | {
                    t.attr
                    for t in ast.walk(node)
                    if isinstance(t, ast.Attribute)
                    and isinstance(t.ctx, ast.Store)
                    and getattr(t.value, "id", "") == "self"
                }
                if len(attrs) > 12:
                    wide.append(f"{name}.{node.name}: {len(attrs)}")
    assert wide == []
    tree = ast.parse((ROOT / "train.py").read_text())
    train = next(n for n in tree.body if getattr(n, "name", "") == "train")
    withs = [
        w
        for w in ast.walk(train)
        if isinstance(w, ast.With) and "replacing(" not in ast.unparse(w.items[0])
    ]
    assert len(withs) <= 4 and all(len(w.items) == 1 for w in withs)


@pytest.mark.slow  # it runs both scripts
def test_the_code_and_what_the_two_commands_load_stay_under_issue_50s_token_limits():
    product = size.product()
    assert set(product) == {str(p.relative_to(ROOT)) for p in modules().values()}
    assert sum(product.values()) <= size.LIMITS["product"]
    for name, files in size.closures().items():
        assert sum(product[f] for f in files) <= size.LIMITS[name], name


def test_tokens_are_counted_without_comments_blank_lines_or_docstrings(tmp_path):
    path = tmp_path / "x.py"
    path.write_text(
        '"""Doc."""\n\n# a comment\ndef f(a):\n    """Doc."""\n    return a + "b"  # c\n'
    )
    assert size.tokens(path) == 10  # def f ( a ) : return a + "b"
