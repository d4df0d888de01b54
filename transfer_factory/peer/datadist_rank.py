"""A CTM rank's LLM-DataDist endpoint (``datadist.DataDistEndpoint``), opened from the rank's own
caches when a peer asks for the ``datadist`` transport (``cache_manager.rank.peer.datadist``).

Offered by capability: the rank's device memory is Ascend NPU memory (the ``npu`` platform) and
CANN's ``llm_datadist`` can be imported.  It opens once, at the first descriptor that offers it
(every device cache and the swap space must be registered before any link), listens on the rank's
``--pod_ip`` at a free port, and maps its engine's exposure and layer boards to register them.
"""
from __future__ import annotations

import importlib.util
import logging
import socket
import threading
from typing import Any, Sequence

from ops.shm import SharedMemorySegment

from transfer_factory.peer.datadist import DataDistEndpoint
from transfer_factory.peer.datadist_params import cluster_id_for

import numpy as np


def datadist_capable(platform: Any) -> bool:
    """Whether a rank on ``platform`` can offer LLM-DataDist: Ascend device memory and the SDK."""
    return getattr(platform, "name", "") == "npu" and importlib.util.find_spec("llm_datadist") is not None


def free_port(ip: str) -> int:
    """A TCP port free on ``ip`` now, for ``llm.listenIpInfo`` (LLM-DataDist wants an explicit one)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


class RankDataDist:
    """Opened on first use; ``endpoint`` is then the rank's ``DataDistEndpoint`` (RuntimeError before)."""

    def __init__(self, rank: int, tp: int, role: str, platform: Any, ip: str, log: logging.Logger):
        self._rank, self._tp, self._role = rank, tp, role
        self._platform, self._ip, self._log = platform, ip, log
        self._lock = threading.Lock()
        self._endpoint: DataDistEndpoint | None = None
        self._params: dict | None = None
        self._instance = ""
        self._segments: list[SharedMemorySegment] = []

    @property
    def endpoint(self) -> DataDistEndpoint:
        if self._endpoint is None:
            raise RuntimeError("this rank's LLM-DataDist endpoint is not open (or was closed)")
        return self._endpoint

    def capable(self) -> bool:
        return datadist_capable(self._platform)

    def open(self, instance_id: str, groups: Sequence[Any], block_bytes: dict[str, int], cache_dtype: str,
             num_layers: int, board_segment: str, layer_board_segment: str) -> dict:
        """The endpoint's params for this rank's descriptor (opened and registered once).  ``groups``:
        the rank's cache groups (``kind``, per-layer ``tensors``, ``host_ptrs``, ``swap_plan``)."""
        with self._lock:
            if self._params is not None:
                if instance_id != self._instance:
                    raise ValueError(f"LLM-DataDist endpoint opened as {self._instance!r}, asked as {instance_id!r}")
                return self._params
            board = SharedMemorySegment(board_segment)
            self._segments.append(board)
            layer_board = SharedMemorySegment(layer_board_segment)
            self._segments.append(layer_board)
            endpoint = DataDistEndpoint(self._role, int(getattr(self._platform, "device_id", 0) or 0),
                                        cluster_id_for(instance_id, self._rank), self._log, tp=self._tp, rank=self._rank)
            device = {g.kind: [int(t.data_ptr()) for t in g.tensors] for g in groups}
            num_blocks = min(int(t.shape[0]) for g in groups for t in g.tensors)
            with_host = all(g.host_ptrs and g.swap_plan is not None for g in groups)
            host = {g.kind: [int(p) for p in g.host_ptrs] for g in groups} if with_host else None
            host_blocks = min(int(g.swap_plan.host.capacities.min()) for g in groups) if with_host else 0
            try:
                self._params = endpoint.open(device, block_bytes, num_blocks, cache_dtype, num_layers, self._ip,
                                             free_port(self._ip), host=host, host_blocks=host_blocks,
                                             board=_address(board), layer_board=(_address(layer_board), layer_board.size))
            except BaseException:
                endpoint.close()
                raise
            self._endpoint, self._instance = endpoint, instance_id
            return self._params

    def link(self, name: str, params: Any, timeout: float = 3.0) -> int:
        """Link the endpoint to peer ``name``; the token that unlinks this link (not a later one)."""
        return self.endpoint.link(name, params, timeout)

    def unlink(self, name: str, token: int | None = None) -> None:
        if self._endpoint is not None:
            self._endpoint.unlink(name, token)

    def close(self) -> None:
        with self._lock:
            endpoint, self._endpoint, self._params = self._endpoint, None, None
            segments, self._segments = self._segments, []
        if endpoint is not None:
            endpoint.close()
        for segment in segments:
            segment.close()


def _address(segment: SharedMemorySegment) -> int:
    return int(np.frombuffer(segment.buf, dtype=np.uint8).ctypes.data)
