"""The wire format and the equality rule of sweet_jax/sandbox/protocol.py (no processes here)."""
import math

import pytest

from sweet_jax.sandbox import (ValueRejected, decode_value, encode_value, extract_code,
                               sweet_rl_code, values_equal)

NAN = float("nan")


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 10**300, 1.5, -0.0, float("inf"), 1e-310, 2 + 3j, "", "héllo\udcff",
    b"\x00\xff", [1, [2, (3, "x")]], (), {"a": [1.0], 2: None, (1, 2): {3}}, {1, "a"},
    frozenset({(1, 2)}),
])
def test_plain_values_round_trip_exactly(value):
    decoded = decode_value(encode_value(value))
    assert type(decoded) is type(value)
    assert repr(decoded) == repr(value)


def test_nan_round_trips_as_nan():
    assert math.isnan(decode_value(encode_value(NAN)))


class _AlwaysEqual:
    def __eq__(self, other):
        return True


class _OddInt(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [
    _AlwaysEqual(), _OddInt(3), type("S", (str,), {})("x"), (x for x in ()), lambda: 1, math,
    {1: _AlwaysEqual()}, [object()], pytest.param(10**5000, id="huge_int"), bytearray(b"x"),
])
def test_non_plain_values_are_rejected(value):
    with pytest.raises(ValueRejected):
        encode_value(value)


def test_deep_and_self_referential_values_are_rejected():
    deep = []
    for _ in range(1000):
        deep = [deep]
    loop = []
    loop.append(loop)
    for value in (deep, loop):
        with pytest.raises(ValueRejected):
            encode_value(value)


@pytest.mark.parametrize("tagged", [
    ["x"], ["i", "1e5"], ["i", 5], ["b", 1], ["l", "abc"], ["d", [[["l", []], ["n"]]]],
    ["S", [["l", []]]], "s", None, ["f", "nope"], ["y", "zz"],
])
def test_malformed_tagged_values_are_rejected(tagged):
    with pytest.raises(ValueRejected):
        decode_value(tagged)


@pytest.mark.parametrize("expected, actual, equal", [
    (1, 1.0, True), (1, True, True), (0, False, True), (1.0, True, True), (0.0, -0.0, True),
    (1, 1 + 0j, True), ((1, 2), [1, 2], False), ([1, 2], (1, 2), False), ([1, 2], [1, 2], True),
    (NAN, NAN, False), ([NAN], [NAN], False), ({"a": NAN}, {"a": NAN}, False),
    ({NAN}, {NAN}, False), ({"a": 1, "b": 2}, {"b": 2, "a": 1}, True), ({1, 2}, frozenset({1, 2}), True),
    ("a", b"a", False), ("1", 1, False), (None, None, True), ([1, [2, 3]], [1, [2, 4]], False),
    ({"a": [1, 2]}, {"a": (1, 2)}, False), (1, [1], False), ({1: "x"}, {True: "x"}, True),
])
def test_values_equal_is_python_equality_with_nan_never_equal(expected, actual, equal):
    assert values_equal(expected, actual) is equal


def test_extract_code_takes_the_python_fence():
    answer = "I WANT TO ANSWER:\nHere:\n```text\nno\n```\n```python\ndef f():\n    return 1\n```\nbye"
    assert extract_code(answer) == "def f():\n    return 1\n"
    assert extract_code("def f():\n    return 2") == "def f():\n    return 2"
    assert extract_code("```\ndef f(): pass\n```") == "def f(): pass\n"


def test_sweet_rl_code_applies_the_official_deny_list_and_fence_rule():
    assert sweet_rl_code("import os\ndef f(): pass")[0] is None
    assert "deny-list" in sweet_rl_code("x = 1\nsys.exit(0)")[1]
    assert sweet_rl_code("```python\ndef f(): pass\n```")[0] == "\ndef f(): pass\n"


def test_sets_and_dicts_of_colliding_hashes_are_rejected_not_built():
    """20,000 ints congruent mod 2**61 - 1 hash alike: building the set is quadratic (seconds).
    Equal members (duplicates) and a few chance collisions are fine."""
    colliding = [["i", str(k * (2**61 - 1))] for k in range(1, 20_001)]
    for tagged in (["S", colliding], ["F", colliding], ["d", [[k, ["n"]] for k in colliding]]):
        with pytest.raises(ValueRejected, match="one hash value"):
            decode_value(tagged)
    assert decode_value(["S", [["i", "7"]] * 20_000 + [["f", (7.0).hex()], ["b", True]]]) == {7, True}
    few = {k * (2**61 - 1) for k in range(1, 9)}
    assert decode_value(encode_value(few)) == few


@pytest.mark.parametrize("body", [b'{"k":"case","v":NaN}', b'{"v":Infinity}', b'{"v":-Infinity}',
                                  b'[' * 100_000 + b']' * 100_000, b'{"a":1', b'\xff\xfe'])
def test_frames_with_nan_deep_nesting_or_bad_bytes_are_rejected(body):
    from sweet_jax.sandbox.protocol import parse_frame_body

    with pytest.raises(ValueRejected):
        parse_frame_body(body)


def test_code_fence_extraction_is_linear():
    """300 KB of ``` with no newline took 101 s through a backtracking regex."""
    import time

    start = time.process_time()
    assert extract_code("```" * 100_000) == "```" * 100_000
    assert extract_code("```python\n" + "x```" * 75_000) == "x"
    assert time.process_time() - start < 1.0
    answer = "x\n```py3 x\nno\n```\n```Python  extra\nyes = 1\n```tail"
    assert extract_code(answer) == "yes = 1\n"
    assert extract_code("```\nfirst\n```\n```js\nsecond") == "first\n"
