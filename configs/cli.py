"""The command line every script shares: argparse through its public API, with a few habits added.

Every `--top-k` is also `--top_k` (nanoGPT's spelling); booleans are `--force`, `--no-force`, `--force=false` or
`--force false`; --help shows every default; bad input is one UserError line with a "did you mean"; no prefixes.
"""

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import field
from functools import partial
from typing import Any, Literal, NoReturn, get_args, get_origin

from .errors import UserError

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# Common names for a choice that are too far from it for difflib to suggest
ALIASES = {"gpu": "cuda", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def closest(word: str, options: Sequence[str]) -> str | None:
    return next(iter(difflib.get_close_matches(word, options, n=1, cutoff=0.6)), None)


class Number:
    """An int or float from text or a TOML/JSON value, finite and from lo to hi (ends included unless open)."""

    def __init__(self, kind: type, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False,
                 hi_open: bool = False, expects: str = "") -> None:
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open
        self.noun, self.metavar = ("an integer", "INT") if kind is int else ("a number", "FLOAT")
        above = f" {'>' if lo_open else '>='} {lo}" if lo > -math.inf else ""
        within = f" in {'[('[lo_open]}{lo}, {hi}{'])'[hi_open]}" if hi < math.inf else above
        self.expects = expects or self.noun + within

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
        above = self.lo < x or not self.lo_open and x == self.lo
        if not (math.isfinite(x) and above and (x < self.hi or not self.hi_open and x == self.hi)):
            expects = self.expects if math.isfinite(x) else "a finite number"  # no option means inf or nan
            raise argparse.ArgumentTypeError(f"expects {expects}, got {value!r}")
        return x


integer, number = partial(Number, int), partial(Number, float)
seed = Number(int, 0, 2**32, hi_open=True, expects="a seed from 0 to 2**32 - 1 (torch keeps 32 bits)")  # 2**32 is 0


def setting(default: Any, help: str, section: str = "", check: Callable[[Any], Any] | None = None) -> Any:
    """A config field with its --help line, the --help group it starts, and its check (default: by its type, >= 0)."""
    return field(default=default, metadata={"help": help, "section": section, "check": check})


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
    """A string field's check: str() would make a TOML/JSON [1] a folder name."""
    if isinstance(value, str):
        return value
    raise argparse.ArgumentTypeError(f"expects text, got {value!r}")


def converter(annotation: Any) -> Callable[[Any], Any]:
    """Checks and converts a command-line string or a TOML/JSON value to `annotation` (a number: at least 0)."""
    if get_origin(annotation) is Literal:
        return Choice(get_args(annotation))
    return {int: integer(lo=0), float: number(lo=0), bool: boolean, str: text}[annotation]


def argument(kind: Any) -> dict[str, Any]:
    """add_argument keywords for a Literal type's value, or for a value that the check `kind` takes."""
    check = Choice(get_args(kind)) if get_origin(kind) is Literal else kind
    return {"action": Flag} if check is boolean else {"type": check, "choices": getattr(check, "options", None)}


class Store(argparse.Action):
    """argparse's "store" or "append", plus nanoGPT's spelling (`--max_iters`), the type's metavar, --help's default."""

    def __init__(self, option_strings: list[str], dest: str, default: Any = None, type: Any = None,
                 metavar: Any = None, help: str | None = None, append: bool = False, **kwargs: Any) -> None:
        self.append = append
        twins = ["--" + s[2:].replace("-", "_") for s in option_strings if s.startswith("--")]
        if option_strings and isinstance(default, (bool, int, float, str)):
            help = f"{help or ''} (default: %(default)r)".lstrip()
        super().__init__([*option_strings, *(s for s in twins if s not in option_strings)], dest, default=default,
                         type=type, metavar=metavar or getattr(type, "metavar", None), help=help, **kwargs)

    def __call__(self, parser: Any, namespace: argparse.Namespace, value: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), value] if self.append else value)


class Flag(Store):
    """A boolean option: `--x` is true, `--no-x` false, `--x=VALUE` or `--x true` says which."""

    def __init__(self, option_strings: list[str], dest: str, default: bool = False, **kwargs: Any) -> None:
        negated = [f"--no-{s[2:]}" for s in option_strings if s.startswith("--")]
        super().__init__([*option_strings, *negated], dest, nargs="?", type=boolean, default=default,
                         metavar="BOOL", **kwargs)
        self.negated = {s for s in self.option_strings if s.startswith(("--no-", "--no_"))} - set(option_strings)

    def __call__(self, parser: Any, namespace: argparse.Namespace, value: Any, option_string: Any = None) -> None:
        if option_string in self.negated and value is not None:
            raise argparse.ArgumentError(None, f"{option_string} takes no value")
        setattr(namespace, self.dest, option_string not in self.negated if value is None else value)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the habits in this module's docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.actions: dict[str, argparse.Action] = {}  # by option string: for "did you mean" and the flags' values
        # add_argument looks an action up in this registry, which argument groups share
        for name, action in ((None, Store), ("store", Store), ("append", partial(Store, append=True)), (Flag, Flag)):
            self.register("action", name, partial(self.noted, action))
        # The one private name here: argparse's own pattern takes `-1e-3`, `-inf` and `-nan` for options, so
        # `--lr -1e-3` would be "expected one argument" instead of a range.
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.I)

    def noted(self, action: type[argparse.Action], **kwargs: Any) -> argparse.Action:
        made = action(**kwargs)
        self.actions |= dict.fromkeys(made.option_strings, made)
        return made

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """A bare boolean flag before a word that is not true/false is written `--x=true` (`--no-x`: `--x=false`),
        as argparse would take the word (`--force shakespeare_char`) for the flag's value."""
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)
        for i, (arg, after) in enumerate(zip(args[:end], [*args[1:end], "--"])):
            if isinstance(flag := self.actions.get(arg), Flag) and after.lower() not in TRUE + FALSE:
                args[i] = f"{flag.option_strings[0]}={str(arg not in flag.negated).lower()}"
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if not unknown:
            return parsed
        if not unknown[0].startswith("-") or unknown[0] == "--":
            self.error(f"unexpected argument {unknown[0]!r} (see --help)")
        flag = unknown[0].partition("=")[0]
        hint = closest(flag.lstrip("-").replace("_", "-"), [s[2:] for s in ["--help", *self.actions] if "_" not in s])
        self.error(f"unknown option {flag!r}; " + (f"did you mean --{hint}?" if hint else "see --help for the options"))

    def error(self, message: str) -> NoReturn:
        # argparse names an option by all its spellings, "argument --x/--x_y/--no-x: problem"; the first is enough
        raise UserError(re.sub(r"argument (-[^/\s:]+)[^\s:]*", r"argument \1", message).removeprefix("argument "))
