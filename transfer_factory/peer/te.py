"""The cross-host peer transport: the Mooncake Transfer Engine (``mooncake.engine.TransferEngine``).

One endpoint per CTM rank, opened only when a peer on another host is linked (or the operator
forces it): ``initialize`` with the rank's address and the P2P handshake (no metadata server),
over TCP here and RDMA where there are NICs.  Its memory (the rank's caches, its swap space, its
engine's exposure board) is registered once.  A transfer is a list of (local address, remote
address, length) runs, contiguous blocks coalesced into one run, submitted with
``batch_transfer_async_read``/``write``, one run per batch, at most ``MAX_SLICES_IN_FLIGHT`` at once,
polled with ``transfer_check_status`` until all end or the task's deadline passes.  A run still
running at the deadline cannot be cancelled: the caller gets it back (``Inflight``) and keeps its
destination blocks unreleased until it ends.

Its data plane has no authentication and (0.3.13) its RPC and TCP data ports listen on every
interface whatever address ``initialize`` gets: whoever reaches them can read and write the
registered memory.  So it stays closed on one host, its ports are logged when it opens, and the
README says it belongs behind a firewall or on a private fabric (DESIGN §3.11).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ops.procs import listening_sockets

from transfer_factory.mooncake.loopback import bind_address, loopback_binds

POLL_FIRST_S = 0.0002
POLL_MAX_S = 0.005  # a transfer's completion is seen at most this late; no busy loop
DONE, RUNNING, FAILED, TIMED_OUT = 1, 0, -1, -2


def valid_batch(batch: object) -> bool:
    """Whether a batch id from ``batch_transfer_async_read/write`` names a batch.  Mooncake 0.3.13 gives
    0 (a null batch: polling it crashes the process) when the handshake with the peer fails,
    connection refused or timed out; other bindings give a negative code or ``2**64 - 1``."""
    return isinstance(batch, int) and 0 < batch < 2**64 - 1



def _settled_listeners(before: set) -> set:
    """The sockets the engine opened: Mooncake starts some of its listeners on its own threads a
    moment after ``initialize`` returns, so the set is read until it stops changing (at most 1 s)."""
    opened, deadline = listening_sockets() - before, time.monotonic() + 1.0
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = listening_sockets() - before
        if now == opened and len(now) >= 2:  # its RPC (handshake) port and its data port
            break
        opened = now
    return opened

class PeerTransferError(RuntimeError):
    """A transfer to or from a peer failed; the message names the peer."""


class WordStillInFlight(PeerTransferError):
    """A board word's transfer outlived its deadline: its scratch word may still be written until
    ``inflight`` (its batches) has ended."""

    def __init__(self, message: str, inflight: "Inflight | None" = None):
        super().__init__(message)
        self.inflight = inflight


# Runs in flight per transfer, counted in the engine's 64 KiB slices: Mooncake 0.3.13's TCP
# transport queues about 2048 slices per peer and fails the rest, and two transfers (a pull and a
# push) may run at once.
SLICE_BYTES = 64 << 10
MAX_SLICES_IN_FLIGHT = 512
OPEN_ATTEMPTS = 3  # tries to start the Transfer Engine (its random data port may be taken)


def _slices(length: int) -> int:
    return -(-length // SLICE_BYTES)


@dataclass
class Inflight:
    """Batches still running past their deadline: ``wait(timeout)`` says whether all have ended."""

    endpoint: "TransferEngineEndpoint"
    batch_ids: list[int]

    def wait(self, timeout: float) -> bool:
        self.batch_ids = self.endpoint._poll_all(self.batch_ids, time.monotonic() + timeout)[0]
        return not self.batch_ids


def socket_text(address: str, port: int) -> str:
    """``address:port`` as a log says where something listens (``[v6]:port``; a wildcard says so)."""
    text = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return text + (" (every interface)" if address in ("0.0.0.0", "::") else "")


def coalesce(local: Sequence[int], remote: Sequence[int], length: int) -> tuple[list[int], list[int], list[int]]:
    """Runs of (local, remote, length) where consecutive blocks are adjacent on both sides."""
    out_l: list[int] = []
    out_r: list[int] = []
    out_n: list[int] = []
    for lo, ro in zip(local, remote):
        if out_n and out_l[-1] + out_n[-1] == lo and out_r[-1] + out_n[-1] == ro:
            out_n[-1] += length
        else:
            out_l.append(lo)
            out_r.append(ro)
            out_n.append(length)
    return out_l, out_r, out_n


def block_addresses(bases: np.ndarray, stride: int, ids: Sequence[int], layers: range) -> list[int]:
    """Addresses of blocks ``ids`` of each layer of ``layers`` (layer-major, block order kept)."""
    idx = np.asarray(ids, dtype=np.int64) * stride
    return (bases[layers.start:layers.stop, None] + idx[None, :]).reshape(-1).tolist()


class ScratchWords:
    """Registered words that board reads and writes land in or leave from, one per word transfer in
    flight: two transfers never share one, so a late word cannot overwrite a newer transfer's.  A
    word whose transfer outlived its deadline is handed out again only once that transfer's batches
    have ended (looked at when words are taken): before, a stopped peer cost two words per timed-out
    pull for good, and after 32 every pull of the rank failed."""

    def __init__(self, count: int = 64):
        self.words = np.zeros(count, dtype=np.int64)
        self._free = list(range(count))
        self._late: list[tuple[list[int], Inflight]] = []  # words of transfers past their deadline
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        return int(self.words.ctypes.data)

    @contextmanager
    def take(self, count: int = 1) -> Iterator[list[np.ndarray]]:
        """``count`` scratch words (one-word arrays), each for one word of one transfer."""
        with self._lock:
            if len(self._free) < count:
                self._reclaim()
            if len(self._free) < count:
                raise PeerTransferError(f"fewer than {count} of {len(self.words)} board-word scratch words are free: "
                                        "the others are held by transfers that outlived their deadline")
            indices = [self._free.pop() for _ in range(count)]
        late: Inflight | None = None
        lost = False
        try:
            yield [self.words[i:i + 1] for i in indices]
        except WordStillInFlight as exc:
            lost, late = True, exc.inflight
            raise
        finally:
            with self._lock:
                if not lost:
                    self._free.extend(indices)
                elif late is not None:
                    self._late.append((indices, late))

    def _reclaim(self) -> None:
        """Give back the words of late transfers whose batches have ended (never waits)."""
        still = []
        for indices, late in self._late:
            if late.wait(0):
                self._free.extend(indices)
            else:
                still.append((indices, late))
        self._late = still


class ScratchRegions:
    """Registered buffers that peers' digest regions are read into (``transfer_factory.peer.digests``),
    one per read in flight.  A buffer whose read outlived its deadline is handed out again only once
    that read's batch ended, so a late region never lands in a newer read's buffer."""

    MIN_WORDS = 1 << 14

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._late: list[tuple[np.ndarray, Inflight]] = []
        self._lock = threading.Lock()

    def read(self, endpoint: "TransferEngineEndpoint", peer: str, peer_address: str, remote: int, count: int,
             deadline: float) -> np.ndarray:
        """``count`` 8-byte words of the peer's registered memory at ``remote``, in one transfer."""
        buf = self._take(endpoint, count)
        late: Inflight | None = None
        try:
            late = endpoint.transfer(peer, peer_address, False, [int(buf.ctypes.data)], [int(remote)], [8 * count],
                                     deadline) if count else None
            if late is not None:
                raise PeerTransferError(f"peer {peer} ({peer_address}): its digests did not arrive in time")
            return buf[:count].copy()
        finally:
            with self._lock:
                if late is None:
                    self._free.append(buf)
                else:
                    self._late.append((buf, late))

    def _take(self, endpoint: "TransferEngineEndpoint", count: int) -> np.ndarray:
        with self._lock:
            still = []
            for buf, late in self._late:
                (self._free.append(buf) if late.wait(0) else still.append((buf, late)))
            self._late = still
            for i, buf in enumerate(self._free):
                if len(buf) >= count:
                    return self._free.pop(i)
        buf = np.zeros(max(count, self.MIN_WORDS), dtype=np.int64)
        endpoint.register(int(buf.ctypes.data), buf.nbytes)  # unregistered when the endpoint closes
        return buf


class TransferEngineEndpoint:
    def __init__(self, hostname: str, protocol: str, log: logging.Logger):
        self.hostname = hostname
        self.protocol = protocol
        self._log = log
        self._engine = None
        self._lock = threading.Lock()
        self.address = ""
        self.ports: list[int] = []  # what it listens on, as the kernel says (for the log and tests)
        self._registered: list[int] = []

    @property
    def is_open(self) -> bool:
        return self._engine is not None

    def open(self) -> str:
        """Start the engine (once); returns the address peers use, ``host:rpc_port``."""
        with self._lock:
            if self._engine is None:
                from mooncake.engine import TransferEngine  # the wheel is optional for same-host P/D

                before = listening_sockets()
                # Mooncake binds its handshake and data ports to every interface whatever hostname it
                # is given: bind them to the hostname where it is an address of this host
                host = bind_address(self.hostname)
                for attempt in range(1, OPEN_ATTEMPTS + 1):
                    engine = TransferEngine()
                    with loopback_binds(host) if host else contextlib.nullcontext():
                        rc = engine.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, "")
                    if rc == 0:
                        break
                    # Mooncake draws its data port at random: two ranks starting in the same millisecond
                    # can draw the same one ("Address already in use"); a fresh engine draws again
                    self._log.warning("the Transfer Engine did not start on %s (return code %s, try %d of %d)",
                                      self.hostname, rc, attempt, OPEN_ATTEMPTS)
                else:
                    raise PeerTransferError(f"the Mooncake Transfer Engine did not start on {self.hostname} "
                                            f"({self.protocol}): return code {rc}, {OPEN_ATTEMPTS} times")
                self._engine = engine
                self.address = f"{self.hostname}:{engine.get_rpc_port()}"
                opened = sorted(_settled_listeners(before), key=lambda s: s[1])
                self.ports = [port for _, port in opened]
                self._log.warning("Transfer Engine open: peers reach it at %s (%s); it listens on %s, with no "
                                  "authentication: keep them on a private fabric", self.address, self.protocol,
                                  ", ".join(socket_text(a, p) for a, p in opened) or "ports unknown")
            return self.address

    def register(self, address: int, nbytes: int) -> None:
        rc = self._engine.register_memory(int(address), int(nbytes))
        if rc != 0:
            raise PeerTransferError(f"Transfer Engine: registering {nbytes} bytes at {address:#x} failed ({rc})")
        self._registered.append(int(address))

    def unregister(self, address: int) -> None:
        """Peers can no longer read or write the memory registered at ``address`` (before it is freed)."""
        if int(address) in self._registered:
            self._registered.remove(int(address))
            rc = self._engine.unregister_memory(int(address))
            if rc != 0:
                self._log.error("Transfer Engine: unregistering %#x failed (%s)", int(address), rc)

    def transfer(self, peer: str, peer_address: str, write: bool, local: list[int], remote: list[int],
                 lengths: list[int], deadline: float) -> Inflight | None:
        """Move the runs with one peer (see ``transfer_many``)."""
        return self.transfer_many([(peer, peer_address, local, remote, lengths)], write, deadline)

    def transfer_many(self, jobs: Sequence[tuple[str, str, list[int], list[int], list[int]]], write: bool,
                      deadline: float, on_landed: Callable[[list[tuple[int, int]]], None] | None = None
                      ) -> Inflight | None:
        """Move each job's runs (``(peer name, peer address, local, remote, lengths)``) with its
        peer, every peer's at once (a rank reading its kv heads from several peer ranks); None once
        every run has landed, an ``Inflight`` if the deadline passed with some still running.
        Raises ``PeerTransferError`` naming the peer of the first failed run, but only once none
        of the runs is still running.

        Each run is its own batch: the binding's ``transfer_check_status`` reports only the first
        task of a batch, so a batch of many runs looked done while most were still in flight.  At
        most ``MAX_SLICES_IN_FLIGHT`` slices per peer.  ``on_landed([(job, run), ...])`` hears, once per
        look at the batches, the runs whose batch ended since (while the others are still in
        flight: a pull digests what landed meanwhile); it must not raise."""
        submit = self._engine.batch_transfer_async_write if write else self._engine.batch_transfer_async_read
        pending: list[tuple[int, int, int, int]] = []  # (batch id, slices, job, run)
        in_flight = [0] * len(jobs)
        next_run = [0] * len(jobs)
        failure, failed_job = "", 0
        wait = POLL_FIRST_S
        while True:
            for j, (_, address, local, remote, lengths) in enumerate(jobs):
                while not failure and next_run[j] < len(lengths) and (
                        not in_flight[j] or in_flight[j] + _slices(lengths[next_run[j]]) <= MAX_SLICES_IN_FLIGHT):
                    i = next_run[j]
                    batch = submit(address, [local[i]], [remote[i]], [lengths[i]])
                    if not valid_batch(batch):
                        failure, failed_job = (f"the Transfer Engine refused a run (batch id {batch}: 0 when it "
                                               "could not reach the peer)"), j
                        break
                    pending.append((batch, _slices(lengths[i]), j, i))
                    in_flight[j] += pending[-1][1]
                    next_run[j] += 1
            still, ended, status, entry = self._poll_once(pending)
            if status is not None and not failure:
                failed_job = entry[2]
                failure = "transfer timed out" if status == TIMED_OUT else f"transfer failed (status {status})"
            if ended:
                if on_landed is not None:
                    running = {e[0] for e in still}
                    on_landed([(e[2], e[3]) for e in pending if e[0] not in running])
                pending = still
                in_flight = [0] * len(jobs)  # one pass over what is still in flight, not one per peer
                for _, slices, job, _ in pending:
                    in_flight[job] += slices
                wait = POLL_FIRST_S
            left = sum(len(job[4]) - next_run[j] for j, job in enumerate(jobs))
            if not pending and (failure or not left):
                break
            if time.monotonic() >= deadline:
                if pending:
                    return Inflight(self, [e[0] for e in pending])
                failure = failure or f"{left} runs not started by the deadline"
                break
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(POLL_MAX_S, wait * 2)
        if failure:
            raise PeerTransferError(f"peer {jobs[failed_job][0]} ({jobs[failed_job][1]}): {failure}")
        return None

    def _poll_once(self, pending: list[tuple]) -> tuple[list[tuple], bool, int | None, tuple | None]:
        """(still running, whether any ended, the status of a failed one or None, that entry)."""
        still: list[tuple] = []
        failed, failed_entry = None, None
        for entry in pending:
            status = self._engine.transfer_check_status(entry[0])
            if status == RUNNING:
                still.append(entry)
            elif status != DONE and failed is None:
                failed, failed_entry = status, entry
        return still, len(still) != len(pending), failed, failed_entry

    def _poll_all(self, batch_ids: list[int], deadline: float) -> tuple[list[int], int | None]:
        """Poll until every batch ended or ``deadline``; (those still running, a failure status)."""
        pending = [(b, 0) for b in batch_ids]
        failed = None
        wait = POLL_FIRST_S
        while True:
            pending, _, status, _ = self._poll_once(pending)
            failed = failed if failed is not None else status
            if not pending or time.monotonic() >= deadline:
                return [b for b, _ in pending], failed
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(POLL_MAX_S, wait * 2)

    def read_words(self, peer: str, peer_address: str, scratch: list[np.ndarray], remotes: list[int],
                   deadline: float) -> list[int]:
        """8-byte words of the peer's registered memory (its boards), all in one transfer, each into
        its own scratch word."""
        local = [int(word.ctypes.data) for word in scratch]
        late = self.transfer(peer, peer_address, False, local, list(remotes), [8] * len(local), deadline)
        if late is not None:
            raise WordStillInFlight(f"peer {peer} ({peer_address}): no answer for its board words in time", late)
        return [int(word.view(np.int64)[0]) for word in scratch]

    def write_word(self, peer: str, peer_address: str, scratch: np.ndarray, remote: int, value: int,
                   deadline: float) -> None:
        """Store one 8-byte word into the peer's registered memory (its layer board)."""
        scratch.view(np.int64)[0] = value
        late = self.transfer(peer, peer_address, True, [int(scratch.ctypes.data)], [remote], [8], deadline)
        if late is not None:
            raise WordStillInFlight(f"peer {peer} ({peer_address}): a layer-board word was not written in time", late)

    def close(self) -> None:
        with self._lock:
            if self._engine is None:
                return
            for address in self._registered:
                self._engine.unregister_memory(address)
            self._registered.clear()
            self._engine = None  # the engine's threads and ports go with the object
