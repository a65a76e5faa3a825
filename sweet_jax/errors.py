"""The one base class for errors meant for the user (bad input, bad config, bad checkpoint), and how the
command-line entry points show them."""
from __future__ import annotations

import logging
import sys
from typing import Callable, NoReturn, TypeVar

T = TypeVar("T")


class SweetJaxError(ValueError):
    """An error caused by the user's input; its message says what, where and what to do."""


def exit_with_error(message: str) -> NoReturn:
    """One line `error: ...` on stderr and exit status 2 (a usage error), no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def cli_main(log: logging.Logger, body: Callable[[], T]) -> T:
    """Run an absl entry point's body: the entry point's own logger at INFO, absl's at WARNING (Orbax logs every
    file operation there), and a SweetJaxError as one line on stderr with exit status 2 (the traceback only at
    DEBUG). Other exceptions propagate."""
    logging.getLogger("absl").setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    try:
        return body()
    except SweetJaxError as e:
        log.debug("error details", exc_info=True)
        exit_with_error(str(e))
