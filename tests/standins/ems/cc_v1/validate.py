"""Argument checks of save/load/exists in the EMS contract stand-in (tests only; not the Huawei SDK).

Every violation raises ``EmsException(EMS_INVALID_ARGUMENT)`` with a message naming the argument:

* ``slot_mapping``: a non-empty ``list`` of ``int`` (not ``bool``), ``0 <= slot < num_blocks *
  block_size`` (slot = ``block_id * block_size + offset_in_block``);
* ``hashes``: a non-empty ``list`` of ``int`` (not ``bool``), each in ``[-2**63, 2**64)``;
* ``offsets``: a ``list`` of ``int``, tokens per block, each in ``[1, block_size]``, as many as
  ``hashes``, summing to ``len(slot_mapping)``;
* ``option``: a valid ``CcKvOption`` (``None`` is rejected).
"""
from __future__ import annotations

from typing import Any

from ..errors import invalid
from ..options import CcKvOption, is_int

HASH_MIN = -(1 << 63)
HASH_END = 1 << 64


def _int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise invalid(f"{name} must be a list of int, got {type(value).__name__}")
    if not value:
        raise invalid(f"{name} must not be empty")
    for i, item in enumerate(value):
        if not is_int(item):
            raise invalid(f"{name}[{i}] must be an int, got {type(item).__name__} {item!r}")
    return list(value)  # a copy: an async call must not see later changes


def check_option(option: Any) -> CcKvOption:
    if not isinstance(option, CcKvOption):
        raise invalid(f"option must be a CcKvOption, got {type(option).__name__}")
    option.validate()
    return option


def check_hashes(hashes: Any) -> list[int]:
    hashes = _int_list("hashes", hashes)
    for i, h in enumerate(hashes):
        if not HASH_MIN <= h < HASH_END:
            raise invalid(f"hashes[{i}] {h} does not fit in 64 bits")
    return hashes


def check_transfer(slot_mapping: Any, hashes: Any, offsets: Any, option: Any, block_size: int,
                   num_slots: int) -> list[tuple[int, list[int]]]:
    """The blocks of one save/load as (hash, its slots), after checking every argument."""
    slots = _int_list("slot_mapping", slot_mapping)
    for i, s in enumerate(slots):
        if not 0 <= s < num_slots:
            raise invalid(f"slot_mapping[{i}] {s} is outside the registered caches (0 <= slot < {num_slots})")
    hashes = check_hashes(hashes)
    offsets = _int_list("offsets", offsets)
    for i, n in enumerate(offsets):
        if not 1 <= n <= block_size:
            raise invalid(f"offsets[{i}] {n} must be in [1, block_size={block_size}]")
    if len(offsets) != len(hashes):
        raise invalid(f"offsets has {len(offsets)} entries but hashes has {len(hashes)}")
    if sum(offsets) != len(slots):
        raise invalid(f"offsets sum to {sum(offsets)} tokens but slot_mapping has {len(slots)}")
    check_option(option)
    blocks = []
    start = 0
    for h, n in zip(hashes, offsets):
        blocks.append((h, slots[start:start + n]))
        start += n
    return blocks
