"""FastDeploy's ``IPCSignal`` for the engine side: its constructor, its names, its create/attach
semantics, and this project's checks (DESIGN §4: other local users are untrusted).

``IPCSignal(name, array=None, dtype=None, suffix=None, create=True, shm_size=None)`` names the
segment ``<name>.<suffix>`` as FastDeploy does (``/dev/shm/cache_ready_signal.8700``), so FastDeploy's
``PrefixCacheManager``, which attaches ``cache_ready_signal``, ``swap_space_ready_signal``,
``prefix_tree_status`` and ``cache_transfer_inited_signal`` and creates ``cache_task_is_paused`` and
``cache_task_inflight``, finds them by its exact names, and so do our CTMs
(``cache_manager.ipc_signal.signal_segment_names``).

* ``create=True`` makes the segment 0600 with ``O_EXCL``.  A segment already under the name that is
  **ours** is what a crashed engine left (FastDeploy's create deletes it): it is replaced, with a
  warning, so an engine restarted on the same port starts.  One that belongs to **another user** is
  never removed or used: ``PermissionError`` names it and its owner.
* ``create=False`` attaches only to a segment of our own uid (``PermissionError`` otherwise) that is
  large enough for ``array`` (``ValueError`` otherwise).
* ``clear()`` unlinks the segment if this object created it; an attached one only detaches (an
  attaching process must never remove the creator's segment: DESIGN §3.5).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from cache_manager.ipc_signal import fastdeploy_segment_name, segment_identity
from ops.shm import SharedMemorySegment, shm_path

logger = logging.getLogger(__name__)

# The signals FastDeploy's PrefixCacheManager attaches (the engine creates them) and creates itself
PREFIX_CACHE_ATTACHES = ("cache_ready_signal", "swap_space_ready_signal", "prefix_tree_status",
                         "cache_transfer_inited_signal")
PREFIX_CACHE_CREATES = ("cache_task_broadcast_signal", "cache_task_is_paused", "cache_task_inflight")

_REPLACING = "ShareMemory: %s already exists (left by an engine that did not exit cleanly); replacing it"


def _create_replacing_ours(name: str, size: int) -> SharedMemorySegment:
    """A new segment ``name``; a leftover of ours under the name is replaced once, another user's refused.
    What a provably gone process left goes by identity, in the create itself (``ops.shm``)."""
    path = shm_path(name)
    try:
        warned = os.lstat(path).st_uid == os.geteuid()
    except FileNotFoundError:
        warned = False
    if warned:  # logged as FastDeploy logs it, also when the create below sweeps it (ops.shm)
        logger.warning(_REPLACING, name)
    try:
        return SharedMemorySegment(name, size, create=True)
    except FileExistsError:
        pass
    try:
        info = os.lstat(path)
    except FileNotFoundError:  # gone in between: create as if it had never been there
        return SharedMemorySegment(name, size, create=True)
    if info.st_uid != os.geteuid():
        raise PermissionError(f"shared-memory segment {path} belongs to uid {info.st_uid}, not to this process's "
                              f"uid {os.geteuid()}: another user holds the name, and it is never removed or used. "
                              "Remove it as root or that user, or run the engine on another port") from None
    if not warned:
        logger.warning(_REPLACING, name)
    if not SharedMemorySegment.unlink_name(name):
        raise PermissionError(f"shared-memory segment {path} exists and is not a regular file of ours: "
                              "refusing to replace it") from None
    return SharedMemorySegment(name, size, create=True)  # O_EXCL again: a squatter in between is refused


class IPCSignal:
    """FastDeploy's ``IPCSignal`` (see the module docstring).  ``value`` is the live numpy view, or
    None for a segment made from ``shm_size`` alone; ``shm`` the segment (``name``, ``buf``, ``size``)."""

    def __init__(self, name: str, array: np.ndarray | None = None, dtype: Any = None, suffix: Any = None,
                 create: bool = True, shm_size: int | None = None) -> None:
        full = fastdeploy_segment_name(name, suffix)
        if array is None or dtype is None:
            if not isinstance(shm_size, int) or isinstance(shm_size, bool) or shm_size <= 0:
                raise ValueError(f"signal {full!r}: shm_size {shm_size!r} must be a positive number of bytes when "
                                 "array and dtype are not given")
            nbytes = shm_size
        else:
            if not isinstance(array, np.ndarray):
                raise ValueError(f"signal {full!r}: array must be a numpy array, got {type(array).__name__}")
            if np.dtype(dtype) != array.dtype:
                raise ValueError(f"signal {full!r}: dtype {np.dtype(dtype)} does not match the array's {array.dtype}")
            nbytes = array.nbytes
            if nbytes == 0:
                raise ValueError(f"signal {full!r} needs a non-empty array")
        self.name = full
        self.created = create
        self.shm = _create_replacing_ours(full, nbytes) if create else SharedMemorySegment(full)
        if self.shm.size < nbytes:
            size = self.shm.size
            self.shm.close()
            raise ValueError(f"signal {full!r} holds {size} bytes; {nbytes} are needed")
        self.identity = segment_identity(full)
        self.value: np.ndarray | None = None
        if array is not None and dtype is not None:
            self.value = np.ndarray(array.shape, dtype=array.dtype, buffer=self.shm.buf)
            if create:
                self.value[:] = array

    def close(self) -> None:
        """Detach this process's view; the segment stays."""
        self.value = None
        self.shm.close()

    def clear(self) -> None:
        """Creator: detach and unlink (only the segment it created, not a successor under the name).
        Attached: detach only."""
        self.close()
        if self.created:
            if segment_identity(self.name) == self.identity:
                self.shm.unlink()
        else:
            logger.debug("signal %s: clear() by a process that only attached detaches", self.name)

    def __repr__(self) -> str:
        return f"IPCSignal({self.name!r}, created={self.created})"
