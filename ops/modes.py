"""Copy directions and block-id lists, shared by the platform interface and the copy plans."""
from __future__ import annotations

from typing import Sequence

BlockIds = Sequence[int]

DEVICE_TO_HOST = 0
HOST_TO_DEVICE = 1
