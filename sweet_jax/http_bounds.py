"""An engine's HTTP answer read under a deadline for the whole request and a cap on its size.

A socket timeout bounds one read, not a request: a server that sends a byte a second holds a request forever, and
one that sends 256 MiB is read whole. Both clients of an OpenAI-compatible engine (policy_backend's completions,
envs.simulators' chat) read the body through `read_body`, with a watchdog that shuts the socket at the deadline
so that a read blocked in the kernel returns too.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Callable, Iterable, Iterator

MiB = 1 << 20


class AnswerBoundError(Exception):
    """An answer past its deadline or its size cap (what and how much in the message); retried like a timeout."""


def answer_cap(max_tokens: int, n: int = 1) -> int:
    """Bytes an honest answer of n choices of at most max_tokens tokens fits in: 1 MiB of envelope plus 1 KiB a
    token (a token's text, id and log-prob in JSON are well under 100 bytes), so only a runaway answer is cut."""
    return MiB + max(1, int(n)) * max(1, int(max_tokens)) * 1024


@contextlib.contextmanager
def watchdog(stop: Callable[[], None] | None, deadline: float) -> Iterator[None]:
    """Call `stop` (shut the answer's socket) at `deadline` (time.monotonic()) unless the block has ended first:
    a read blocked in the kernel then returns."""
    if stop is None:
        yield
        return

    def shut():
        with contextlib.suppress(OSError):
            stop()

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), shut)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def socket_stopper(sock: socket.socket | None) -> Callable[[], None] | None:
    return None if sock is None else lambda: sock.shutdown(socket.SHUT_RDWR)


def read_body(chunks: Iterable[bytes], *, deadline: float, max_bytes: int, timeout_s: float, where: str,
              content_length: str | None = None) -> bytes:
    """The whole body of `chunks`, or AnswerBoundError once it passes `max_bytes` or the deadline."""
    if content_length is not None and content_length.strip().isdigit() and int(content_length) > max_bytes:
        raise AnswerBoundError(f"{where}: the answer announces {int(content_length)} bytes, more than the "
                               f"{max_bytes} an answer to this request may have")
    parts, size = [], 0
    try:
        for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise AnswerBoundError(f"{where}: the answer passed {max_bytes} bytes, more than an answer to this "
                                       "request may have; stopped reading")
            if time.monotonic() > deadline:
                raise AnswerBoundError(f"{where}: no complete answer within the request's deadline of "
                                       f"{timeout_s:g} s (timeout_s; {size} bytes had come)")
            parts.append(chunk)
    except AnswerBoundError:
        raise
    except Exception as e:  # noqa: BLE001 — a read the watchdog cut short ends here
        if time.monotonic() >= deadline:
            raise AnswerBoundError(f"{where}: no complete answer within the request's deadline of {timeout_s:g} s "
                                   f"(timeout_s; {size} bytes had come)") from None
        raise
    return b"".join(parts)
