"""The one exception type for mistakes a user can fix (bad flag, missing file, ...).

Entry points catch it and print a single line; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user caused; the message names it and says how to fix it."""
