"""The engine side a FastDeploy engine sets up around our CTMs, from project pieces (no
CacheTransferService): device caches, IPC signals, the FastDeploy-API ``EngineCacheQueue`` and one
CTM per rank launched with FastDeploy's flags.  ``close()`` stops the CTMs and unlinks every segment.

``unix_socket=True`` gives the queue FastDeploy's ``/dev/shm/fd_task_queue_<port>.sock`` address
(``FD_ENGINE_TASK_QUEUE_WITH_SHM=1``); ``fastdeploy_signals=True`` creates the signals under
FastDeploy's names with its ``IPCSignal``'s semantics (``engine_hooks.fastdeploy.signals``), as its
engine and prefix cache manager do; ``launch_like_fastdeploy`` starts a CTM as FastDeploy does.
``control`` puts a FastDeploy control request and returns its ``ControlResponse``; ``free_caches`` and
``recreate_caches`` are what FastDeploy's worker does to its KV caches on a sleep and a wakeup.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

import ops
from cache_manager.cache_data import (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, KV_CACHE_STATUS_SIGNAL,
                                      PER_RANK_SIGNALS, WORKER_HEALTHY_LIVE_SIGNAL, CacheStatus)
from cache_manager.ipc_signal import IPCSignal
from cache_manager.queue.unix_address import fastdeploy_queue_path
from engine_hooks.core.device_caches import CacheSpec, DeviceCaches
from engine_hooks.core.launcher import REPO_ROOT, RankProcess, launch
from engine_hooks.core.launcher import default_log_dir, free_port
from engine_hooks.fastdeploy.queue import DEFAULT_AUTHKEY
from engine_hooks.fastdeploy.signals import PREFIX_CACHE_ATTACHES, PREFIX_CACHE_CREATES
from engine_hooks.fastdeploy_queue import EngineCacheQueue  # the names FastDeploy's adoption imports
from engine_hooks.fastdeploy_signals import IPCSignal as FastDeploySignal
from ops.procs import private_dir
from ops.shm import unlink_segments

SPEC = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)
NUM_CPU_BLOCKS = 8


class FastDeployEngine:
    def __init__(self, tp: int = 2, authkey: bytes = DEFAULT_AUTHKEY, storage_root: str | None = None,
                 spec: CacheSpec = SPEC, num_cpu_blocks: int = NUM_CPU_BLOCKS, unix_socket: bool = False,
                 fastdeploy_signals: bool = False, port: int | None = None, cache_queue_port: int | None = None,
                 model_path: str = "", dp_index: int = 0, **queue_kw: Any):
        self.dp_index = dp_index  # FastDeploy's local_data_parallel_id: this engine's place among DP engines
        self.tp, self.spec, self.num_cpu_blocks, self.storage_root = tp, spec, num_cpu_blocks, storage_root
        self.model_path = model_path  # FastDeploy's --model_path: where its version.yaml is
        self._controls = 0  # control requests put (their default ids)
        self.port = port or free_port()  # engine_worker_queue_port: the suffix of signals and segments
        # FastDeploy's local_cache_queue_port: with a Unix-socket queue only a number in the socket's name
        self.cache_queue_port = (cache_queue_port or free_port()) if unix_socket else None
        self.log_dir = default_log_dir()
        self.platform = ops.get_platform("cpu", instance=str(self.port))
        self.procs: dict[int, RankProcess] = {}
        self.shells: list[subprocess.Popen] = []  # CTMs launched as FastDeploy launches them
        self.signals: dict[str, Any] = {}
        self.caches = DeviceCaches(self.platform, spec, tp, list(range(tp)))
        self.queue: EngineCacheQueue | None = None
        try:
            self._create_signals(fastdeploy_signals)
            for rank in range(tp):
                self.caches.create_rank(rank)
                self.signals[CACHE_READY_SIGNAL].value[rank] = 1
            # FastDeploy: EngineCacheQueue(address=(ip, port) or "/dev/shm/fd_task_queue_<port>.sock",
            # authkey=..., is_server=True, num_client=tp)
            address = fastdeploy_queue_path(self.cache_queue_port) if unix_socket else ("127.0.0.1", 0)
            self.queue = EngineCacheQueue(address=address, authkey=authkey, is_server=True, num_client=tp,
                                          **queue_kw)
        except BaseException:
            self.close()
            raise

    def _create_signals(self, fastdeploy_signals: bool) -> None:
        tp = self.tp
        if not fastdeploy_signals:
            for name in PER_RANK_SIGNALS:
                self.signals[name] = IPCSignal(name, np.zeros(tp, np.int32), suffix=self.port, create=True)
            for name in (WORKER_HEALTHY_LIVE_SIGNAL, KV_CACHE_STATUS_SIGNAL):
                self.signals[name] = IPCSignal(name, np.zeros(1, np.int32), suffix=self.port, create=True)
            return
        # as FastDeploy's engine (common_engine) and its PrefixCacheManager create them, <name>.<port>
        words = {WORKER_HEALTHY_LIVE_SIGNAL: min(8, tp), "cache_task_inflight": tp}
        for name in PREFIX_CACHE_ATTACHES + PREFIX_CACHE_CREATES + (WORKER_HEALTHY_LIVE_SIGNAL, KV_CACHE_STATUS_SIGNAL):
            n = tp if name in PER_RANK_SIGNALS else words.get(name, 1)
            self.signals[name] = FastDeploySignal(name, np.zeros(n, np.int32), np.int32, suffix=self.port, create=True)

    def flags(self, rank: int) -> dict[str, object]:
        """FastDeploy's launch flags for rank ``rank``, plus the CPU platform's."""
        s = self.spec
        flags: dict[str, object] = {
            "device_id": rank, "rank": rank, "splitwise_role": "mixed", "num_layers": s.num_layers,
            "mp_num": self.tp, "cache_dtype": s.cache_dtype, "key_cache_shape": ",".join(map(str, s.cache_shape)),
            "value_cache_shape": ",".join(map(str, s.value_cache_shape)),
            "cache_queue_port": self.cache_queue_port or self.queue.get_server_port(), "enable_splitwise": 0,
            "pod_ip": "127.0.0.1",
            "engine_worker_queue_port": self.port, "num_cpu_blocks": self.num_cpu_blocks, "protocol": "ipc",
            "local_data_parallel_id": self.dp_index, "rdma_port": "0", "speculative_config": "{}",
            "default_dtype": s.default_dtype, "kvcache_storage_backend": "none", "write_policy": "write_through",
            "max_model_len": 64, "platform": "cpu", "log_dir": self.log_dir, "engine_pid": os.getpid(),
            "attach_timeout": 20,
        }
        if self.model_path:
            flags["model_path"] = self.model_path
        if self.storage_root:
            flags["kvcache_storage_backend"] = "file"
            flags["storage_options"] = json.dumps({"root": self.storage_root, "fsync": False})
        return flags

    def launch(self, rank: int, env: dict[str, str] | None = None) -> RankProcess:
        """Start rank ``rank``'s CTM; like FastDeploy's subprocess it inherits this process's environment."""
        self.procs[rank] = launch(rank, self.flags(rank), self.log_dir, env or {})
        return self.procs[rank]

    def launch_like_fastdeploy(self, rank: int) -> subprocess.Popen:
        """Start rank ``rank``'s CTM as FastDeploy's ``launch_cache_manager`` does: one shell command line,
        ``Popen(cmd, shell=True, preexec_fn=os.setsid)``, no engine pid, output to a launch log."""
        flags = self.flags(rank)
        del flags["engine_pid"]
        log = os.path.join(private_dir(self.log_dir), f"launch_cache_transfer_manager_{rank}.log")
        cmd = (f"PYTHONPATH={shlex.quote(REPO_ROOT)} {shlex.quote(sys.executable)} -m cache_manager.cache_transfer_manager"
               + "".join(f" --{k} {shlex.quote(str(v))}" for k, v in flags.items()) + f" >{shlex.quote(log)} 2>&1")
        shell = subprocess.Popen(cmd, shell=True, preexec_fn=os.setsid, cwd=REPO_ROOT)
        self.shells.append(shell)
        return shell

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
                if r in self.procs:  # one launched like FastDeploy has only its shell to look at
                    assert self.procs[r].alive(), f"CTM {self.procs[r].describe_failure()}"
            for shell in self.shells:
                assert shell.poll() is None, f"a CTM launched like FastDeploy exited with {shell.poll()}: see " \
                    f"{self.log_dir}/launch_cache_transfer_manager_*.log"
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

    def control(self, method: str, args: dict | None = None, request_id: str | None = None,
                timeout: float = 20.0) -> Any:
        """Put FastDeploy's ``(CacheStatus.CTRL, ControlRequest)`` (as a dict) and return its response."""
        self._controls += 1
        rid = request_id or f"{method}-{self._controls}"
        self.queue.put_transfer_task((CacheStatus.CTRL, {"request_id": rid, "method": method, "args": args or {}}))
        return self.queue.get_control_response(rid, timeout)

    def free_caches(self) -> None:
        """FastDeploy's worker on a sleep: its KV caches freed (segments unlinked), ``cache_ready`` 0."""
        self.caches.close()
        self.signals[CACHE_READY_SIGNAL].value[:self.tp] = 0

    def recreate_caches(self, seed: int) -> None:
        """FastDeploy's worker on a wakeup: NEW caches under the same names, filled from ``seed``, then
        ``cache_ready`` 1 per rank."""
        self.caches = DeviceCaches(self.platform, self.spec, self.tp, list(range(self.tp)))
        for rank in range(self.tp):
            self.caches.create_rank(rank)
        self.fill(seed)
        self.signals[CACHE_READY_SIGNAL].value[:self.tp] = 1

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
        for shell in self.shells:  # its own session and process group: the shell and its CTM
            if shell.poll() is None:
                try:
                    os.killpg(shell.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shell.wait(10)
        self.caches.close()
        for sig in self.signals.values():
            sig.clear()
        unlink_segments(self.platform.segment_prefix)
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ctm.{self.port}.")
                      or n.endswith(f".{self.port}"))
