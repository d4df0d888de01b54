"""The Mooncake client behind a MooncakeStore: setup, registered buffers, reconnect and close.

A master that does not answer, or a failed ``setup``, raises ``MooncakeConnectionError`` (both
a ``StorageConfigError`` and a ``ConnectionError``) naming the master address.  Each client
contributes ``global_segment_size`` bytes of this process's memory to the pool; the master
places objects in any mounted segment, and those in this one are gone when this client closes.

Binds: the client listens on two ports (the P2P handshake, and the TCP transport's data port,
which serves reads and writes of this process's registered memory).  Mooncake 0.3.13 binds both
to every interface whatever ``local_hostname`` says; the client's listeners are kept on the
address ``local_hostname`` names (``loopback.py`` says how): loopback (the default, 127.0.0.1),
or, in a multi-host pool, this host's routable address.  A ``local_hostname`` that is not an
address of this host (a NAT address) leaves Mooncake's wildcard binds, with a warning.  A
loopback ``local_hostname`` with a master not on loopback is refused before anything connects
(``config.check_pool_addresses``).
The ``MC_*`` variables below are set only while ``setup`` runs, so child processes (CTMs
started by this process) do not inherit one store's values.

What Mooncake 0.3.13 does when the master fails (measured on loopback, TCP protocol)
-----------------------------------------------------------------------------------------
* ``setup`` with no master: the client retries 20 times (``MC_STORE_CLIENT_SETUP_RETRIES``),
  ~4.4 s each: -1 after ~90 s.  So a TCP connect to the master comes first (``probe_timeout``;
  refused at once on a live host) and ``MC_STORE_CLIENT_SETUP_RETRIES`` is set
  (``setup_retries``): no master -> ``MooncakeConnectionError`` in ~1 ms.
* Master killed (SIGKILL): the first call on the broken connection returns ``RPC_FAIL`` (-900)
  at once; every later call blocks ~4.3-4.5 s (the RPC client reconnecting; not shortened by
  ``MC_RPC_CONNECT_TIMEOUT_MS``) and returns -900.  ``health_check()`` turns 2 only after 3
  missed heartbeats (~10 s).  Batch calls release the GIL.
* Master hung (SIGSTOP): every call blocks for the RPC timeout, 30 s by default
  (``MC_RPC_TIMEOUT_MS``), and returns -901 (``RPC_TIMEOUT``).  The client reads
  ``MC_RPC_TIMEOUT_MS`` / ``MC_RPC_CONNECT_TIMEOUT_MS`` at ``setup``; they are set from
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

How the connection recovers and closes
--------------------------------------
* Reconnect: when the circuit breaker (``breaker.py``) says one is due, a background thread
  builds a new client (``setup``, every buffer registered again), swaps it in, waits (bounded)
  for calls still on the old one and closes it; an old client whose calls do not finish is left
  open rather than risking a segfault.  ``reconnect()`` does the same synchronously.  Objects
  held in the old client's segment are gone with it.
* Nothing that holds the GIL while it waits on the master runs against a master that does not
  answer a liveness probe (connect, send a bad header, expect the connection closed within
  ``probe_timeout``): a reconnect's ``setup`` is not tried, and a client is parked (kept
  referenced, never closed) instead of closed.  So a stopped master never freezes the CTM's
  other threads (swaps, the queue, the engine watch) for seconds.
* ``close()`` is idempotent: it waits (bounded by ``close_timeout``) for calls in flight,
  unregisters the buffers (unless the master is down), closes the client (~2 s, every thread
  stopped); when the master does not answer the probe the client is parked instead, and the
  process should leave with ``os._exit`` (its teardown would block 10-20 s).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from transfer_factory.kvcache_storage import StorageConfigError
from transfer_factory.mooncake.config import MooncakeConfig, check_pool_addresses
from transfer_factory.mooncake.loopback import bind_address, loopback_binds
from transfer_factory.mooncake.prefault import anonymous_ranges, new_anonymous_ranges, prefault
from transfer_factory.mooncake.probe import master_alive, master_answers

log = logging.getLogger("transfer_factory.mooncake.store")  # the store's log lines keep their logger name

# Mooncake client settings read from the environment at setup, and the tuning key for each.
_CLIENT_ENV = {"MC_RPC_TIMEOUT_MS": "rpc_timeout_ms", "MC_RPC_CONNECT_TIMEOUT_MS": "rpc_connect_timeout_ms",
               "MC_STORE_CLIENT_SETUP_RETRIES": "setup_retries"}
_env_lock = threading.Lock()            # one setup at a time changes the process environment

# Clients whose close() was skipped because the master did not answer: kept referenced so that no
# destructor runs (it would hold the GIL as long as close() does).  See MooncakeConnection.close.
_PARKED: list[Any] = []


class MooncakeConnectionError(StorageConfigError, ConnectionError):
    """The master (or the metadata service) did not answer, or ``setup`` failed."""


class MooncakeClient:
    """One MooncakeDistributedStore and the number of calls in flight on it."""
    __slots__ = ("store", "inflight", "generation")

    def __init__(self, store: Any, generation: int) -> None:
        self.store = store
        self.inflight = 0
        self.generation = generation


@contextlib.contextmanager
def _client_env(values: Mapping[str, int]) -> Iterator[None]:
    """Mooncake reads these at setup: set for its duration only, so neither a later store nor a
    child process (a CTM started by this process) inherits one store's values.  A value the user
    put in the environment wins."""
    with _env_lock:
        added = [env for env in _CLIENT_ENV if env not in os.environ]
        for env in added:
            os.environ[env] = str(values[_CLIENT_ENV[env]])
        try:
            yield
        finally:
            for env in added:
                os.environ.pop(env, None)


class MooncakeConnection:
    """The client in place, the calls in flight on it, the buffers registered, its replacement and close.

    ``on_client_change(generation)`` is told (under this object's lock, so in order) which client
    generation is in place whenever that changes; None once closed.
    """

    def __init__(self, config: MooncakeConfig, tuning: Mapping[str, Any], *, rank: int, factory: Callable[[], Any],
                 on_client_change: Callable[[int | None], None]) -> None:
        check_pool_addresses(config)
        self.config = config
        self.rank = rank
        self.rpc_timeout_ms = int(tuning["rpc_timeout_ms"])
        self.rpc_connect_timeout_ms = int(tuning["rpc_connect_timeout_ms"])
        self.setup_retries = int(tuning["setup_retries"])
        self.probe_timeout = float(tuning["probe_timeout"])
        self.close_timeout = float(tuning["close_timeout"])
        self.segment_prefault = str(tuning["segment_prefault"])
        self.prefaulted: list[tuple[int, int]] = []   # the ranges the last setup faulted in
        self._factory = factory
        self._on_client_change = on_client_change
        self._lock = threading.Condition(threading.Lock())
        self._closed = False
        self._buffers: dict[int, int] = {}          # ptr -> size, every range registered
        self._reconnect_thread: threading.Thread | None = None
        self._generation = 0
        self._gen_lock = threading.Lock()
        self._stats = {"reconnects": 0, "reconnect_failures": 0}
        client = self._new_client()
        with self._lock:
            self._client: MooncakeClient | None = client
            self._on_client_change(client.generation)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def current(self) -> MooncakeClient | None:
        """The client in place (None once closed); for diagnostics: calls go through ``acquire``."""
        return self._client

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    # ---- calls in flight ---------------------------------------------------------------------

    def acquire(self) -> MooncakeClient | None:
        """The client to call, with the call counted in flight; None once closed."""
        with self._lock:
            if self._closed or self._client is None:
                return None
            client = self._client
            client.inflight += 1
            return client

    def release(self, client: MooncakeClient) -> None:
        with self._lock:
            client.inflight -= 1
            if client.inflight == 0:
                self._lock.notify_all()

    def register_buffer(self, ptr: int, size: int) -> None:
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
            self.release(client)

    # ---- setup -------------------------------------------------------------------------------

    def _new_client(self, check: Callable[[], tuple[bool, str]] | None = None) -> MooncakeClient:
        """A set-up client (buffers not yet registered); MooncakeConnectionError when that fails."""
        cfg = self.config
        ok, why = (check or (lambda: master_answers(cfg, self.probe_timeout)))()
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
            # Every listener of the client is created inside setup; they are kept on the address
            # local_hostname names (Mooncake itself binds them to all interfaces).
            host = bind_address(cfg.local_hostname)
            if host is None:
                log.warning("mooncake store rank %d: local_hostname %s is not an address of this host: the "
                            "client's ports listen on every interface", self.rank, cfg.local_hostname)
            env = {key: getattr(self, key) for key in _CLIENT_ENV.values()}
            with _client_env(env), loopback_binds(host) if host else contextlib.nullcontext():
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
            return MooncakeClient(store, self._generation)

    def _prefault_segment(self, maps_before: list[tuple[int, int]]) -> None:
        """Fault in the segment ``setup`` just mounted (``prefault.py``): otherwise every first
        write of one of its pages, a peer's put included, takes a page fault here."""
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

    def _register_all(self, client: MooncakeClient, buffers: dict[int, int]) -> None:
        for ptr, size in buffers.items():
            try:
                rc = client.store.register_buffer(ptr, size)
            except Exception as e:
                rc = f"{type(e).__name__}: {e}"
            if rc != 0:
                log.warning("mooncake store rank %d: registering buffer %#x+%d on client generation %d returned %s",
                            self.rank, ptr, size, client.generation, rc)

    # ---- reconnect ---------------------------------------------------------------------------

    def reconnect(self) -> bool:
        """Replace the client now: set up a new one, register every buffer, retire the old one.
        Returns whether it worked (the old client stays in place when it did not).  Nothing is
        tried while the master does not answer: setup would hold the GIL meanwhile."""
        try:
            new = self._new_client(check=lambda: master_alive(self.config, self.probe_timeout))
        except MooncakeConnectionError as e:
            log.warning("mooncake store rank %d: reconnect failed: %s", self.rank, e)
            with self._lock:
                self._stats["reconnect_failures"] += 1
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
                self._on_client_change(new.generation)
                self._stats["reconnects"] += 1
        if old is None:                          # closed meanwhile
            self._close_client(new, unregister=False)
            return False
        log.warning("mooncake store rank %d: reconnected to master %s (client generation %d)",
                    self.rank, self.config.master_server_addr, new.generation)
        self._retire(old)
        return True

    def reconnect_in_background(self, due: Callable[[], bool]) -> None:
        """Start a background ``reconnect`` unless one runs, the store is closed, or ``due()`` says no."""
        with self._lock:
            if self._closed or (self._reconnect_thread is not None and self._reconnect_thread.is_alive()):
                return
            if not due():
                return
            self._reconnect_thread = threading.Thread(target=self.reconnect, name=f"mooncake-reconnect-r{self.rank}",
                                                      daemon=True)
            self._reconnect_thread.start()

    def _retire(self, old: MooncakeClient) -> None:
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

    # ---- close -------------------------------------------------------------------------------

    def _park_if_master_gone(self, client: MooncakeClient, what: str) -> bool:
        alive, why = master_alive(self.config, self.probe_timeout)
        if alive:
            return False
        _PARKED.append(client.store)
        log.warning("mooncake store rank %d: master %s does not answer (%s): %s generation %d left open, not "
                    "closed (closing would hold the GIL for 10-20 s)", self.rank, self.config.master_server_addr,
                    why, what, client.generation)
        return True

    def _close_client(self, client: MooncakeClient, unregister: bool) -> None:
        try:
            if unregister:
                for ptr in list(self._buffers):
                    client.store.unregister_buffer(ptr)
            client.store.close()
        except Exception:
            log.exception("mooncake store rank %d: closing client generation %d", self.rank, client.generation)

    def close(self, unregister: bool) -> bool:
        """Close the client (idempotent); ``unregister`` its buffers first.  Returns whether a client
        was closed here: not when already closed, still busy after ``close_timeout``, or parked."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            client, self._client = self._client, None
            self._on_client_change(None)
            reconnecting = self._reconnect_thread
            deadline = time.monotonic() + self.close_timeout
            while client is not None and client.inflight and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            busy = client.inflight if client is not None else 0
        if reconnecting is not None and reconnecting is not threading.current_thread():
            reconnecting.join(self.close_timeout)     # it closes the client it was building
        if client is None:
            return False
        if busy:
            log.warning("mooncake store rank %d: %d calls still in flight after %.0fs; not closing the client",
                        self.rank, busy, self.close_timeout)
            return False
        # Mooncake's close holds the GIL: ~2 s, 11-19 s when the master is gone (its heartbeat
        # thread is stuck reconnecting), and a closed client must never be called again.  With
        # the master gone the client is parked instead: its destructor would block as long, so
        # the process should leave with os._exit (as a CTM does) rather than by interpreter exit.
        if self._park_if_master_gone(client, "client"):
            return False
        start = time.monotonic()
        self._close_client(client, unregister=unregister)
        spent = time.monotonic() - start
        if spent > 3.0:
            log.warning("mooncake store rank %d: closing the client took %.1fs", self.rank, spent)
        with self._lock:
            self._buffers.clear()
        return True
