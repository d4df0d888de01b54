"""``CcKvOption`` and ``CcResult`` of the EMS contract stand-in (tests only; not the Huawei SDK).

``CcKvOption`` validates its arguments at construction, as the SDK's typed binding does:
``write_rcache`` and ``read_local_only`` must be ``bool``, ``timeout`` a positive ``int`` of
milliseconds (``bool`` is not accepted as an int); anything else raises
``EmsException(EMS_INVALID_ARGUMENT)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import invalid


class CcKvOption:
    """Per-call options: ``CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)``."""

    __slots__ = ("write_rcache", "read_local_only", "timeout")

    def __init__(self, write_rcache: bool = True, read_local_only: bool = False, timeout: int = 5000) -> None:
        self.write_rcache = write_rcache
        self.read_local_only = read_local_only
        self.timeout = timeout
        self.validate()

    def validate(self) -> None:
        """Raise ``EMS_INVALID_ARGUMENT`` unless every field has its documented type (re-run per call)."""
        for name in ("write_rcache", "read_local_only"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise invalid(f"CcKvOption {name} must be a bool, got {value!r}")
        if not is_int(self.timeout) or self.timeout <= 0:
            raise invalid(f"CcKvOption timeout must be a positive int of milliseconds, got {self.timeout!r}")

    def __repr__(self) -> str:
        return (f"CcKvOption(write_rcache={self.write_rcache}, read_local_only={self.read_local_only}, "
                f"timeout={self.timeout})")


@dataclass(frozen=True)
class CcResult:
    """Outcome of save/load/exists: ``success`` leading consecutive blocks of ``total``."""

    success: int
    total: int


def is_int(value: object) -> bool:
    """A Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
