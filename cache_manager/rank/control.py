"""Control tasks on one CTM rank: FastDeploy's control requests (``(CacheStatus.CTRL, ControlRequest)``:
pause, resume, update_weights, sleep, wakeup) and this project's own commands (``ping``, the
diagnostic ``sleep`` that holds a task in flight, the prefill/decode ``pd_*``).

FastDeploy's requests arrive as control tasks whose command is ``ctrl_<method>``.  What must follow the
order of the ranks' task stream takes effect on the serve thread, when the task is received (every
rank receives the same stream): ``pause`` holds every non-control task received after it (control
tasks still run), ``resume`` submits the held tasks in receive order, ``sleep`` refuses tasks until a
wakeup.  The rest runs on the control pool, bounded by the task's deadline:

* **pause**: waits until no task of this rank is in flight (drained), publishes FastDeploy's
  ``cache_task_is_paused`` (and ``cache_task_inflight[rank]`` whenever it changes);
* **resume**: nothing more (the held tasks were submitted on receipt); a held task whose deadline
  passes is answered as never started (the scheduler drops it), so none waits for ever;
* **sleep** (tags holding ``kv_cache``, FastDeploy's default ``weight,kv_cache``): drains, then lets go
  of the engine's caches as the RL clear does (``lifecycle.detach_rank``: storage closed, swap space
  freed under ``FD_ENABLE_SWAP_SPACE_CLEARING``, caches detached, ``cache_ready[rank] = 0``);
* **wakeup**: waits for the engine's ``cache_ready[rank] = 1`` (its NEW caches), attaches them, re-reads
  the storage key prefix from ``<model_path>/version.yaml`` if there is one, re-opens storage; a rank
  that never let go of its caches (its sleep failed) refuses, never serving the old segments.  A
  wakeup that succeeded on every rank also ends the pause (FastDeploy's sleep pauses and its wakeup
  means to resume, but its ``_control_wakeup`` can fail before it sends the resume): the held tasks
  are submitted, in receive order, unless a pause was received after the wakeup;
* **update_weights** (the rank paused or asleep, as FastDeploy's engine requires): the storage key
  prefix from ``version.yaml``, so keys stored under the old weights never hit again.

Then every rank arrives at the task's barrier (``ctrl/<task id>``, a timeout short of the deadline):
one that failed its part still arrives and then answers its error; one whose barrier timed out answers
an error naming the ranks that never came.  The engine's answer names the failing, silent or dead ranks.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from cache_manager.cache_data import (CACHE_READY_SIGNAL, CACHE_TASK_INFLIGHT_SIGNAL, CACHE_TASK_IS_PAUSED_SIGNAL,
                                      CONTROL_COMMAND_PREFIX, CONTROL_METHODS, DEFAULT_SLEEP_TAGS, KV_CACHE_TAG)
from cache_manager.cache_tasks import ControlTask
from cache_manager.rank.lifecycle import detach_rank, reattach_rank
from cache_manager.rank.lockstep import BarrierQueue
from cache_manager.rank.resources import RankResources
from cache_manager.rank.scheduler import TaskScheduler
from cache_manager.rank.signals import RankSignals

CONTROL_POOL = "control"
NO_DEADLINE_S = 60.0  # a control task sent without a budget gets this long
POLL_S = 0.01  # how often a drain or a wakeup looks again
# A rank answers this much before the engine's deadline (at most ANSWER_MARGIN_S, at most a fifth of
# the budget), so the engine gets the rank's own reason, not a timeout that hides it.
ANSWER_MARGIN_S = 1.0
MAX_DIAGNOSTIC_SLEEP_S = 60.0

PeerCommand = Callable[[str, dict], Any]  # (pd_* command, args) -> this rank's answer


class RankControl:
    def __init__(self, resources: RankResources, scheduler: TaskScheduler, signals: RankSignals, queue: BarrierQueue,
                 rank: int, num_ranks: int, model_path: str, log: logging.Logger, stop_event: threading.Event,
                 peer_command: PeerCommand):
        self._resources = resources
        self._scheduler = scheduler
        self._signals = signals
        self._queue = queue
        self._rank = rank
        self._model_path = model_path  # where FastDeploy's version.yaml is
        self._log = log
        self._stop_event = stop_event
        self._peer_command = peer_command
        self.paused = False  # serve thread only: holding non-control tasks
        self._held: deque[tuple[float | None, Callable[[], None]]] = deque()  # (deadline, submit), receive order
        # asleep is set on the serve thread (at a sleep's receipt) and cleared on the control pool (a wakeup)
        self._lock = threading.Lock()
        self.asleep = False  # refusing tasks: a sleep was received and no wakeup ended it
        self.detached = False  # a sleep let go of the caches
        self._paused_signal = self._attach(CACHE_TASK_IS_PAUSED_SIGNAL, 1)
        self._inflight_signal = self._attach(CACHE_TASK_INFLIGHT_SIGNAL, num_ranks)
        self._inflight_published: int | None = None
        self._pauses = 0  # serve thread: pauses received; a wakeup resumes only if none came after it
        self._resume_after: int | None = None  # set by a wakeup that succeeded: the pause count at its receipt

    def _attach(self, name: str, words: int) -> Any:
        try:
            return self._signals.attach(name, words)
        except (FileNotFoundError, ValueError):  # only FastDeploy's PrefixCacheManager creates them
            self._log.info("no %s signal of %d words: not published", name, words)
            return None

    # ------------------------------------------------------------------ serve thread
    def dispatch(self, task: ControlTask, seq: int, deadline: float | None) -> None:
        """Take effect on receipt where the task stream's order matters, then queue the body on the
        control pool (control tasks are never held)."""
        command = task.command
        if not command.startswith(CONTROL_COMMAND_PREFIX):
            self._scheduler.submit(task.task_id, seq, CONTROL_POOL, (), deadline, lambda: self._command(task))
            return
        method = command[len(CONTROL_COMMAND_PREFIX):]
        pauses = self._pauses
        if method == "pause":
            self._pauses += 1
            self._set_paused(True)
        elif method == "resume":
            self._set_paused(False)
        elif method == "sleep" and _kv_tag(task.args):
            with self._lock:
                self.asleep = True  # tasks received from now on are refused (held, while paused)
        start = time.monotonic()
        end = deadline if deadline is not None else start + NO_DEADLINE_S
        until = end - min(ANSWER_MARGIN_S, max(0.0, end - start) / 5)
        self._scheduler.submit(task.task_id, seq, CONTROL_POOL, (), deadline,
                               lambda: self._run(task, method, until, pauses))

    def hold(self, submit: Callable[[], None], deadline: float | None) -> None:
        """Keep a non-control task received while ``paused``: ``submit`` runs at the resume, or at its
        deadline (then the scheduler answers it as never started)."""
        self._held.append((deadline, submit))

    def refusal(self) -> str | None:
        """Why a non-control task cannot run now (the caches are let go), or None."""
        if self.asleep:
            return (f"kv caches of rank {self._rank} are released (FastDeploy sleep); a wakeup control request "
                    f"re-attaches them")
        return None

    def step(self) -> None:
        """Every serve-loop iteration: submit held tasks whose deadline passed (the scheduler answers
        them as never started), end the pause a wakeup ended, and publish ``cache_task_inflight[rank]``."""
        resume_after = None
        if self._resume_after is not None:
            with self._lock:
                resume_after, self._resume_after = self._resume_after, None
        if resume_after is not None and self.paused and resume_after == self._pauses:
            self._log.info("wakeup done on every rank: ending the pause its sleep began")
            self._set_paused(False)
        if self._held:
            now = time.monotonic()
            kept: deque = deque()
            expired = []
            for held in self._held:
                (expired if held[0] is not None and held[0] <= now else kept).append(held)
            if expired:
                self._held = kept
                for _, submit in expired:
                    submit()
        if self._inflight_signal is not None:
            busy = 1 if self._held or self._scheduler.active(excluding=(CONTROL_POOL,)) else 0
            if busy != self._inflight_published:
                self._inflight_signal.value[self._rank] = busy
                self._inflight_published = busy

    def next_deadline(self) -> float | None:
        """The soonest deadline of a held task (the serve loop wakes for it), or None."""
        return min((d for d, _ in self._held if d is not None), default=None)

    def close(self) -> None:
        if self._held:
            self._log.warning("stopping with %d task(s) held by a pause: never run (the engine's deadlines answer "
                              "them)", len(self._held))
            self._held.clear()

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        if self._paused_signal is not None:
            self._paused_signal.value[0] = int(paused)
        if not paused:
            held, self._held = self._held, deque()
            if held:
                self._log.info("resume: submitting %d task(s) held by the pause, in receive order", len(held))
            for _, submit in held:
                submit()

    # ------------------------------------------------------------------ control pool
    def _command(self, task: ControlTask) -> Any:
        if task.command == "ping":
            return {"pid": os.getpid(), "rank": self._rank}
        if task.command == "sleep":  # holds a task in flight (tests, diagnostics); optionally on one rank
            if task.args.get("rank", self._rank) == self._rank:
                self._stop_event.wait(min(float(task.args.get("seconds", 0)), MAX_DIAGNOSTIC_SLEEP_S))
            return None
        if task.command.startswith("pd_"):
            return self._peer_command(task.command, task.args)
        raise ValueError(f"unknown control command {task.command!r}")

    def _run(self, task: ControlTask, method: str, until: float, pauses: int = 0) -> dict:
        """This rank's part of ``method``, then the ranks' barrier; raises naming what failed."""
        error: Exception | None = None
        value: dict = {}
        try:
            if method not in CONTROL_METHODS:
                raise ValueError(f"unknown control method {method!r} (known: {', '.join(CONTROL_METHODS)})")
            value = getattr(self, f"_{method}")(task.args, until)
            value["rank"] = self._rank
        except Exception as exc:  # answered after the barrier, so the other ranks do not wait for this one
            error = exc
        name = f"ctrl/{task.task_id}"
        wait = max(0.0, until - time.monotonic())
        answer = self._queue.arrive(name, 0 if error else 1, wait)
        if error is not None:
            raise error
        if not answer.ok:
            if answer.missing:
                raise TimeoutError(f"{method}: rank(s) {answer.missing} did not reach the ranks' barrier within "
                                   f"{wait:.2f}s")
            raise RuntimeError(f"{method}: the ranks' barrier {name} failed before rank {self._rank} arrived")
        self._log.info("control %s (%s) done on every rank", method, task.task_id)
        if method == "wakeup" and _kv_tag(task.args):
            with self._lock:
                self._resume_after = pauses  # the serve thread resumes (``step``)
        return value

    def _pause(self, args: dict, until: float) -> dict:
        self._drain(until, "pause")
        return {"paused": True}

    def _resume(self, args: dict, until: float) -> dict:
        return {"paused": False}

    def _sleep(self, args: dict, until: float) -> dict:
        if not _kv_tag(args):
            return {"kv_cache": "kept"}
        with self._lock:
            if self.detached:
                return {"kv_cache": "released"}
        self._drain(until, "sleep")  # no I/O may touch a block the engine is about to free
        swap_freed = detach_rank(self._resources, self._signals, self._rank)
        with self._lock:
            self.detached = True
        self._log.info("[sleep] rank %d let go of its caches%s", self._rank, ", swap space freed" if swap_freed else "")
        return {"kv_cache": "released", "swap_freed": swap_freed}

    def _wakeup(self, args: dict, until: float) -> dict:
        if not _kv_tag(args):
            return {"kv_cache": "kept"}
        with self._lock:
            asleep, detached = self.asleep, self.detached
        if not asleep:
            return {"kv_cache": "attached"}  # no sleep to end (a rank restarted since attached at its start)
        if not detached:
            raise RuntimeError(f"rank {self._rank} never let go of its caches (its sleep failed), so it cannot "
                               f"attach new ones: sleep again once its tasks are done, or restart the rank")
        self._wait_cache_ready(until)
        reread = self._version_file_present()
        reattach_rank(self._resources, self._signals, self._rank, reread_version=reread)
        with self._lock:
            self.asleep = self.detached = False
        self._log.info("[wakeup] rank %d attached the new caches (storage namespace %s)", self._rank,
                       self._resources.namespace())
        return {"kv_cache": "attached", "version": self._resources.model_version}

    def _update_weights(self, args: dict, until: float) -> dict:
        with self._lock:
            asleep = self.asleep
        if not (self.paused or asleep):
            raise RuntimeError("update_weights needs the cache transfer paused (a pause control request) or asleep")
        resources = self._resources
        if asleep:  # storage is closed: the wakeup opens it under the new prefix
            resources.reload_model_version()
        else:
            self._drain(until, "update_weights")
            resources.reload_model_version()  # raises, changing nothing, when version.yaml cannot be read
            resources.close_storage()
            resources.open_storage()
        self._log.info("[update_weights] rank %d: storage key prefix %r", self._rank, resources.model_version)
        return {"version": resources.model_version}

    # ------------------------------------------------------------------ helpers
    def _drain(self, until: float, what: str) -> None:
        while True:
            busy = self._scheduler.active(excluding=(CONTROL_POOL,))
            if not busy:
                return
            if time.monotonic() >= until:
                raise TimeoutError(f"{what}: {busy} task(s) still in flight on rank {self._rank}")
            if self._stop_event.wait(POLL_S):
                raise RuntimeError(f"{what}: rank {self._rank} is stopping")

    def _wait_cache_ready(self, until: float) -> None:
        sig = self._signals.get(CACHE_READY_SIGNAL)
        while sig is None or int(sig.value[self._rank]) != 1:
            if time.monotonic() >= until:
                raise TimeoutError(f"wakeup: cache_ready_signal[{self._rank}] was not set: the engine has not "
                                   f"created rank {self._rank}'s new caches")
            if self._stop_event.wait(POLL_S):
                raise RuntimeError(f"wakeup: rank {self._rank} is stopping")
            sig = sig or self._signals.get(CACHE_READY_SIGNAL)

    def _version_file_present(self) -> bool:
        return bool(self._model_path) and os.path.isfile(os.path.join(self._model_path, "version.yaml"))


def _kv_tag(args: dict) -> bool:
    """Whether a sleep/wakeup concerns the KV caches: its ``tags`` (a list, or FastDeploy's comma-separated
    string; FastDeploy's default ``weight,kv_cache`` when absent) hold ``kv_cache``."""
    tags = args.get("tags")
    if tags is None:
        tags = list(DEFAULT_SLEEP_TAGS)
    elif isinstance(tags, str):
        tags = [t.strip() for t in tags.split(",")]
    return isinstance(tags, list) and KV_CACHE_TAG in tags
