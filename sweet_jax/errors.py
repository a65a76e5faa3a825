"""The one base class for errors meant for the user (bad input, bad config, bad checkpoint), and how the
command-line entry points show them."""
from __future__ import annotations

import errno
import logging
import re
import sys
import warnings
from typing import Callable, NoReturn, TypeVar

T = TypeVar("T")


class SweetJaxError(ValueError):
    """An error caused by the user's input; its message says what, where and what to do."""


class TrainConfigError(SweetJaxError):
    """A config value that cannot work; the message names the field and what to set (raised by config_utils and by
    the layers below it that read the training config's files, such as data.datasets)."""


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
    except Exception as e:  # noqa: BLE001 — only a full disk or unreachable storage is answered here
        message = storage_failure(e)
        if message is None:
            raise
        log.debug("error details", exc_info=True)
        exit_with_error(message)


# TensorStore (Orbax's array writer) reports a full disk as ValueError("RESOURCE_EXHAUSTED: ... Failed writing:
# "PATH": ... No space left on device [os_error_code='28']"), not as an OSError.
_NO_SPACE = re.compile(rf"No space left on device|Disk quota exceeded|os_error_code='({errno.ENOSPC}|{errno.EDQUOT})'")
_WRITTEN = re.compile(r'(?:Failed writing|local file): "([^"]+)"')


def disk_full(error: BaseException) -> OSError | None:
    """The ENOSPC (or EDQUOT) OSError behind `error` (itself, or its cause / context, as libraries wrap it; a
    TensorStore write error as one)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return error
        if not isinstance(error, OSError) and _NO_SPACE.search(str(error)[:100_000]):
            written = _WRITTEN.search(str(error))
            return OSError(errno.ENOSPC, "No space left on device", written.group(1) if written else None)
        error = error.__cause__ or error.__context__
    return None


# A remote path (gs://, s3://, ...) whose storage cannot be reached: TensorFlow's file system (behind etils.epath)
# raises its own error types with libcurl's message, fsspec back ends OSErrors of their own.
# A time-out or a refused connection is a network problem only where a remote path is named: Orbax's own threads
# time out on a local disk too (a checkpoint's save finalize, e.g. after the process was stopped for a while).
_REMOTE_PATH = re.compile(r"\b(?:gs|gcs|s3|hdfs|az|abfs)://[^\s'\"]+")
_UNREACHABLE = re.compile(r"Could not resolve host|Couldn't resolve host|libcurl code|Name or service not known|"
                          r"Temporary failure in name resolution|Network is unreachable|DefaultCredentialsError|"
                          r"could not find default credentials", re.IGNORECASE)
_UNREACHABLE_IF_REMOTE = re.compile(r"Connection refused|Failed to connect|Could not connect|timed out", re.IGNORECASE)


def remote_unreachable(error: BaseException) -> str | None:
    """One line for an error behind `error` (itself, its cause or context) that says a remote path's storage could
    not be reached (no network, no credentials), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)[:10_000]
        path = _REMOTE_PATH.search(text)
        reason = _UNREACHABLE.search(text) or (_UNREACHABLE_IF_REMOTE.search(text) if path else None)
        if reason:
            where = path.group(0) if path else "a remote path (gs://, s3://, ...)"
            detail = next((line.strip() for line in text.splitlines() if reason.group(0) in line), reason.group(0))
            return (f"cannot reach {where}: {detail[:300]}; check the network and the storage credentials, or use a "
                    "local path")
        error = error.__cause__ or error.__context__
    return None


def storage_failure(error: BaseException) -> str | None:
    """A full disk or unreachable storage as the one line a command ends with (None for any other error). On a full
    disk the save it cut short is not warned of at exit either (drop_abandoned_writes)."""
    full = disk_full(error)
    if full is None:
        return remote_unreachable(error)
    drop_abandoned_writes()
    return disk_full_message(full)


def drop_abandoned_writes() -> None:
    """A run that ends on a full disk: the save it cut short leaves array writes that never ran, and at exit Python
    warns of each such coroutine ("coroutine ... was never awaited") after the one-line error. Ignored from here
    on: the error says what happened (errors.disk_full); the writes were to a checkpoint that is dropped."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def disk_full_message(error: OSError) -> str:
    where = f" writing {error.filename}" if getattr(error, "filename", None) else ""
    return (f"no space left on the device{where}: free space (or point the output elsewhere) and rerun the same "
            "command; what was written before is whole (records are appended or replaced atomically, a checkpoint "
            "cut short is dropped) and a training run resumes from its last checkpoint")
