"""Error codes and the exception of the EMS contract stand-in (tests only; not the Huawei SDK).

``EmsErrorCode`` is a plain ``Enum`` on purpose: the real SDK's numeric values are not
documented, so code under test must compare members (``exc.status_code() ==
EmsErrorCode.EMS_INVALID_ARGUMENT``) or use ``.name``, never integers; an ``IntEnum`` here
would hide such a mistake.
"""
from __future__ import annotations

from enum import Enum


class EmsErrorCode(Enum):
    """Status codes of the EMS SDK (the spelling ``EMS_RECOVERD_ERROR`` is the SDK's own)."""

    EMS_OK = 0
    EMS_INVALID_ARGUMENT = 1
    EMS_TIMEOUT = 2
    EMS_INTERNAL_ERROR = 3
    EMS_INIT_FAILED = 4
    EMS_NOT_INITIALIZED = 5
    EMS_NOT_REGISTERED = 6
    EMS_UNHEALTHY = 7
    EMS_RECOVERD_ERROR = 8


class EmsException(Exception):
    """An EMS failure: ``EmsException(code, message)``; ``status_code()`` gives the code."""

    def __init__(self, code: EmsErrorCode, message: str = "") -> None:
        if not isinstance(code, EmsErrorCode):
            raise TypeError(f"EmsException code must be an EmsErrorCode, got {code!r}")
        super().__init__(code, message)
        self._code = code
        self.message = str(message)

    def status_code(self) -> EmsErrorCode:
        return self._code

    def __str__(self) -> str:
        return f"[{self._code.name}] {self.message}"

    def __repr__(self) -> str:
        return f"EmsException({self._code.name}, {self.message!r})"


def invalid(message: str) -> EmsException:
    """An ``EMS_INVALID_ARGUMENT`` exception (shorthand used by the validators)."""
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)
