"""MooncakeStore: the KVCacheStorage backend over Mooncake's distributed store (DESIGN §2, §3.7, §6).

Host-staged: the CTM registers its staging buffers (``register_buffer``) and every batch call
passes raw pointers into them (``batch_get_into`` / ``batch_put_from`` and their
``_multi_buffers`` forms, one object gathered from / scattered to several buffers).  Keys are
used as given; the caller builds namespaced keys (``transfer_factory.keys``).

Configuration: see ``mooncake_config.py`` (``options``, else the JSON file at
``MOONCAKE_CONFIG_PATH``, else ``MOONCAKE_*`` variables; tuning keys ``rpc_timeout_ms``,
``rpc_connect_timeout_ms``, ``setup_retries``, ``probe_timeout``, ``retry_interval``,
``reconnect_after``, ``close_timeout``, ``segment_prefault``, ``replica_num``,
``io_thread_nice``).  A master that does not answer, or a failed ``setup``, raises
``MooncakeConnectionError`` (both a ``StorageConfigError`` and a ``ConnectionError``) naming
the master address.

Each store contributes ``global_segment_size`` bytes of this process's memory to the pool; the
master places objects in any mounted segment, and those in this one are gone when this client
closes (see ``reconnect`` and ``close``).

Binds: the client listens on two ports (the P2P handshake, and the TCP transport's data port,
which serves reads and writes of this process's registered memory).  Mooncake 0.3.13 binds both
to every interface whatever ``local_hostname`` says; when ``local_hostname`` is a loopback
address (the default, 127.0.0.1) this store keeps them on loopback (``mooncake_loopback.py``
says how).  Any other ``local_hostname`` is a multi-host setup: Mooncake binds as it always does.
The ``MC_*`` variables below are set only while ``setup`` runs, so child processes (CTMs
started by this process) do not inherit one store's values.

What Mooncake 0.3.13 does when the master fails (measured on loopback, TCP protocol)
-----------------------------------------------------------------------------------------
* ``setup`` with no master: the client retries 20 times (``MC_STORE_CLIENT_SETUP_RETRIES``),
  ~4.4 s each: -1 after ~90 s.  So the store first tries a TCP connect to the master
  (``probe_timeout``; refused at once on a live host) and sets ``MC_STORE_CLIENT_SETUP_RETRIES``
  (``setup_retries``): no master -> ``MooncakeConnectionError`` in ~1 ms.
* Master killed (SIGKILL): the first call on the broken connection returns ``RPC_FAIL`` (-900)
  at once; every later call blocks ~4.3-4.5 s (the RPC client reconnecting; not shortened by
  ``MC_RPC_CONNECT_TIMEOUT_MS``) and returns -900.  ``health_check()`` turns 2 only after 3
  missed heartbeats (~10 s).  Batch calls release the GIL.
* Master hung (SIGSTOP): every call blocks for the RPC timeout, 30 s by default
  (``MC_RPC_TIMEOUT_MS``), and returns -901 (``RPC_TIMEOUT``).  The client reads
  ``MC_RPC_TIMEOUT_MS`` / ``MC_RPC_CONNECT_TIMEOUT_MS`` at ``setup``; the store sets them from
  ``rpc_timeout_ms`` / ``rpc_connect_timeout_ms`` unless the user's environment has them.  A
  client-side metadata cache may still answer ``batch_is_exist`` for recently used keys.
* Master restarted on the same address (empty: a master keeps its metadata in memory): the
  same client recovers by itself.  Its heartbeat reconnects and remounts its segment within
  ~0.3-2 s; until then reads find nothing and writes fail with ``NO_AVAILABLE_HANDLE`` (-200,
  no segment mounted).  No re-``setup`` was needed in any run.
* ``close()`` holds the GIL (every Python thread stops) for ~2 s, 11-19 s when the master is
  gone (its heartbeat thread is stuck reconnecting); an unclosed client's destructor, or the
  library's teardown at interpreter exit, blocks as long (a process with a client whose master
  was killed took 19-23 s to exit).  ``setup`` holds the GIL too: ~4 s against a stopped master
  with a 2 s RPC timeout and 2 retries.  Any call on a closed client segfaults.
* A stopped (SIGSTOP) master's kernel still accepts TCP connections; a running master closes
  at once a connection that sends a bad header, a stopped one leaves it unanswered.
* Reads hold a lease (``--default_kv_lease_ttl``): a lease shorter than one batch's transfer
  fails reads with -707 (``LEASE_EXPIRED``; seen with 200 ms and 256 MiB per batch across
  processes), and ``remove`` returns -706 while a lease is held.  A full segment answers writes
  with -200 until the master evicts objects whose lease has passed.
* Mooncake's -900/-901 collide with this package's CORRUPT/UNAVAILABLE, so codes are mapped.
* Raw throughput, 256 objects x 1 MiB, one batch: client and segment in one process ~12 GiB/s
  put and get (memcpy 13.7 GiB/s); segment in another process over loopback TCP ~2.1-2.2 GiB/s;
  the same objects gathered from / scattered to 8 buffers of 128 KiB: ~9.5/6.7 GiB/s in one
  process, ~1.7-1.8 GiB/s across processes.

How this store stays bounded and recovers
-----------------------------------------
* Circuit breaker: a batch that fails at the RPC level (-9xx) or raises marks the store
  *down*.  While down, calls return ``UNAVAILABLE`` at once without touching the client,
  except that at most once per ``retry_interval`` one caller first probes the master with a
  TCP connect (``probe_timeout``); only if it answers does that caller's batch go through,
  and its result decides whether the store is up again.  So while the master is dead every
  call returns in about a millisecond (at most ``probe_timeout``); while it hangs, at most one
  call per ``retry_interval`` waits for the RPC timeout (5 s by default, plus up to ~2 s
  when a reconnect's ``close`` holds the GIL meanwhile).  Calls already in flight when the
  master dies return on their own (first -900 at once, otherwise ~4.5 s or the RPC timeout).
* Reconnect: if the master has answered probes for ``reconnect_after`` seconds and batches
  still fail at the RPC level, a background thread builds a new client (``setup``, every
  buffer registered again), swaps it in, waits (bounded) for calls still on the old one and
  closes it; an old client whose calls do not finish is left open rather than risking a
  segfault.  ``reconnect()`` does the same synchronously.  Objects held in the old client's
  segment are gone with it.
* Nothing that holds the GIL while it waits on the master runs against a master that does not
  answer a liveness probe (connect, send a bad header, expect the connection closed within
  ``probe_timeout``): a reconnect's ``setup`` is not tried, and a client is parked (kept
  referenced, never closed) instead of closed.  So a stopped master never freezes the CTM's
  other threads (swaps, the queue, the engine watch) for seconds.
* ``close()`` is idempotent: it waits (bounded by ``close_timeout``) for calls in flight,
  unregisters the buffers (unless the master is down), closes the client (~2 s, every thread
  stopped); when the master does not answer the probe the client is parked instead, and the
  process should leave with ``os._exit`` (its teardown would block 10-20 s).  Afterwards batch
  calls return ``UNAVAILABLE``.  A CTM whose engine died skips ``close`` and ``os._exit``s.

Result codes: get -> bytes read (> 0), ``NOT_FOUND`` (-704), ``BUFFER_TOO_SMALL`` (-600);
set -> 0 (also for an existing key); exists -> 1/0.  Mooncake's ``NO_AVAILABLE_HANDLE`` ->
``NO_SPACE``, ``CHECKSUM_MISMATCH`` -> ``CORRUPT``, RPC and transfer failures and -1 ->
``UNAVAILABLE``; -600 on a write -> ``INVALID``; other Mooncake codes (-703 replica not
ready, -706 object has a lease, -707 lease expired, ...) pass through unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from transfer_factory.kvcache_storage import (BUFFER_TOO_SMALL, CORRUPT, INVALID, NO_SPACE, NOT_FOUND, UNAVAILABLE,
                              KVCacheStorage, StorageAccess, StorageConfigError, check_batch)
from transfer_factory.mooncake.config import (CONFIG_PATH_ENV, DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE,
                              DEFAULT_METADATA_SERVER, PROTOCOLS, MooncakeConfig, load_mooncake_config, parse_size)
from transfer_factory.mooncake.loopback import loopback_address, loopback_binds
from transfer_factory.mooncake.prefault import anonymous_ranges, new_anonymous_ranges, prefault

__all__ = ["MooncakeStore", "MooncakeConnectionError", "MooncakeConfig", "load_mooncake_config", "parse_size",
           "CONFIG_PATH_ENV", "PROTOCOLS", "DEFAULT_METADATA_SERVER", "DEFAULT_GLOBAL_SEGMENT_SIZE",
           "DEFAULT_LOCAL_BUFFER_SIZE"]

log = logging.getLogger(__name__)

# Mooncake client settings read from the environment at setup, and the tuning key for each.
_CLIENT_ENV = {"MC_RPC_TIMEOUT_MS": "rpc_timeout_ms", "MC_RPC_CONNECT_TIMEOUT_MS": "rpc_connect_timeout_ms",
               "MC_STORE_CLIENT_SETUP_RETRIES": "setup_retries"}
_env_lock = threading.Lock()            # one setup at a time changes the process environment

# Mooncake ErrorCode values this module treats specially.
MC_NO_AVAILABLE_HANDLE = -200
MC_INVALID_PARAMS = -600
MC_OBJECT_NOT_FOUND = -704
MC_OBJECT_ALREADY_EXISTS = -705
MC_TRANSFER_FAIL = -800
MC_CHECKSUM_MISMATCH = -801
MC_INTERNAL_ERROR = -1


# Not a coro_rpc header (bad magic): a master whose I/O threads run closes the connection at once;
# a stopped or hung one leaves it unanswered while its kernel still accepts connections.
_LIVENESS_PROBE = b"\0" * 64
# Clients whose close() was skipped because the master did not answer: kept referenced so that no
# destructor runs (it would hold the GIL as long as close() does).  See MooncakeStore.close.
_PARKED: list[Any] = []


def _is_rpc_failure(code: int) -> bool:
    """RPC_FAIL (-900), RPC_TIMEOUT (-901) and the rest of Mooncake's RPC range."""
    return -999 <= code <= -900


class MooncakeConnectionError(StorageConfigError, ConnectionError):
    """The master (or the metadata service) did not answer, or ``setup`` failed."""


class _Client:
    """One MooncakeDistributedStore and the number of calls in flight on it."""
    __slots__ = ("store", "inflight", "generation")

    def __init__(self, store: Any, generation: int) -> None:
        self.store = store
        self.inflight = 0
        self.generation = generation


class MooncakeStore(KVCacheStorage):
    name = "mooncake"
    access = StorageAccess.HOST_STAGED
    supports_multi_buffer = True

    def __init__(self, *, namespace: str = "", rank: int = 0, options: Mapping[str, Any] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.namespace = str(namespace)
        self.rank = int(rank)
        self.config, tuning = load_mooncake_config(options, environ)
        self.rpc_timeout_ms = int(tuning["rpc_timeout_ms"])
        self.rpc_connect_timeout_ms = int(tuning["rpc_connect_timeout_ms"])
        self.setup_retries = int(tuning["setup_retries"])
        self.probe_timeout = float(tuning["probe_timeout"])
        self.retry_interval = float(tuning["retry_interval"])
        self.reconnect_after = float(tuning["reconnect_after"])
        self.close_timeout = float(tuning["close_timeout"])
        self.segment_prefault = str(tuning["segment_prefault"])
        # Mooncake 0.3.13's batch calls wait for their transfers by polling (the wheel is built
        # without USE_EVENT_DRIVEN_COMPLETION: a loop on clock_gettime and the tasks' status), so
        # the calling thread keeps a core busy for the whole transfer.  A storage mover runs its
        # I/O threads at this nice value, so the spinning yields to the threads moving the bytes.
        self.io_nice = int(tuning["io_thread_nice"])
        self.replica_num = int(tuning["replica_num"])  # memory replicas of each put object
        self.prefaulted: list[tuple[int, int]] = []   # the ranges the last setup faulted in
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageConfigError(
                "storage backend 'mooncake' needs the Mooncake SDK: pip install mooncake-transfer-engine "
                f"(mooncake-transfer-engine-non-cuda on CPU hosts): {e}") from None
        self._factory: Callable[[], Any] = MooncakeDistributedStore

        self._lock = threading.Condition(threading.Lock())
        self._closed = False
        self._buffers: dict[int, int] = {}          # ptr -> size, every range registered
        self._other_keys: set[str] = set()          # written keys outside this rank's namespace pattern
        self._key_re = (re.compile(rf"^{re.escape(self.namespace)}/[^/]+/{self.rank}/") if self.namespace else None)
        self._down = False
        self._down_since = 0.0
        self._reachable_since: float | None = None   # while down: when the master began answering probes
        self._next_probe = 0.0
        self._next_reconnect = 0.0
        self._reconnect_thread: threading.Thread | None = None
        self._generation = 0
        self._gen_lock = threading.Lock()
        self.stats = {"calls": 0, "fast_failed": 0, "failed_batches": 0, "probes": 0, "reconnects": 0,
                      "reconnect_failures": 0}
        self._client: _Client | None = self._new_client()
        log.info("mooncake store rank %d connected to master %s (metadata %s, protocol %s, config from %s)",
                 self.rank, self.config.master_server_addr, self.config.metadata_server, self.config.protocol,
                 self.config.source)

    # ---- connection ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _client_env(self) -> Iterator[None]:
        """Mooncake reads these at setup: set for its duration only, so neither a later store nor
        a child process (a CTM started by this process) inherits this store's values.  A value
        the user put in the environment wins."""
        with _env_lock:
            added = [env for env in _CLIENT_ENV if env not in os.environ]
            for env in added:
                os.environ[env] = str(getattr(self, _CLIENT_ENV[env]))
            try:
                yield
            finally:
                for env in added:
                    os.environ.pop(env, None)

    def _master_answers(self) -> tuple[bool, str]:
        hp = self.config.master_host_port()
        if hp is None:
            return True, ""
        try:
            with socket.create_connection(hp, timeout=self.probe_timeout):
                return True, ""
        except OSError as e:
            return False, str(e) or type(e).__name__

    def _master_alive(self) -> tuple[bool, str]:
        """Whether the master's process serves, not only whether its kernel accepts connections (a
        SIGSTOPped master does).  Asked before what holds the GIL for as long as the master takes
        to answer (``setup``, ``close``), so a hung master never freezes every thread here."""
        hp = self.config.master_host_port()
        if hp is None:
            return True, ""
        try:
            conn = socket.create_connection(hp, timeout=self.probe_timeout)
        except OSError as e:
            return False, str(e) or type(e).__name__
        with conn:
            try:
                conn.sendall(_LIVENESS_PROBE)
                conn.recv(1)            # EOF (or any answer): its I/O threads run
            except ConnectionResetError:
                pass                    # so does a reset
            except OSError as e:
                return False, f"connected but no answer within {self.probe_timeout:g}s ({e or type(e).__name__})"
        return True, ""

    def _new_client(self, check: Callable[[], tuple[bool, str]] | None = None) -> _Client:
        """A set-up client (buffers not yet registered); MooncakeConnectionError when that fails."""
        cfg = self.config
        ok, why = (check or self._master_answers)()
        if not ok:
            raise MooncakeConnectionError(f"Mooncake master {cfg.master_server_addr} is not reachable ({why}); "
                                          f"config from {cfg.source}")
        start = time.monotonic()
        try:
            store = self._factory()
        except Exception as e:
            raise MooncakeConnectionError(f"Mooncake client for master {cfg.master_server_addr} could not be "
                                          f"created: {type(e).__name__}: {e}") from None
        maps_before = anonymous_ranges() if self.segment_prefault != "off" and cfg.global_segment_size else []
        try:
            # Every listener of the client is created inside setup; for a loopback local_hostname
            # they are kept on loopback (Mooncake itself binds them to all interfaces).
            host = loopback_address(cfg.local_hostname)
            with self._client_env(), loopback_binds(host) if host else contextlib.nullcontext():
                rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size,
                                 cfg.local_buffer_size, cfg.protocol, cfg.rdma_devices, cfg.master_server_addr)
        except Exception as e:  # pybind raises on argument or transport errors
            rc, detail = None, f"{type(e).__name__}: {e}"
        else:
            detail = f"rc {rc}"
        if rc != 0:
            try:
                store.close()
            except Exception:
                pass
            raise MooncakeConnectionError(
                f"Mooncake setup failed ({detail}) after {time.monotonic() - start:.1f}s: master "
                f"{cfg.master_server_addr}, metadata {cfg.metadata_server}, protocol {cfg.protocol}, "
                f"local_hostname {cfg.local_hostname}; config from {cfg.source}")
        if maps_before:
            self._prefault_segment(maps_before)
        with self._gen_lock:
            self._generation += 1
            return _Client(store, self._generation)

    def _prefault_segment(self, maps_before: list[tuple[int, int]]) -> None:
        """Fault in the segment ``setup`` just mounted (``mooncake_prefault.py``): otherwise every
        first write of one of its pages, a peer's put included, takes a page fault here."""
        size = self.config.global_segment_size
        ranges = new_anonymous_ranges(maps_before, anonymous_ranges(), size)
        if not ranges:
            log.info("mooncake store rank %d: no new mapping of %d bytes after setup; segment not prefaulted",
                     self.rank, size)
            return
        done = prefault(ranges, self.segment_prefault)
        self.prefaulted = ranges
        log.info("mooncake store rank %d: prefaulted %d MiB of segment memory in %.2fs (%s%s)", self.rank,
                 done["bytes"] >> 20, done["seconds"], self.segment_prefault,
                 "" if done["hugepage"] or self.segment_prefault != "hugepage" else ", huge pages refused")

    def reconnect(self) -> bool:
        """Replace the client now: set up a new one, register every buffer, retire the old one.
        Returns whether it worked (the old client stays in place when it did not).  Nothing is
        tried while the master does not answer: setup would hold the GIL meanwhile."""
        try:
            new = self._new_client(check=self._master_alive)
        except MooncakeConnectionError as e:
            log.warning("mooncake store rank %d: reconnect failed: %s", self.rank, e)
            with self._lock:
                self.stats["reconnect_failures"] += 1
            return False
        with self._lock:
            done = dict(self._buffers)
        self._register_all(new, done)
        with self._lock:
            if self._closed:
                old = None
            else:
                # buffers registered meanwhile (rare; registering is quick on a fresh client)
                self._register_all(new, {p: s for p, s in self._buffers.items() if p not in done})
                old, self._client = self._client, new
                self._next_probe = 0.0          # let the next call try the new client at once
                self.stats["reconnects"] += 1
        if old is None:                          # closed meanwhile
            self._close_client(new, unregister=False)
            return False
        log.warning("mooncake store rank %d: reconnected to master %s (client generation %d)",
                    self.rank, self.config.master_server_addr, new.generation)
        self._retire(old)
        return True

    def _register_all(self, client: _Client, buffers: dict[int, int]) -> None:
        for ptr, size in buffers.items():
            try:
                rc = client.store.register_buffer(ptr, size)
            except Exception as e:
                rc = f"{type(e).__name__}: {e}"
            if rc != 0:
                log.warning("mooncake store rank %d: registering buffer %#x+%d on client generation %d returned %s",
                            self.rank, ptr, size, client.generation, rc)

    def _reconnect_in_background(self) -> None:
        with self._lock:
            if self._closed or (self._reconnect_thread is not None and self._reconnect_thread.is_alive()):
                return
            now = time.monotonic()
            if (not self._down or self._reachable_since is None or now - self._reachable_since < self.reconnect_after
                    or now < self._next_reconnect):
                return
            self._next_reconnect = now + max(self.reconnect_after, self.retry_interval)
            self._reconnect_thread = threading.Thread(target=self.reconnect, name=f"mooncake-reconnect-r{self.rank}",
                                                      daemon=True)
            self._reconnect_thread.start()

    def _retire(self, old: _Client) -> None:
        """Close a replaced client once no call is on it (bounded); leave it open otherwise, and
        park it while the master does not answer (its close would hold the GIL ~10-20 s)."""
        deadline = time.monotonic() + self.close_timeout
        with self._lock:
            while old.inflight and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            busy = old.inflight
        if busy:
            log.warning("mooncake store rank %d: old client generation %d still has %d calls after %.0fs; "
                        "leaving it open", self.rank, old.generation, busy, self.close_timeout)
            return
        if not self._park_if_master_gone(old, "old client"):
            self._close_client(old, unregister=False)

    def _park_if_master_gone(self, client: _Client, what: str) -> bool:
        alive, why = self._master_alive()
        if alive:
            return False
        _PARKED.append(client.store)
        log.warning("mooncake store rank %d: master %s does not answer (%s): %s generation %d left open, not "
                    "closed (closing would hold the GIL for 10-20 s)", self.rank, self.config.master_server_addr,
                    why, what, client.generation)
        return True

    def _close_client(self, client: _Client, unregister: bool) -> None:
        try:
            if unregister:
                for ptr in list(self._buffers):
                    client.store.unregister_buffer(ptr)
            client.store.close()
        except Exception:
            log.exception("mooncake store rank %d: closing client generation %d", self.rank, client.generation)

    # ---- the guarded call ------------------------------------------------------------------

    def _admit(self) -> _Client | None:
        """The client to call, with the call counted in flight; None to fail fast (closed or down)."""
        with self._lock:
            if self._closed or self._client is None:
                return None
            self.stats["calls"] += 1
            if self._down:
                now = time.monotonic()
                if now < self._next_probe:
                    self.stats["fast_failed"] += 1
                    return None
                self._next_probe = now + self.retry_interval    # this caller probes; the others fail fast
                probing = True
            else:
                probing = False
        if probing:
            ok, _ = self._master_answers()
            with self._lock:
                self.stats["probes"] += 1
                if not ok:
                    self._reachable_since = None
                    self.stats["fast_failed"] += 1
                    return None
                if self._reachable_since is None:
                    self._reachable_since = time.monotonic()
        with self._lock:
            if self._closed or self._client is None:
                return None
            client = self._client
            client.inflight += 1
            return client

    def _release(self, client: _Client) -> None:
        with self._lock:
            client.inflight -= 1
            if client.inflight == 0:
                self._lock.notify_all()

    def _mark(self, failed: bool, what: str, client: _Client) -> None:
        with self._lock:
            if client is not self._client:
                return                  # a late answer from a replaced client says nothing about the new one
            now = time.monotonic()
            if failed:
                self.stats["failed_batches"] += 1
                if not self._down:
                    self._down, self._down_since, self._reachable_since = True, now, None
                    log.warning("mooncake store rank %d: master %s unavailable (%s); failing fast, probing every %.1fs",
                                self.rank, self.config.master_server_addr, what, self.retry_interval)
                self._next_probe = max(self._next_probe, now + self.retry_interval)
            elif self._down:
                self._down, self._reachable_since = False, None
                log.warning("mooncake store rank %d: master %s available again after %.1fs",
                            self.rank, self.config.master_server_addr, now - self._down_since)

    def _run(self, op: str, keys: Sequence[str], call: Callable[[Any], Sequence[int]],
             convert: Callable[[int, int], int]) -> list[int]:
        """Call the client for a whole batch; map each raw code with ``convert(i, code)``."""
        n = len(keys)
        client = self._admit()
        if client is None:
            return [UNAVAILABLE] * n
        try:
            raw = list(call(client.store))
        except Exception as e:
            log.warning("mooncake %s of %d keys raised %s: %s", op, n, type(e).__name__, e)
            self._mark(True, f"{op} raised {type(e).__name__}", client)
            self._reconnect_in_background()
            return [UNAVAILABLE] * n
        finally:
            self._release(client)
        try:
            raw = [int(code) for code in raw]
        except (TypeError, ValueError):
            raw = []
        if len(raw) != n:
            log.warning("mooncake %s of %d keys returned %d usable results", op, n, len(raw))
            self._mark(True, f"{op} returned {len(raw)} results for {n} keys", client)
            return [UNAVAILABLE] * n
        rpc_failed = [c for c in raw if _is_rpc_failure(c)]
        self._mark(bool(rpc_failed), f"{op}: {rpc_failed[0] if rpc_failed else ''}", client)
        if rpc_failed:
            self._reconnect_in_background()
        return [convert(i, code) for i, code in enumerate(raw)]

    @staticmethod
    def _common(code: int) -> int:
        if code == MC_OBJECT_NOT_FOUND:
            return NOT_FOUND
        if code == MC_NO_AVAILABLE_HANDLE:
            return NO_SPACE
        if code == MC_CHECKSUM_MISMATCH:
            return CORRUPT
        if _is_rpc_failure(code) or code in (MC_TRANSFER_FAIL, MC_INTERNAL_ERROR):
            return UNAVAILABLE
        return code

    def _read_code(self, _i: int, code: int) -> int:
        if code > 0:
            return code
        if code == 0:
            return CORRUPT          # an empty object is never one this backend wrote
        if code == MC_INVALID_PARAMS:
            return BUFFER_TOO_SMALL
        return self._common(code)

    def _write_code(self, _i: int, code: int) -> int:
        if code in (0, MC_OBJECT_ALREADY_EXISTS):
            return 0
        if code == MC_INVALID_PARAMS:
            return INVALID
        return self._common(code) if code < 0 else INVALID

    def _exists_code(self, _i: int, code: int) -> int:
        if code in (0, 1):
            return code
        return self._common(code) if code < 0 else INVALID

    def _subset(self, keys: Sequence[str], valid: list[bool], run: Callable[[list[int]], list[int]]) -> list[int]:
        """Run ``run`` on the indices whose arguments are valid; the others get INVALID."""
        idx = [i for i, ok in enumerate(valid) if ok]
        out = [INVALID] * len(keys)
        if idx:
            for i, code in zip(idx, run(idx)):
                out[i] = code
        return out

    @staticmethod
    def _valid_key(key: object) -> bool:
        return isinstance(key, str) and bool(key)

    # ---- KVCacheStorage --------------------------------------------------------------------

    def register_buffer(self, ptr: int, size: int) -> None:
        ptr, size = int(ptr), int(size)
        if ptr <= 0 or size <= 0:
            raise ValueError(f"cannot register buffer {ptr:#x}+{size}")
        with self._lock:
            if self._closed:
                raise RuntimeError("mooncake store is closed")
            if any(p <= ptr and ptr + size <= p + s for p, s in self._buffers.items()):
                return                      # already registered (or inside a registered range)
            # Recorded first, so a reconnect registers it on the new client too.
            self._buffers[ptr] = size
            client = self._client
            if client is None:
                return
            client.inflight += 1
        try:
            # A failure is logged, not raised: with protocol tcp an unregistered buffer still
            # works; with rdma the batch calls will report per-key errors.
            self._register_all(client, {ptr: size})
        finally:
            self._release(client)

    def exists(self, keys: Sequence[str]) -> list[int]:
        keys = list(keys)
        if not keys:
            return []
        return self._subset(keys, [self._valid_key(k) for k in keys], lambda idx: self._run(
            "exists", idx, lambda s: s.batch_is_exist([keys[i] for i in idx]), self._exists_code))

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        keys, ptrs, sizes = list(keys), [int(p) for p in ptrs], [int(s) for s in sizes]
        if not keys:
            return []
        valid = [self._valid_key(k) and p > 0 and s > 0 for k, p, s in zip(keys, ptrs, sizes)]
        return self._subset(keys, valid, lambda idx: self._run(
            "get", idx, lambda s: s.batch_get_into([keys[i] for i in idx], [ptrs[i] for i in idx],
                                                   [sizes[i] for i in idx]), self._read_code))

    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        check_batch(keys, ptrs, sizes)
        keys, ptrs, sizes = list(keys), [int(p) for p in ptrs], [int(s) for s in sizes]
        if not keys:
            return []
        valid = [self._valid_key(k) and p > 0 and s > 0 for k, p, s in zip(keys, ptrs, sizes)]
        out = self._subset(keys, valid, lambda idx: self._run(
            "set", idx, lambda s: self._put(s.batch_put_from, [keys[i] for i in idx], [ptrs[i] for i in idx],
                                                   [sizes[i] for i in idx]), self._write_code))
        self._remember(keys, out)
        return out

    def _multi_args(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                    size_lists: Sequence[Sequence[int]]) -> tuple[list[str], list[list[int]], list[list[int]], list[bool]]:
        check_batch(keys, ptr_lists, size_lists)
        keys = list(keys)
        ptrs = [[int(p) for p in pl] for pl in ptr_lists]
        sizes = [[int(s) for s in sl] for sl in size_lists]
        valid = [self._valid_key(k) and len(p) == len(s) and len(p) > 0 and all(x > 0 for x in p)
                 and all(x > 0 for x in s) for k, p, s in zip(keys, ptrs, sizes)]
        return keys, ptrs, sizes, valid

    def batch_get_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        keys, ptrs, sizes, valid = self._multi_args(keys, ptr_lists, size_lists)
        if not keys:
            return []
        return self._subset(keys, valid, lambda idx: self._run(
            "get_multi", idx, lambda s: s.batch_get_into_multi_buffers(
                [keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx]), self._read_code))

    def batch_set_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                        size_lists: Sequence[Sequence[int]]) -> list[int]:
        keys, ptrs, sizes, valid = self._multi_args(keys, ptr_lists, size_lists)
        if not keys:
            return []
        out = self._subset(keys, valid, lambda idx: self._run(
            "set_multi", idx, lambda s: self._put(s.batch_put_from_multi_buffers,
                [keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx]), self._write_code))
        self._remember(keys, out)
        return out

    def _put(self, put: Callable[..., Sequence[int]], *args: Any) -> Sequence[int]:
        """``put(*args)`` with ``replica_num`` memory replicas (Mooncake's ``ReplicateConfig``: each on
        another segment, best effort); with 1, Mooncake's default, no config is passed."""
        if self.replica_num == 1:
            return put(*args)
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.replica_num
        return put(*args, config)

    def _remember(self, keys: list[str], results: list[int]) -> None:
        """Keys ``clear`` cannot find by this rank's namespace pattern are kept to remove one by one."""
        other = [k for k, r in zip(keys, results) if r == 0 and (self._key_re is None or not self._key_re.match(k))]
        if other:
            with self._lock:
                self._other_keys.update(other)

    def delete(self, keys: Sequence[str]) -> list[int]:
        """Remove keys: 0, NOT_FOUND, or Mooncake's -706 while another reader holds its lease."""
        keys = list(keys)
        if not keys:
            return []
        out = self._subset(keys, [self._valid_key(k) for k in keys], lambda idx: self._run(
            "delete", idx, lambda s: s.batch_remove([keys[i] for i in idx], False),
            lambda _i, code: 0 if code == 0 else self._common(code)))
        with self._lock:
            self._other_keys.difference_update(k for k, r in zip(keys, out) if r in (0, NOT_FOUND))
        return out

    def clear(self) -> None:
        """Remove what this store wrote: this rank's keys in its namespace (``{namespace}/*/{rank}/...``,
        by regex) and any other key it wrote.  Other namespaces and ranks are never touched.
        Leases are overridden (force).  Failures are logged, not raised."""
        if self._key_re is not None:
            pattern = self._key_re.pattern
            removed = self._run("clear", ["*"], lambda s: [s.remove_by_regex(pattern, True)],
                                lambda _i, code: code)[0]
            if removed < 0:
                log.warning("mooncake store rank %d: remove_by_regex(%r) returned %d", self.rank, pattern, removed)
        with self._lock:
            other = sorted(self._other_keys)
        for start in range(0, len(other), 1000):
            chunk = other[start:start + 1000]
            codes = self._run("clear", chunk, lambda s: s.batch_remove(chunk, True),
                              lambda _i, code: 0 if code == 0 else self._common(code))
            with self._lock:
                self._other_keys.difference_update(k for k, r in zip(chunk, codes) if r in (0, NOT_FOUND))
            failed = sum(1 for r in codes if r not in (0, NOT_FOUND))
            if failed:
                log.warning("mooncake store rank %d: clear could not remove %d keys", self.rank, failed)

    def is_down(self) -> bool:
        """Whether the last batch failed at the RPC level (calls fail fast until the master answers)."""
        with self._lock:
            return self._down

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
            down = self._down
            reconnecting = self._reconnect_thread
            deadline = time.monotonic() + self.close_timeout
            while client is not None and client.inflight and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            busy = client.inflight if client is not None else 0
        if reconnecting is not None and reconnecting is not threading.current_thread():
            reconnecting.join(self.close_timeout)     # it closes the client it was building
        if client is None:
            return
        if busy:
            log.warning("mooncake store rank %d: %d calls still in flight after %.0fs; not closing the client",
                        self.rank, busy, self.close_timeout)
            return
        # Mooncake's close holds the GIL: ~2 s, 11-19 s when the master is gone (its heartbeat
        # thread is stuck reconnecting), and a closed client must never be called again.  With
        # the master gone the client is parked instead: its destructor would block as long, so
        # the process should leave with os._exit (as a CTM does) rather than by interpreter exit.
        if self._park_if_master_gone(client, "client"):
            return
        start = time.monotonic()
        self._close_client(client, unregister=not down)
        spent = time.monotonic() - start
        if spent > 3.0:
            log.warning("mooncake store rank %d: closing the client took %.1fs", self.rank, spent)
        with self._lock:
            self._buffers.clear()
            self._other_keys.clear()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("down" if self._down else "up")
        return (f"MooncakeStore(namespace={self.namespace!r}, rank={self.rank}, "
                f"master={self.config.master_server_addr}, {state})")
