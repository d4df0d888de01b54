"""IPCSignal: a named int32 array in shared memory that the engine and the CTMs share.

The engine creates each signal (``create=True``) and is the only process that may
unlink it (``clear()``).  A process that attaches never unlinks, not when it closes,
exits or crashes: the segments bypass ``multiprocessing.resource_tracker``, which
would otherwise unlink them when the first attaching process exits.

Names follow DESIGN §3.5: ``ctm.<name>.<suffix>``, suffix = engine_worker_queue_port.
"""
from __future__ import annotations

import logging

import numpy as np

from ops.shm import SharedMemorySegment

logger = logging.getLogger(__name__)

SIGNAL_PREFIX = "ctm."


def signal_segment_name(name: str, suffix: object | None) -> str:
    return f"{SIGNAL_PREFIX}{name}" if suffix is None else f"{SIGNAL_PREFIX}{name}.{suffix}"


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
            self._segment = SharedMemorySegment(self.segment_name)
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
