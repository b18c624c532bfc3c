"""How a script starts and ends: one line and exit status 2 for a mistake a user can fix (UserError).

The wrapper `entry_point` gives every script that line (a bad flag, a missing file, ...); anything
else is a bug and keeps its traceback. It also makes the standard streams safe to write to,
whatever the shell gave the script (`StandardStream`).
"""

from __future__ import annotations

import codecs
import errno
import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

INTERRUPTED = "\ninterrupted; nothing was changed"  # a script writes beside its outputs and swaps them in
READER_LEFT = 128 + signal.SIGPIPE  # the status a shell gives a command whose pipe's reader left (`| head`)


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
        if main.__module__ == "__main__":  # a process of its own; tests that call main() keep pytest's streams
            StandardStream.install()
        try:
            check_folder_variables()
            return main(*args, **kwargs) or 0
        except BrokenPipeError:  # StandardStream: the reader of our output left, so nothing more is wanted
            return READER_LEFT
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


# Variables that name a folder for a library this project uses (torch.compile's cache, Hugging Face's,
# wandb's, matplotlib's, temporary files): naming a file, each failed deep inside that library.
FOLDER_VARIABLES = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE",
                    "WANDB_DIR", "WANDB_CACHE_DIR", "MPLCONFIGDIR", "XDG_CACHE_HOME")


def check_folder_variables() -> None:
    if files := [f"{name}={os.environ[name]}" for name in FOLDER_VARIABLES if os.path.isfile(os.environ.get(name, ""))]:
        raise UserError(f"{', '.join(files)}: a file where a folder is expected; point it at a folder or unset it")


def start_script(module: str) -> None:
    """A script's first statement, given its __name__: run as a script, Ctrl-C during its imports
    (seconds for torch's), where KeyboardInterrupt would be a traceback, is one line and the shell's 130,
    and so is a working folder deleted under the shell (torch's import would blame its own install)."""
    if module != "__main__":
        return
    try:
        os.getcwd()
    except FileNotFoundError:
        print("error: the current folder was deleted; cd to one that exists and run it again", file=sys.stderr)
        sys.exit(2)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job's ignored Ctrl-C stays ignored
        signal.signal(signal.SIGINT, interrupted)


def interrupted(*_: Any) -> NoReturn:
    """Exits at once: an exception raised inside an import can come out as another (numpy turns it
    into an ImportError), and an import has nothing to clean up."""
    print(INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)


def _bytes_back_else_escape(e: UnicodeError) -> tuple[str | bytes, int]:
    """Python's stand-ins for bytes that were not text (a file name, an argument) are written back as those
    bytes, so a printed path is the path; any other character the encoding lacks comes out as `\\u2603`."""
    try:
        return codecs.lookup_error("surrogateescape")(e)
    except UnicodeError:
        return codecs.backslashreplace_errors(e)


class StandardStream:
    """stdout or stderr as a script needs it, whatever the shell gave: closed (`2>&-`), it is /dev/null,
    whose descriptor no file opened later (a checkpoint) can then take; text its encoding cannot show
    (`PYTHONIOENCODING=ascii`) comes out escaped (_bytes_back_else_escape); a pipe whose reader left (`| head -1`) swallows the rest.
    Then a training run, which handles SIGPIPE as a stop signal (training/budget.py), saves and exits 141;
    any other command ends at once, quietly, with the same status (entry_point)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    @classmethod
    def install(cls) -> None:
        for fd, name in enumerate(("stdin", "stdout", "stderr")):
            if getattr(sys, name) is None:  # Python found the descriptor closed
                null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one, or moved there
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))
            if fd and not isinstance(stream := getattr(sys, name), cls):
                codecs.register_error("bytes_back_else_escape", _bytes_back_else_escape)
                stream.reconfigure(errors="bytes_back_else_escape")
                setattr(sys, name, cls(stream))

    def write(self, text: str) -> int:
        return self._unless_reader_left(self.stream.write, text) or len(text)

    def flush(self) -> None:
        self._unless_reader_left(self.stream.flush)

    def _unless_reader_left(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())  # what is still buffered, and all that follows, goes nowhere
            os.close(null)
            if not callable(signal.getsignal(signal.SIGPIPE)):  # no training run that saves on it first
                raise BrokenPipeError(errno.EPIPE, "the reader of this output left") from None
            return None

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)
