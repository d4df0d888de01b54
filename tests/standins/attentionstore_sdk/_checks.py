"""Argument checks of the AttentionStore SDK stand-in (tests only).

Helpers that reject a bad argument with ``AttentionStoreSDKError("invalid argument <name>: ...")``,
as the SDK does, and the packing of token ids into int64 little-endian bytes.
"""
from __future__ import annotations

import math
import struct

from .utils.err import AttentionStoreSDKError

MAX_NAME_CHARS = 128  # namespace, pod_name and model_version must be shorter than this
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def is_int(value: object) -> bool:
    """A Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bad(name: str, must: str, value: object) -> AttentionStoreSDKError:
    return AttentionStoreSDKError(f"invalid argument {name}: must be {must}, got {show(value)}")


def check_int(name: str, value: object, minimum: int) -> int:
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise bad(name, "a positive int" if minimum == 1 else f"an int >= {minimum}", value)
    return value  # type: ignore[return-value]


def check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) >= MAX_NAME_CHARS:
        raise bad(name, f"a non-empty str shorter than {MAX_NAME_CHARS} characters", value)
    return value


def check_int_list(name: str, value: object, minimum: int, non_empty: bool) -> list[int]:
    must = f"a {'non-empty ' if non_empty else ''}list of ints >= {minimum}"
    if not isinstance(value, list) or (non_empty and not value):
        raise bad(name, must, value)
    for item in value:
        if not is_int(item) or item < minimum:
            raise bad(name, must + f" (bad element {show(item)})", value)
    return value


def check_timeout(value: object) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise bad("timeout", "a finite positive number of seconds", value)
    return float(value)


def pack_token_ids(token_ids: object, block_token_size: object) -> bytes:
    """``token_ids`` (a non-empty list of int64 ints) as int64 little-endian bytes, after checking
    them and ``block_token_size`` (a positive int), as ``Tokens(token_ids, block_token_size)`` does."""
    if not isinstance(token_ids, list) or not token_ids:
        raise bad("token_ids", "a non-empty list of ints", token_ids)
    for item in token_ids:
        if not is_int(item) or not _INT64_MIN <= item <= _INT64_MAX:
            raise bad("token_ids", f"a list of int64 ints (bad element {show(item)})", token_ids)
    check_int("block_token_size", block_token_size, 1)
    return struct.pack(f"<{len(token_ids)}q", *token_ids)
