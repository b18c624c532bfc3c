"""The one exception type for mistakes a user can fix (bad flag, missing file, ...), and the
wrapper that turns it into one line and exit status 2 at every entry point.

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user caused; the message names it and says how to fix it."""


def entry_point(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a script's main(): a UserError prints `error: <message>` to stderr and returns 2;
    --help returns 0."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except SystemExit as e:  # --help exits 0 from inside main(); main(argv) returns it instead
            if e.code not in (0, None):
                raise
            return 0

    return wrapper
