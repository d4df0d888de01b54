"""The same-host peer transport: map a peer rank's exported caches and copy with the block kernel.

A peer rank on this host (same kernel: ``descriptor.choose_transport``) lists where its caches
live: per cache kind and layer, a POSIX shared-memory name, an offset and a size (the CPU
platform's device memory, ``ops.cpu.CpuPlatform.exported_region``), and its engine's exposure
board.  ``IpcPeer`` maps them, read-only for a pull, and gives each kind a ``Side`` the block-copy
kernel copies from.  It opens no port.  It maps only regular files of this user under plain
names, never through a symlink (another user's segment would feed us bytes: DESIGN §4).  A pidfd
on the peer's engine says whether the engine still lives, so a pull from an instance that died
mid-copy is not reported loaded.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ops import _shm_atomic
from ops.layout import Side
from ops.procs import ProcessWatch
from ops.shm import shm_path

from transfer_factory.peer.handles import BOARD_BYTES, BOARD_WORDS

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,250}$")


class PeerUnavailable(RuntimeError):
    """The peer's memory cannot be used: gone, not ours, or not what its descriptor said."""


@dataclass(frozen=True)
class Region:
    """One layer of one cache kind, as the peer exported it."""

    kind: str
    layer: int
    segment: str
    offset: int
    nbytes: int

    @classmethod
    def from_wire(cls, value: Any) -> "Region":
        if not (isinstance(value, list) and len(value) == 5):
            raise ValueError(f"an ipc region is [kind, layer, segment, offset, nbytes], got {value!r:.80}")
        kind, layer, segment, offset, nbytes = value
        if type(kind) is not str or type(segment) is not str or not _PLAIN_NAME.match(segment):
            raise ValueError(f"ipc region kind {kind!r:.40} / segment {segment!r:.80} is not a plain name")
        for name, v in (("layer", layer), ("offset", offset), ("nbytes", nbytes)):
            if type(v) is not int or v < 0 or v >= 2**48:
                raise ValueError(f"ipc region {name} {v!r:.40} must be a non-negative integer")
        return cls(kind, layer, segment, offset, nbytes)

    def to_wire(self) -> list:
        return [self.kind, self.layer, self.segment, self.offset, self.nbytes]


def ipc_params(regions: Sequence[Region], board: Region, layer_board: Region, engine_pid: int,
               digests: Region | None = None) -> dict:
    """What a rank puts under ``ipc`` in its descriptor: its caches, its engine's exposure board
    (pulls from it check handles there) and layer board (pushes into it publish layers there), and
    its digest table where it publishes digests."""
    out = {"regions": [r.to_wire() for r in regions], "board": board.to_wire(), "layer_board": layer_board.to_wire(),
           "engine_pid": engine_pid}
    if digests is not None:
        out["digests"] = digests.to_wire()
    return out


class _Mapping:
    def __init__(self, name: str, writable: bool):
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(shm_path(name), flags)
        except OSError as exc:
            raise PeerUnavailable(f"cannot open the peer's segment {name}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise PeerUnavailable(f"the peer's segment {name} is not a regular file of uid {os.getuid()} "
                                      f"(uid {info.st_uid}, mode {info.st_mode:o}): refusing to map it")
            self.size = info.st_size
            if self.size == 0:
                raise PeerUnavailable(f"the peer's segment {name} is empty")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # Fault every page in now, as device memory is: the first transfers then pay no page faults.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags, prot=prot)
        finally:
            os.close(fd)
        self.writable = writable
        self.array = np.frombuffer(self.mm, dtype=np.uint8)  # read-only when the mapping is
        self.base = int(self.array.ctypes.data)

    def close(self) -> None:
        self.array = None
        self.mm.close()


class IpcPeer:
    """A peer rank's caches and its engine's boards, mapped into this process: read-only for a
    link that only pulls, writable for one that pushes (``writable``)."""

    def __init__(self, params: Any, kind_block_bytes: dict[str, int], layer_counts: dict[str, int], peer_name: str,
                 layer_board_bytes: int, writable: bool = False):
        if not isinstance(params, dict) or not isinstance(params.get("regions"), list):
            raise ValueError(f"{peer_name}: ipc parameters must hold a list of regions")
        regions = [Region.from_wire(r) for r in params["regions"]]
        board = Region.from_wire(params.get("board"))
        layer_board = Region.from_wire(params.get("layer_board"))
        pid = params.get("engine_pid")
        if type(pid) is not int or pid <= 0:
            raise ValueError(f"{peer_name}: ipc engine_pid {pid!r:.40} must be a positive integer")
        self.peer_name = peer_name
        self._maps: dict[str, _Mapping] = {}
        self._engine: ProcessWatch | None = None  # the peer's engine, which owns the mapped caches
        self._sides: dict[str, Side] = {}
        self._board: np.ndarray | None = None
        self.layer_board: np.ndarray | None = None  # the peer engine's layer board, for a push
        self.digests: np.ndarray | None = None  # the peer rank's digest table, where it publishes one
        try:
            self._sides = self._plan(regions, kind_block_bytes, layer_counts, writable)
            if params.get("digests") is not None:
                table = Region.from_wire(params["digests"])
                self.digests = self._words(table, table.nbytes, writable=False).view(np.int64)
            self._board = self._words(board, BOARD_BYTES, writable=False).view(np.int64)
            self.layer_board = self._words(layer_board, layer_board_bytes, writable).view(np.int64) if writable else None
            self._engine = ProcessWatch(pid)
            if self._engine.gone():
                raise PeerUnavailable(f"{peer_name}: its engine (pid {pid}) is not running")
        except BaseException:
            self.close()
            raise

    def _map(self, name: str, writable: bool) -> _Mapping:
        if name not in self._maps:
            self._maps[name] = _Mapping(name, writable)
        elif writable and not self._maps[name].writable:
            raise PeerUnavailable(f"{self.peer_name}: segment {name} is both read-only and written")
        return self._maps[name]

    def _words(self, region: Region, nbytes: int, writable: bool) -> np.ndarray:
        m = self._map(region.segment, writable)
        if region.nbytes != nbytes or region.offset % 8 or region.offset + nbytes > m.size:
            raise PeerUnavailable(f"{self.peer_name}: region {region.to_wire()} does not fit {nbytes} bytes "
                                  f"inside segment {region.segment} of {m.size}")
        return m.array[region.offset:region.offset + nbytes]

    def _plan(self, regions: list[Region], kind_block_bytes: dict[str, int], layer_counts: dict[str, int],
              writable: bool) -> dict[str, Side]:
        by_kind: dict[str, dict[int, Region]] = {}
        for r in regions:
            by_kind.setdefault(r.kind, {})[r.layer] = r
        if set(by_kind) != set(kind_block_bytes):
            raise PeerUnavailable(f"{self.peer_name}: exports cache kinds {sorted(by_kind)}, "
                                  f"this rank has {sorted(kind_block_bytes)}")
        sides = {}
        for kind, layers in by_kind.items():
            num_layers = layer_counts[kind]  # the group's layer tensors
            if sorted(layers) != list(range(num_layers)):
                raise PeerUnavailable(f"{self.peer_name}: exports layers {sorted(layers)} of {kind}, want 0..{num_layers - 1}")
            stride = kind_block_bytes[kind]
            bases, capacities = [], []
            for layer in range(num_layers):
                region = layers[layer]
                if region.nbytes == 0 or region.nbytes % stride:
                    raise PeerUnavailable(f"{self.peer_name}: {kind} layer {layer} holds {region.nbytes} bytes, "
                                          f"not a whole number of {stride}-byte blocks")
                bases.append(int(self._words(region, region.nbytes, writable).ctypes.data))
                capacities.append(region.nbytes // stride)
            sides[kind] = Side(f"peer {self.peer_name} {kind}", np.asarray(bases, dtype=np.int64),
                               np.asarray(capacities, dtype=np.int64), stride)
        return sides

    def side(self, kind: str) -> Side:
        return self._sides[kind]

    def board_word(self, index: int) -> int:
        """Word ``index`` of the peer engine's exposure board (a handle slot or its generation word),
        read after every earlier load of this thread (the bytes of a transfer)."""
        if not 0 <= index < BOARD_WORDS:
            raise ValueError(f"board word {index} outside the board")
        return _shm_atomic.load_after_reads(self._board, index)

    def engine_alive(self) -> bool:
        return self._engine is not None and not self._engine.gone()

    def close(self) -> None:
        self._sides = {}
        self._board = None
        self.layer_board = None
        self.digests = None
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
