"""FastDeploy's ``FMQ`` for its engine, with the cache transfer managers' control answers served here.

FastDeploy's engine (``common_engine.py``) makes one FMQ consumer queue per rank for the cache transfer
managers' control responses, ``FMQ().queue(f"ctrl_c2e_rank{r}_{cache_queue_port}", "consumer")``
(``r`` = tp rank + tp size x data-parallel index), and its ``_wait_for_control_responses`` awaits
``queue.get()`` on each and checks every ``msg.payload.error_code``.  An adopter imports ``FMQ`` from
here instead of ``fastdeploy.inter_communicator.fmq`` (one line); everything else stays FastDeploy's:

* a ``ctrl_c2e_rank<r>_<port>`` consumer is a ``ControlResponseQueue``: ``get()`` gives rank
  ``r``'s part of each control answer of the ``EngineCacheQueue`` server this process runs for
  ``port``, in answer order, as a message with FastDeploy's ``payload`` (a ``ControlResponse``,
  FastDeploy's field names).  Nothing is bound, connected or created for it: FastDeploy's FMQ would
  bind ``ipc:///dev/shm/fmq_<name>.ipc`` (a name any local user can take first) and unpickle what
  arrives; here the answers come over the queue's authenticated msgpack link, in process.
* every other name (the workers' ``ctrl_w2e_…`` queues, topics) and every other method go to
  FastDeploy's own ``FMQ``, imported when first needed.
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .queue import control_responses_for

CONTROL_QUEUE = re.compile(r"ctrl_c2e_rank(\d+)_(\d+)")
POLL_S = 0.005


@dataclass
class Message:
    """FastDeploy's FMQ ``Message`` fields: what its engine reads is ``payload``."""

    payload: Any
    msg_id: int | None = None
    timestamp: float = field(default_factory=time.time)
    descriptor: Any = None


class ControlResponseQueue:
    """The consumer end of ``ctrl_c2e_rank<rank>_<port>``: rank ``rank``'s control answers from this
    process's ``EngineCacheQueue`` server for ``port`` (looked up at each ``get``: FastDeploy makes its
    queues before it starts the server)."""

    def __init__(self, name: str, rank: int, port: int):
        self.name, self.rank, self.port = name, rank, port
        self._msg_id = 0

    async def get(self, timeout: int | None = None) -> Message | None:
        """The next answer (FastDeploy's semantics: ``timeout`` in milliseconds, None when it passes;
        without one, wait until an answer comes or the caller cancels)."""
        deadline = None if not timeout else time.monotonic() + timeout / 1000
        while True:
            responses = control_responses_for(self.port)
            response = responses.next_for_rank(self.rank) if responses is not None else None
            if response is not None:
                self._msg_id += 1
                return Message(response, self._msg_id)
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await asyncio.sleep(POLL_S)

    async def put(self, data: Any, shm_threshold: int = 0) -> None:
        raise PermissionError("Only producers can send messages.")  # FastDeploy's words for a consumer

    async def close(self) -> None:
        """Nothing to close: no socket was opened."""


def _fastdeploy_fmq() -> type:
    try:
        from fastdeploy.inter_communicator.fmq import FMQ as FastDeployFMQ
    except ImportError as exc:
        raise ImportError(f"FastDeploy's FMQ is not importable ({exc}): engine_hooks.fastdeploy.fmq serves only "
                          "the cache transfer managers' ctrl_c2e_rank<r>_<port> consumer queues itself") from exc
    return FastDeployFMQ


class FMQ:
    """``FMQ()`` as FastDeploy's engine calls it; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._args, self._kwargs = args, kwargs

    def queue(self, name: str, role: str = "producer") -> Any:
        match = CONTROL_QUEUE.fullmatch(name) if isinstance(name, str) else None
        if match is not None and role == "consumer":
            return ControlResponseQueue(name, int(match[1]), int(match[2]))
        return self._delegate().queue(name, role)

    def __getattr__(self, attr: str) -> Any:  # topic, destroy, ...: FastDeploy's
        return getattr(self._delegate(), attr)

    def _delegate(self) -> Any:
        return _fastdeploy_fmq()(*self._args, **self._kwargs)
