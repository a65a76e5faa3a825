"""JSON Lines, the one way every reader and writer of sweet_jax handles them.

  read(path)               every object of a file, strictly: a bad line is a DataError naming file:line; a path
                           that is a directory, a gzip/zip archive or a binary file is named as such.
  read(path, partial="drop"|"repair")
                           for files a crash may have cut short (append-only outputs): a last line without its
                           newline that is not a whole JSON object is dropped (and with "repair" truncated from
                           the file); a whole one is kept.
  lines(path)              (where = "file:line", text) of the non-blank lines, after the same checks.
  append(path, records)    append + flush + fsync: once it returns the records survive a crash; a last record
                           without its newline gets one first, and a failed write (a full disk) is undone.
  write(path, records)     atomic: a temporary file beside `path`, renamed over it.
  read_json(path)          one JSON document (a run's record: results.json, done.json, selection.json), strictly:
                           a regular file (a link to a device or a pipe is refused before it is read) of at most
                           MAX_JSON_BYTES, UTF-8, whole; the caller checks its fields (check_number, ...).

Bounds: a line longer than MAX_LINE_BYTES is a DataError before it is held in memory; a string holding a lone
surrogate (a \\ud800 escape: no UTF-8 file can store it, and tokenizers fail on it) is a DataError naming
file:line and the field.

Paths are anything etils.epath opens (local, gs://, ...). Records are dicts or objects with .to_json().
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
from typing import Any, Iterable, Iterator

from etils import epath

from sweet_jax.errors import SweetJaxError

SNIFF_BYTES = 8192
MAX_LINE_BYTES = 64 << 20  # one record; the largest honest line (an official trajectory with every turn's
                           # templated prompt at 8k tokens) is a few MB
MAX_JSON_BYTES = 64 << 20  # one run record; the largest honest one (a results.json with every stage) is ~100 KB
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


def _capped_lines(f, where: str, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a binary file, never holding more than max_line_bytes of one line."""
    n = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        n += 1
        if len(raw) > max_line_bytes and not (len(raw) == max_line_bytes + 1 and raw.endswith(b"\n")):
            raise DataError(f"line longer than {max_line_bytes} bytes (jsonl.MAX_LINE_BYTES); a record that large "
                            "is not ColBench data: check the file", where=f"{where}:{n}")
        yield n, raw


def lines(path, *, max_line_bytes: int | None = None) -> Iterator[tuple[str, str]]:
    """(f"{path}:{line number}", text) of every non-blank line, after check_file; a line longer than
    max_line_bytes (default MAX_LINE_BYTES) is a DataError before it is read whole."""
    check_file(path)
    with _path(path).open("rb") as f:
        for n, raw in _capped_lines(f, str(path), max_line_bytes or MAX_LINE_BYTES):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"not UTF-8 text (byte {e.start} of the line)", where=f"{path}:{n}") from None
            if text.strip():
                yield f"{path}:{n}", text


def parse(text: str, where: str) -> dict:
    """One line -> its JSON object; anything else is a DataError at `where`, as is a lone surrogate in a string."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON ({e.msg} at column {e.colno})", where=where) from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}", where=where)
    refuse_lone_surrogates(obj, text, where)
    return obj


def refuse_lone_surrogates(obj, text: str, where: str) -> None:
    """A DataError naming `where` and the field when the object parsed from the line `text` holds a lone
    surrogate; every reader of JSONL records calls it (jsonl.parse, data.schema)."""
    if _SURROGATE_ESCAPE.search(text):  # rare: only then walk the object
        field = _lone_surrogate_field(obj)
        if field is not None:
            raise DataError("holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is not text; "
                            "fix or drop the record", where=where, field=field)


def _lone_surrogate_field(obj, prefix: str = "") -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, else None."""
    if isinstance(obj, str):
        return prefix or "(value)" if _LONE_SURROGATE.search(obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(key, str) and _LONE_SURROGATE.search(key):
            return path
        found = _lone_surrogate_field(value, path)
        if found is not None:
            return found
    return None


def read(path, *, partial: str = "error") -> list[dict]:
    """Every object of a JSONL file (see the module docstring for `partial`)."""
    if partial not in ("error", "drop", "repair"):
        raise ValueError(f"partial={partial!r}: expected error, drop or repair")
    if partial != "error":
        p = _path(path)
        if not p.exists():
            return []
        check_file(path)
        with p.open("rb") as f:
            numbered = list(_capped_lines(f, str(path), MAX_LINE_BYTES))
        if numbered and not numbered[-1][1].endswith(b"\n") and not _whole_object(numbered[-1][1]):
            n, cut = numbered.pop()
            logging.getLogger(__name__).warning(
                "%s: %s a half-written last line (%d bytes) left by an interrupted run", path,
                "truncating" if partial == "repair" else "ignoring", len(cut))
            if partial == "repair":
                with open(os.fspath(path), "r+b") as f:
                    f.truncate(f.seek(0, os.SEEK_END) - len(cut))
        out = []
        for n, raw in numbered:
            if raw.strip():
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"not UTF-8 text (byte {e.start} of the line)", where=f"{path}:{n}") from None
                out.append(parse(text, f"{path}:{n}"))
        return out
    return [parse(text, where) for where, text in lines(path)]


def read_json(path, *, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value of a local file, read in at most max_bytes + 1 bytes; a DataError naming the file when it is
    not a regular file, is larger, is not UTF-8 text or not one whole JSON document (a truncated write)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)   # follows links: /dev/zero behind a link is a device, never read
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, pipe or socket)"
        raise DataError(f"{path}: is {what}; expected a JSON file")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise DataError(f"{path}: larger than {max_bytes} bytes (jsonl.MAX_JSON_BYTES); not a run's record")
    for magic, what in MAGIC:
        if raw.startswith(magic):
            raise DataError(f"{path}: is {what}; expected JSON text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: is not UTF-8 text (byte {e.start}); expected JSON") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        ends_early = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
        cut = " (the file ends early: a truncated write?)" if ends_early else ""
        raise DataError(f"malformed JSON ({e.msg}){cut}", where=f"{path}:{e.lineno}") from None
    except RecursionError:
        raise DataError(f"{path}: nested too deeply to be a run's record") from None
    refuse_lone_surrogates(value, text, path)
    return value


def _whole_object(raw: bytes) -> bool:
    """A last line without its newline that is nevertheless a complete JSON object (kept, not dropped)."""
    try:
        return isinstance(json.loads(raw.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError):
        return False


def _dumps(record: Any) -> str:
    line = json.dumps(record.to_json() if hasattr(record, "to_json") else record, ensure_ascii=False) + "\n"
    if _LONE_SURROGATE.search(line):  # refused on reading; here a last guard, so a final write never fails
        logging.getLogger(__name__).warning("a record holds a lone surrogate; written as U+FFFD")
        line = replace_lone_surrogates(line)
    return line


def append(path, records: Iterable[Any]) -> None:
    """Append records, flush and fsync (local files). A file whose last record lacks its newline gets one first
    (else the first new record would be glued to it and both lost); a write that fails (a full disk) is
    truncated back, so the file holds whole records only."""
    text = "".join(_dumps(r) for r in records)
    if not text:
        return
    with open(os.fspath(path), "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                text = "\n" + text
        try:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise


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


def write_atomic(path, text: str) -> None:
    """`text` into `path` through a temporary file beside it, fsynced and renamed over it: readers and a crash
    see the old file or the new one, never half of one; a failed write (a full disk) leaves the old file."""
    path = _path(path)
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    try:
        if "://" in str(path):  # object stores: an upload is whole or absent
            tmp.write_text(text)
        else:
            with open(os.fspath(tmp), "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            if tmp.exists():
                tmp.unlink()
        raise
