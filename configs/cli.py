"""The command line every script shares: argparse with a few habits added.

    parser = ArgumentParser(prog="python sample.py", description=__doc__)
    parser.add_argument("--top-k", type=integer, help="keep the k most likely tokens")
    parser.add_argument("--device", default="auto", **argument(Literal["auto", "cpu"]))
    parser.add_argument("--force", action=Flag, help="rebuild even if up to date")
    args = parser.parse_args(argv)

`--max_iters=5` means `--max-iters 5` (nanoGPT habits work); booleans are `--force`, `--no-force`
or `--force false`; --help shows the script's docstring as written and every default; bad input
is one UserError line with a "did you mean"; prefixes are refused (`--max-iter` must not quietly
set --max-iters).
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

from .errors import UserError

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# Common names for a choice that are too far from it for difflib to suggest
ALIASES = {"gpu": "cuda", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def closest(word: str, options: Sequence[str]) -> str | None:
    """The option a typo most likely meant, or None."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return close[0] if close else None


class Number:
    """An int or float from text or a TOML/JSON value, finite (1e4 and 2_000 are fine; 2.5 for an int, true, nan
    are not) and within `bounds`, which the message quotes: integer.within(">= 1"), number.within("[0, 1)")."""

    def __init__(self, kind: type, bounds: str = "", expects: str = "") -> None:
        self.kind, (self.metavar, self.noun) = kind, ("INT", "an integer") if kind is int else ("FLOAT", "a number")
        lo, _, hi = re.sub(r"^>=? (\S+)$", r"\1,inf", bounds or "-inf,inf").strip("[]() ").partition(",")
        self.lo, self.hi, self.closed = float(lo), float(hi), (bounds.startswith(("[", ">=")), bounds.endswith("]"))
        self.expects = expects or f"{self.noun} {'in ' * (bounds[:1] in '[(')}{bounds}"

    def within(self, bounds: str) -> Number:
        return Number(self.kind, bounds)

    def holds(self, x: float) -> bool:
        return (self.lo < x or self.closed[0] and x == self.lo) and (x < self.hi or self.closed[1] and x == self.hi)

    def __call__(self, value: Any) -> Any:
        try:
            x = float(value) if self.kind is float or isinstance(value, str) and re.search(r"[.eE]", value) else value
            if isinstance(value, bool) or (self.kind is int and isinstance(x, float) and not x.is_integer()):
                raise ValueError
            x = self.kind(x)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expects {self.noun}, got {value!r}") from None
        if self.kind is int and self.hi == math.inf and abs(x) >= 2**31:  # torch's sizes and counts are C ints
            raise argparse.ArgumentTypeError(f"expects {self.noun} below 2**31, got {value!r}")
        if not self.holds(x):  # inf and nan too: no option means them (max_time 0 is none)
            expects = self.expects if abs(x) < math.inf else "a finite number"
            raise argparse.ArgumentTypeError(f"expects {expects}, got {value!r}")
        return x


integer, number = Number(int), Number(float)
seed = Number(int, f"[0, {2**32})", "a seed from 0 to 2**32 - 1 (torch keeps 32 bits)")  # 2**32 would repeat 0


def boolean(value: Any) -> bool:
    if str(value).lower() in TRUE + FALSE:
        return str(value).lower() in TRUE
    raise argparse.ArgumentTypeError(f"expects true/false (or no value), got {value!r}")


class Choice:
    """Checks a value against fixed options; a near miss gets a "did you mean"."""

    def __init__(self, options: Sequence[str]) -> None:
        self.options = tuple(options)

    def __call__(self, value: Any) -> str:
        if value in self.options:
            return value
        hint = ALIASES.get(str(value).lower()) or closest(str(value).lower(), self.options)
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(self.options)}"
                                         + (f"; did you mean {hint!r}?" if hint in self.options else ""))


def text(value: Any) -> str:
    """A string field's check: a TOML/JSON value must be text already (str() would make [1] a folder name)."""
    if isinstance(value, str):
        return value
    raise argparse.ArgumentTypeError(f"expects text, got {value!r}")


def converter(annotation: Any, bounds: str = "") -> Callable[[Any], Any]:
    """Checks and converts a command-line string or a TOML/JSON value to `annotation`; raises ArgumentTypeError."""
    if get_origin(annotation) is Literal:
        return Choice(get_args(annotation))
    return {int: integer.within(bounds), float: number.within(bounds), bool: boolean, str: text}[annotation]


def one_of(options: Sequence[str]) -> dict[str, Any]:
    """add_argument keywords for a choice: choices= lists them in --help; Choice rejects a bad
    value before argparse does, with a "did you mean"."""
    return {"type": Choice(options), "choices": tuple(options)}


def argument(annotation: Any, check: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """add_argument keywords for a value of type `annotation`, checked by `check` (default: see converter)."""
    if annotation is bool:
        return {"action": Flag}
    return {"type": check or converter(annotation), "choices": get_args(annotation) or None}


class Flag(argparse.Action):
    """A boolean option: `--x` is true, `--no-x` false, `--x VALUE` / `--x=VALUE` says which."""

    def __init__(self, option_strings: list[str], dest: str, default: bool = False, **kwargs: Any) -> None:
        negated = [f"--no-{s[2:]}" for s in option_strings if s.startswith("--")]
        super().__init__([*option_strings, *negated], dest, nargs="?", type=boolean, default=default,
                         metavar="BOOL", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        negated = option_string is not None and option_string.startswith("--no-")
        if negated and value is not None:
            raise argparse.ArgumentError(None, f"{option_string} takes no value")
        setattr(namespace, self.dest, not negated if value is None else value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; every option with its default; `--x, --no-x` for a Flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        shown = isinstance(action.default, (bool, int, float, str)) and action.default is not argparse.SUPPRESS
        if not shown or not action.option_strings or "%(default)" in help:
            return help
        return f"{help} (default: %(default)r)".lstrip()

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return getattr(action.type, "metavar", action.dest.upper())

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Flag):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the habits in this module's docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.I)  # `--lr -1e-3`: a value, no option

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(self._spelled_out(sys.argv[1:] if args is None else args), namespace)

    def _spelled_out(self, argv: Sequence[str]) -> list[str]:
        """`--max_iters=5` -> `--max-iters=5` (the flag's name, never a value, nothing after `--`); a boolean
        flag takes the next word only when it is true/false, so `--force NAME` keeps NAME for the positional:
        `--force` -> `--force=true`, `--no-force` -> `--force=false`."""
        out = list(argv)
        for i, arg in enumerate(argv):
            if arg == "--":
                break
            if arg.startswith("--"):
                flag, eq, value = arg.partition("=")
                arg = out[i] = flag.replace("_", "-") + eq + value
            action = self._option_string_actions.get(arg)
            if isinstance(action, Flag):
                following = argv[i + 1].lower() if i + 1 < len(argv) else ""
                if arg.startswith("--no-"):
                    out[i] = f"{action.option_strings[0]}=false"
                elif following not in TRUE + FALSE:
                    out[i] = f"{arg}=true"
        return out

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if not unknown:
            return parsed
        if not unknown[0].startswith("-") or unknown[0] == "--":
            self.error(f"unexpected argument {unknown[0]!r} (see --help)")
        flag = unknown[0].partition("=")[0]
        names = [s[2:] for s in self._option_string_actions if s.startswith("--")]
        hint = closest(flag.lstrip("-"), names)
        self.error(f"unknown option {flag!r}; " + (f"did you mean --{hint}?" if hint else "see --help for the options"))

    def error(self, message: str) -> NoReturn:
        # argparse writes "argument --x/--no-x: problem"; the first spelling names it well enough
        raise UserError(re.sub(r"^argument (\S+?)(?:/\S+)?: ", r"\1: ", message))
