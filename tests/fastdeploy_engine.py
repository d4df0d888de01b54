"""The engine side a FastDeploy engine sets up around our CTMs, from project pieces (no
CacheTransferService): device caches, IPC signals, the FastDeploy-API ``EngineCacheQueue`` and one
CTM per rank launched with FastDeploy's flags.  ``close()`` stops the CTMs and unlinks every segment."""
from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

import ops
from cache_manager.cache_data import (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, KV_CACHE_STATUS_SIGNAL,
                                      PER_RANK_SIGNALS, WORKER_HEALTHY_LIVE_SIGNAL)
from cache_manager.ipc_signal import IPCSignal
from engine_hooks.device_caches import CacheSpec, DeviceCaches
from engine_hooks.fastdeploy_queue import DEFAULT_AUTHKEY, EngineCacheQueue
from engine_hooks.launcher import RankProcess, launch
from engine_hooks.launcher import default_log_dir, free_port
from ops.shm import unlink_segments

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)
NUM_CPU_BLOCKS = 8


class FastDeployEngine:
    def __init__(self, tp: int = 2, authkey: bytes = DEFAULT_AUTHKEY, storage_root: str | None = None,
                 spec: CacheSpec = SPEC, num_cpu_blocks: int = NUM_CPU_BLOCKS, **queue_kw: Any):
        self.tp, self.spec, self.num_cpu_blocks, self.storage_root = tp, spec, num_cpu_blocks, storage_root
        self.port = free_port()  # engine_worker_queue_port: the suffix of signals and segments
        self.log_dir = default_log_dir()
        self.platform = ops.get_platform("cpu", instance=str(self.port))
        self.procs: dict[int, RankProcess] = {}
        self.signals = {name: IPCSignal(name, np.zeros(tp, np.int32), suffix=self.port, create=True)
                        for name in PER_RANK_SIGNALS}
        for name in (WORKER_HEALTHY_LIVE_SIGNAL, KV_CACHE_STATUS_SIGNAL):
            self.signals[name] = IPCSignal(name, np.zeros(1, np.int32), suffix=self.port, create=True)
        self.caches = DeviceCaches(self.platform, spec, tp, list(range(tp)))
        self.queue: EngineCacheQueue | None = None
        try:
            for rank in range(tp):
                self.caches.create_rank(rank)
                self.signals[CACHE_READY_SIGNAL].value[rank] = 1
            # FastDeploy: EngineCacheQueue(address=(ip, port), authkey=..., is_server=True, num_client=tp)
            self.queue = EngineCacheQueue(address=("127.0.0.1", 0), authkey=authkey, is_server=True,
                                          num_client=tp, **queue_kw)
        except BaseException:
            self.close()
            raise

    def flags(self, rank: int) -> dict[str, object]:
        """FastDeploy's launch flags for rank ``rank``, plus the CPU platform's."""
        s = self.spec
        flags: dict[str, object] = {
            "device_id": rank, "rank": rank, "splitwise_role": "mixed", "num_layers": s.num_layers,
            "mp_num": self.tp, "cache_dtype": s.cache_dtype, "key_cache_shape": ",".join(map(str, s.cache_shape)),
            "value_cache_shape": ",".join(map(str, s.value_cache_shape)),
            "cache_queue_port": self.queue.get_server_port(), "enable_splitwise": 0, "pod_ip": "127.0.0.1",
            "engine_worker_queue_port": self.port, "num_cpu_blocks": self.num_cpu_blocks, "protocol": "ipc",
            "local_data_parallel_id": 0, "rdma_port": "0", "speculative_config": "{}",
            "default_dtype": s.default_dtype, "kvcache_storage_backend": "none", "write_policy": "write_through",
            "max_model_len": 64, "platform": "cpu", "log_dir": self.log_dir, "engine_pid": os.getpid(),
            "attach_timeout": 20,
        }
        if self.storage_root:
            flags["kvcache_storage_backend"] = "file"
            flags["storage_options"] = json.dumps({"root": self.storage_root, "fsync": False})
        return flags

    def launch(self, rank: int, env: dict[str, str] | None = None) -> RankProcess:
        """Start rank ``rank``'s CTM; like FastDeploy's subprocess it inherits this process's environment."""
        self.procs[rank] = launch(rank, self.flags(rank), self.log_dir, env or {})
        return self.procs[rank]

    def start(self, timeout: float = 30.0) -> "FastDeployEngine":
        for rank in range(self.tp):
            self.launch(rank)
        self.wait_ready(list(range(self.tp)), timeout)
        return self

    def wait_ready(self, ranks: list[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        inited = self.signals[CACHE_TRANSFER_INITED_SIGNAL]
        while not all(inited.value[r] == 1 for r in ranks) or not self.queue.wait_ready(0):
            for r in ranks:
                assert self.procs[r].alive(), f"CTM {self.procs[r].describe_failure()}"
            assert time.monotonic() < deadline, f"ranks {ranks} not ready within {timeout}s"
            time.sleep(0.02)

    def views(self) -> dict[tuple[int, str, int], np.ndarray]:
        """(rank, kind, layer) -> writable [num_blocks, block_bytes] view of the device cache."""
        return {(rank, kind, layer): self.platform.raw_view(t)
                for rank, caches in enumerate(self.caches.tensors)
                for kind, layers in caches.items() for layer, t in enumerate(layers)}

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for view in self.views().values():
            view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)

    def signals_for(self, n: int, timeout: float = 20.0) -> list[Any]:
        """Poll ``get_transfer_done_signal`` (as FastDeploy's recv thread does) until ``n`` arrived."""
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n:
            item = self.queue.get_transfer_done_signal()
            if item is not None:
                out.append(item)
                continue
            assert time.monotonic() < deadline, f"{len(out)} of {n} done signals within {timeout}s: {out}"
            time.sleep(0.002)
        return out

    def close(self) -> list[str]:
        """Stop the CTMs, close the queue, unlink everything; returns the segments still left (none)."""
        if self.queue is not None:
            self.queue.close()
        for proc in self.procs.values():
            proc.stop(5.0)
        self.caches.close()
        for sig in self.signals.values():
            sig.clear()
        unlink_segments(self.platform.segment_prefix)
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ctm.{self.port}.")
                      or n.endswith(f".{self.port}"))
