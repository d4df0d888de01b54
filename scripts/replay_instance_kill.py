"""``--kill-instance-at K`` of ``replay_instances.py``: kill one instance, count what the pool lost, measure the recovery.

Before request K the replay counts the blocks the pool holds (a client of its own that contributes
no memory, ``global_segment_size`` 0, asks ``exists``), SIGKILLs one instance's engine process,
waits (bounded) until its CTMs are gone and the master has dropped their clients, counts again,
and checks that nothing of the instance is left (processes, /dev/shm segments).  ``recovery``
then says how the hit ratio came back after the kill.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from typing import Any, Callable, Iterator

import _common  # noqa: F401  (puts the repo on sys.path)
from ops.procs import pid_alive
from replay_workload import KINDS

log = logging.getLogger("replay.instances")

CTM_EXIT_S = 15.0        # a killed engine's CTMs notice (pidfd) and exit


@contextlib.contextmanager
def stderr_to(path: str | None) -> Iterator[None]:
    """Mooncake's client logs (glog, INFO and up) to this process's stderr, which is the replay's
    terminal: while it sets up and closes, fd 2 goes to ``path`` (the replay writes nothing then)."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PoolInspector:
    """A Mooncake client that mounts no memory (``global_segment_size`` 0): which blocks the pool holds."""

    def __init__(self, storage_options: dict, namespace: str, tp: int) -> None:
        from transfer_factory.mooncake.store import MooncakeStore

        self.namespace, self.tp = namespace, tp
        self.store = MooncakeStore(namespace="replay-inspector", rank=0, options={
            **storage_options, "global_segment_size": 0, "local_buffer_size": 1 << 20})

    def held(self, hashes: list[str], batch: int = 1024) -> set[str]:
        """The blocks whose every object (each rank's K and V) the pool holds."""
        from transfer_factory.keys import storage_key

        tags = ("k", "v")[:len(KINDS)]
        out: set[str] = set()
        for start in range(0, len(hashes), batch):
            chunk = hashes[start:start + batch]
            keys = [storage_key(self.namespace, h, r, t) for h in chunk for r in range(self.tp) for t in tags]
            found = self.store.exists(keys)
            if any(f < 0 for f in found):
                log.warning("pool inspector: %d exists queries failed", sum(f < 0 for f in found))
            per = self.tp * len(tags)
            out.update(h for j, h in enumerate(chunk) if all(f == 1 for f in found[j * per:(j + 1) * per]))
        return out

    def close(self) -> None:
        self.store.close()


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def shm_leftovers(info: dict) -> list[str]:
    """/dev/shm names an instance's engine and CTMs may leave: its platform's and its signals'."""
    port, prefix = str(info["port"]), info["segment_prefix"]
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix) or n.endswith(f".{port}"))


def _window(part: list) -> tuple[float, float]:
    blocks = sum(n for n, _, _ in part)
    if not blocks:
        return 0.0, 0.0
    return sum(n - c["miss"] for n, _, c in part) / blocks, sum(c for _, c, _ in part) / blocks


def recovery(timeline: list, at: int) -> dict:
    """Hit ratio and ceiling before and after the kill (``at``: requests served before it), in ten
    windows after it, and the requests after which a window's hit ratio is back within 2 points of
    the ceiling's share it reached before the kill."""
    before, after = timeline[:at], timeline[at:]
    (hb, cb), (ha, ca) = _window(before), _window(after)
    efficiency = hb / cb if cb else 1.0
    w = max(1, -(-len(after) // 10))
    windows, back = [], None
    for j in range(0, len(after), w):
        h, c = _window(after[j:j + w])
        windows.append({"requests_after_kill": j + len(after[j:j + w]), "hit_ratio": round(h, 4),
                        "ceiling": round(c, 4)})
        if back is None and c and h >= (efficiency - 0.02) * c:
            back = j + len(after[j:j + w])
    return {"hit_ratio_before_kill": hb, "ceiling_before_kill": cb, "hit_ratio_after_kill": ha,
            "ceiling_after_kill": ca, "recovery": windows, "recovered_after_requests": back}


def kill_instance(args: argparse.Namespace, master: Any, storage_options: dict, inspector_log: str, victim: Any,
                  written: list[str]) -> dict:
    """SIGKILL ``victim``; count the blocks of ``written`` the pool held before and holds once the
    master dropped the victim's segments.  The counting client (and its own log lines) lives only
    meanwhile; its log goes to ``inspector_log``.  ``victim`` is the replay's ``EngineInstance``;
    ``master`` the replay's own ``LocalMooncakeMaster``, or None for an outside one."""
    segments = len(master.segments()) if master is not None else None
    ttl = args.mooncake_client_ttl or 10
    pids = victim.info["ctm_pids"]
    with stderr_to(inspector_log):
        inspector = PoolInspector(storage_options, victim.info["namespace"], args.tp)
        try:
            before = inspector.held(written)
            t0 = time.monotonic()
            victim.kill()
            ctms_gone = wait_until(lambda: not any(pid_alive(p) for p in pids), CTM_EXIT_S)
            if master is not None:  # its CTMs' segments, one per rank, leave the pool
                dropped = master.wait_for_segments(segments - args.tp, ttl + 20.0)
            else:  # an outside master: its client_ttl is --mooncake-client-ttl, or Mooncake's default
                time.sleep(ttl + 2.0)
                dropped = None
            pause = time.monotonic() - t0
            after = inspector.held(sorted(before))
        finally:
            inspector.close()
    wait_until(lambda: not shm_leftovers(victim.info), 10.0)
    left = {"processes": [p for p in [victim.proc.pid, *pids] if pid_alive(p)], "segments": shm_leftovers(victim.info)}
    if not ctms_gone or left["processes"] or left["segments"]:
        log.error("instance %d left %s behind", victim.index, left)
    if dropped is False:
        log.warning("the master still lists instance %d's segments after %.0fs", victim.index, pause)
    return {"killed_instance": victim.index, "stored_blocks_at_kill": len(before),
            "lost_blocks": len(before) - len(after), "kill_pause_s": pause, "killed_leftovers": left}
