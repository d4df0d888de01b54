"""FastDeploy's engine side of the cache queue, per FastDeploy version, as the tests drive our CTMs with it.

FastDeploy's source is not installable here, so what its engine does with the queue is modelled from
its code, one version at a time (``VERSIONS``; pytest's ``--fastdeploy-version`` picks one, the
README's adoption section names them):

* ``PrefixCacheSide`` is its ``PrefixCacheManager``'s side: the thread ``recv_data_transfer_result``
  that reads done signals, and the waits of a storage write (``write_back_storage_task``, reached
  from a request's finish path), a storage read and a swap.  A read takes ``tensor_parallel_size``
  signals and the shortest block list; a write takes ``tensor_parallel_size`` too on release/2.6 and
  develop after #8046 (FastDeploy #7839), the first one on develop of 2026-05.  FastDeploy waits for a
  write without a timeout; the model waits ``WAIT_S`` and reports a wait that ran out as ``None``.
* ``ControlSide`` is its ``EngineService``'s control part: a queue ``ctrl_c2e_rank{tp rank + tp x dp
  index}_{cache_queue_port}`` per rank from ``FMQ().queue(name, "consumer")`` (the README's change 6
  imports ``FMQ`` from ``engine_hooks.fastdeploy_fmq``), ``_wait_for_control_responses`` as FastDeploy
  writes it (one waiter per queue in ``asyncio.wait``, stale answers stashed in a mailbox per queue, an
  ``Exception`` naming the queue for a response whose ``error_code`` is not 200, or for a timeout),
  and ``_control_pause``/``_resume``/``_sleep``/``_wakeup`` with their fixed request ids
  (``pause_transfer``, ``resume_transfer``).  Its ``_control_wakeup`` ends with
  ``_control_resume(None)``, which raises on every version modelled (docs/fastdeploy.md): the model
  raises there too unless ``fixed_wakeup`` (the one-line fix an adopter can carry).
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine_hooks.fastdeploy_fmq import FMQ  # the README's change 6
from engine_hooks.fastdeploy_queue import EngineCacheQueue  # the README's changes 1 and 2
from tests.fastdeploy_types import FDCacheStatus, FDControlRequest, FDReadStorageTask, FDWriteStorageTask

WAIT_S = 20.0  # how long the model waits where FastDeploy waits for ever


@dataclass(frozen=True)
class FastDeployVersion:
    name: str
    write_signals_per_rank: bool  # recv_data_transfer_result waits for tensor_parallel_size write signals
    create_cache_tensor: bool  # launch_cache_manager appends --create_cache_tensor; the worker skips the caches
    changes: tuple[int, ...]  # the README's numbered changes that apply


VERSIONS = {v.name: v for v in (
    FastDeployVersion("release/2.6", True, True, (1, 2, 3, 4, 5, 6, 7)),
    FastDeployVersion("develop-2026-05", False, True, (1, 2, 3, 4, 5, 6, 7)),
    FastDeployVersion("develop-8046", True, False, (1, 2, 3, 6, 7)),
)}


class PrefixCacheSide:
    """FastDeploy's ``PrefixCacheManager`` around the queue: its receiving thread and its waits."""

    def __init__(self, queue: EngineCacheQueue, tp: int, version: FastDeployVersion):
        self.queue, self.tp, self.version = queue, tp, version
        self._lock = threading.Lock()
        self._events: dict[Any, threading.Event] = {}
        self._blocks: dict[Any, list] = {}  # task id -> the block lists received (reads; 2.6 writes)
        self.results: dict[Any, list] = {}  # task id -> the block list FastDeploy takes
        self.stray: list = []  # signals that matched nothing waiting (FastDeploy logs and drops them)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv, name="fd-recv-data-transfer-result", daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        while not self._stop.is_set():
            data = self.queue.get_transfer_done_signal()
            if data is None:
                time.sleep(0.001)
                continue
            event = data[0]
            with self._lock:
                if event.value in (FDCacheStatus.STORAGE2GPU.value, FDCacheStatus.GPU2STORAGE.value):
                    task_id, _keys, blocks = data[1:]
                    per_rank = event.value == FDCacheStatus.STORAGE2GPU.value or self.version.write_signals_per_rank
                    if not per_rank:
                        self.results.setdefault(task_id, list(blocks))
                    else:
                        got = self._blocks.setdefault(task_id, [])
                        got.append(list(blocks))
                        if len(got) == self.tp:
                            self.results[task_id] = min(got, key=len)
                    done = task_id in self.results
                else:  # a swap: (event, task_id, nodes, gpu, cpu)
                    task_id, done = data[1], True
                    self.results[task_id] = list(data[3])
                waiter = self._events.get(task_id)
                if waiter is None and done:
                    self.stray.append(data)
                elif done:
                    waiter.set()

    def _wait(self, task_id: Any, put: Any, wait: float) -> list | None:
        event = threading.Event()
        with self._lock:
            self._events[task_id] = event
        self.queue.put_transfer_task(put)
        ok = event.wait(wait)
        with self._lock:
            del self._events[task_id]
            self._blocks.pop(task_id, None)
            return self.results.pop(task_id, None) if ok else None

    def write(self, task_id: str, keys: list[str], gpu_block_ids: list[int], timeout: float = 30.0,
              wait: float = WAIT_S) -> list | None:
        """``write_back_storage_task``: the blocks stored, or None if no answer came within ``wait``."""
        task = FDWriteStorageTask(task_id=task_id, keys=keys, token_ids=None, gpu_block_ids=gpu_block_ids,
                                  timeout=timeout)
        return self._wait(task_id, (FDCacheStatus.GPU2STORAGE, task), wait)

    def read(self, task_id: str, keys: list[str], gpu_block_ids: list[int], timeout: float = 30.0,
             wait: float = WAIT_S) -> list | None:
        task = FDReadStorageTask(task_id=task_id, keys=keys, token_ids=None, gpu_block_ids=gpu_block_ids,
                                 start_read_block_idx=0, timeout=timeout)
        return self._wait(task_id, (FDCacheStatus.STORAGE2GPU, task), wait)

    def swap(self, task_id: str, event: FDCacheStatus, gpu: list[int], cpu: list[int],
             wait: float = WAIT_S) -> list | None:
        return self._wait(task_id, (event, task_id, [None] * len(gpu), gpu, cpu), wait)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class ControlSide:
    """FastDeploy's ``EngineService`` control methods over the cache transfer managers (see the module
    docstring).  ``fixed_wakeup``: the adopter carries the fix of ``_control_wakeup``."""

    def __init__(self, queue: EngineCacheQueue, tp: int, cache_queue_port: int, dp_index: int = 0,
                 fixed_wakeup: bool = False):
        self.queue, self.fixed_wakeup = queue, fixed_wakeup
        self.is_paused = False
        self._ctrl_output_queues = {}
        self._mailboxes: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        for tp_rank in range(tp):
            name = f"ctrl_c2e_rank{tp_rank + tp * dp_index}_{cache_queue_port}"
            self._ctrl_output_queues[name] = FMQ().queue(name, "consumer")

    async def _wait_for_control_responses(self, request_id: str, timeout: float) -> list:
        async def wait_one(name: str, queue: Any) -> Any:
            mailbox = self._mailboxes[name]
            cached = mailbox.pop(request_id, None)
            if cached is not None:
                return cached
            while True:
                response = (await queue.get()).payload
                if response.request_id == request_id:
                    return response
                mailbox[response.request_id] = response

        tasks = {name: asyncio.create_task(wait_one(name, q)) for name, q in self._ctrl_output_queues.items()}
        done, pending = await asyncio.wait(tasks.values(), timeout=timeout)
        if pending:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise Exception(f"Control request {request_id} timed out after {timeout}s")
        results = []
        for name, task in tasks.items():
            response = task.result()
            if response.error_code != 200:
                raise Exception(f"Error response from {name}: {response.error_message}")
            results.append(response.result)
        return results

    def _call(self, request: FDControlRequest, timeout: float) -> list:
        self.queue.put_transfer_task((FDCacheStatus.CTRL, request))
        return asyncio.run(self._wait_for_control_responses(request.request_id, timeout))

    def pause(self, timeout: float = 60.0) -> None:
        if self.is_paused:
            return
        self.is_paused = True
        self._call(FDControlRequest("pause_transfer", "pause"), timeout)

    def resume(self, timeout: float = 60.0) -> None:
        if not self.is_paused:
            return
        self.is_paused = False
        self._call(FDControlRequest("resume_transfer", "resume"), timeout)

    def sleep(self, request_id: str, tags: str = "weight,kv_cache", timeout: float = 60.0) -> list:
        self.pause(timeout)  # FastDeploy: "Implicitly pause LLM engine before sleeping"
        return self._call(FDControlRequest(request_id, "sleep", {"tags": tags}), timeout)

    def wakeup(self, request_id: str, tags: str = "weight,kv_cache", timeout: float = 300.0,
               after_dispatch: Any = None) -> list:
        """``after_dispatch()`` runs once the request is sent (the worker re-creates its caches meanwhile)."""
        self.queue.put_transfer_task((FDCacheStatus.CTRL, FDControlRequest(request_id, "wakeup", {"tags": tags})))
        if after_dispatch is not None:
            after_dispatch()
        result = asyncio.run(self._wait_for_control_responses(request_id, timeout))
        if not self.fixed_wakeup:
            raise RuntimeError("_control_resume(None) raised after the wakeup (FastDeploy's own bug; its engine "
                               "and this model stay paused)")
        self.resume(timeout)
        return result

    def update_weights(self, request_id: str, timeout: float = 60.0) -> list:
        return self._call(FDControlRequest(request_id, "update_weights"), timeout)
