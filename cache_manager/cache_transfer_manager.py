"""The CacheTransferManager process: one per tensor-parallel rank.

    python -m cache_manager.cache_transfer_manager --rank 0 --mp_num 2 --num_layers 4 \\
        --key_cache_shape 256,8,64,128 --value_cache_shape 256,8,64,128 --num_cpu_blocks 512 \\
        --cache_queue_port 8600 --engine_worker_queue_port 8700 ...

Start-up: check every flag (``ctm_flags``: a bad value exits non-zero naming the flag, before
anything is attached), wait for ``cache_ready_signal[rank]`` with a timeout, attach every layer's
device caches (extra speculative layers and fp8 scales included), allocate host swap
space, set ``swap_space_ready_signal``, join the EngineCacheQueue and set
``cache_transfer_inited_signal``.  Then serve: the ``TaskScheduler`` orders tasks that share
a block, drops those past their deadline, and runs the rest on one thread pool per kind;
each rank sends its own result.  What the rank holds (device caches, swap space, storage, model
version) is its ``RankResources``; the RL clear/restore (``rank.lifecycle``) and FastDeploy's control
requests (``rank.control``: pause, resume, sleep, wakeup, update_weights) drive those, never this
process object.

Liveness (``engine_watch``): the process exits by itself once the engine *process* is gone (its
``--engine_pid``, its parent, or the process at the queue link's other end, which is how a CTM
FastDeploy launched through a shell sees its engine die) and only then removes the segments the
engine can no longer unlink; a heartbeat that stops is
logged and nothing more, since a paused engine keeps its caches.  SIGTERM gives a clean exit.
A rank whose stream from the engine breaks for good (its local link closed, a frame lost) exits at
once with ``STREAM_BROKEN_EXIT``, its in-flight I/O cut short: alive but mute, it would only let
every task time out.  The engine declares it down and restarts it (``engine_hooks.core.rank_recovery``).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, repeat
from typing import Any

import ops
from transfer_factory import StorageConfigError

from cache_manager.queue import wire
from cache_manager.cache_data import (
    CACHE_TRANSFER_INITED_SIGNAL,
    PER_RANK_SIGNALS,
    SWAP_SPACE_READY_SIGNAL,
    WORKER_HEALTHY_LIVE_SIGNAL,
    KV_CACHE_STATUS_SIGNAL,
    CONTROL_COMMAND_PREFIX,
    CacheStatus,
)
from cache_manager.rank.peer.links import PeerLinks, peer_command
from cache_manager.rank.peer.late import STUCK_TRANSFER_EXIT
from cache_manager.rank.peer.transfers import PeerTransfers
from cache_manager.cache_tasks import (ControlTask, PullTask, PushTask, Outcome, RankResult, ReadStorageTask, SwapTask, TaskFormatError, task_deadline,
                          task_from_wire)
from cache_manager.ctm_flags import NPU_COPY_ENGINE_DEFAULT, layout_from_args, parse_args
from cache_manager.engine_watch import EngineGone, EngineWatch, remove_engine_leftovers
from cache_manager.rank.scheduler import Fail, TaskScheduler
from cache_manager.rank.lifecycle import KvCacheLifecycle
from cache_manager.rank.control import RankControl
from cache_manager.rank.logs import rank_logger
from cache_manager.queue.client import EngineCacheQueueClient
from cache_manager.queue.session import STREAM_BROKEN_EXIT
from cache_manager.queue.unix_address import ctm_queue_endpoint
from cache_manager.ipc_signal import engine_ipc_suffix
from cache_manager.layer_progress import LAYER_PROGRESS_SIGNAL
from cache_manager.rank.layerwise_copy import RankLayerBoard, publishing
from cache_manager.rank.resources import RankResources
from cache_manager.rank.signals import RankSignals
from cache_manager.rank.swaps import RankSwaps

# A swap this small takes a few microseconds of memcpy, less than handing it to a pool thread:
# the serve thread runs it (on platforms whose copies cannot stall).  Bigger swaps stay on pools,
# so the serve thread never stops polling for long.
INLINE_SWAP_MAX_BYTES = 256 << 10
# P/D transfer threads per direction: one stuck peer must not hold up transfers with others (blocks
# shared by two tasks still go in order); 4 x MAX_SLICES_IN_FLIGHT fit a Transfer Engine peer queue.
PD_THREADS = 4
IDLE_POLL_MS = 250  # an idle rank wakes this often to look at kv_cache_status and the engine
DRAIN_POLL_MS = 10  # how often a clearing rank looks whether its tasks released their blocks
# A local link that closed because the engine died is the engine's death, not a break: the engine's
# sockets close a moment before its process is seen to end, so such a break waits this long to tell.
ENGINE_EXIT_WAIT_S = 0.5


class StreamBroken(Exception):
    """The rank's stream from the engine broke for good (``EngineCacheQueueClient.broken``)."""


class CacheTransferManager:
    def __init__(self, args: argparse.Namespace, log: logging.Logger, queue_endpoint: str | None = None,
                 engine_watch: EngineWatch | None = None):
        self.args = args
        # the queue: tcp://pod_ip:cache_queue_port, or the engine's Unix socket (``unix_address``)
        self.queue_endpoint = queue_endpoint or f"tcp://{args.pod_ip}:{args.cache_queue_port}"
        self.log = log
        self.rank = args.rank
        self.layout = layout_from_args(args)
        # The engine's IPC names: port and its random token (CTM_IPC_TOKEN), or the bare port, warned
        self.ipc_suffix = engine_ipc_suffix(args.engine_worker_queue_port)
        self.instance = args.ipc_instance or self.ipc_suffix
        # --npu_copy_engine goes to a platform that has copy engines (ops.copy_engines); on one without,
        # its default is a no-op and any other value is passed on, so get_platform refuses it by name.
        engine = args.npu_copy_engine
        wanted = engine if ops.copy_engines(args.platform) or engine != NPU_COPY_ENGINE_DEFAULT else None
        self.platform = ops.get_platform(args.platform, instance=self.instance, copy_engine=wanted)
        ops.use_platform(self.platform)
        self.stop_event = threading.Event()
        self.signals = RankSignals(self.ipc_suffix)
        self.pools: dict[str, ThreadPoolExecutor] = {}
        self.queue: EngineCacheQueueClient | None = None
        self.scheduler: TaskScheduler | None = None
        self.lifecycle: KvCacheLifecycle | None = None  # RL weight updates: clear and restore the caches
        self.control: RankControl | None = None  # control tasks: FastDeploy's pause/resume/sleep/wakeup/update_weights
        self.recv_seq = 0
        self.engine_watch = engine_watch or EngineWatch(args.engine_pid, log)
        self._next_engine_check = 0.0
        self.resources = RankResources(args, self.layout, self.platform, self.signals, log, self.stop_event,
                                       self._check_engine)
        self.layer_board = RankLayerBoard(args.mp_num, self.ipc_suffix, args.rank, log)
        self.swaps = RankSwaps(self.platform, self.resources, self.layer_board, self.stop_event, args.num_cpu_blocks)
        self.peers: PeerLinks | None = None  # links to other engine instances' ranks (prefill/decode)
        self.transfers: PeerTransfers | None = None  # the pulls and pushes over them

    # -- start-up -------------------------------------------------------------
    def start(self) -> None:
        a = self.args
        self.platform.set_device(a.device_id)
        self.resources.wait_cache_ready()
        self.resources.attach()
        self.resources.alloc_swap()
        self.signals.attach(SWAP_SPACE_READY_SIGNAL, a.mp_num).value[self.rank] = 1
        self.resources.open_storage()
        self._attach_heartbeat()
        try:
            self.signals.attach(KV_CACHE_STATUS_SIGNAL, 1)
        except FileNotFoundError:
            self.log.warning("no %s signal: RL cache clearing is off", KV_CACHE_STATUS_SIGNAL)
        self.queue = EngineCacheQueueClient(self.rank, a.mp_num, wire.load_secret(), self.queue_endpoint,
                                            hello_timeout=a.attach_timeout)
        if self.queue.engine_pid is not None:  # however this CTM was launched, the engine's end is the engine
            self.engine_watch.watch_engine(self.queue.engine_pid)
        init = lambda: self.platform.set_device(a.device_id)  # noqa: E731  (device binding is per thread)
        for kind, workers in (("swap_to_cpu", a.swap_threads), ("swap_to_gpu", a.swap_threads),
                              ("read_storage", 1), ("write_storage", 1), ("control", 1), ("pd_pull", PD_THREADS),
                              ("pd_push", PD_THREADS)):
            self.pools[kind] = ThreadPoolExecutor(workers, thread_name_prefix=kind, initializer=init)
        self.scheduler = TaskScheduler(self.pools, self.rank, self.queue.send_result, self.log)
        self.signals.attach(CACHE_TRANSFER_INITED_SIGNAL, a.mp_num)
        self.lifecycle = KvCacheLifecycle(self.resources, self.scheduler, self.signals, self.queue, self.rank,
                                          self.log, self.stop_event, a.rl_barrier_timeout)
        self.peers = PeerLinks(self.rank, a.mp_num, a.splitwise_role, self.layout, self.resources, self.platform,
                               a.pod_ip, self.log)
        self.transfers = PeerTransfers(self.peers, self.resources, self.log, on_stuck=self._transfer_stuck)
        self.control = RankControl(self.resources, self.scheduler, self.signals, self.queue, self.rank, a.mp_num,
                                   a.model_path, self.log, self.stop_event,
                                   lambda command, args: peer_command(self.peers, command, args, self.rank))
        self.signals[CACHE_TRANSFER_INITED_SIGNAL].value[self.rank] = 1
        self.log.info("ready: rank %d of %d, pid %d", self.rank, a.mp_num, os.getpid())

    def _transfer_stuck(self, why: str) -> None:
        """A peer transfer's bytes may still land long past its deadline: only this process's end
        stops them.  Exit at once (no memory unregistered under them); the engine restarts the rank."""
        self.log.critical("exiting with status %d: %s; the engine restarts this rank", STUCK_TRANSFER_EXIT, why)
        logging.shutdown()
        os._exit(STUCK_TRANSFER_EXIT)

    # -- liveness ---------------------------------------------------------------
    def _attach_heartbeat(self) -> None:
        # ours holds one word; FastDeploy's engine makes it min(8, TP) words (its value[0] is the beat)
        for words in dict.fromkeys((1, min(8, self.args.mp_num), self.args.mp_num)):
            try:
                self.signals.attach(WORKER_HEALTHY_LIVE_SIGNAL, words)
                return
            except (FileNotFoundError, ValueError):
                continue
        self.log.warning("no usable %s signal: watching the engine process only", WORKER_HEALTHY_LIVE_SIGNAL)

    def _check_engine(self) -> None:
        self.engine_watch.check(self.signals.get(WORKER_HEALTHY_LIVE_SIGNAL))

    def _wait_engine_exit(self) -> None:
        """Raise ``EngineGone`` if the engine ends within ``ENGINE_EXIT_WAIT_S``."""
        deadline = time.monotonic() + ENGINE_EXIT_WAIT_S
        while not self.engine_watch.engine_exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._check_engine()

    # -- serving ----------------------------------------------------------------
    def serve(self) -> None:
        assert self.queue is not None and self.scheduler is not None and self.lifecycle is not None
        assert self.control is not None
        while not self.stop_event.is_set():
            try:
                for wire_task in self.queue.poll(self._poll_ms()):
                    self._dispatch(wire_task)
                self.scheduler.expire_waiting()
                self.lifecycle.step()
                self.control.step()
            except Exception:  # one bad iteration must not end the serve loop
                self.log.exception("serve loop iteration failed; serving on")
            if self.queue.broken is not None:
                if self.queue.link_closed:
                    self._wait_engine_exit()  # raises EngineGone if it was the engine that went
                raise StreamBroken(self.queue.broken)
            now = time.monotonic()
            if now >= self._next_engine_check:  # a busy queue must not pay a liveness check per poll
                self._next_engine_check = now + 0.2
                self._check_engine()

    def _poll_ms(self) -> int:
        if self.lifecycle.draining:
            return DRAIN_POLL_MS  # a clear waits for its tasks' releases, which come on other threads
        soonest = min((d for d in (self.scheduler.next_deadline(), self.control.next_deadline()) if d is not None),
                      default=None)
        if soonest is None:
            return IDLE_POLL_MS
        return max(1, min(IDLE_POLL_MS, int((soonest - time.monotonic()) * 1000) + 1))

    def _dispatch(self, wire_task: dict) -> None:
        seq = self.recv_seq
        self.recv_seq += 1
        task_id = wire_task.get("task_id") if isinstance(wire_task, dict) else None
        task_id = task_id if isinstance(task_id, str) else "?"
        try:
            task = task_from_wire(wire_task)
            deadline = task_deadline(wire_task, self.queue.shared_clock, time.monotonic())
            ctrl = isinstance(task, ControlTask) and task.command.startswith(CONTROL_COMMAND_PREFIX)
            refusal = None if ctrl else self.lifecycle.refusal()  # FastDeploy's control requests always run
            if refusal is not None:
                raise TaskFormatError(refusal)
        except TaskFormatError as exc:
            self._refuse(task_id, seq, str(exc))
            return
        if isinstance(task, ControlTask):  # never held by a pause (``rank.control``)
            self.control.dispatch(task, seq, deadline)
        elif self.control.paused:  # FastDeploy's pause: the task waits for the resume
            self.control.hold(lambda: self._submit(task, seq, deadline, held=True), deadline)
        else:
            self._submit(task, seq, deadline)

    def _refuse(self, task_id: str, seq: int, why: str) -> None:
        self.log.error("task %s refused: %s", task_id, why)
        self.queue.send_result(RankResult(task_id, self.rank, False, error=why, recv_seq=seq))

    def _submit(self, task: Any, seq: int, deadline: float | None, held: bool = False) -> None:
        # a task a pause held is looked at again: the caches may have gone meanwhile
        refusal = self.control.refusal() or (self.lifecycle.refusal() if held else None)
        if refusal is not None:
            self._refuse(task.task_id, seq, refusal)
            return
        submit = self.scheduler.submit
        if isinstance(task, SwapTask):
            kind = "swap_to_cpu" if task.event_type == CacheStatus.SWAP2CPU else "swap_to_gpu"
            touched = chain(zip(repeat("gpu"), task.gpu_block_ids), zip(repeat("cpu"), task.cpu_block_ids),
                            zip(("state", "cpu_state"), task.state_slots or ()))
            inline = (self.platform.copies_cannot_stall and task.layerwise is None
                      and len(task.gpu_block_ids) * self.resources.block_bytes_all_layers <= INLINE_SWAP_MAX_BYTES)
            submit(task.task_id, seq, kind, touched, deadline, lambda: self.swaps.run(task, deadline), inline=inline)
        elif isinstance(task, PullTask):
            touched = zip(repeat("cpu" if task.placement == "host" else "gpu"), task.dst_block_ids)
            submit(task.task_id, seq, "pd_pull", touched, deadline, lambda: self.transfers.pull(task, deadline),
                   drop_value=Fail(f"a pull from {task.peer}"))
        elif isinstance(task, PushTask):
            submit(task.task_id, seq, "pd_push", zip(repeat("gpu"), task.src_block_ids), deadline,
                   lambda: self._push(task, deadline), drop_value=Fail(f"a push to {task.peer}"))
        else:
            kind = "read_storage" if task.event_type == CacheStatus.STORAGE2GPU else "write_storage"
            touched = zip(repeat("gpu"), task.gpu_block_ids)
            # A storage task that cannot run in time moved 0 blocks, as one whose store is down.
            submit(task.task_id, seq, kind, touched, deadline, lambda: self._storage(task, deadline), drop_value=[])

    def _push(self, task: PushTask, deadline: float | None) -> Outcome:
        publisher = self.layer_board.publisher(task.layerwise) if task.layerwise else None
        with publishing(publisher):
            return self.transfers.push(task, deadline if deadline is not None else time.monotonic() + 30.0, publisher,
                                   self.stop_event)

    def _storage(self, task: Any, deadline: float | None) -> Outcome:
        publisher = self.layer_board.publisher(task.layerwise) if task.layerwise else None
        with publishing(publisher):
            storage = self.resources.storage
            if storage is None:
                raise ValueError("no storage backend configured (--kvcache_storage_backend none)")
            if deadline is None:
                deadline = time.monotonic() + task.timeout
            if isinstance(task, ReadStorageTask):
                outcome = storage.read(task, deadline)
                if publisher is not None:  # the blocks found, then every layer of them
                    publisher.set_blocks(len(outcome.value or []))
                    publisher.layers_done(self.resources.num_layers)
                return outcome
            if publisher is not None and task.layerwise.await_compute:
                publisher.wait_computed(self.resources.num_layers, deadline, self.stop_event)
            return storage.write(task, deadline)

    # -- shutdown ---------------------------------------------------------------
    def close(self, engine_gone: bool, stream_broken: bool = False) -> None:
        if stream_broken:
            # The engine fails this rank's tasks and restarts it: nothing here is worth waiting for,
            # and an I/O still running must stop now, which only the process's exit guarantees.
            return
        if engine_gone:
            self._remove_orphans()
            # The engine is gone: nobody waits for answers, and a storage client or a task stuck
            # in a backend call may take many seconds to wind down.  main() exits at once.
            return
        if self.lifecycle is not None:
            self.lifecycle.close()
        if self.control is not None:
            self.control.close()
        for pool in self.pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        self.resources.close_storage()
        if self.transfers is not None:
            self.transfers.close()
        if self.peers is not None:
            self.peers.close()
        if self.queue is not None:
            self.queue.flush()
            self.queue.close()  # also answers a barrier still waited at
        if self.lifecycle is not None:
            self.lifecycle.join()
        self.resources.close()
        self.signals.close()
        self.layer_board.close()

    def _remove_orphans(self) -> None:
        """The engine died without cleaning up: remove what it left (``remove_engine_leftovers``: what this
        CTM attached, by identity, and what provably dead processes created).  Attached processes never
        unlink while the engine lives."""
        names = PER_RANK_SIGNALS + (WORKER_HEALTHY_LIVE_SIGNAL, KV_CACHE_STATUS_SIGNAL, LAYER_PROGRESS_SIGNAL)
        remove_engine_leftovers([self.signals.get(name) for name in names], self.platform, self.log)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = rank_logger(args.rank, args.log_dir)
    # Made first: it notes who launched this process while that one still runs (paddle's import
    # takes seconds, and an engine may die meanwhile).
    watch = EngineWatch(args.engine_pid, log)
    try:
        wire.load_secret()
        endpoint = ctm_queue_endpoint(args.pod_ip, args.cache_queue_port)  # as FastDeploy maps the port
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    importlib.import_module("paddle")  # paddle installs fatal-error signal handlers on import: ours must come after

    ctm = CacheTransferManager(args, log, endpoint, watch)

    def install_handlers() -> None:
        signal.signal(signal.SIGTERM, lambda *_: ctm.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: ctm.stop_event.set())

    install_handlers()
    engine_gone = stream_broken = False
    code = 0
    try:
        ctm.start()
        install_handlers()  # in case attaching initialised more of paddle
        ctm.serve()
        log.info("stopping on request")
    except EngineGone as exc:
        log.warning("exiting: %s", exc)
        engine_gone = True
    except StreamBroken as exc:
        log.error("exiting with status %d: the stream from the engine broke (%s); the engine restarts this rank",
                  STREAM_BROKEN_EXIT, exc)
        stream_broken, code = True, STREAM_BROKEN_EXIT
    except StorageConfigError as exc:
        log.error("storage configuration: %s", exc)
        code = 2
    except Exception:
        log.exception("fatal error")
        code = 1
    finally:
        ctm.close(engine_gone, stream_broken)
    # Everything this process owns is released above.  Interpreter teardown can still hang for
    # many seconds in a storage client's destructor (Mooncake holds the GIL while it closes,
    # 11-19 s once its master is gone): flush the rank's log and leave now.
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
