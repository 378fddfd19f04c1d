"""``msgpack_shape``'s table of head bytes, over all 256 first bytes, with msgspec's own
decoder as the oracle.

For every head byte there is one well-formed value that starts with it (``_sample``); msgspec
decodes it, and ``is_container``, ``num_items`` and ``check`` must agree with what it decoded:
whether it is an array or map, how many items (a map's pairs), and how far the scan steps over
it. The step is seen from outside: the value is put first in a two-item array, and the second
item is a nest of arrays one level too deep, which ``check`` must refuse. A scan that steps too
far or too short reads the nest shallower, or reads the value's own payload (0xc1 bytes, or
ASCII) as the array's second item, and lets the frame through.

The table is built when the module is imported, so each test imports a fresh copy of the module
(``_fresh``): a test process that imported it earlier holds the table it built then (mutmut
forks its mutants from such a process, and only a fresh import sees a mutant of the table).

Then the edges the table's users meet: counts that need every byte of their width, counts cut
off, a value followed by more bytes, and the quick path's one-container-byte rule.
"""

from __future__ import annotations

import importlib.util
import struct
from types import ModuleType
from typing import Any

import msgspec
import pytest

import prefill_worker.msgpack_shape as imported
from prefill_worker.msgpack_shape import Shape, ShapeError, check, num_items

_DEEP = 3  # the nest after the sample: arrays within arrays, this many levels
_EXT_TYPE = 5
_PAYLOAD = b"\xc1\xc1\xc1"  # bin/ext payload: 0xc1 is never a head, a misstep ends the scan


def _fresh() -> ModuleType:
    """A new copy of ``prefill_worker.msgpack_shape``, its table built now."""
    spec = importlib.util.spec_from_file_location(imported.__name__, imported.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sized(head: int, width: int, length: int) -> bytes:
    return bytes([head]) + length.to_bytes(width, "big")


def _sample(head: int) -> bytes:
    """A well-formed msgpack value whose first byte is ``head`` (0xc1: just that byte)."""
    fixed = {0xC0: b"", 0xC2: b"", 0xC3: b""}  # nil, false, true
    fixed |= {0xCA: b"\xc1" * 4, 0xCB: b"\xc1" * 8}  # float 32/64 (finite, negative)
    fixed |= {0xCC: b"\xc1", 0xCD: b"\xc1" * 2, 0xCE: b"\xc1" * 4, 0xCF: b"\xc1" * 8}  # uint
    fixed |= {0xD0: b"\xc1", 0xD1: b"\xc1" * 2, 0xD2: b"\xc1" * 4, 0xD3: b"\xc1" * 8}  # int
    fixext = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
    widths = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin, str 8/16/32
    if head <= 0x7F or head >= 0xE0 or head == 0xC1:  # fixints; the reserved byte
        return bytes([head])
    if head <= 0x8F:  # fixmap: distinct int keys, nil values
        return bytes([head]) + b"".join(bytes([key, 0xC0]) for key in range(head & 0x0F))
    if head <= 0x9F:  # fixarray of nils
        return bytes([head]) + b"\xc0" * (head & 0x0F)
    if head <= 0xBF:  # fixstr
        return bytes([head]) + b"a" * (head & 0x1F)
    if head in fixed:
        return bytes([head]) + fixed[head]
    if head in fixext:
        return bytes([head, _EXT_TYPE]) + b"\xc1" * fixext[head]
    if head in widths:
        payload = b"abc" if head >= 0xD9 else _PAYLOAD
        return _sized(head, widths[head], len(payload)) + payload
    if head in (0xC7, 0xC8, 0xC9):  # ext 8/16/32: length, type, payload
        width = {0xC7: 1, 0xC8: 2, 0xC9: 4}[head]
        return _sized(head, width, len(_PAYLOAD)) + bytes([_EXT_TYPE]) + _PAYLOAD
    if head in (0xDC, 0xDD):  # array 16/32 of two nils
        return _sized(head, 2 if head == 0xDC else 4, 2) + b"\xc0\xc0"
    assert head in (0xDE, 0xDF), hex(head)  # map 16/32 of two pairs
    return _sized(head, 2 if head == 0xDE else 4, 2) + b"\x00\xc0\x01\xc0"


def _nest(levels: int) -> bytes:
    """Arrays within arrays, ``levels`` deep: [[[]]] for 3."""
    return b"\x91" * (levels - 1) + b"\x90"


def _decoded(head: int) -> Any:
    return msgspec.msgpack.decode(_sample(head))


def _measure(value: Any, depth: int = 1) -> tuple[int, int]:
    """(deepest container, items in all its containers) of a decoded value."""
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        children = value
    else:
        return 0, 0
    deepest, total = depth, len(value)
    for child in children:
        child_depth, child_total = _measure(child, depth + 1)
        deepest, total = max(deepest, child_depth), total + child_total
    return deepest, total


_HEADS = [h for h in range(256) if h != 0xC1]


def test_every_sample_is_one_whole_value_for_msgspec() -> None:
    # The oracle itself: each sample decodes, with nothing left over, to its head's kind.
    kinds: dict[type, set[int]] = {}
    for head in _HEADS:
        kinds.setdefault(type(_decoded(head)), set()).add(head)
    assert kinds[list] == set(range(0x90, 0xA0)) | {0xDC, 0xDD}
    assert kinds[dict] == set(range(0x80, 0x90)) | {0xDE, 0xDF}
    assert kinds[str] == set(range(0xA0, 0xC0)) | {0xD9, 0xDA, 0xDB}
    assert kinds[bytes] == {0xC4, 0xC5, 0xC6}
    assert kinds[msgspec.msgpack.Ext] == {0xC7, 0xC8, 0xC9, *range(0xD4, 0xD9)}
    assert kinds[float] == {0xCA, 0xCB}
    assert kinds[int] == set(range(0x80)) | set(range(0xCC, 0xD4)) | set(range(0xE0, 0x100))
    assert kinds[type(None)] == {0xC0} and kinds[bool] == {0xC2, 0xC3}
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(b"\xc1")
    assert struct.unpack(">f", b"\xc1" * 4)[0] == _decoded(0xCA)


def test_is_container_and_num_items_agree_with_msgspec_for_every_head() -> None:
    shape = _fresh()
    wrong = []
    for head in _HEADS:
        value, sample = _decoded(head), _sample(head)
        is_container = isinstance(value, (list, dict))
        count = len(value) if is_container else 0
        if (shape.is_container(sample), shape.num_items(sample)) != (is_container, count):
            wrong.append(f"{head:#04x}: {shape.is_container(sample)}, {shape.num_items(sample)}")
    assert not wrong, wrong
    assert not shape.is_container(b"\xc1") and shape.num_items(b"\xc1") == 0


def test_a_container_cut_off_before_its_count_has_no_items() -> None:
    shape = _fresh()
    for head, width in ((0xDC, 2), (0xDD, 4), (0xDE, 2), (0xDF, 4)):
        sample = _sample(head)
        assert shape.num_items(sample) == 2
        assert shape.num_items(sample[: 1 + width]) == 2  # the count alone is enough
        for cut in range(1, 1 + width):
            assert shape.num_items(sample[:cut]) == 0, (hex(head), cut)
    assert shape.num_items(b"") == 0 and not shape.is_container(b"")


def test_the_scan_steps_over_every_head_exactly() -> None:
    # [sample, nest]: the frame is _DEEP + 1 deep (one more for a container sample whose
    # items are scalars, which the nest outdoes): refused at max_depth _DEEP, let through
    # at _DEEP + 1 -- only when the scan lands on the nest's first byte.
    shape = _fresh()
    wrong = []
    for head in _HEADS:
        frame = b"\x92" + _sample(head) + _nest(_DEEP)
        depth, _ = _measure(msgspec.msgpack.decode(frame))
        assert depth == _DEEP + 1, hex(head)
        try:
            shape.check(frame, shape.Shape(max_depth=_DEEP))
            wrong.append(f"{head:#04x}: let through at max_depth {_DEEP}")
        except shape.ShapeError:
            pass
        try:
            shape.check(frame, shape.Shape(max_depth=_DEEP + 1))
        except shape.ShapeError as exc:
            wrong.append(f"{head:#04x}: refused at max_depth {_DEEP + 1}: {exc}")
    assert not wrong, wrong


def test_the_items_of_every_head_count_toward_the_total() -> None:
    shape = _fresh()
    wrong = []
    for head in _HEADS:
        frame = b"\x92" + _sample(head) + _nest(_DEEP)
        _, total = _measure(msgspec.msgpack.decode(frame))
        for limit, refused in ((total, False), (total - 1, True)):
            try:
                shape.check(frame, shape.Shape(max_total_items=limit))
                if refused:
                    wrong.append(f"{head:#04x}: let through at {limit} items in all")
            except shape.ShapeError:
                if not refused:
                    wrong.append(f"{head:#04x}: refused at {limit} items in all")
    assert not wrong, wrong


def test_the_reserved_byte_ends_the_scan_quietly() -> None:
    # 0xc1 is no msgpack value: the scan stops there (the decoder refuses the frame), even
    # when what follows would break the shape.
    shape = _fresh()
    frame = b"\x92\xc1" + _nest(_DEEP)
    shape.check(frame, shape.Shape(max_depth=_DEEP))
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(frame)


def test_a_lone_value_is_judged_by_its_head_for_every_head() -> None:
    # One value whose payload holds no container head takes the quick path: the head alone
    # says whether it is a container (refused at max_depth 0) and how many items it holds.
    shape = _fresh()
    wrong = []
    for head in _HEADS:
        value, sample = _decoded(head), _sample(head)
        count = len(value) if isinstance(value, (list, dict)) else None
        shape.check(sample, shape.Shape(max_depth=1))  # a lone container is 1 deep
        try:
            shape.check(sample, shape.Shape(max_depth=0))
            refused = False
        except shape.ShapeError:
            refused = True
        if refused != (count is not None):
            wrong.append(f"{head:#04x}: refused={refused} at max_depth 0")
        if count:
            with pytest.raises(shape.ShapeError, match=f"of {count} items"):
                shape.check(sample, shape.Shape(max_items=count - 1))
            shape.check(sample, shape.Shape(max_items=count))
    assert not wrong, wrong


def test_a_fresh_table_is_the_imported_one() -> None:
    # The fresh copies above judge the same bytes as the module every decoder imported.
    shape = _fresh()
    for head in range(256):
        sample = _sample(head)
        assert shape.is_container(sample) == imported.is_container(sample), hex(head)
        assert shape.num_items(sample) == imported.num_items(sample), hex(head)


# ---- the edges around the table -----------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "count"),
    [
        (b"\xdc\x01\x02", 0x0102),
        (b"\xde\x01\x02", 0x0102),
        (b"\xdd\x01\x02\x03\x04", 0x01020304),
        (b"\xdf\x01\x02\x03\x04", 0x01020304),
    ],
)
def test_a_count_is_read_from_every_byte_of_its_width_big_endian(header: bytes, count: int) -> None:
    assert num_items(header) == count
    assert num_items(header + b"\xc0") == count  # what follows the count is not read
    with pytest.raises(ShapeError, match=f"of {count} items"):
        check(header, Shape(max_items=count - 1))


@pytest.mark.parametrize("cut", [b"\xdc\x01", b"\xde\x7f", b"\xdd\x01\x02\x03", b"\xdf\xff"])
def test_a_count_cut_off_reads_as_no_items(cut: bytes) -> None:
    assert num_items(cut) == 0
    check(cut, Shape(max_items=0))  # nothing to refuse: the decoder refuses the frame


def test_only_the_value_the_bytes_start_with_is_judged() -> None:
    after = _nest(_DEEP)  # deeper than allowed, but after the value
    for head in _HEADS:
        check(_sample(head) + after, Shape(max_depth=1))


def test_two_container_bytes_are_scanned_not_judged_by_the_head() -> None:
    check(b"\x91\x90", Shape(max_depth=2))
    with pytest.raises(ShapeError, match="deeper than 1"):
        check(b"\x91\x90", Shape(max_depth=1))
    with pytest.raises(ShapeError, match="more than 2 items"):
        check(b"\x91\x92\x01\x02", Shape(max_total_items=2))
    check(b"\x91\x92\x01\x02", Shape(max_total_items=3))
