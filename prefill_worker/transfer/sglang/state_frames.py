"""The state fields of SGLang's control frames (hybrid models), parsed and bounded: what a
decode registers per state component, and the state indices a transfer request names.

SGLang 0.5.23's decode (``nixl/conn.py``, ``build_receiver_registration_message`` and
``build_receiver_metadata_message``) packs each field as a list of int lists
(``common/utils.py``, ``pack_int_lists``): a u32 count n, n u32 byte lengths, then each list's
values packed little-endian, one list per state component in the decode's own ``state_types``
order (which is not sent: both sides pair their components by position)::

    registration frame  8  state_data_ptrs   Q   per component: one base address per buffer
                       13  state_item_lens   I   bytes of one item (a page, a slot) per buffer
                       14  state_dims        I   per-tensor split dims (mamba TP); [] for swa
                       20  state_layer_ids   I   model layer of each buffer (mamba); [] for swa
                       24  state_data_lens   Q   bytes of each buffer (0.5.23 only)
    request frame       8  state_indices     i   per component: the decode's items (swa: the
                                                  window's pages in its SWA pool; mamba: one slot)

A decode with no state sends every frame empty. Anything that is not this exactly (a count
past ``MAX_COMPONENTS``, lengths that do not add up to the frame, a list that is not whole
values, fields whose component counts differ) is a ``FrameError`` naming the field. Torch-,
ZMQ- and NIXL-free.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_COMPONENTS = 16  # SGLang 0.5.23 has 13 state types; a decode registers a few of them
_WIDTHS = {"Q": 8, "I": 4, "i": 4}


class StateFrameError(ValueError):
    """A state field that is not SGLang's packed lists; ``frames`` turns it into its
    ``FrameError``."""


@dataclass(frozen=True, slots=True)
class StateBuffers:
    """One state component as a decode registered it: per buffer its base address, the bytes
    of one item and (0.5.23) of the whole buffer; mamba's split dims and layer ids."""

    data_ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    data_lens: tuple[int, ...]  # () from decodes before 0.5.23
    dims: tuple[int, ...]
    layer_ids: tuple[int, ...]


def unpack_lists(raw: bytes, fmt: str, what: str) -> tuple[tuple[int, ...], ...]:
    """SGLang's ``unpack_int_lists``, strict: the count bounded, the lengths adding up to the
    frame exactly, each list whole values of ``fmt`` ("Q", "I" or "i")."""
    if not raw:
        return ()
    width = _WIDTHS[fmt]
    if len(raw) < 4:
        raise StateFrameError(f"{what} is truncated ({len(raw)} bytes)")
    (count,) = struct.unpack_from("<I", raw)
    if count > MAX_COMPONENTS:
        raise StateFrameError(f"{what} names {count} lists; at most {MAX_COMPONENTS}")
    start = 4 + 4 * count
    if len(raw) < start:
        raise StateFrameError(f"{what} is truncated ({len(raw)} bytes)")
    lens = struct.unpack_from(f"<{count}I", raw, 4)
    if start + sum(lens) != len(raw):
        raise StateFrameError(
            f"{what}: its lists' lengths add up to {sum(lens)} bytes, it carries {len(raw) - start}"
        )
    lists = []
    for length in lens:
        if length % width:
            raise StateFrameError(f"{what}: a list of {length} bytes is not whole {fmt} values")
        lists.append(struct.unpack_from(f"<{length // width}{fmt}", raw, start))
        start += length
    return tuple(lists)


def registration_state(f: list[bytes]) -> tuple[StateBuffers, ...]:
    """The registration's state components (``f``: its 24 or 25 frames), one per component;
    () when it registered none."""
    ptrs = unpack_lists(f[8], "Q", "state_data_ptrs")
    others = {
        "state_item_lens": unpack_lists(f[13], "I", "state_item_lens"),
        "state_data_lens": unpack_lists(f[24], "Q", "state_data_lens") if len(f) > 24 else (),
        "state_dims": unpack_lists(f[14], "I", "state_dims"),
        "state_layer_ids": unpack_lists(f[20], "I", "state_layer_ids"),
    }
    for name, lists in others.items():
        if len(lists) not in (0, len(ptrs)):
            raise StateFrameError(f"{name} has {len(lists)} lists, state_data_ptrs {len(ptrs)}")
    if ptrs and not others["state_item_lens"]:
        raise StateFrameError("state buffers registered without state_item_lens")
    fields = (ptrs, *others.values())
    return tuple(
        StateBuffers(*(lists[i] if lists else () for lists in fields)) for i in range(len(ptrs))
    )


def request_state(raw: bytes) -> tuple[tuple[int, ...], ...]:
    """A transfer request's state indices, one tuple per component (signed int32, as SGLang
    packs them); () when it names none."""
    return unpack_lists(raw, "i", "state_indices")
