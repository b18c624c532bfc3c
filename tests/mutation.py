"""Mutation score of the core: how many small bugs (mutants) the test suite catches.

    pip install mutmut==3.8.1
    python tests/mutation.py                   # the whole core: about 50 minutes on 2 cores
    python tests/mutation.py --only 'optim*'   # one module's mutants (mutmut's name patterns)
    python tests/mutation.py --again           # after adding tests: retest the last run's survivors
    python tests/mutation.py --again --only 'model.gpt*'     # or every mutant of a changed module
    python tests/mutation.py --update          # after a change: test the mutants without a verdict

Run it before a large change, not on every push (too slow for CI). mutmut changes one thing at a
time in the code below (a + becomes -, a 1 becomes 2, a condition is negated...) and runs the
tests that call the changed function; a mutant that no test fails on "survived". The run happens
in a copy of the tracked files (WORK, kept for `mutmut browse` / `mutmut show NAME` there), so
the checkout is never touched. docs/mutation.md has the last score and why each survivor is left.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the project, for test_layout's imports
from test_layout import tracked  # noqa: E402  the project's files, as git would list them

# The core: the model package, the optimizer and schedule, sampling, the batches, the tokenizers
# and the HellaSwag scorer.
CORE = (
    "model/ training/optim.py sample.py data/loader.py data/tokenizer.py training/hellaswag.py"
).split()
# Mutating the words of a message (a help text, an error's wording) is not a bug a test should
# catch: lines that only raise, print or hold such text are left alone. Everything else is mutated.
MESSAGE_LINES = [
    r"help=",
    r"^\s*raise \w+\(",
    r"^\s*f?\"[^\"]*\"\s*\)*,?$",
    r"\b(print|tqdm\.write)\(",
]
# Tests left out of the run, so that the score is a lower bound: those that compile (mutmut wraps
# each function in a dispatcher that torch.compile cannot trace), those that start processes
# (torchrun, the scripts), and the documented commands: minutes each mutant would pay, for code the
# in-process tests run too. pytest takes the last -m it is given: one expression says all.
LEFT_OUT = "test_commands.py test_layout.py test_failures.py test_benchmarks.py".split()
MARKERS = "-mnot cuda and not slow"
CONFIG = """[mutmut]
source_paths=
{sources}
also_copy=
{others}
do_not_mutate_patterns=
{patterns}
# torch is not fork-safe once it has run: fork each mutant's worker from one that only imported
process_isolation=forkserver
# a test at a time whatever the cores: mutmut reads which tests ran which code in its process
pytest_add_cli_args=
    -n0
{deselected}
"""


def write_copy(work: Path) -> None:
    """The tracked files into work, with mutmut's configuration beside them."""
    if work.exists():
        shutil.rmtree(work)
    files = tracked()
    for name in files:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, work / name)
    tops = sorted({name.split("/")[0] + ("/" if "/" in name else "") for name in files})
    indent = lambda items: "\n".join(f"    {x}" for x in items)
    deselected = [f"--deselect=tests/{t}" for t in LEFT_OUT] + [MARKERS]
    (work / "setup.cfg").write_text(
        CONFIG.format(
            sources=indent(CORE),
            others=indent(tops),
            patterns=indent(MESSAGE_LINES),
            deselected=indent(deselected),
        )
    )


def update_copy(work: Path) -> None:
    """Bring WORK up to date: copy the files that changed since it was made. mutmut then makes the
    mutants of each changed function again, and forgets their verdicts."""
    for name in tracked():
        if not (work / name).is_file() or (work / name).read_bytes() != (ROOT / name).read_bytes():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, work / name)


def score(work: Path) -> dict:
    """Counts per status and the names of the survivors, from mutmut's results."""
    out = subprocess.run(
        "mutmut results --all true".split(), cwd=work, capture_output=True, text=True
    ).stdout
    status = dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    counts = Counter(status.values())
    tested = sum(n for s, n in counts.items() if s not in ("not checked", "skipped"))
    caught = sum(n for s, n in counts.items() if s in ("killed", "timeout", "caught by type check"))
    return {
        "counts": dict(counts),
        "score": caught / tested if tested else 0.0,
        "survived": sorted(name for name, s in status.items() if s == "survived"),
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--work", type=Path, default=Path("/tmp/gpt-mutation"), help="where the copy runs (WORK)"
    )
    p.add_argument("--only", nargs="*", default=[], help="mutant name patterns, e.g. 'model.gpt*'")
    p.add_argument(
        "--again",
        action="store_true",
        help="retest WORK's survivors with the current code and tests",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="bring WORK up to date; test every mutant without a verdict (new, or of changed code)",
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    args = p.parse_args()
    if shutil.which("mutmut") is None:
        sys.exit("mutmut is not installed: pip install mutmut==3.8.1")
    t0 = time.time()
    # mutmut keeps every verdict: bring the copy up to date, retest what is asked
    if args.again or args.update:
        names = args.only or (score(args.work)["survived"] if args.again else [])
        update_copy(args.work)
    else:
        names = args.only
        write_copy(args.work)
    subprocess.run(["mutmut", "run", "--max-children", str(args.jobs), *names], cwd=args.work)
    result = score(args.work)
    survived = result.pop("survived")
    result["seconds"] = round(time.time() - t0)
    print(json.dumps(result))
    print(f"{len(survived)} survivors (mutmut show NAME in {args.work} for each diff):")
    for name in survived:
        print(f"| {name} | `{changed_line(args.work, name)}` |")
    return 0


def changed_line(work: Path, name: str) -> str:
    """The mutant's new line, as mutmut shows its diff."""
    diff = subprocess.run(["mutmut", "show", name], cwd=work, capture_output=True, text=True).stdout
    added = [
        line[1:].strip()
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    return (added[-1] if added else "(a line removed)").replace("|", "\\|")


if __name__ == "__main__":
    sys.exit(main())
