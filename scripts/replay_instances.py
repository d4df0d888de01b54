"""Several engine instances over one Mooncake pool: ``replay_trace.py --instances N --storage mooncake``.

Each instance is its own process, as an engine host would be: ``python scripts/replay_instances.py
--child FD PPID`` runs one engine (its device caches, a ``CacheTransferService`` with its own TP
CTMs, whose Mooncake clients each mount their own segment into the pool, a ``TieredPrefixCache``)
and serves the requests the replay sends it over a pipe (``multiprocessing`` connection on an
inherited socket).  All instances use one model id, so they share one storage namespace and one
set of keys: a block one instance wrote is a storage hit for every other.

Routing (``--route``): ``round-robin`` over the live instances, or ``session``: a conversation stays
on one instance (its key is the request's first trace hash id, which every turn of a conversation
shares; rendezvous hashing over the live instances, so losing one moves only its conversations).

The replay is sequential: an instance answers once its request's storage writes are done and
released, so the next request finds them wherever it is routed (what requests spaced in time would
see).  Cross-instance hits are storage hits on a block another instance computed (and wrote: the
write policy writes what the engine computed).

``--kill-instance-at K``: before request K the replay counts the blocks the pool holds (a client
of its own that contributes no memory, ``global_segment_size`` 0, asks ``exists``), SIGKILLs one
instance's engine process, waits (bounded) until its CTMs are gone (they watch the engine's pid)
and the master has dropped their clients (``client_ttl`` after their last ping: their segments are
unmounted and the objects with no replica left are erased), counts again, and goes on with the
survivors.  Until the master drops them, reads of those objects fail (TRANSFER_FAIL: a miss, never
wrong bytes); afterwards they are not found.  Its /dev/shm segments are checked gone.

This module is the replay's side (arguments, the instance handles, routing, the summary); the
instance process is ``replay_instance_process.py``, the kill and its accounting
``replay_instance_kill.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import logging
import multiprocessing
import os
import subprocess
import sys
import time

import _common

_common.quiet_paddle()

from cache_manager.cache_spec import as_layout  # noqa: E402
from engine_hooks.prefix_cache import TierStats  # noqa: E402
from engine_hooks.service import default_log_dir  # noqa: E402
from replay_instance_kill import kill_instance, recovery  # noqa: E402
from replay_instance_process import child_main  # noqa: E402
from replay_workload import (ByteLedger, Request, Served, Tally, model_result, naive_block_bytes,  # noqa: E402
                             summarize)

log = logging.getLogger("replay.instances")

STARTUP_S = 240.0        # an instance's CTMs up and its caches attached
STOP_S = 60.0            # an instance drains its writes and stops its CTMs
LOCAL_MASTER_SEGMENT = 1 << 30  # each client's segment with the replay's own master, unless told


# ---------------------------------------------------------------------------- configuration
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several instances over one Mooncake pool (--storage mooncake)")
    g.add_argument("--instances", type=int, default=1, help="engine instances, each with its own CTMs and "
                   "Mooncake clients, sharing one master and one namespace (default 1)")
    g.add_argument("--route", choices=["round-robin", "session"], default="round-robin",
                   help="round-robin over live instances, or a conversation (first trace hash id) pinned to one")
    g.add_argument("--kill-instance-at", type=int, default=None, metavar="K",
                   help="SIGKILL one instance's engine (its CTMs and Mooncake clients go with it) before request K")
    g.add_argument("--kill-instance", type=int, default=0, help="which instance --kill-instance-at kills (default 0)")
    m = p.add_argument_group("Mooncake keys (the replay's own master, or override $MOONCAKE_CONFIG_PATH's)")
    m.add_argument("--mooncake-segment-size", default=None,
                   help="global_segment_size: memory each client (one per CTM rank) mounts into the pool "
                        "(default 1gb with the replay's own master)")
    m.add_argument("--mooncake-local-buffer-size", default=None, help="local_buffer_size of each client")
    m.add_argument("--mooncake-replicas", type=int, default=None,
                   help="replica_num: memory replicas of each object, on distinct segments, best effort (default 1)")
    m.add_argument("--mooncake-lease-ttl", type=int, default=None,
                   help="master --default_kv_lease_ttl in ms (the replay's own master; default 5000)")
    m.add_argument("--mooncake-client-ttl", type=int, default=None,
                   help="master --client_ttl in s: a client silent this long is dropped with its segment "
                        "(the replay's own master; Mooncake's default 10)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.instances < 1:
        parser.error(f"--instances {args.instances} must be positive")
    if args.instances > 1 and args.storage != "mooncake":
        parser.error("--instances > 1 needs --storage mooncake (the instances share one Mooncake pool)")
    if args.instances > 1 and args.metrics_port is not None:
        parser.error("--metrics-port serves one engine's metrics: not with --instances > 1")
    if args.kill_instance_at is not None:
        if args.instances < 2:
            parser.error("--kill-instance-at needs --instances 2 or more (a survivor serves on)")
        if args.kill_instance_at < 1:
            parser.error(f"--kill-instance-at {args.kill_instance_at} must be a request number (from 1)")
        if not 0 <= args.kill_instance < args.instances:
            parser.error(f"--kill-instance {args.kill_instance} must be in 0..{args.instances - 1}")
    for name in ("mooncake_replicas", "mooncake_lease_ttl", "mooncake_client_ttl"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")


def start_local_master(args: argparse.Namespace, log_dir: str):
    from scripts.local_mooncake_master import LocalMooncakeMaster

    kw = {"lease_ttl_ms": args.mooncake_lease_ttl} if args.mooncake_lease_ttl else {}
    return LocalMooncakeMaster(log_dir=log_dir, client_ttl_s=args.mooncake_client_ttl, **kw).start()


def mooncake_options(args: argparse.Namespace, master) -> dict:
    """The CTMs' storage options: the replay's own master (1 GiB segments unless told), or only the
    keys given on the command line (the rest from $MOONCAKE_CONFIG_PATH or $MOONCAKE_*)."""
    out: dict = {**master.config(), "global_segment_size": LOCAL_MASTER_SEGMENT} if master is not None else {}
    if args.mooncake_segment_size is not None:
        out["global_segment_size"] = args.mooncake_segment_size
    if args.mooncake_local_buffer_size is not None:
        out["local_buffer_size"] = args.mooncake_local_buffer_size
    if args.mooncake_replicas is not None:
        out["replica_num"] = args.mooncake_replicas
    return out


# ---------------------------------------------------------------------------- the replay's side
def engine_config(spec, tp: int, storage_options: dict, model_id: str, *, device_blocks: int, host_blocks: int = 0,
                  write_policy: str = "write_through", write_threshold: int = 2, task_timeout: float = 30.0,
                  max_model_len: int = 8192, verbose: bool = False, log_dir: str | None = None) -> dict:
    """What an instance is started with (``EngineInstance``); instances with one ``model_id`` and
    ``spec`` share their storage keys."""
    return {"spec": spec, "tp": tp, "host_blocks": host_blocks, "device_blocks": device_blocks,
            "write_policy": write_policy, "write_threshold": write_threshold, "task_timeout": task_timeout,
            "storage_options": storage_options, "model_id": model_id, "max_model_len": max_model_len,
            "verbose": verbose, "log_dir": log_dir}


class InstanceDied(RuntimeError):
    pass


class EngineInstance:
    """The replay's handle on one instance process."""

    def __init__(self, index: int, cfg: dict):
        self.index = index
        here, there = multiprocessing.Pipe()
        fd = there.fileno()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(fd), str(os.getpid())],
                                     pass_fds=(fd,), stdin=subprocess.DEVNULL, cwd=_common.REPO_ROOT)
        there.close()
        self.conn = here
        self.alive = True
        self.info: dict = {}
        self.stats: dict = {}
        self.busy_s = 0.0
        self.latencies: list[float] = []
        self.requests = self.blocks = self.hits = self.storage_hits = self.cross_hits = 0
        # each instance's CTMs log apart: their file names are per rank
        log_dir = cfg.get("log_dir") or os.path.join(default_log_dir(), f"instance{index}")
        self.conn.send({**cfg, "index": index, "log_dir": log_dir})

    def _recv(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.conn.poll(max(0.0, min(0.5, deadline - time.monotonic()))):
                    return self.conn.recv()
            except (EOFError, OSError):
                raise InstanceDied(f"instance {self.index} (pid {self.proc.pid}) closed its pipe {what}") from None
            code = self.proc.poll()
            if code is not None:
                raise InstanceDied(f"instance {self.index} (pid {self.proc.pid}) exited with {code} {what}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"instance {self.index} (pid {self.proc.pid}) did not answer {what} "
                                   f"within {timeout:.0f}s")

    def wait_ready(self, timeout: float = STARTUP_S) -> None:
        msg = self._recv(timeout, "while starting")
        self.info = msg[1]

    def serve(self, line: int, hashes: list[str], timeout: float) -> Served | None:
        try:
            self.conn.send(("serve", line, hashes))
        except OSError:
            raise InstanceDied(f"instance {self.index} (pid {self.proc.pid}) is gone") from None
        _, served, stats, latencies = self._recv(timeout, f"request on line {line}")
        self._account(stats, latencies)
        return served

    def _account(self, stats: dict, latencies: list[float]) -> None:
        self.busy_s = stats.pop("busy_s", self.busy_s)
        self.stats = stats
        self.latencies += latencies

    def kill(self) -> None:
        """SIGKILL the engine process (its CTMs exit when they see it gone) and reap it."""
        self.alive = False
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.conn.close()

    def stop(self, timeout: float = STOP_S) -> bool:
        """Drain, take the final figures, stop the CTMs; SIGKILL if it does not stop in time."""
        drained = False
        if self.alive and self.proc.poll() is None:
            try:
                self.conn.send(("stop",))
                _, drained, stats, latencies = self._recv(timeout, "while stopping")
                self._account(stats, latencies)
                self.proc.wait(timeout)
            except (InstanceDied, TimeoutError, OSError, subprocess.TimeoutExpired) as exc:
                log.warning("instance %d did not stop cleanly (%s): killing it", self.index, exc)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.alive = False
        self.conn.close()
        return drained


class Router:
    """Round-robin over the live instances, or a conversation pinned to one (rendezvous hashing)."""

    def __init__(self, n: int, policy: str):
        self.live = list(range(n))
        self.policy = policy
        self.turn = 0

    def pick(self, req: Request) -> int:
        if not self.live:
            raise RuntimeError("no engine instance left to serve")
        if self.policy == "round-robin":
            self.turn += 1
            return self.live[(self.turn - 1) % len(self.live)]
        key = f"{req.hash_ids[0] if req.hash_ids else 'line' + str(req.line)}"
        return max(self.live, key=lambda i: hashlib.blake2b(f"{key}/{i}".encode(), digest_size=8).digest())

    def drop(self, index: int) -> None:
        if index in self.live:
            self.live.remove(index)


def run(args: argparse.Namespace, spec, requests: list[Request], block_hashes: list[list[str]], source: str,
        max_model_len: int, storage_options: dict, master, log_dir: str, progress) -> dict:
    """Start the instances, replay over them (killing one if asked), stop them; the summary."""
    cfg = engine_config(spec, args.tp, storage_options, f"replay/{source}", device_blocks=args.device_blocks,
                        host_blocks=args.host_blocks, write_policy=args.write_policy,
                        write_threshold=args.write_threshold, task_timeout=args.task_timeout,
                        max_model_len=max_model_len, verbose=args.verbose)
    instances: list[EngineInstance] = []
    try:
        for i in range(args.instances):
            instances.append(EngineInstance(i, {**cfg, "log_dir": os.path.join(log_dir, f"instance{i}")}))
        for inst in instances:
            inst.wait_ready()
        print(f"{args.instances} engine instances up (pids {', '.join(str(x.proc.pid) for x in instances)}), "
              f"route {args.route}", flush=True)
        kill = functools.partial(kill_instance, args, master, storage_options,
                                 os.path.join(log_dir, "mooncake_inspector.stderr"))
        result = _replay(args, as_layout(spec), instances, kill, requests, block_hashes, progress)
        for inst in instances:
            if inst.alive and not inst.stop():
                log.warning("instance %d: storage writes or late tasks still outstanding at its end", inst.index)
        return result
    finally:
        for inst in instances:
            if inst.alive or inst.proc.poll() is None:
                inst.stop(timeout=10.0)


def _summed_stats(instances: list[EngineInstance]) -> dict:
    """The ``TierStats`` fields summed over the instances (each one's latest report)."""
    stats: dict = {}
    for inst in instances:
        for k, v in inst.stats.items():
            stats[k] = stats.get(k, 0) + v
    return {**dataclasses.asdict(TierStats()), **stats}


def _replay(args, layout, instances: list[EngineInstance], kill_one, requests, block_hashes, progress) -> dict:
    tally = Tally(requests, block_hashes, args.kv_blocks_per_hash)
    ledger = ByteLedger(args.tp * naive_block_bytes(layout)) if args.model else None
    router = Router(len(instances), args.route)
    writer: dict[str, int] = {}  # block hash -> the instance that last computed it
    cross = 0
    kill: dict = {"killed_instance": None, "lost_blocks": 0}
    died: list[int] = []
    timeout = 4 * args.task_timeout + 60.0
    t0 = time.perf_counter()
    for done, (req, hashes) in enumerate(zip(requests, block_hashes), start=1):
        if done == args.kill_instance_at:
            kill = kill_one(instances[args.kill_instance], list(writer))
            kill.update(kill_at_request=done, _kill_index=len(tally.timeline))
            router.drop(args.kill_instance)
            print(f"killed instance {args.kill_instance} before request {done}: {kill['lost_blocks']} of "
                  f"{kill['stored_blocks_at_kill']} stored blocks lost with its segments", flush=True)
        ceiling = tally.ceiling(hashes)
        while True:
            inst = instances[router.pick(req)]
            try:
                served = inst.serve(req.line, hashes, timeout)
                break
            except InstanceDied as exc:  # not one we killed: its requests go to the others
                log.error("%s; routing its requests to the others", exc)
                inst.alive = False
                router.drop(inst.index)
                died.append(inst.index)
        if ledger is not None:
            ledger.add(_summed_stats(instances))
        if served is None:
            tally.skipped += 1
            continue
        per_tier = tally.add(req, served, ceiling)
        inst.requests += 1
        inst.blocks += len(hashes)
        inst.hits += len(hashes) - per_tier["miss"]
        inst.storage_hits += per_tier["storage"]
        for h, s in zip(hashes, served.sources):
            if s == "miss":
                writer[h] = inst.index
            elif s == "storage" and writer.get(h, inst.index) != inst.index:
                cross += 1
                inst.cross_hits += 1
        progress.update(done, tally.hit_ratio())
    elapsed = time.perf_counter() - t0
    return _result(args, layout, instances, tally, cross, kill, died, elapsed, ledger)


def _result(args, layout, instances, tally: Tally, cross: int, kill: dict, died: list[int], elapsed: float,
            ledger: ByteLedger | None = None) -> dict:
    stats = _summed_stats(instances)
    latencies = [x for inst in instances for x in inst.latencies]
    block_bytes = args.tp * layout.bytes_per_block()  # every group, layer and rank
    result = summarize(tally, stats, latencies, sum(i.busy_s for i in instances), block_bytes, elapsed, args,
                       bounce_blocks=stats.get("bounce_blocks", 0), metrics_port=None)
    at = kill.pop("_kill_index", None)
    result.update({
        "instances": len(instances), "route": args.route, "cross_instance_hits": cross,
        "cross_instance_hit_ratio": cross / tally.blocks if tally.blocks else 0.0, **kill,
        "died_instances": died,
        "per_instance": [{"instance": i.index, "requests": i.requests, "blocks": i.blocks,
                          "hit_ratio": round(i.hits / i.blocks, 6) if i.blocks else 0.0,
                          "storage_hits": i.storage_hits, "cross_instance_hits": i.cross_hits,
                          "alive_at_end": i.index not in died and i.index != kill["killed_instance"]}
                         for i in instances],
    })
    if at is not None:
        result.update(recovery(tally.timeline, at))
        result["_kill_index"] = at
    if ledger is not None:  # the instances' final reports (their drained writes) count in the last request
        ledger.close(stats)
        result.update(model_result(args.model, layout, args.tp, args, ledger))
    result["_timeline"] = tally.timeline
    return result


def summary_rows(r: dict) -> list[tuple[str, str]]:
    """The summary's rows for several instances."""
    per = ", ".join(f"#{p['instance']} {p['requests']} req {p['hit_ratio']:.1%}" for p in r["per_instance"])
    rows = [("instances", f"{r['instances']} over one Mooncake pool, route {r['route']}: {per}"),
            ("cross-instance hits", f"{r['cross_instance_hits']} blocks ({r['cross_instance_hit_ratio']:.2%} of all "
                                    f"blocks) loaded from storage that another instance computed")]
    if r.get("killed_instance") is not None:
        left = r["killed_leftovers"]
        rows += [("killed instance", f"#{r['killed_instance']} before request {r['kill_at_request']}: "
                                     f"{r['lost_blocks']} of {r['stored_blocks_at_kill']} stored blocks lost with its "
                                     f"segments (master dropped them in {r['kill_pause_s']:.1f} s); left behind: "
                                     f"{len(left['processes'])} processes, {len(left['segments'])} segments"),
                 ("hit ratio before kill", f"{r['hit_ratio_before_kill']:7.2%}   (ceiling {r['ceiling_before_kill']:.2%})"),
                 ("hit ratio after kill", f"{r['hit_ratio_after_kill']:7.2%}   (ceiling {r['ceiling_after_kill']:.2%}); "
                                          + (f"back at the ceiling's share after {r['recovered_after_requests']} requests"
                                             if r["recovered_after_requests"] is not None else "not back by the end"))]
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit("replay_instances.py is started by replay_trace.py --instances N")
