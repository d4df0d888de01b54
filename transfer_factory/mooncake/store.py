"""MooncakeStore: the KVCacheStorage backend over Mooncake's distributed store (DESIGN §2, §3.7, §6).

Host-staged: the CTM registers its staging buffers (``register_buffer``) and every batch call
passes raw pointers into them (``batch_get_into`` / ``batch_put_from`` and their
``_multi_buffers`` forms, one object gathered from / scattered to several buffers).  Keys are
used as given; the caller builds namespaced keys (``transfer_factory.keys``).

Configuration: see ``config.py`` (``options``, else the JSON file at ``MOONCAKE_CONFIG_PATH``,
else ``MOONCAKE_*`` variables; tuning keys ``rpc_timeout_ms``, ``rpc_connect_timeout_ms``,
``setup_retries``, ``probe_timeout``, ``retry_interval``, ``reconnect_after``,
``close_timeout``, ``segment_prefault``, ``replica_num``, ``placement``, ``io_thread_nice``).

Placement (a store-wide decision, ``placement`` "local" by default): every put names this client's
own segment as the preferred one, so all of a block's objects (each rank writes its own, and an
instance's ranks share a host) sit on the writer's host.  A host cut off from the master past its
``client_ttl`` loses its segments; with Mooncake's random placement that took a piece of nearly
every block (0-3 of 24 blocks readable on the two-host bed, 8-11 with ``replica_num`` 2, whose
copies may share a host), with "local" none of another host's (24 of 24).  A full own segment
spills to others (the master's fallback).  ``test_mooncake_two_hosts.py`` measures it.

This module maps the KVCacheStorage calls and result codes onto the client; the parts that
keep it bounded when the master fails are components of their own: ``connection.py`` (the
client: setup, buffers, reconnect, close, and what Mooncake 0.3.13 does when the master fails)
and ``breaker.py`` (fail fast while the master is down, probe it, say when to reconnect).
``close()`` is idempotent; afterwards batch calls return ``UNAVAILABLE``.  A CTM whose engine
died skips ``close`` and ``os._exit``s.

More measured behaviour of Mooncake 0.3.13:
* Reads hold a lease (``--default_kv_lease_ttl``): a lease shorter than one batch's transfer
  fails reads with -707 (``LEASE_EXPIRED``; seen with 200 ms and 256 MiB per batch across
  processes), and ``remove`` returns -706 while a lease is held.  A full segment answers writes
  with -200 until the master evicts objects whose lease has passed.
* Mooncake's -900/-901 collide with this package's CORRUPT/UNAVAILABLE, so codes are mapped.
* Raw throughput, 256 objects x 1 MiB, one batch: client and segment in one process ~12 GiB/s
  put and get (memcpy 13.7 GiB/s); segment in another process over loopback TCP ~2.1-2.2 GiB/s;
  the same objects gathered from / scattered to 8 buffers of 128 KiB: ~9.5/6.7 GiB/s in one
  process, ~1.7-1.8 GiB/s across processes.

Result codes: get -> bytes read (> 0), ``NOT_FOUND`` (-704), ``BUFFER_TOO_SMALL`` (-600);
set -> 0 (also for an existing key); exists -> 1/0.  Mooncake's ``NO_AVAILABLE_HANDLE`` ->
``NO_SPACE``, ``CHECKSUM_MISMATCH`` -> ``CORRUPT``, RPC and transfer failures and -1 ->
``UNAVAILABLE``; -600 on a write -> ``INVALID``; other Mooncake codes (-703 replica not
ready, -706 object has a lease, -707 lease expired, ...) pass through unchanged.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any, Callable, Mapping, Sequence

from transfer_factory.kvcache_storage import (BUFFER_TOO_SMALL, CORRUPT, INVALID, NO_SPACE, NOT_FOUND, UNAVAILABLE,
                                              KVCacheStorage, StorageAccess, StorageConfigError, check_batch)
from transfer_factory.mooncake.breaker import CircuitBreaker
from transfer_factory.mooncake.config import load_mooncake_config
from transfer_factory.mooncake.connection import MooncakeClient, MooncakeConnection, MooncakeConnectionError
from transfer_factory.log_tags import redact
from transfer_factory.mooncake.probe import master_answers

__all__ = ["MooncakeStore", "MooncakeConnectionError"]

log = logging.getLogger(__name__)

# Mooncake ErrorCode values this module treats specially.
MC_NO_AVAILABLE_HANDLE = -200
MC_INVALID_PARAMS = -600
MC_OBJECT_NOT_FOUND = -704
MC_OBJECT_ALREADY_EXISTS = -705
MC_TRANSFER_FAIL = -800
MC_CHECKSUM_MISMATCH = -801
MC_INTERNAL_ERROR = -1


def _is_rpc_failure(code: int) -> bool:
    """RPC_FAIL (-900), RPC_TIMEOUT (-901) and the rest of Mooncake's RPC range."""
    return -999 <= code <= -900


class MooncakeStore(KVCacheStorage):
    """One rank's KVCacheStorage over a Mooncake Store client, failing fast while its master is down."""
    name = "mooncake"
    access = StorageAccess.HOST_STAGED
    supports_multi_buffer = True

    def __init__(self, *, namespace: str = "", rank: int = 0, options: Mapping[str, Any] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.namespace = str(namespace)
        self.rank = int(rank)
        self.config, tuning = load_mooncake_config(options, environ)
        # Mooncake 0.3.13's batch calls wait for their transfers by polling (the wheel is built
        # without USE_EVENT_DRIVEN_COMPLETION: a loop on clock_gettime and the tasks' status), so
        # the calling thread keeps a core busy for the whole transfer.  A storage mover runs its
        # I/O threads at this nice value, so the spinning yields to the threads moving the bytes.
        self.io_nice = int(tuning["io_thread_nice"])
        self.replica_num = int(tuning["replica_num"])  # memory replicas of each put object
        self.placement = str(tuning["placement"])       # "local": objects prefer this client's own segment
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageConfigError(
                "storage backend 'mooncake' needs the Mooncake SDK: pip install mooncake-transfer-engine "
                f"(mooncake-transfer-engine-non-cuda on CPU hosts): {e}") from None

        self._keys_lock = threading.Lock()
        self._other_keys: set[str] = set()          # written keys outside this rank's namespace pattern
        self._key_re = (re.compile(rf"^{re.escape(self.namespace)}/[^/]+/{self.rank}/") if self.namespace else None)
        probe_timeout = float(tuning["probe_timeout"])
        self._breaker = CircuitBreaker(functools.partial(master_answers, self.config, probe_timeout),
                                       retry_interval=float(tuning["retry_interval"]),
                                       reconnect_after=float(tuning["reconnect_after"]), rank=self.rank,
                                       master=self.config.master_server_addr)
        self._connection = MooncakeConnection(self.config, tuning, rank=self.rank, factory=MooncakeDistributedStore,
                                              on_client_change=self._breaker.client_changed)
        log.info("mooncake store rank %d connected to master %s (metadata %s, protocol %s, config from %s)",
                 self.rank, self.config.master_server_addr, self.config.metadata_server, self.config.protocol,
                 self.config.source)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the guarded calls (calls, fast_failed, failed_batches, probes) and reconnects."""
        return {**self._breaker.stats(), **self._connection.stats()}

    @property
    def prefaulted(self) -> list[tuple[int, int]]:
        """The memory ranges of the segment the last setup faulted in."""
        return self._connection.prefaulted

    def reconnect(self) -> bool:
        """Replace the client now (see ``MooncakeConnection.reconnect``); whether it worked."""
        return self._connection.reconnect()

    # ---- the guarded call ------------------------------------------------------------------

    def _admit(self) -> MooncakeClient | None:
        """The client to call, with the call counted in flight; None to fail fast (closed or down)."""
        if self._connection.closed or not self._breaker.admit():
            return None
        return self._connection.acquire()

    def _mark(self, failed: bool, what: str, client: MooncakeClient) -> None:
        self._breaker.record(failed, what, client.generation)

    def _reconnect_in_background(self) -> None:
        self._connection.reconnect_in_background(due=self._breaker.reconnect_due)

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
            # redact: Mooncake's message may name a key (a block hash), which logs must not show
            log.warning("mooncake %s of %d keys raised %s: %s", op, n, type(e).__name__, redact(e))
            self._mark(True, f"{op} raised {type(e).__name__}", client)
            self._reconnect_in_background()
            return [UNAVAILABLE] * n
        finally:
            self._connection.release(client)
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
        self._connection.register_buffer(ptr, size)

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
            "set", idx, lambda s: self._put(s, s.batch_put_from, [keys[i] for i in idx], [ptrs[i] for i in idx],
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
            "set_multi", idx, lambda s: self._put(s, s.batch_put_from_multi_buffers,
                [keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx]), self._write_code))
        self._remember(keys, out)
        return out

    def _put(self, client: Any, put: Callable[..., Sequence[int]], *args: Any) -> Sequence[int]:
        """``put(*args)`` with Mooncake's ``ReplicateConfig``: ``replica_num`` memory replicas (each on
        another segment, best effort) and, with placement "local", this client's own segment as the
        preferred one (the master falls back to others when it is full).  With neither, no config is
        passed (Mooncake's default: one replica in a segment picked at random)."""
        segment = self._own_segment(client) if self.placement == "local" else ""
        if self.replica_num == 1 and not segment:
            return put(*args)
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.replica_num
        if segment:
            config.preferred_segment = segment
        return put(*args, config)

    def _own_segment(self, client: Any) -> str:
        """The name of the segment this client mounted (its ``local_hostname:port``), "" when it
        mounts none."""
        if not self.config.global_segment_size:
            return ""
        try:
            return str(client.get_hostname())
        except Exception as e:      # an older wheel: random placement
            log.debug("mooncake store rank %d: no segment name (%s)", self.rank, e)
            return ""

    def _remember(self, keys: list[str], results: list[int]) -> None:
        """Keys ``clear`` cannot find by this rank's namespace pattern are kept to remove one by one."""
        other = [k for k, r in zip(keys, results) if r == 0 and (self._key_re is None or not self._key_re.match(k))]
        if other:
            with self._keys_lock:
                self._other_keys.update(other)

    def delete(self, keys: Sequence[str]) -> list[int]:
        """Remove keys: 0, NOT_FOUND, or Mooncake's -706 while another reader holds its lease."""
        keys = list(keys)
        if not keys:
            return []
        out = self._subset(keys, [self._valid_key(k) for k in keys], lambda idx: self._run(
            "delete", idx, lambda s: s.batch_remove([keys[i] for i in idx], False),
            lambda _i, code: 0 if code == 0 else self._common(code)))
        with self._keys_lock:
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
        with self._keys_lock:
            other = sorted(self._other_keys)
        for start in range(0, len(other), 1000):
            chunk = other[start:start + 1000]
            codes = self._run("clear", chunk, lambda s: s.batch_remove(chunk, True),
                              lambda _i, code: 0 if code == 0 else self._common(code))
            with self._keys_lock:
                self._other_keys.difference_update(k for k, r in zip(chunk, codes) if r in (0, NOT_FOUND))
            failed = sum(1 for r in codes if r not in (0, NOT_FOUND))
            if failed:
                log.warning("mooncake store rank %d: clear could not remove %d keys", self.rank, failed)

    def is_down(self) -> bool:
        """Whether the last batch failed at the RPC level (calls fail fast until the master answers)."""
        return self._breaker.is_down()

    def close(self) -> None:
        if self._connection.close(unregister=not self._breaker.is_down()):
            with self._keys_lock:
                self._other_keys.clear()

    def __repr__(self) -> str:
        state = "closed" if self._connection.closed else ("down" if self._breaker.is_down() else "up")
        return (f"MooncakeStore(namespace={self.namespace!r}, rank={self.rank}, "
                f"master={self.config.master_server_addr}, {state})")
