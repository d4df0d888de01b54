"""The IPC signals one rank attaches to (DESIGN §3.5).  The engine creates them; a rank only
attaches, by name, and never unlinks them."""
from __future__ import annotations

import numpy as np

from cache_manager.ipc_signal import IPCSignal


class RankSignals:
    def __init__(self, suffix: int | str):
        self._suffix = suffix
        self._attached: dict[str, IPCSignal] = {}

    @property
    def suffix(self) -> int | str:
        """The engine's IPC suffix (``ipc_signal.ipc_suffix``) the signals are named with."""
        return self._suffix

    def attach(self, name: str, shape: int) -> IPCSignal:
        """Attach ``name`` (``FileNotFoundError`` while the engine has not created it)."""
        sig = IPCSignal(name, np.zeros(shape, np.int32), suffix=self._suffix)
        self._attached[name] = sig
        return sig

    def get(self, name: str) -> IPCSignal | None:
        return self._attached.get(name)

    def __getitem__(self, name: str) -> IPCSignal:
        return self._attached[name]

    def close(self) -> None:
        for sig in self._attached.values():
            sig.close()
