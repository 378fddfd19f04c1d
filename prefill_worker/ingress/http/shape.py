"""Bounds on a JSON body's shape, checked on its bytes before any value is built.

msgspec builds (or skips) a JSON value recursively: a body nested a thousand levels deep ends
in a ``RecursionError``, and a few megabytes of ``[[],[],...]`` or ``"a","a",...`` build
millions of Python objects. ``check_shape`` refuses both from the raw bytes, with C-speed byte
operations only (``bytes.count``, one regex pass, ``bytes.replace``)::

    body      {"input_ids": [[1, 2], [3]], "rid": ["a]", "b"]}
    strings   removed (a bracket inside a string is text):   2 strings
    brackets  {[[][]][]}  ->  [[[][]][]]  (braces as brackets): 5 containers
    depth     each round removes the innermost pairs "[]": empty after 3 rounds = depth 3

Small bodies with few brackets and quotes skip the scan (a handful of ``count`` calls).
"""

from __future__ import annotations

import re

MAX_DEPTH = 32  # SGLang's bodies nest 3 deep; routers' extra flags a little more
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)  # possessive: linear
_BRACES = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = re.compile(rb"[^\[\]]++")


class ShapeRefused(ValueError):
    """The body's shape is refused: ``status`` 400 (too deep) or 413 (too many values)."""

    def __init__(self, message: str, code: str, status: int) -> None:
        super().__init__(message)
        self.code, self.status = code, status


def check_shape(body: bytes, max_values: int, max_depth: int = MAX_DEPTH) -> None:
    """Raise ``ShapeRefused`` when ``body`` nests deeper than ``max_depth`` (400 ``malformed``)
    or holds more than ``max_values`` strings, arrays and objects (413 ``too_large``)."""
    num_open = body.count(b"[") + body.count(b"{")
    if num_open <= max_depth and num_open + body.count(b'"') // 2 <= max_values:
        return  # cannot be deeper than its brackets, nor hold more values than quote pairs
    stripped, num_strings = _STRING.subn(b"", body)
    brackets = _NOT_BRACKET.sub(b"", stripped.translate(_BRACES))
    num_values = num_strings + len(brackets) // 2
    if num_values > max_values:
        why = f"the body holds {num_values} strings, arrays and objects; at most {max_values}"
        raise ShapeRefused(why, "too_large", 413)
    for _ in range(max_depth):
        brackets = brackets.replace(b"[]", b"")
        if not brackets:
            return
    why = f"JSON nested deeper than {max_depth} levels (or unbalanced)"
    raise ShapeRefused(why, "malformed", 400)
