"""JSON Lines, the one way every reader and writer of sweet_jax handles them.

  read(path)               every object of a file, strictly: a bad line is a DataError naming file:line; a path
                           that is a directory, a gzip/zip archive or a binary file is named as such.
  read(path, partial="drop"|"repair")
                           for files a crash may have cut short (append-only outputs): a last line without its
                           newline is dropped (and with "repair" truncated from the file).
  lines(path)              (where = "file:line", text) of the non-blank lines, after the same checks.
  append(path, records)    append + flush + fsync: once it returns the records survive a crash.
  write(path, records)     atomic: a temporary file beside `path`, renamed over it.

Paths are anything etils.epath opens (local, gs://, ...). Records are dicts or objects with .to_json().
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Iterator

from sweet_jax.errors import SweetJaxError

SNIFF_BYTES = 8192
MAGIC = ((b"\x1f\x8b", "a gzip file; decompress it first (gunzip)"),
         (b"PK\x03\x04", "a zip archive; extract it first"),
         (b"BZh", "a bzip2 file; decompress it first (bunzip2)"),
         (b"\xfd7zXZ", "an xz file; decompress it first (unxz)"),
         (b"\x28\xb5\x2f\xfd", "a zstd file; decompress it first (unzstd)"))


class DataError(SweetJaxError):
    """A file or record that cannot be read; the message names file:line and the field."""

    def __init__(self, message: str, *, where: str = "", field: str = ""):
        self.where, self.field, self.reason = where, field, message
        parts = [p for p in (where, f"field '{field}'" if field else "") if p]
        super().__init__((": ".join(parts) + ": " if parts else "") + message)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs \\ud83d\\ude00; what is left is lone
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def replace_lone_surrogates(text: str) -> str:
    """`text` with each lone surrogate (no UTF-8 file can hold one) replaced by U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def _path(path):
    from etils import epath
    return epath.Path(os.fspath(path))


def check_file(path) -> None:
    """A DataError unless `path` is an existing file of UTF-8 text (what it is instead, in one line)."""
    p = _path(path)
    if not p.exists():
        raise DataError(f"{path}: file not found")
    if p.is_dir():
        raise DataError(f"{path}: is a directory, not a JSONL file")
    with p.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    for magic, what in MAGIC:
        if head.startswith(magic):
            raise DataError(f"{path}: is {what}; expected JSON Lines text")
    if b"\x00" in head:
        raise DataError(f"{path}: is a binary file (NUL bytes), not JSON Lines text")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sniffed block
            raise DataError(f"{path}: is not UTF-8 text (byte {e.start}); expected JSON Lines") from None


def lines(path) -> Iterator[tuple[str, str]]:
    """(f"{path}:{line number}", text) of every non-blank line, after check_file."""
    check_file(path)
    with _path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"not UTF-8 text (byte {e.start} of the line)", where=f"{path}:{n}") from None
            if text.strip():
                yield f"{path}:{n}", text


def parse(text: str, where: str) -> dict:
    """One line -> its JSON object; anything else is a DataError at `where`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON ({e.msg} at column {e.colno})", where=where) from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}", where=where)
    return obj


def read(path, *, partial: str = "error") -> list[dict]:
    """Every object of a JSONL file (see the module docstring for `partial`)."""
    if partial not in ("error", "drop", "repair"):
        raise ValueError(f"partial={partial!r}: expected error, drop or repair")
    if partial != "error":
        p = _path(path)
        if not p.exists():
            return []
        check_file(path)
        data = p.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            import logging
            logging.getLogger(__name__).warning(
                "%s: %s a half-written last line (%d bytes) left by an interrupted run", path,
                "truncating" if partial == "repair" else "ignoring", len(data) - len(complete))
            if partial == "repair":
                with open(os.fspath(path), "r+b") as f:
                    f.truncate(len(complete))
        out = []
        for n, raw in enumerate(complete.split(b"\n"), start=1):
            if raw.strip():
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"not UTF-8 text (byte {e.start} of the line)", where=f"{path}:{n}") from None
                out.append(parse(text, f"{path}:{n}"))
        return out
    return [parse(text, where) for where, text in lines(path)]


def _dumps(record: Any) -> str:
    return json.dumps(record.to_json() if hasattr(record, "to_json") else record, ensure_ascii=False) + "\n"


def append(path, records: Iterable[Any]) -> None:
    """Append records, flush and fsync (local files)."""
    text = "".join(_dumps(r) for r in records)
    if not text:
        return
    with open(os.fspath(path), "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write(path, records: Iterable[Any]) -> None:
    """All records, atomically: a reader (or a crash) never sees half a file."""
    p = _path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.tmp{os.getpid()}"
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(_dumps(r))
        tmp.replace(p)  # os.replace locally; a rename on object stores
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
