"""How deep and how wide a msgpack value from a peer may be, checked on its bytes before any
decoder builds it.

Why: msgspec descends into nested arrays and maps recursively, also to skip an unknown key, and
raises ``RecursionError`` (not ``DecodeError``) past the interpreter's recursion limit: about
1 KB of ``[[[[…]]]]`` in an ignored key once escaped every decoder here and stopped the thread
that read it. Each decoder of peer frames (router ingress, bootstrap wire, router client) asks
``check`` first, and what it refuses never reaches msgspec. The scan reads headers only: a
string, binary or ext payload is stepped over in one move, so the cost is one short Python
step per item, never per byte; ``max_total_items`` bounds that work for any frame.

``Shape`` holds the bounds a protocol allows; the defaults here are the one owner of the depth
every peer protocol shares (``MAX_DEPTH``).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_DEPTH = 8  # containers within containers, the outermost counted; v1 frames use 2 or 3


class ShapeError(ValueError):
    """A msgpack value nested deeper or holding more items than its protocol allows."""


@dataclass(frozen=True, slots=True)
class Shape:
    """Bounds on one msgpack value: nesting depth, items per array or map (a map's pairs),
    and items in all its containers together."""

    max_depth: int = MAX_DEPTH
    max_items: int = 1 << 16
    max_total_items: int = 1 << 16


# What each head byte is: a scalar of fixed size, a str/bin/ext whose length follows, or a
# container whose item count is in the head or follows it.
_FIXED = 0
_SIZED = 1  # payload length in the next `nbytes` bytes, then `extra` bytes (ext type), payload
_ARRAY = 2
_MAP = 3
_INVALID = 4


def _table() -> list[tuple[int, int, int]]:
    """(kind, a, b) per head byte: _FIXED (size, 0); _SIZED (length bytes, extra bytes);
    _ARRAY/_MAP (count bytes, 0; count bytes 0: the count is the head's low nibble)."""
    table: list[tuple[int, int, int]] = [(_FIXED, 1, 0)] * 256  # fixints, nil, bools
    for head in range(0x80, 0x90):
        table[head] = (_MAP, 0, 0)
    for head in range(0x90, 0xA0):
        table[head] = (_ARRAY, 0, 0)
    for head in range(0xA0, 0xC0):
        table[head] = (_FIXED, 1 + (head & 0x1F), 0)  # fixstr
    table[0xC1] = (_INVALID, 0, 0)
    for head, nbytes in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        table[head] = (_SIZED, nbytes, 0)  # bin, str
    for head, nbytes in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        table[head] = (_SIZED, nbytes, 1)  # ext: a type byte after the length
    sizes = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5}
    sizes |= {0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # int64, fixext
    for head, size in sizes.items():
        table[head] = (_FIXED, size, 0)
    table[0xDC], table[0xDD] = (_ARRAY, 2, 0), (_ARRAY, 4, 0)
    table[0xDE], table[0xDF] = (_MAP, 2, 0), (_MAP, 4, 0)
    return table


_HEADS = _table()
# Every byte that is not a container's head: deleting them counts the bytes that could be one.
_NOT_CONTAINER_HEADS = bytes(h for h in range(256) if _HEADS[h][0] not in (_ARRAY, _MAP))
_QUICK_BYTES = 4096  # up to this size, a value with one container head byte is scanned in C


def check(buf: bytes | memoryview, shape: Shape) -> None:
    """Raise ``ShapeError`` when the value ``buf`` starts with breaks ``shape``. Bytes that
    are not msgpack (truncated, 0xc1) end the scan quietly: the decoder refuses them.

    The common case costs one C call: a small value in which no byte but the first could be a
    container's head nests nothing, and only that head is checked."""
    if len(buf) <= _QUICK_BYTES and len(bytes(buf).translate(None, _NOT_CONTAINER_HEADS)) <= 1:
        count = num_items(buf)
        if is_container(buf):
            _check_container(1, count, count, shape)
        return
    _scan(buf, shape)


def _scan(buf: bytes | memoryview, shape: Shape) -> None:
    heads = _HEADS
    pos, end = 0, len(buf)
    left = [1]  # values still to read at each open level; left[0] is the value itself
    total = 0
    while left:
        if not left[-1]:
            left.pop()
            continue
        left[-1] -= 1
        if pos >= end:
            return
        kind, a, b = heads[buf[pos]]
        if kind == _FIXED:
            pos += a
        elif kind == _SIZED:
            pos += 1 + a + b + int.from_bytes(buf[pos + 1 : pos + 1 + a], "big")
        elif kind == _INVALID:
            return
        else:
            count = num_items(buf[pos : pos + 1 + a])
            pos += 1 + a
            total += count
            _check_container(len(left), count, total, shape)
            left.append(count * 2 if kind == _MAP else count)


def _check_container(depth: int, count: int, total: int, shape: Shape) -> None:
    if depth > shape.max_depth:
        raise ShapeError(f"nested deeper than {shape.max_depth} arrays or maps")
    if count > shape.max_items:
        raise ShapeError(f"an array or map of {count} items (at most {shape.max_items})")
    if total > shape.max_total_items:
        raise ShapeError(f"more than {shape.max_total_items} items in arrays and maps")


def is_container(buf: bytes | memoryview) -> bool:
    """Whether the value ``buf`` starts with is an array or a map (one byte read)."""
    return bool(buf) and _HEADS[buf[0]][0] in (_ARRAY, _MAP)


def num_items(buf: bytes | memoryview) -> int:
    """Entries of the array or map ``buf`` starts with (a map's pairs); 0: not a container,
    or its count is cut off."""
    kind, nbytes, _ = _HEADS[buf[0]] if buf else (_FIXED, 0, 0)
    if kind not in (_ARRAY, _MAP):
        return 0
    if nbytes == 0:
        return buf[0] & 0x0F
    return int.from_bytes(buf[1 : 1 + nbytes], "big") if len(buf) > nbytes else 0
