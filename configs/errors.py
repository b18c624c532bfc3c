"""Mistakes a user can fix: one exception type (UserError), one line and exit status 2 for it.

The wrapper `entry_point` gives every script that line (a bad flag, a missing file, ...);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

INTERRUPTED = "\ninterrupted; nothing was changed"  # a script writes beside its outputs and swaps them in


class UserError(Exception):
    """A problem the user caused; the message names it and says how to fix it."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's first non-blank line (at most `limit` characters), else its type's name:
    what a one-line message quotes of a library's error."""
    line = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return line[:limit] or type(e).__name__


def entry_point(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a script's main(): a UserError prints `error: <message>` to stderr and returns 2;
    Ctrl-C one line and 130; --help returns 0."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        if signal.getsignal(signal.SIGINT) is interrupted:  # imports done: main() and this handle Ctrl-C
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return main(*args, **kwargs) or 0
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # data.prepare's, or train.py's before StopSignal: a traceback says nothing more
            print(INTERRUPTED, file=sys.stderr)
            return 130
        except SystemExit as e:  # --help exits 0 from inside main(); main(argv) returns it instead
            if e.code not in (0, None):
                raise
            return 0
        finally:  # a script's work is done: Ctrl-C in the interpreter's exit would be a traceback from atexit
            if main.__module__ == "__main__":
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    return wrapper


def quiet_ctrl_c(module: str) -> None:
    """A script's first statement, given its __name__: run as a script, Ctrl-C during its imports
    (seconds for torch's), where KeyboardInterrupt would be a traceback, is one line and the shell's 130."""
    if module == "__main__":
        signal.signal(signal.SIGINT, interrupted)


def interrupted(*_: Any) -> NoReturn:
    """Exits at once: an exception raised inside an import can come out as another (numpy turns it
    into an ImportError), and an import has nothing to clean up."""
    print(INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)
