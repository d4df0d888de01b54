"""FastDeploy's engine as an adopter runs it: its exact CTM launch line and its storage tasks.

``fastdeploy_launch_line`` is the shell command FastDeploy's ``PrefixCacheManager.launch_cache_manager``
(upstream ``develop``, 2026-05) builds for one rank, flag for flag and in its order, ``--create_cache_tensor``
included where it adds it (a storage backend in mixed mode).  ``adopt`` applies the README's changes to
that line (the CTM module instead of FastDeploy's script; no ``--create_cache_tensor``), so a test runs
exactly what the README tells an adopter to run.

``FastDeployPDEngine`` is one instance of a deployment (``tests.fastdeploy_engine.FastDeployEngine``
with FastDeploy's Unix-socket queue and signal names) whose CTMs are started from that line, through
a shell, as FastDeploy starts them; ``role`` is ``mixed``, ``prefill`` or ``decode``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys

from cache_manager.queue.unix_address import SHM_QUEUE_ENV
from cache_manager.queue.wire import SECRET_ENV
from engine_hooks.core.launcher import REPO_ROOT
from ops.procs import private_dir
from tests.fastdeploy_engine import FastDeployEngine

# What FastDeploy's launch line runs, and what the README's step replaces it with
FD_SCRIPT = "{py_path}"  # os.path.join(<fastdeploy>/cache_manager, "cache_transfer_manager.py")
CTM_MODULE = "-m cache_manager.cache_transfer_manager"
CREATE_CACHE_TENSOR = " --create_cache_tensor"


def pd_storage_keys(token_ids: list[int], block_size: int) -> list[str]:
    """A request's keys as FastDeploy's P writes them with ``FD_PD_TRANSFER_VIA_STORAGE``: one chained
    hash per block, the last one ``<chained hash>:partial:<N>`` when its block holds only N tokens."""
    keys, prev = [], b""
    for start in range(0, len(token_ids), block_size):
        block = token_ids[start:start + block_size]
        prev = hashlib.sha256(prev + json.dumps(block).encode()).digest()
        keys.append(prev.hex() + (f":partial:{len(block)}" if len(block) < block_size else ""))
    return keys


def fastdeploy_launch_line(engine: FastDeployEngine, rank: int, *, role: str, storage_backend: str,
                           model_path: str) -> str:
    """FastDeploy's command for rank ``rank``'s CTM, as its ``launch_cache_manager`` writes it."""
    s, enable_splitwise = engine.spec, int(role != "mixed")
    storage = f" --kvcache_storage_backend {storage_backend}" if storage_backend else " "
    if storage_backend and not enable_splitwise:
        storage += CREATE_CACHE_TENSOR  # prefix_cache_manager.py:299-300 (removed by FastDeploy #8046)
    log = os.path.join(private_dir(engine.log_dir), f"launch_cache_transfer_manager_{rank}.log")
    return ("FLAGS_allocator_strategy=auto_growth "
            + f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(engine.tp)))}"
            + " NCCL_MAX_NCHANNELS=1 NCCL_BUFFSIZE=0"
            + " FD_ENABLE_SWAP_SPACE_CLEARING=0"
            + f" {shlex.quote(sys.executable)} {FD_SCRIPT}"
            + f" --device_id {rank}"
            + f" --rank {rank}"
            + f" --splitwise_role {role}"
            + f" --num_layers {s.num_layers}"
            + f" --mp_num {engine.tp}"
            + f" --cache_dtype {s.cache_dtype}"
            + f" --key_cache_shape {','.join(map(str, s.cache_shape))}"
            + f" --value_cache_shape {','.join(map(str, s.value_cache_shape))}"
            + f" --cache_queue_port {engine.cache_queue_port}"
            + f" --enable_splitwise {enable_splitwise}"
            + " --pod_ip 127.0.0.1"
            + f" --engine_worker_queue_port {engine.port}"
            + f" --num_cpu_blocks {engine.num_cpu_blocks}"
            + " --protocol ipc"
            + " --local_data_parallel_id 0"
            + " --rdma_port 0"
            + " --speculative_config '{\"method\": null, \"num_speculative_tokens\": 1}'"
            + f" --default_dtype '{s.default_dtype}'"
            + storage
            + " --write_policy write_through"
            + " --max_model_len 64"
            + f" --model_path {shlex.quote(model_path)}"
            + f" >{shlex.quote(log)} 2>&1")


def adopt(line: str) -> str:
    """The README's changes to FastDeploy's launch line: our CTM module, no ``--create_cache_tensor``."""
    assert line.count(FD_SCRIPT) == 1
    return line.replace(FD_SCRIPT, CTM_MODULE).replace(CREATE_CACHE_TENSOR, "")


class FastDeployPDEngine(FastDeployEngine):
    """One FastDeploy instance (Unix-socket queue, FastDeploy's signal names) whose CTMs are launched from
    FastDeploy's own line through a shell, with ``env`` added to the engine's environment."""

    def __init__(self, role: str, *, storage_backend: str, model_path: str, env: dict[str, str], **kw):
        self.role, self.storage_backend, self.model_path, self.extra_env = role, storage_backend, model_path, env
        super().__init__(tp=2, unix_socket=True, fastdeploy_signals=True, **kw)

    def launch_env(self) -> dict[str, str]:
        """The engine's environment as its CTMs inherit it: this repository importable, FastDeploy's
        default Unix-socket queue, this queue's secret file (two engines share this test process)."""
        env = {k: v for k, v in os.environ.items()  # the store is the one ``env`` names, whatever this shell has
               if k not in (SECRET_ENV, "CTM_IPC_TOKEN", "CTM_FILE_STORE_ROOT") and not k.startswith("MOONCAKE_")}
        env.update(PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p),
                   CTM_LOG_DIR=self.log_dir, **{SHM_QUEUE_ENV: "1"}, **self.queue.secret_env(), **self.extra_env)
        return env

    def line(self, rank: int, adopted: bool = True) -> str:
        line = fastdeploy_launch_line(self, rank, role=self.role, storage_backend=self.storage_backend,
                                      model_path=self.model_path)
        return adopt(line) if adopted else line.replace(FD_SCRIPT, CTM_MODULE)

    def launch_line(self, rank: int, line: str) -> subprocess.Popen:
        """``Popen(line, shell=True, preexec_fn=os.setsid)``, as FastDeploy does; ``close()`` kills it."""
        shell = subprocess.Popen(line, shell=True, preexec_fn=os.setsid, env=self.launch_env(), cwd=REPO_ROOT)
        self.shells.append(shell)
        return shell

    def start(self, timeout: float = 30.0) -> "FastDeployPDEngine":
        for rank in range(self.tp):
            self.launch_line(rank, self.line(rank))
        self.wait_ready(list(range(self.tp)), timeout)
        return self

    def launch_log(self, rank: int) -> str:
        with open(os.path.join(self.log_dir, f"launch_cache_transfer_manager_{rank}.log")) as f:
            return f.read()
