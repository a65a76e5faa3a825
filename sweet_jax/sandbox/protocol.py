"""Wire format between the sandbox and the trainer, and the one rule that compares values.

Untrusted code only ever hands back *plain data*: a value is encoded inside the sandboxed child as
tagged JSON, with exact type checks (``type(x) is int``, so no subclass with a custom ``__eq__``
gets through) and caps on depth, node count and size. The trainer decodes it into fresh built-in
objects; nothing is ever unpickled and no object from the sandbox is ever called.

Tags (one JSON list per value):
    ["n"] None          ["b", true] bool        ["i", "123"] int (decimal string, <= 4300 digits)
    ["f", "0x1.8p+1"] float (float.hex: exact, keeps nan/inf/-0.0)
    ["c", re_hex, im_hex] complex               ["s", "text"] str      ["y", "00ff"] bytes (hex)
    ["l", [...]] list   ["t", [...]] tuple      ["S", [...]] set       ["F", [...]] frozenset
    ["d", [[k, v], ...]] dict (insertion order kept, but dict equality ignores order, as in Python)
    ["N", "math"] the NaN object math.nan (or "numpy": numpy.nan); compat="sweet_rl" only, see below

Equality rule (``values_equal``), the same in both compat modes: Python ``==`` on these plain
values, with NaN never equal to anything (also not inside containers, where Python's identity
shortcut would otherwise make ``[x] == [x]`` true for the same NaN object). Consequences, tested in
tests/test_sandbox.py: ``1 == 1.0 == True`` (and ``0 == -0.0 == False``), ``(1, 2) != [1, 2]``,
``{'a': 1, 'b': 2} == {'b': 2, 'a': 1}``, ``{1} == frozenset({1})``, ``'a' != b'a'``.

compat="sweet_rl" compares as the official evaluator, by Python ``==`` (``values_equal_official``),
still on plain values only. Before encoding, the child turns well-known value types into the plain values
Python ``==`` treats them as (``official_plain``): numpy scalars and arrays (``.item()`` / ``.tolist()``,
only for objects of the real, compiled numpy), Counter / OrderedDict / defaultdict (dict), namedtuples
(tuple), Decimal / Fraction (int or float when exact). User-defined classes stay refused: whatever a
conversion returns must itself be plain data. NaN: the same NaN object in the reference's and the
answer's value (math.nan, numpy.nan) travels as ["N", name] and decodes to one shared object, so a
container holding it compares equal, as Python's identity shortcut makes it in the official process.

This module is also imported, stand-alone, by the worker script (sandbox/_worker.py), so it
depends on the standard library only.
"""

import collections
import fractions
import json
import math
import struct

MAX_DEPTH = 64  # nesting of containers in one returned value
MAX_NODES = 200_000  # values (leaves and containers) in one returned value
MAX_FRAME_BYTES = 8 << 20  # one encoded message
MAX_RESULT_BYTES = 32 << 20  # all the results of one evaluation
MAX_INT_DIGITS = 4300  # Python's own default int <-> str limit
# Distinct members of one set (or keys of one dict) that may share a hash value. Equal hashes of
# unequal values are rare by chance but easy to forge (ints congruent mod 2**61 - 1), and each one
# makes building the set cost another probe per member: quadratic without this cap.
MAX_SHARED_HASH = 8

# One NaN object per name on the trainer's side: the reference's and the answer's decode to the same one.
SHARED_NANS = {"math": float("nan"), "numpy": float("nan")}

_HEADER = struct.Struct(">I")


class ValueRejected(Exception):
    """A value that is not plain data, or exceeds the caps. The case fails; the message says why."""


# ----------------------------------------------------------------------------------------------
# Encoding (runs inside the sandboxed child)


def encode_value(value, shared_nans=()):
    """Returns the tagged form of a plain value; raises ValueRejected for anything else.
    shared_nans: (name, NaN object) pairs sent as ["N", name] when the value holds that very object."""
    nodes = [0]

    def enc(x, depth):
        if depth > MAX_DEPTH:
            raise ValueRejected(f"value nested deeper than {MAX_DEPTH} levels (or self-referential)")
        nodes[0] += 1
        if nodes[0] > MAX_NODES:
            raise ValueRejected(f"value has more than {MAX_NODES} elements")
        t = type(x)
        if x is None:
            return ["n"]
        if t is bool:
            return ["b", x]
        if t is int:
            if x.bit_length() > MAX_INT_DIGITS * 4:  # surely too long; no need to try str()
                raise ValueRejected(f"int with more than {MAX_INT_DIGITS} digits")
            try:
                return ["i", str(x)]
            except ValueError:  # the interpreter's int -> str digit limit
                raise ValueRejected(f"int with more than {MAX_INT_DIGITS} digits") from None
        if t is float:
            for name, nan in shared_nans:
                if x is nan:
                    return ["N", name]
            return ["f", x.hex()]
        if t is complex:
            return ["c", x.real.hex(), x.imag.hex()]
        if t is str:
            return ["s", x]
        if t is bytes:
            return ["y", x.hex()]
        if t is list:
            return ["l", [enc(v, depth + 1) for v in x]]
        if t is tuple:
            return ["t", [enc(v, depth + 1) for v in x]]
        if t is set:
            return ["S", [enc(v, depth + 1) for v in x]]
        if t is frozenset:
            return ["F", [enc(v, depth + 1) for v in x]]
        if t is dict:
            return ["d", [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        raise ValueRejected(f"returned a {_type_name(t)}, not plain data (None, bool, int, float, "
                            "complex, str, bytes, list, tuple, set, frozenset, dict)")

    return enc(value, 0)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: classes made by a class statement or type(); never numpy's own


def _static_type(t):
    return not (type.__getattribute__(t, "__flags__") & _HEAPTYPE)


def _real_numpy(modules):
    """numpy as imported by the answer, if it is the compiled one (its array and scalar base types are
    static C types, which no Python-level stand-in can be)."""
    np = modules.get("numpy")
    try:
        if np is not None and _static_type(np.ndarray) and _static_type(np.generic):
            return np
    except Exception:
        pass
    return None


def shared_nans(modules):
    """The NaN objects the official process shares between the reference and the answer."""
    out = [("math", math.nan)]
    np = _real_numpy(modules)
    nan = getattr(np, "nan", None) if np is not None else None
    if type(nan) is float and nan != nan:
        out.append(("numpy", nan))
    return tuple(out)


def official_plain(value, modules, depth=0):
    """compat="sweet_rl", inside the child: well-known value types -> the plain values Python == equates them
    with (see the module docstring); anything else is returned as it is (encode_value then refuses it)."""
    if depth > MAX_DEPTH:
        return value
    t = type(value)
    if t in (list, tuple, set, frozenset):
        return t(official_plain(v, modules, depth + 1) for v in value)
    if t in (dict, collections.Counter, collections.OrderedDict, collections.defaultdict):
        return {official_plain(k, modules, depth + 1): official_plain(v, modules, depth + 1)
                for k, v in dict.items(value)}
    np = _real_numpy(modules)
    if np is not None and _static_type(t) and isinstance(value, (np.ndarray, np.generic)):
        return official_plain(value.tolist() if isinstance(value, np.ndarray) else value.item(), modules, depth + 1)
    if issubclass(t, tuple) and type.__getattribute__(t, "__bases__") == (tuple,) and hasattr(t, "_fields") \
            and "__eq__" not in type.__getattribute__(t, "__dict__"):
        return tuple(official_plain(v, modules, depth + 1) for v in tuple.__iter__(value))  # a namedtuple
    decimal = modules.get("decimal")
    if t is fractions.Fraction or (decimal is not None and t is getattr(decimal, "Decimal", None)):
        try:
            exact = fractions.Fraction(value)
        except (ValueError, OverflowError, TypeError):  # NaN / infinite Decimal: left for encode to refuse
            return value
        if exact.denominator == 1:
            return int(exact)
        as_float = float(exact)
        return as_float if fractions.Fraction(as_float) == exact else value
    return value


def values_equal_official(expected, actual):
    """compat="sweet_rl": Python == on plain decoded values, as the official evaluator compares (NaN unequal
    to itself, but a container holding one shared NaN object equal to another holding it)."""
    return expected == actual


def _type_name(t):
    try:
        return f"{type.__getattribute__(t, '__module__')}.{type.__getattribute__(t, '__qualname__')}"
    except Exception:  # a hostile metaclass; the name is only for the message
        return "non-builtin type"


# ----------------------------------------------------------------------------------------------
# Decoding (runs in the trainer: input is untrusted, so every shape is checked)


def decode_value(tagged):
    """Builds fresh built-in objects from a tagged value; raises ValueRejected on any malformation."""
    nodes = [0]

    def items(body, depth):
        if type(body) is not list:
            raise ValueRejected("malformed container")
        return [dec(v, depth + 1) for v in body]

    def dec(x, depth):
        if depth > MAX_DEPTH:
            raise ValueRejected(f"value nested deeper than {MAX_DEPTH} levels")
        nodes[0] += 1
        if nodes[0] > MAX_NODES:
            raise ValueRejected(f"value has more than {MAX_NODES} elements")
        if type(x) is not list or not x or type(x[0]) is not str:
            raise ValueRejected("malformed tagged value")
        tag, n = x[0], len(x)
        try:
            if tag == "n" and n == 1:
                return None
            if tag == "b" and n == 2 and type(x[1]) is bool:
                return x[1]
            if tag == "i" and n == 2 and type(x[1]) is str and len(x[1]) <= MAX_INT_DIGITS + 1:
                return int(x[1])
            if tag == "f" and n == 2 and type(x[1]) is str and len(x[1]) < 64:
                return float.fromhex(x[1])
            if tag == "N" and n == 2 and type(x[1]) is str and x[1] in SHARED_NANS:
                return SHARED_NANS[x[1]]
            if tag == "c" and n == 3 and type(x[1]) is str and type(x[2]) is str:
                return complex(float.fromhex(x[1][:64]), float.fromhex(x[2][:64]))
            if tag == "s" and n == 2 and type(x[1]) is str:
                return x[1]
            if tag == "y" and n == 2 and type(x[1]) is str:
                return bytes.fromhex(x[1])
            if n == 2 and tag in ("l", "t"):
                return (list if tag == "l" else tuple)(items(x[1], depth))
            if n == 2 and tag in ("S", "F"):
                body = items(x[1], depth)
                _check_hash_spread(body)
                return (set if tag == "S" else frozenset)(body)
            if tag == "d" and n == 2 and type(x[1]) is list:
                pairs = []
                for pair in x[1]:
                    if type(pair) is not list or len(pair) != 2:
                        raise ValueRejected("malformed dict item")
                    pairs.append((dec(pair[0], depth + 1), dec(pair[1], depth + 1)))
                _check_hash_spread([k for k, _ in pairs])
                return dict(pairs)
        except (ValueError, TypeError, OverflowError) as e:  # bad digits, unhashable key, ...
            raise ValueRejected(f"malformed {tag!r} value: {type(e).__name__}") from None
        raise ValueRejected(f"unknown or malformed tag {tag[:8]!r}")

    return dec(tagged, 0)


def _check_hash_spread(members):
    """Rejects members holding more than MAX_SHARED_HASH distinct values of one hash, in time
    linear in len(members): counting hashes is one pass, and only a crowded hash is looked into."""
    counts = {}
    for h in map(hash, members):  # TypeError (an unhashable member) is the caller's malformation
        counts[h] = counts.get(h, 0) + 1
    crowded = {h for h, c in counts.items() if c > MAX_SHARED_HASH}
    if not crowded:
        return
    distinct = {}  # hash -> its distinct members so far (at most MAX_SHARED_HASH of them)
    for m in members:
        h = hash(m)
        if h in crowded:
            seen = distinct.setdefault(h, [])
            if not any(m == s for s in seen):
                if len(seen) == MAX_SHARED_HASH:
                    raise ValueRejected(f"more than {MAX_SHARED_HASH} distinct set members or dict "
                                        "keys with one hash value")
                seen.append(m)


# ----------------------------------------------------------------------------------------------
# The comparison rule


def values_equal(expected, actual):
    """Python == on plain values, except that NaN is never equal (see the module docstring)."""
    te, ta = type(expected), type(actual)
    if te in (list, tuple):
        if ta is not te or len(expected) != len(actual):
            return False
        return all(values_equal(e, a) for e, a in zip(expected, actual))
    if te is dict:
        if ta is not dict or len(expected) != len(actual):
            return False
        for k, v in expected.items():
            if _has_nan(k) or k not in actual:
                return False
            if not values_equal(v, actual[k]):
                return False
        return True
    if te in (set, frozenset):
        if ta not in (set, frozenset) or _has_nan(expected) or _has_nan(actual):
            return False
        return expected == actual
    if _has_nan(expected) or _has_nan(actual):
        return False
    if ta in (list, tuple, dict, set, frozenset):
        return False
    return expected == actual  # both are built-in scalars here: bool/int/float/complex/str/bytes/None


def _has_nan(x):
    t = type(x)
    if t is float:
        return math.isnan(x)
    if t is complex:
        return math.isnan(x.real) or math.isnan(x.imag)
    if t in (tuple, frozenset, list, set):
        return any(_has_nan(v) for v in x)
    return False


# ----------------------------------------------------------------------------------------------
# Frames: 4-byte big-endian length, then UTF-8 JSON.


def pack_frame(message):
    body = json.dumps(message, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass")
    return _HEADER.pack(len(body)) + body


def unpack_header(header):
    return _HEADER.unpack(header)[0]


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")  # pack_frame never writes NaN or Infinity


def parse_frame_body(body):
    """JSON of one frame; raises ValueRejected for anything that is not a JSON object (NaN and
    Infinity included). The C parser is linear in the bytes and raises RecursionError, caught here,
    past the interpreter's recursion limit; decode_value then bounds a value's depth at MAX_DEPTH."""
    try:
        message = json.loads(body.decode("utf-8", "surrogatepass"), parse_constant=_reject_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ValueRejected(f"unreadable message: {type(e).__name__}") from None
    if type(message) is not dict:
        raise ValueRejected("message is not an object")
    return message
