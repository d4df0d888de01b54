"""CacheTransferService: the engine's handle on its CTM processes.

    from engine_hooks import CacheSpec, CacheTransferService

    spec = CacheSpec(num_layers=4, num_blocks=256, kv_heads=8, block_size=64, head_dim=128)
    with CacheTransferService(spec, tp=2, num_cpu_blocks=512) as svc:
        svc.swap_to_cpu(gpu_block_ids=[3, 4], cpu_block_ids=[0, 1]).result()
        svc.swap_to_gpu(gpu_block_ids=[7, 8], cpu_block_ids=[0, 1]).result()

``start()`` creates and exports every rank's device caches, creates the IPC signals and
the queue server, launches one CTM per rank with FastDeploy's flags and waits for all
of them (a rank that fails is named, with the tail of its log).  Every task returns a
``concurrent.futures.Future`` that resolves when every rank has answered:

* with the task's result (DESIGN §3.3) when all ranks succeeded;
* with ``TaskFailedError`` naming each failing rank and its reason;
* with ``TaskTimeoutError`` naming the ranks that did not answer in time;
* with ``RankDiedError`` at once when a rank goes down: its process dies, or its stream to the
  engine breaks (then its process is killed); the service restarts it (``rank_recovery``).

A resolved future also carries ``rank_results``: each rank's ``RankResult`` (its receive
order, its time, the bytes it moved).

Two-phase completion (DESIGN §3.8): every future has ``released``, a second future that
resolves once every rank has let go of the task's blocks: it answered (in time or late, and
for a direct storage call that outlived its deadline, once that call returned), died, or was
restarted.  The engine must not reuse the device blocks or host slots of a failed or
timed-out task before ``future.released`` is done.  Every task carries its deadline on
CLOCK_MONOTONIC (shared by the host's processes); a rank never starts a task past it.

``shutdown()`` stops the CTMs (SIGTERM, then SIGKILL), closes the queue and unlinks every
segment; the service is also a context manager.  A supervisor thread enforces the
deadlines, watches the processes and writes the heartbeat signal.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import ops
from cache_manager.queue import wire
from cache_manager.cache_data import CacheStatus, KVCacheStatus, swap_clearing
from cache_manager.ipc_signal import IPC_TOKEN_ENV, IPCSignal, ipc_suffix, new_ipc_token
from cache_manager.queue.server import EngineCacheQueueServer
from transfer_factory.keys import Namespace
from transfer_factory.peer.descriptor import ROLES
from transfer_factory.peer.handles import NO_GENERATION

from .core import kv_cache_control
from cache_manager.cache_layout import CacheLayout
from cache_manager.cache_spec import CacheSpec, as_layout

from .core.device_caches import DeviceCaches
from .core.engine_resources import EngineResources
from .core.errors import CachesClearedError, ServiceClosed
from .core.launcher import RankProcess, RankProcesses, default_log_dir, free_port
from .core.layerwise import LayerwiseTasks
from .core.metrics import CacheMetrics
from .core.engine_core import EngineCore
from .core.transfer_records import DEFAULT_CAPACITY, RequestTransfers, TransferRecord, check_request_id
from .core.rank_recovery import RankHooks, RankRecovery, RestartPolicy
from .core.wire_tasks import state_slot as wire_state_slot
from .core.wire_tasks import storage_task, swap_task

logger = logging.getLogger(__name__)


class CacheTransferService:
    def __init__(
        self,
        spec: CacheSpec | CacheLayout,
        tp: int = 1,
        num_cpu_blocks: int = 0,
        *,
        platform: str = "cpu",
        device_ids: Sequence[int] | None = None,
        log_dir: str | None = None,
        pod_ip: str = "127.0.0.1",
        engine_worker_queue_port: int = 0,
        cache_queue_port: int = 0,
        max_model_len: int = 8192,
        task_timeout: float = 30.0,
        storage_grace: float = 5.0,
        ready_timeout: float = 120.0,
        stop_grace: float = 5.0,
        storage_backend: str = "none",
        storage_options: dict[str, Any] | None = None,
        storage_transfer: str = "auto",
        num_cpu_state_slots: int = 0,  # host slots of a layout's state groups (a swap's state_slots)
        model_id: str = "model",
        model_version: str = "",
        extra_flags: dict[str, object] | None = None,
        extra_env: dict[str, str] | None = None,
        metrics_port: int | None = None,
        record_latencies: bool = False,
        auto_restart: bool = True,  # a rank that goes down is restarted (else: down until restart_rank)
        restart_policy: RestartPolicy | None = None,  # how often and how soon (rank_recovery)
        splitwise_role: str = "mixed",  # FastDeploy's: a decode instance maps its P/D peers read-only
        transfer_records: int = DEFAULT_CAPACITY,  # requests whose tasks' records are kept (0: none)
    ):
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp {tp!r} must be a positive integer")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks {num_cpu_blocks!r} must be a non-negative integer")
        if splitwise_role not in ROLES:
            raise ValueError(f"splitwise_role {splitwise_role!r} must be one of {ROLES}")
        self.splitwise_role = splitwise_role
        self.spec = spec
        self.layout = as_layout(spec)  # what every path works on (a CacheSpec's FastDeploy layout, or a grouped one)
        self.tp = tp
        self.num_cpu_blocks = num_cpu_blocks
        if not isinstance(num_cpu_state_slots, int) or num_cpu_state_slots < 0:
            raise ValueError(f"num_cpu_state_slots {num_cpu_state_slots!r} must be a non-negative integer")
        if num_cpu_state_slots and not self.layout.request_slots:
            raise ValueError(f"num_cpu_state_slots {num_cpu_state_slots}: the cache layout has no state group")
        self.num_cpu_state_slots = num_cpu_state_slots
        self.platform_name = platform
        self.device_ids = list(device_ids) if device_ids is not None else list(range(tp))
        if len(self.device_ids) != tp:
            raise ValueError(f"device_ids has {len(self.device_ids)} entries for tp {tp}")
        self.pod_ip = pod_ip
        self.port = engine_worker_queue_port or free_port(pod_ip)
        self.cache_queue_port = cache_queue_port
        self.max_model_len = max_model_len
        self.task_timeout = task_timeout
        if not 0 <= storage_grace < 3600:
            raise ValueError(f"storage_grace {storage_grace!r} must be in [0, 3600) seconds")
        self.storage_grace = storage_grace  # for the ranks' in-time answers to a storage task to arrive
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        from transfer_factory import backend_names

        known = backend_names({**os.environ, **(extra_env or {})})  # the CTMs see both
        if storage_backend != "none" and storage_backend not in known:
            raise ValueError(f"storage_backend {storage_backend!r} must be 'none' or one of {known}")
        self.storage_backend = storage_backend
        self.storage_options = dict(storage_options or {})
        self.storage_transfer = storage_transfer
        self.model_id = model_id
        self.extra_flags = dict(extra_flags or {})
        self.extra_env = dict(extra_env or {})
        self.log_dir = os.path.abspath(log_dir) if log_dir else default_log_dir()
        # A random token in every IPC name, so no other user can predict (and squat) them; the CTMs
        # get it in their environment (IPC_TOKEN_ENV), never on the command line.
        self.ipc_token = new_ipc_token()
        self.instance = ipc_suffix(self.port, self.ipc_token)

        self.platform = ops.get_platform(platform, instance=self.instance)
        # the device caches, the IPC signals and the model version, shared with the CTMs
        self.resources = EngineResources(self.platform, spec, tp, self.device_ids, self.instance, model_id,
                                        model_version)
        self.layerwise: LayerwiseTasks | None = None  # the progress board of layer-wise tasks
        self.server: EngineCacheQueueServer | None = None
        self._secret = wire.new_secret()
        self._ranks = RankProcesses(self.ctm_flags, self.log_dir, lambda: {wire.SECRET_ENV: self._secret.hex(),
                                                                           IPC_TOKEN_ENV: self.ipc_token,
                                                                           **self.extra_env})
        # the engine core, shared with FastDeploy's façade: every task in flight (its future and its
        # release), the supervisor, the host-slot guard, what a rank going down or coming back does
        self.core = EngineCore(tp, num_cpu_blocks, self._ranks.current, self._on_beat,
                               lambda rank, proc: self.recovery.process_died(rank, proc),
                               control_timeout=task_timeout, record_latencies=record_latencies,
                               transfer_records=transfer_records)
        self.tracker = self.core.tracker
        self.metrics = CacheMetrics()  # counted from the ranks' results; served only with metrics_port
        self.metrics.attach(self.tracker, backend=storage_backend)
        if metrics_port is not None and not (isinstance(metrics_port, int) and 0 <= metrics_port < 65536):
            raise ValueError(f"metrics_port {metrics_port!r} must be a port number (0 picks a free one)")
        self.metrics_port = metrics_port
        self._shutdown_lock = threading.Lock()
        hooks = RankHooks(self._ranks, self.core, lambda: self.server.registered_ranks(), self.resources.reset_rank,
                          self._rank_ready, ready_timeout, stop_grace)
        self.recovery = RankRecovery(hooks, restart_policy, auto_restart)  # a rank down: killed, released, restarted
        self._supervisor = self.core.supervisor
        self._closed = False
        self._started = False

    # ------------------------------------------------------------------ start
    def __enter__(self) -> "CacheTransferService":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self) -> "CacheTransferService":
        if self._started:
            raise RuntimeError("the service is already started")
        self._started = True
        atexit.register(self.shutdown)
        try:
            # what instances killed whole (engine and CTMs at once) left: only provably dead creators' names
            self.platform.sweep_orphans()
            self.layerwise = LayerwiseTasks(self.tp, suffix=self.instance)
            self.resources.create()
            self.server = EngineCacheQueueServer(self.tp, self._secret, host=self.pod_ip, port=self.cache_queue_port,
                                                 on_result=self.tracker.on_result,
                                                 on_rank_broken=self.recovery.stream_broke,
                                                 on_rank_joined=self.core.rank_joined)
            self.core.serve(self.server)
            self.cache_queue_port = self.server.port
            self.resources.beat()
            for rank in range(self.tp):
                self._ranks.start(rank)
            self._ranks.wait_ready(list(range(self.tp)), self._rank_ready, self.ready_timeout)
            self._supervisor.start()
            self.recovery.start()
            if self.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.metrics_port, host=self.pod_ip)
        except BaseException:
            self.shutdown()
            raise
        logger.info("CTM service ready: tp=%d, queue %s", self.tp, self.server.address)
        return self

    def ctm_flags(self, rank: int) -> dict[str, object]:
        """The command-line flags of rank ``rank``'s CTM (FastDeploy's, plus the platform's)."""
        s = self.spec
        flags: dict[str, object] = {
            "splitwise_role": self.splitwise_role, "rank": rank, "device_id": self.device_ids[rank],
            "max_model_len": self.max_model_len, "num_layers": s.num_layers, "mp_num": self.tp,
            "cache_queue_port": self.cache_queue_port, "pod_ip": self.pod_ip,
            "engine_worker_queue_port": self.port, "num_cpu_blocks": self.num_cpu_blocks,
            "platform": self.platform_name, "log_dir": self.log_dir, "engine_pid": os.getpid(),
            "attach_timeout": self.ready_timeout, "kvcache_storage_backend": self.storage_backend,
            "model_path": self.model_id, "model_version": self.resources.model_version,
            "storage_transfer": self.storage_transfer,
        }
        if self.storage_options:
            flags["storage_options"] = json.dumps(self.storage_options)
        if isinstance(s, CacheSpec):  # FastDeploy's flags, as its launch line gives them
            flags.update(cache_dtype=s.cache_dtype, default_dtype=s.default_dtype,
                         key_cache_shape=",".join(map(str, s.cache_shape)),
                         value_cache_shape=",".join(map(str, s.value_cache_shape)))
            if s.speculative_config():
                flags["speculative_config"] = json.dumps(s.speculative_config())
        else:
            flags["cache_layout"] = json.dumps(s.to_json(), separators=(",", ":"))
            if self.num_cpu_state_slots:
                flags["num_cpu_state_slots"] = self.num_cpu_state_slots
        flags.update(self.extra_flags)
        return flags

    def _rank_ready(self, rank: int) -> bool:
        """Registered with the queue (so this process got through its start, caches attached), and
        serving (``EngineResources.rank_serving``: inited, or cleared itself during an RL clear)."""
        return rank in self.server.registered_ranks() and self.resources.rank_serving(rank)

    # ------------------------------------------------------------------ tasks
    def submit(self, task: dict, timeout: float | None = None, grace: float = 0.0,
               request_id: str | None = None) -> Future:
        """Broadcast a wire task to every rank; the future resolves when all have answered.

        The future fails ``timeout + grace`` seconds after submission: storage tasks carry their
        own ``timeout`` to the ranks, which answer with 0 blocks when it passes, and the grace
        lets that answer arrive.  Every task method takes a ``request_id`` (a str): the task is then
        recorded for that request (``transfers``)."""
        timeout = self.task_timeout if timeout is None else float(timeout)
        request_id = check_request_id(request_id)
        return self.core.submit(task, timeout, grace, self._refusal(task), request_id)  # the core's guards next

    def _refusal(self, task: dict) -> Exception | None:
        """Why ``task`` fails at once, before it is sent, or None (the engine core then guards the
        host slots a restart emptied)."""
        if self._closed or self.server is None:
            return ServiceClosed("the CTM service is not running")
        status = self.resources.kv_cache_status()
        if status != KVCacheStatus.NORMAL:
            return CachesClearedError(f"the KV caches are cleared for a weight update (kv_cache_status "
                                      f"{status.name}): restore_caches() first")
        if self.resources.generation == NO_GENERATION and task.get("event_type") != CacheStatus.CTRL:
            return CachesClearedError("the KV caches are released (a sleep, or one that failed): wakeup() first")
        return None

    def swap_to_cpu(self, gpu_block_ids: Any, cpu_block_ids: Any, swap_node_ids: Any = None,
                    timeout: float | None = None, layerwise: bool = False, state_slots: Any = None,
                    request_id: str | None = None) -> Future:
        """Copy device blocks to host swap space on every rank.  Result:
        ``(event_type, task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)``.  With
        ``layerwise=True`` the ranks copy layer ``l`` once ``future.layer_computed(l + 1)`` was called.
        ``state_slots``: (device slot, host state slot): the request's state groups too."""
        task = swap_task(CacheStatus.SWAP2CPU, gpu_block_ids, cpu_block_ids, swap_node_ids, state_slots,
                         self.layout.request_slots, self.num_cpu_state_slots)
        return self._submit_maybe_layerwise(task, timeout, 0.0, layerwise, is_store=True, request_id=request_id)

    def swap_to_gpu(self, gpu_block_ids: Any, cpu_block_ids: Any, swap_node_ids: Any = None,
                    timeout: float | None = None, layerwise: bool = False, state_slots: Any = None,
                    request_id: str | None = None) -> Future:
        """Copy host swap blocks back into device blocks on every rank; same result shape.  With
        ``layerwise=True``, ``future.wait_for_layer(l)`` returns once layer ``l`` landed on every rank."""
        task = swap_task(CacheStatus.SWAP2GPU, gpu_block_ids, cpu_block_ids, swap_node_ids, state_slots,
                         self.layout.request_slots, self.num_cpu_state_slots)
        return self._submit_maybe_layerwise(task, timeout, 0.0, layerwise, is_store=False, request_id=request_id)

    def write_storage(self, keys: Sequence[str], gpu_block_ids: Any, token_ids: Sequence[int] | None = None,
                      timeout: float | None = None, layerwise: bool = False, state_slot: int | None = None,
                      cache_salt: str | None = None, request_id: str | None = None) -> Future:
        """Write-through: store blocks ``gpu_block_ids`` under the chained block hashes ``keys``
        on every rank, skipping the leading blocks already stored.  Resolves to the gpu block
        ids stored on every rank (a leading run; 0 blocks when storage is down).  With
        ``layerwise=True`` the ranks stage layer ``l`` once ``future.layer_computed(l + 1)`` was called.
        ``state_slot``: the request's slot of the layout's state groups, stored with the last block.
        ``cache_salt``: the tenant's salt: the blocks are stored under the salted hashes of ``keys``."""
        timeout = self.task_timeout if timeout is None else float(timeout)
        slot = None if state_slot is None else wire_state_slot(state_slot, self.layout.request_slots)
        task = storage_task(CacheStatus.GPU2STORAGE, keys, gpu_block_ids, token_ids, timeout, state_slot=slot,
                            cache_salt=cache_salt)
        return self._submit_maybe_layerwise(task, timeout, self.storage_grace, layerwise, is_store=True,
                                            request_id=request_id)

    def read_storage(self, keys: Sequence[str], gpu_block_ids: Any, start_read_block_idx: int = 0,
                     token_ids: Sequence[int] | None = None, timeout: float | None = None,
                     layerwise: bool = False, state_slot: int | None = None,
                     cache_salt: str | None = None, request_id: str | None = None) -> Future:
        """Load ``keys[start_read_block_idx:]`` into ``gpu_block_ids``.  Resolves to the gpu block
        ids loaded: the leading run present on every rank (the minimum over ranks).  With
        ``layerwise=True``, ``future.wait_for_layer(l)`` returns the blocks of layer ``l`` landed on
        every rank as soon as they are.  ``state_slot``: the slot the state of the run's end
        (stored by a write that ended there) is loaded into; a run is cut back to where one was.
        ``cache_salt``: the tenant's salt: only blocks stored under the same salt are found."""
        timeout = self.task_timeout if timeout is None else float(timeout)
        slot = None if state_slot is None else wire_state_slot(state_slot, self.layout.request_slots)
        task = storage_task(CacheStatus.STORAGE2GPU, keys, gpu_block_ids, token_ids, timeout, start_read_block_idx,
                            slot, cache_salt=cache_salt)
        return self._submit_maybe_layerwise(task, timeout, self.storage_grace, layerwise, is_store=False,
                                            request_id=request_id)

    def _submit_maybe_layerwise(self, task: dict, timeout: float | None, grace: float, layerwise: bool,
                                is_store: bool, request_id: str | None = None) -> Future:
        request_id = check_request_id(request_id)  # before a layer-board slot is taken
        if not layerwise:
            return self.submit(task, timeout, grace, request_id)
        if self.layerwise is None:
            raise ServiceClosed("the CTM service is not running")
        task.setdefault("task_id", self.tracker.new_task_id())
        timeout = self.task_timeout if timeout is None else float(timeout)
        return self.layerwise.submit(task, timeout, is_store, len(self.spec.layer_blocks()),
                                     lambda t: self.submit(t, timeout, grace, request_id))

    def control(self, command: str, timeout: float | None = None, **args: Any) -> Future:
        """A CTRL task (``ping``, ``sleep``); resolves to each rank's answer, in rank order."""
        return self.submit({"event_type": int(CacheStatus.CTRL), "command": command, "args": args}, timeout)

    @property
    def latencies_ms(self) -> list[float]:
        """Every completed task's latency, with ``record_latencies=True`` (replays, benchmarks);
        empty otherwise, since it grows with every task."""
        return self.tracker.latencies_ms

    def transfers(self, request_id: str) -> list[TransferRecord]:
        """The recorded tasks of ``request_id``, oldest first (``core.transfer_records``)."""
        return self.tracker.records.transfers(request_id)

    def slowest_requests(self, n: int = 5) -> list[RequestTransfers]:
        """The ``n`` recorded requests whose tasks spanned the longest, slowest first."""
        return self.tracker.records.slowest_requests(n)

    def unreleased_tasks(self) -> dict[str, list[int]]:
        """Failed or timed-out tasks that some rank may still act on: task id -> those ranks."""
        return self.tracker.unreleased_tasks()

    # ------------------------------------------------------------------ supervision
    def _on_beat(self) -> None:
        self.resources.beat()
        self.metrics.flush()
        self.server.pump()  # registers task connections, drains anything else sent there

    @property
    def rank_replacements(self) -> int:
        """Rank processes replaced so far (automatic restarts and ``restart_rank``); each one
        empties that rank's host swap space."""
        return self.recovery.replacements

    @property
    def supervisor_errors(self) -> int:
        """Iterations of the supervisor that raised and were survived."""
        return self._supervisor.errors

    @property
    def supervisor_loops(self) -> int:
        """The supervisor's wake-ups (it sleeps until it has something to do)."""
        return self._supervisor.loops

    def restart_rank(self, rank: int) -> None:
        """Replace rank ``rank``'s CTM (dead or alive) with a fresh one; its host swap space starts empty.
        Its pending tasks fail; the automatic restarts' count for it starts afresh."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is not in 0..{self.tp - 1}")
        self.recovery.restart(rank)

    # ------------------------------------------------------------------ RL weight updates
    def clear_caches(self, timeout: float = 60.0) -> None:
        """Drain and detach every rank, then free the device caches (``kv_cache_control``)."""
        kv_cache_control.clear_caches(self.resources, self._ranks.failures, self.tp, timeout)
        if swap_clearing({**os.environ, **self.extra_env}):  # the environment the CTMs run in
            self.core.swap_freed(list(range(self.tp)), "an RL clear")

    def sleep(self, timeout: float = 60.0) -> None:
        """FastDeploy's sleep through the service: every rank drains and lets go of the caches, then
        they are freed.  Tasks fail with ``CachesClearedError`` until ``wakeup``; P/D links to or from
        this instance stop counting bytes at once (link again after the wakeup)."""
        kv_cache_control.sleep_caches(self.resources, self._control_answers, timeout)

    def wakeup(self, timeout: float = 120.0) -> None:
        """New caches (zeroed, a new generation), attached by every rank."""
        version_file = os.path.isfile(os.path.join(self.model_id, "version.yaml"))
        kv_cache_control.wakeup_caches(self.resources, self._control_answers, timeout,
                                       reread_model_version=self.storage_backend != "none" and version_file)

    def _control_answers(self, command: str, timeout: float) -> list:
        future = self.control(command, timeout=timeout, tags=list(kv_cache_control.SLEEP_TAGS))
        return future.result(timeout=timeout + 5)

    def restore_caches(self, timeout: float = 120.0) -> None:
        """Re-create the caches and have every rank re-attach under the new model version."""
        kv_cache_control.restore_caches(self.resources, self._ranks.failures, self.tp, timeout,
                                        reread_model_version=self.storage_backend != "none")

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the CTMs, close the queue, unlink every segment.  Idempotent."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        # Every step runs even when one fails: a rank stuck in the kernel, say, must not keep the
        # other ranks running or the engine's segments and signals in /dev/shm.
        for step in (self.tracker.close,  # pending tasks fail; every block is released
                     self.metrics.close,
                     lambda: self.recovery.stop(self.stop_grace + 6.0),  # no restart from here on
                     lambda: self._supervisor.stop(5.0),
                     lambda: self._ranks.stop_all(self.stop_grace),  # bounded; logs a rank that will not die
                     self.server.close if self.server is not None else None, self.resources.close,
                     self.layerwise.close if self.layerwise is not None else None, self._remove_orphans):
            try:
                if step is not None:
                    step()
            except Exception:
                logger.exception("shutdown step %s failed; going on with the rest", getattr(step, "__qualname__", step))
        logger.info("CTM service shut down")

    def _remove_orphans(self) -> None:
        leftovers = self.platform.remove_orphans()  # what a killed CTM or an old run may have left
        if leftovers:
            logger.warning("removed %d leftover segments: %s", len(leftovers), leftovers[:5])

    # ------------------------------------------------------------------ inspection
    def busy_seconds(self) -> float:
        """Wall time during which at least one task was in flight (overlapping tasks count once)."""
        return self.tracker.busy_seconds()

    def namespace(self) -> Namespace:
        """The storage namespace the CTMs key their objects under."""
        return self.resources.namespace()

    def pids(self) -> dict[int, int]:
        return self._ranks.pids()

    @property
    def procs(self) -> Mapping[int, RankProcess]:
        """Rank -> its current CTM process (read-only; ``restart_rank`` replaces one)."""
        return self._ranks.current()

    @property
    def caches(self) -> DeviceCaches | None:
        """The engine's device caches, ``tensors[rank][kind][layer]`` (owned by ``resources``)."""
        return self.resources.caches

    @property
    def signals(self) -> Mapping[str, IPCSignal]:
        """The IPC signals by name, read-only (owned by ``resources``)."""
        return self.resources.signals

    @property
    def model_version(self) -> str:
        """The storage key prefix of the current weights (re-read on ``restore_caches`` with storage on)."""
        return self.resources.model_version
