"""``EmsConfig`` and the ``Ems`` entry point of the EMS contract stand-in (tests only; not the Huawei SDK).

``Ems.init(config)`` checks that ``config`` is an ``EmsConfig`` holding a valid ``CcConfig_v1``
(else ``EMS_INVALID_ARGUMENT``) and sets the per-process singleton that ``Ems.get_cc()`` returns
(``None`` before a successful init).  Data and fault knobs live in the directory named by the
environment variable ``EMS_STANDIN_DIR`` (required: ``EMS_INIT_FAILED`` without it); see
``ems.cc_v1.block_files`` for the layout and ``ems.faults`` for the knobs.  Initialising again
with the same configuration keeps the existing handle (and its registration); with another one
it raises ``EMS_INIT_FAILED`` (one EMS client per process).  ``Ems._reset()`` is for tests only.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional

from .cc_v1.cc_config import CcConfig_v1
from .cc_v1.context_cache import ContextCache_v1
from .errors import EmsErrorCode, EmsException, invalid
from .faults import FaultInjector

STANDIN_DIR_ENV = "EMS_STANDIN_DIR"


class EmsConfig:
    """``EmsConfig(access_id="", access_key="", cc_config=None)``; ``cc_config_v1=`` is an alias."""

    def __init__(self, access_id: str = "", access_key: str = "", cc_config: Optional[CcConfig_v1] = None, *,
                 cc_config_v1: Optional[CcConfig_v1] = None) -> None:
        for name, value in (("access_id", access_id), ("access_key", access_key)):
            if not isinstance(value, str):
                raise invalid(f"EmsConfig {name} must be a str, got {type(value).__name__}")
        if cc_config is not None and cc_config_v1 is not None and cc_config is not cc_config_v1:
            raise invalid("EmsConfig: give cc_config or cc_config_v1, not two different configs")
        self.access_id = access_id
        self.access_key = access_key
        self.cc_config = cc_config if cc_config is not None else cc_config_v1

    @property
    def cc_config_v1(self) -> Optional[CcConfig_v1]:
        return self.cc_config

    def __repr__(self) -> str:
        return f"EmsConfig(access_id={self.access_id!r}, access_key=<{len(self.access_key)} chars>, " \
               f"cc_config={self.cc_config!r})"


class Ems:
    """The per-process EMS client: ``init``, ``get_cc``, ``check_health``."""

    _lock = threading.Lock()
    _cc: Optional[ContextCache_v1] = None
    _faults: Optional[FaultInjector] = None
    _identity: Optional[tuple[Any, ...]] = None

    @classmethod
    def init(cls, config: Any) -> None:
        if not isinstance(config, EmsConfig):
            raise invalid(f"Ems.init: config must be an EmsConfig, got {type(config).__name__}")
        cc_config = config.cc_config
        if not isinstance(cc_config, CcConfig_v1):
            raise invalid(f"Ems.init: EmsConfig.cc_config must be a CcConfig_v1, got {type(cc_config).__name__}")
        cc_config.validate()
        root_text = os.environ.get(STANDIN_DIR_ENV, "")
        if not root_text:
            raise EmsException(EmsErrorCode.EMS_INIT_FAILED,
                               f"Ems.init: {STANDIN_DIR_ENV} not set (the test stand-in keeps its data there)")
        root = Path(root_text).resolve()
        identity = (config.access_id, config.access_key, cc_config.key(), root)
        with cls._lock:
            if cls._cc is not None:
                if identity == cls._identity:
                    return
                raise EmsException(EmsErrorCode.EMS_INIT_FAILED,
                                   f"Ems.init: already initialised in this process with another configuration "
                                   f"({cls._identity!r:.200})")
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise EmsException(EmsErrorCode.EMS_INIT_FAILED, f"Ems.init: cannot use {root}: {exc}") from None
            faults = FaultInjector(root)
            cls._cc = ContextCache_v1(cc_config, root, faults)
            cls._faults = faults
            cls._identity = identity

    @classmethod
    def get_cc(cls) -> Optional[ContextCache_v1]:
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        """False before init and while the ``unhealthy`` knob is set; honours the other knobs too."""
        faults = cls._faults
        if faults is None:
            return False
        plan = faults.begin("check_health", "check_health")
        plan.apply(None)
        return not plan.unhealthy

    @classmethod
    def _reset(cls) -> None:
        """Tests only: forget the singleton (an old handle then raises ``EMS_NOT_INITIALIZED``)."""
        with cls._lock:
            if cls._cc is not None:
                cls._cc._close()
            cls._cc = None
            cls._faults = None
            cls._identity = None
