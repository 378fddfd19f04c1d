"""``msgpack_shape.check`` against the values msgpack makes: depth, items per container and
in all are measured as a reference on the decoded objects, and the byte scan (with its quick
path) must agree on every value hypothesis builds; a deep value is refused in microseconds."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_worker.msgpack_shape import MAX_DEPTH, Shape, ShapeError, check, is_container

SHAPE = Shape(max_depth=4, max_items=6, max_total_items=20)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20))
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=5), inner, max_size=8)
    ),
    max_leaves=60,
)


def _measure(value: Any, depth: int = 1) -> tuple[int, int, int]:
    """(deepest container, widest container, items in all) of a decoded value."""
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        children = value
    else:
        return 0, 0, 0
    deepest, widest, total = depth, len(value), len(value)
    for child in children:
        d, w, t = _measure(child, depth + 1)
        deepest, widest, total = max(deepest, d), max(widest, w), total + t
    return deepest, widest, total


def _fits(value: Any, shape: Shape) -> bool:
    deepest, widest, total = _measure(value)
    return (
        deepest <= shape.max_depth and widest <= shape.max_items and total <= shape.max_total_items
    )


@given(_values)
def test_the_byte_scan_agrees_with_the_decoded_value(value: Any) -> None:
    packed = msgpack.packb(value, use_bin_type=True)
    try:
        check(packed, SHAPE)
    except ShapeError:
        assert not _fits(value, SHAPE)
    else:
        assert _fits(value, SHAPE)
    assert is_container(packed) == isinstance(value, (list, dict))


@given(_values, st.integers(0, 64))
def test_truncated_bytes_never_raise_anything_else(value: Any, cut: int) -> None:
    packed = msgpack.packb(value, use_bin_type=True)
    with contextlib.suppress(ShapeError):
        check(packed[: max(0, len(packed) - cut)], SHAPE)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 100_000])
def test_a_deep_value_is_refused_at_once(depth: int) -> None:
    packed = b"\x91" * depth + b"\xc0"
    start = time.perf_counter()
    with pytest.raises(ShapeError, match=f"nested deeper than {MAX_DEPTH}"):
        check(packed, Shape())
    assert time.perf_counter() - start < 0.05  # the scan stops at the bound, not the end
    check(b"\x91" * MAX_DEPTH + b"\xc0", Shape())


def test_the_total_bounds_the_work_on_any_frame() -> None:
    wide = msgpack.packb([[0] * 60 for _ in range(60)])  # 3,660 items, within 64 each
    with pytest.raises(ShapeError, match="more than 1024 items"):
        check(wide, Shape(max_items=64, max_total_items=1024))
