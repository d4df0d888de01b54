"""Where FastDeploy's ``EngineCacheQueue`` is, and which engine it serves: its ``address`` and its
data-parallel arguments (``check_data_parallel``).  The ``address`` is ``(host, port)``, or, with
``FD_ENGINE_TASK_QUEUE_WITH_SHM=1`` (its default), the path ``/dev/shm/fd_task_queue_<port>.sock``.

A path is a name only (``cache_manager.queue.unix_address`` says why): the server listens on a
socket of that name in the queue's private directory, handles in the engine's process find the
server by the path, and CTMs by ``--cache_queue_port``.  Nothing is created at the path itself.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from cache_manager.queue.unix_address import socket_name


@dataclass(frozen=True)
class QueueAddress:
    host: str
    port: int
    unix: str | None = None  # the requested Unix-socket path (absolute), for a Unix-socket queue

    @property
    def key(self) -> int | str:
        """How handles in this process find the server: the path, or the port."""
        return self.unix if self.unix is not None else self.port


def parse_address(address: Any) -> QueueAddress:
    """``address`` as FastDeploy gives it, checked; ``ValueError`` names what is wrong."""
    if isinstance(address, str):
        socket_name(address)  # FastDeploy's fd_task_queue_<port>.sock, or ValueError
        if not os.path.isabs(address):
            raise ValueError(f"Unix-socket queue address {address!r} must be an absolute path")
        return QueueAddress("127.0.0.1", 0, os.path.normpath(address))
    if not isinstance(address, (tuple, list)) or len(address) != 2 or not isinstance(address[0], str) \
            or isinstance(address[1], bool) or not isinstance(address[1], int) or not 0 <= address[1] < 65536:
        raise ValueError(f"address {address!r} must be (host, port) or a Unix-socket path "
                         "(/dev/shm/fd_task_queue_<port>.sock, as FastDeploy passes with FD_ENGINE_TASK_QUEUE_WITH_SHM=1)")
    return QueueAddress(address[0], address[1])


def check_data_parallel(size: Any, index: Any) -> None:
    """FastDeploy's data-parallel arguments: every DP engine has its own queue (and port), and passes the
    DP size to its server and its index to its handles (with the default size: FastDeploy's prefix cache
    manager passes only the index).  ``ValueError`` names a value out of range."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or isinstance(index, bool) \
            or not isinstance(index, int) or index < 0 or (size > 1 and index >= size):
        raise ValueError(f"local_data_parallel_size {size!r} / local_data_parallel_id {index!r}: the size must be "
                         "a positive integer and the id a non-negative one below it")
