"""IPCSignal: a named int32 array in shared memory that the engine and the CTMs share.

The engine creates each signal (``create=True``) and is the only process that may
unlink it (``clear()``).  A process that attaches never unlinks, not when it closes,
exits or crashes: the segments bypass ``multiprocessing.resource_tracker``, which
would otherwise unlink them when the first attaching process exits.

Names follow DESIGN §3.5: ``ctm.<name>.<suffix>``, suffix = engine_worker_queue_port.  That name is
predictable, so another local user can create it first and stop the engine from starting (DESIGN §4).
An engine of ours therefore draws a random token per instance (``new_ipc_token``) and names every
segment ``ctm.<port>.<token>.<name>`` (the suffix ``ipc_suffix(port, token)``), its cache segments
included (the platform's instance); it hands the token to its CTMs in ``CTM_IPC_TOKEN`` (the
environment: command lines are readable by every user).  A CTM started without it (FastDeploy's own
engine) keeps the port-only names and logs that they are predictable (``engine_ipc_suffix``).

Port-only names.  FastDeploy names a signal ``<name>.<port>`` (its ``IPCSignal``; this project's
drop-in for the engine side is ``engine_hooks.fastdeploy.signals``); this module creates
``ctm.<name>.<port>``.  A process attaching with a bare port takes FastDeploy's name if it is there
(and ours), else ours (``signal_segment_names``), so a CTM serves either engine unchanged.  Another
user's segment under either name is never attached.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import secrets
from typing import Mapping

import numpy as np

from ops import shm
from ops.shm import SharedMemorySegment

logger = logging.getLogger(__name__)

SIGNAL_PREFIX = "ctm."
IPC_TOKEN_ENV = "CTM_IPC_TOKEN"
IPC_TOKEN_BYTES = 8  # 64 random bits: not guessable in the time a squatter has
_TOKEN_RE = re.compile(r"^[0-9a-f]{16}$")
_TOKENED_SUFFIX_RE = re.compile(r"^[0-9]+\.[0-9a-f]{16}$")


def new_ipc_token() -> str:
    """A fresh random token for one engine instance's IPC names (16 hex digits)."""
    return secrets.token_hex(IPC_TOKEN_BYTES)


def check_ipc_token(token: str) -> str:
    """``token`` if it is what ``new_ipc_token`` makes, else ``ValueError`` (it goes into file names)."""
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        raise ValueError(f"IPC token {token!r:.40} must be {2 * IPC_TOKEN_BYTES} lowercase hex digits")
    return token


def ipc_suffix(port: int, token: str | None) -> str:
    """The suffix of an engine's IPC names: ``<port>.<token>``, or the bare port without a token."""
    return str(port) if token is None else f"{int(port)}.{check_ipc_token(token)}"


def engine_ipc_suffix(port: int, environ: Mapping[str, str] | None = None) -> str:
    """A CTM's view of its engine's suffix: with the token from ``CTM_IPC_TOKEN`` (``ValueError`` if it
    is malformed), or, without one, the bare port (FastDeploy's names), logging that it is predictable."""
    token = (os.environ if environ is None else environ).get(IPC_TOKEN_ENV) or None
    if token is None:
        logger.warning("no %s from the engine: IPC names use the bare port %s and are predictable; another local "
                       "user can create them first and stop the engine from starting", IPC_TOKEN_ENV, port)
    return ipc_suffix(port, token)


def signal_segment_name(name: str, suffix: object | None) -> str:
    """``ctm.<port>.<token>.<name>`` for a suffix with a token (under the engine's prefix, beside its
    cache segments); ``ctm.<name>.<suffix>`` for a bare one, as FastDeploy's engine names them."""
    if suffix is None:
        return f"{SIGNAL_PREFIX}{name}"
    if _TOKENED_SUFFIX_RE.match(str(suffix)):
        return f"{SIGNAL_PREFIX}{suffix}.{name}"
    return f"{SIGNAL_PREFIX}{name}.{suffix}"


def fastdeploy_segment_name(name: str, suffix: object | None) -> str:
    """FastDeploy's name for a signal: ``<name>.<suffix>`` (``name`` alone without a suffix)."""
    return name if suffix is None else f"{name}.{suffix}"


def signal_segment_names(name: str, suffix: object | None) -> tuple[str, ...]:
    """The names an attaching process tries, in order: with a token only ours; with a bare port
    FastDeploy's ``<name>.<port>`` first, then ours ``ctm.<name>.<port>``."""
    ours = signal_segment_name(name, suffix)
    if suffix is None or _TOKENED_SUFFIX_RE.match(str(suffix)):
        return (ours,)
    return (fastdeploy_segment_name(name, suffix), ours)


def segment_identity(segment_name: str) -> tuple[int, int] | None:
    """(device, inode) of the segment now under ``segment_name``, or None if there is none."""
    return shm.segment_identity(segment_name)


def unlink_if_same(segment_name: str, identity: tuple[int, int] | None) -> bool:
    """Unlink ``segment_name`` if it is ours and still the segment ``identity`` names (or, for None, any
    segment of ours): an engine restarted on the same port has new segments, which stay."""
    if identity is None:
        return SharedMemorySegment.unlink_name(segment_name)
    return shm.unlink_if_same(segment_name, identity)


class IPCSignal:
    """A shared numpy array; ``value`` is a live view of the segment.

    ``array`` gives the shape (and, on creation, the initial values).  Attaching to a
    segment whose size does not match ``array`` raises ``ValueError``.
    """

    def __init__(
        self,
        name: str,
        array: np.ndarray,
        dtype: type | np.dtype = np.int32,
        suffix: object | None = None,
        create: bool = False,
    ):
        template = np.asarray(array, dtype=dtype)
        if template.size == 0:
            raise ValueError(f"signal {name!r} needs a non-empty array")
        self.name = name
        self.segment_name = signal_segment_name(name, suffix)
        self.created = create
        if create:
            self._segment = SharedMemorySegment(self.segment_name, template.nbytes, create=True)
        else:
            self._segment = self._attach(signal_segment_names(name, suffix))
            self.segment_name = self._segment.name
            if self._segment.size != template.nbytes:
                size = self._segment.size
                self._segment.close()
                raise ValueError(
                    f"signal {self.segment_name!r} holds {size} bytes; "
                    f"shape {template.shape} of {template.dtype} needs {template.nbytes}"
                )
        self.value = np.ndarray(template.shape, dtype=template.dtype, buffer=self._segment.buf)
        if create:
            self.value[:] = template
        # which segment this is, so that only it (never a successor under the name) is removed later
        self.identity = self._segment.identity

    @staticmethod
    def _attach(names: tuple[str, ...]) -> SharedMemorySegment:
        """The first of ``names`` that is a segment of ours.  Another user's is skipped (and named if
        none of ours is there); ``FileNotFoundError`` names them all when none exists."""
        refused: PermissionError | None = None
        for name in names:
            try:
                return SharedMemorySegment(name)
            except FileNotFoundError:
                continue
            except PermissionError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused
        raise FileNotFoundError(errno.ENOENT, f"no shared-memory segment {' or '.join(map(repr, names))}")

    def close(self) -> None:
        """Detach this process's view (the segment stays)."""
        self.value = None  # type: ignore[assignment]
        self._segment.close()

    def clear(self) -> None:
        """Creator only: detach and unlink the segment.  An attached process only detaches."""
        created = self.created
        self.close()
        if created:
            self._segment.unlink()
        else:
            logger.debug("signal %s: clear() by a non-creator only detaches", self.segment_name)

    def __repr__(self) -> str:
        return f"IPCSignal({self.segment_name!r}, created={self.created})"
