"""How a script starts and ends: one line and exit status 2 for a mistake a user can fix (UserError)."""

import codecs
import errno
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
    """An exception's first non-blank line (at most `limit` characters), else its type's name."""
    line = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return line[:limit] or type(e).__name__


def entry_point(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a script's main(): a UserError prints `error: <message>` and returns 2, Ctrl-C 130, --help 0."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        if signal.getsignal(signal.SIGINT) is interrupted:  # imports done: main() and this handle Ctrl-C
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if main.__module__ == "__main__":  # a process of its own; tests that call main() keep pytest's streams
            StandardStream.install()
        try:
            check_folder_variables()
            return main(*args, **kwargs) or 0
        except BrokenPipeError:  # StandardStream: the reader of our output left (`| head`), as a shell says it
            return 128 + signal.SIGPIPE
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


def check_folder_variables() -> None:
    """The folders of the libraries this project uses: naming a file, each failed deep inside that library."""
    names = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE",
             "WANDB_DIR", "WANDB_CACHE_DIR", "MPLCONFIGDIR", "XDG_CACHE_HOME")
    if files := [f"{name}={os.environ[name]}" for name in names if os.path.isfile(os.environ.get(name, ""))]:
        raise UserError(f"{', '.join(files)}: a file where a folder is expected; point it at a folder or unset it")


def start_script(module: str) -> None:
    """A script's first statement, given its __name__: Ctrl-C during its imports (seconds for torch's) is one line
    and 130, not a traceback, and a deleted working folder one line and 2 (torch's import would blame itself)."""
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
    """Exits at once: an exception raised inside an import can come out as another, and there is no cleanup."""
    print(INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)


def _bytes_back_else_escape(e: UnicodeError) -> tuple[str | bytes, int]:
    """Bytes that were not text (a file name) are written back as those bytes; other characters as `\\u2603`."""
    try:
        return codecs.lookup_error("surrogateescape")(e)
    except UnicodeError:
        return codecs.backslashreplace_errors(e)


class StandardStream:
    """stdout or stderr whatever the shell gave: closed (`2>&-`) it is /dev/null, so no later file takes its
    descriptor; text the encoding lacks is escaped; a pipe whose reader left (`| head -1`) swallows the rest, after
    which a training run saves and exits 141 (SIGPIPE is its stop signal) and any other command exits at once."""

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
