"""One engine instance of ``replay_instances.py``, in its own process (``replay_instances.py --child FD PPID``).

It runs one engine: its device caches, a ``CacheTransferService`` with its own TP CTMs (whose
Mooncake clients each mount their own segment into the pool) and a ``TieredPrefixCache``, and
serves the requests the replay sends over the inherited pipe: ``("serve", line, hashes)``,
answered once the request's storage writes are done, until ``("stop",)`` or the replay is gone
(it dies with the replay, even when the replay is SIGKILLed).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
from multiprocessing.connection import Connection

import _common
from replay_workload import Content, Served, serve_request

BUSY_EVERY = 100         # requests between two reports of an instance's busy time (a sort of every task)


def _die_with(parent: int) -> bool:
    """SIGTERM when the replay dies (even by SIGKILL); False if it is gone already."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    return os.getppid() == parent


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)


def _stats(cache, svc, busy: bool) -> dict:
    out = {**dataclasses.asdict(cache.stats), "bounce_blocks": cache.block_counts()["bounce"]}
    if busy:
        out["busy_s"] = svc.busy_seconds()
    return out


def child_main(fd: int, parent: int) -> int:
    """One engine instance: start, then serve ("serve", line, hashes) until ("stop",) or the replay is gone."""
    from engine_hooks import CacheTransferService
    from engine_hooks.prefix_cache import CapacityError, TieredPrefixCache

    if not _die_with(parent):
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C: the replay stops its instances
    signal.signal(signal.SIGTERM, _terminate)
    conn = Connection(fd)
    if not conn.poll(60.0):
        return 1
    cfg = conn.recv()
    _common.setup_logging(cfg["verbose"])
    ilog = logging.getLogger(f"replay.instance{cfg['index']}")
    svc = None
    try:
        svc = CacheTransferService(cfg["spec"], tp=cfg["tp"], num_cpu_blocks=cfg["host_blocks"],
                                   storage_backend="mooncake", storage_options=cfg["storage_options"],
                                   model_id=cfg["model_id"], max_model_len=cfg["max_model_len"],
                                   task_timeout=cfg["task_timeout"], log_dir=cfg["log_dir"], record_latencies=True)
        svc.start()
        cache = TieredPrefixCache(svc, cfg["device_blocks"], cfg["host_blocks"], write_policy=cfg["write_policy"],
                                  write_threshold=cfg["write_threshold"], task_timeout=cfg["task_timeout"])
        content = Content(svc)
        conn.send(("ready", {"pid": os.getpid(), "port": svc.port, "ctm_pids": list(svc.pids().values()),
                             "namespace": str(svc.namespace()), "segment_prefix": svc.platform.segment_prefix}))
        sent = served_n = 0
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    ilog.warning("the replay is gone: stopping")
                    return 1
                continue
            msg = conn.recv()
            if msg[0] == "serve":
                _, line, hashes = msg
                try:
                    served: Served | None = serve_request(cache, content, line, hashes, ilog)
                except CapacityError as exc:
                    ilog.warning("request on line %d skipped: %s", line, exc)
                    served = None
                cache.reap_writes(wait=True)  # its writes land before the next request goes anywhere
                served_n += 1
                lat = svc.latencies_ms
                conn.send(("served", served, _stats(cache, svc, served_n % BUSY_EVERY == 0), lat[sent:]))
                sent = len(lat)
            elif msg[0] == "stop":
                drained = cache.drain()
                conn.send(("stopped", drained, _stats(cache, svc, True), svc.latencies_ms[sent:]))
                return 0
    except (EOFError, OSError) as exc:
        ilog.warning("lost the replay's pipe (%s): stopping", exc)
        return 1
    finally:
        # The replay's death both closes our pipe and (PR_SET_PDEATHSIG) sends SIGTERM, microseconds
        # apart: a SIGTERM raised inside the shutdown would cut it short and leave the segments.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if svc is not None:
            svc.shutdown()
