"""sweet_jax.jsonl under hostile files: appends never lose a record, lines are bounded before they are read,
text that no UTF-8 file can hold is refused at file:line (reading) or replaced (a final write)."""
from __future__ import annotations

import errno
import json
import os

import pytest

from sweet_jax import jsonl


def test_an_append_to_a_file_without_a_final_newline_keeps_its_last_record(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}')  # written by hand, or by another tool
    jsonl.append(path, [{"a": 3}])
    assert jsonl.read(path) == [{"a": 1}, {"a": 2}, {"a": 3}]


@pytest.mark.parametrize("partial", ["drop", "repair"])
def test_the_append_only_read_keeps_a_whole_last_record_without_its_newline(tmp_path, partial):
    path = tmp_path / "out.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}')
    assert jsonl.read(path, partial=partial) == [{"a": 1}, {"a": 2}]
    assert path.read_text() == '{"a": 1}\n{"a": 2}'  # nothing truncated


def test_a_failed_append_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """A full disk in the middle of an append: the file keeps its whole records and no half line."""
    path = tmp_path / "out.jsonl"
    path.write_text('{"a": 1}\n')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        jsonl.append(path, [{"a": 2, "big": "x" * 10000}])
    monkeypatch.undo()
    assert path.read_text() == '{"a": 1}\n'


def test_a_line_longer_than_the_cap_is_an_error_at_its_line_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "big.jsonl"
    path.write_text('{"a": 1}\n' + json.dumps({"a": "x" * 5000}) + "\n")
    with pytest.raises(jsonl.DataError, match=rf"{path}:2: line longer than 1000 bytes"):
        jsonl.read(path)
    with pytest.raises(jsonl.DataError, match=rf"{path}:2: line longer than 1000 bytes"):
        jsonl.read(path, partial="drop")
    path.write_text(json.dumps({"a": "x" * 980}) + "\n")  # just under the cap, newline included
    assert len(jsonl.read(path)) == 1


@pytest.mark.parametrize("line, field", [
    ('{"dialogue_history": [{"role": "user", "content": "caf\\ud800"}]}', "dialogue_history.0.content"),
    ('{"answer": "\\udfff"}', "answer"),
    ('{"k\\udc00": 1}', "k\udc00"),
])
def test_a_lone_surrogate_is_refused_at_its_file_line_and_field(tmp_path, line, field):
    path = tmp_path / "t.jsonl"
    path.write_text('{"ok": "\\ud83d\\ude00"}\n' + line + "\n")  # a surrogate pair is an emoji: fine
    with pytest.raises(jsonl.DataError, match=f"{path}:2: field '{field}': holds a lone surrogate"):
        jsonl.read(path)


def test_a_final_write_of_a_record_with_a_lone_surrogate_never_fails(tmp_path):
    jsonl.write(tmp_path / "o.jsonl", [{"text": "a\ud800b"}])
    jsonl.append(tmp_path / "o.jsonl", [{"text": "c\udfffd"}])
    assert jsonl.read(tmp_path / "o.jsonl") == [{"text": "a\ufffdb"}, {"text": "c\ufffdd"}]
