"""Log lines that clients cannot forge: every string argument of a log record (a request id, a model name,
a path) has its control characters escaped, so a client's CR/LF cannot start a line of its own."""

from __future__ import annotations

import logging
import re

# C0/C1 controls and Unicode's line and paragraph separators: each can end a line in some log viewer
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` with its control characters as escapes (\\n, \\r, \\t, \\xNN, \\uNNNN)."""
    return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or m[0].encode("unicode_escape").decode("ascii"), text)


def _escaped(arg: object) -> object:
    if isinstance(arg, str):
        return printable(arg)
    if isinstance(arg, BaseException):  # its message may quote client input
        return printable(str(arg))
    return arg


class EscapeControlCharacters(logging.Filter):
    """A handler filter: the record's arguments escaped in place (the format string is ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, dict):
            record.args = {k: _escaped(v) for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(_escaped(a) for a in record.args)
        return True


def install(logger_names: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "uvicorn.access")) -> None:
    """Add the filter to every handler of these loggers (the root's and uvicorn's own). Idempotent."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, EscapeControlCharacters) for f in handler.filters):
                handler.addFilter(EscapeControlCharacters())
