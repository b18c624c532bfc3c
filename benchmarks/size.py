"""Size: the product code in Python tokens, per file and folder, and what the main commands load.

    python -m benchmarks size

A token is one of Python's (tokenize), less comments, line breaks, indentation and docstrings, so
that layout cannot change the count. The product is every .py file outside tests/ and benchmarks/;
the tests, tests/*.py, are counted the same way.
The closures are the project's files that `python train.py --config small` (2 steps, in a
temporary folder) and then `python sample.py --prompt X` import, at start-up or later.
"""

import io
import json
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"product": 24_000, "train": 15_000, "sample": 8_000}  # issue 50's
SKIP = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
    tokenize.ENCODING,
}
# Runs a script as `python SCRIPT ARGS` would, then lists the project's files it imported.
LIST_IMPORTS = """import atexit, json, runpy, sys
root, script, *args = sys.argv[1:]
loaded = lambda: [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
atexit.register(lambda: print(json.dumps(sorted(f for f in loaded() if f.startswith(root)))))
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


def tokens(path: Path) -> int:
    """Python tokens of a file, less comments, line breaks, indentation and docstrings."""
    count, statement_start = 0, True
    for tok in tokenize.tokenize(io.BytesIO(path.read_bytes()).readline):
        if tok.type in SKIP:
            if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                statement_start = True
            continue
        if not (tok.type == tokenize.STRING and statement_start):  # a docstring starts a statement
            count += 1
        statement_start = False
    return count


def product() -> dict[str, int]:
    """Tokens of each product file, by its path in the repository."""
    outside = ("tests", "benchmarks", ".venv")
    files = sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in outside)
    return {str(p.relative_to(ROOT)): tokens(p) for p in files}


def imported(script: str, *args: str) -> list[str]:
    """The project's files that `python SCRIPT ARGS`, run in the repository, imports."""
    command = [sys.executable, "-c", LIST_IMPORTS, str(ROOT) + "/", script, *args]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [str(Path(f).relative_to(ROOT)) for f in json.loads(out.splitlines()[-1])]
    return [script] + [f for f in files if not f.startswith((".venv", "benchmarks"))]


def closures() -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        run = f"--out-dir {tmp}/run --data-root {tmp}/data --max-iters 2 --eval-iters 1".split()
        train = imported("train.py", "--config", "small", *run)
        sample = imported("sample.py", "--out-dir", f"{tmp}/run", "--prompt", "X")
    return {"train": train, "sample": sample}


def main() -> None:
    sizes, folders = product(), {}
    for path, n in sizes.items():
        folder = path.split("/")[0] + "/" if "/" in path else path
        folders[folder] = folders.get(folder, 0) + n
        print(f"{n:7,}  {path}")
    print()
    for folder, n in sorted(folders.items(), key=lambda item: -item[1]):
        print(f"{n:7,}  {folder}")
    print(
        f"\nproduct: {sum(sizes.values()):,} tokens in {len(sizes)} files "
        f"(limit {LIMITS['product']:,})"
    )
    tests = sum(tokens(p) for p in (ROOT / "tests").glob("*.py"))
    print(f"tests: {tests:,} tokens, {tests / sum(sizes.values()):.2f}x the product (goal 1.5x)")
    for name, files in closures().items():
        n = sum(sizes[f] for f in files)
        print(
            f"{name} closure: {n:,} tokens in {len(files)} files (limit {LIMITS[name]:,}): "
            f"{' '.join(files)}"
        )


if __name__ == "__main__":
    main()
