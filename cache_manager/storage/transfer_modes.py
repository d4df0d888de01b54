"""How a rank's storage mover moves bytes (``--storage_transfer``), apart from the movers, so the
flag parser can check the flag without loading them."""
from __future__ import annotations

import math
from typing import Any

TRANSFER_MODES = ("auto", "staged", "direct")


def resolve_transfer(transfer: str, backend: Any, platform: Any) -> str:
    """The path a rank takes for ``--storage_transfer transfer`` ("staged" or "direct"), from what
    the backend and the platform (instances or classes) can do.  auto stages: only a staged call
    can outlive its task harmlessly."""
    if transfer not in TRANSFER_MODES:
        raise ValueError(f"storage transfer mode {transfer!r} must be one of {TRANSFER_MODES}")
    if transfer == "direct" and not (backend.supports_multi_buffer and platform.host_addressable):
        raise ValueError(f"--storage_transfer direct needs multi-buffer calls on a host-addressable platform "
                         f"({backend.name} on {platform.name} has not)")
    return "direct" if transfer == "direct" else "staged"


def staging_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks of one staging buffer: enough for the longest request."""
    return max(1, math.ceil(max_model_len / block_size))
