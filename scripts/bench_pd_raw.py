"""The raw Transfer Engine floors of ``bench_pd.py``: this process's own engine making the raw
``batch_transfer_sync_*`` calls over exactly the runs a CTM rank builds (same ``coalesce`` of the
same ids, same addresses on both sides), cut into batches the TCP transport accepts."""
from __future__ import annotations

import logging

import numpy as np

from engine_hooks.pd import PrefillDecode
from transfer_factory.peer.te import TransferEngineEndpoint, block_addresses, coalesce

TE_SLICE = 64 << 10  # the TCP transport cuts a run into slices of this size


class RawTe:
    """This process's own Transfer Engine (opened and registered through the CTM's endpoint class;
    the transfers are raw ``batch_transfer_sync_*`` calls), with D's and P-te's cache memory
    registered, for the floors: the same runs the ranks move, between the same memory."""

    def __init__(self, d_views: list, p_views: list, log: logging.Logger):
        self.ep = TransferEngineEndpoint("127.0.0.1", "tcp", log)
        self.ep.open()
        self.engine = self.ep._engine  # the raw engine, for the raw calls
        for rank_views in d_views + p_views:
            for layers in rank_views.values():
                for v in layers:
                    self.ep.register(int(v.ctypes.data), int(v.nbytes))
        self.scratch = np.zeros(1, dtype=np.int64)
        self.ep.register(int(self.scratch.ctypes.data), self.scratch.nbytes)

    def read(self, address: str, batches: list[tuple]) -> None:
        for runs in batches:
            rc = self.engine.batch_transfer_sync_read(address, *runs)
            if rc != 0:
                raise RuntimeError(f"raw batch_transfer_sync_read of {len(runs[2])} runs from {address} failed ({rc})")

    def write(self, address: str, batches: list[tuple]) -> None:
        for runs in batches:
            rc = self.engine.batch_transfer_sync_write(address, *runs)
            if rc != 0:
                raise RuntimeError(f"raw batch_transfer_sync_write of {len(runs[2])} runs to {address} failed ({rc})")

    def word(self, address: str, remote: int) -> None:
        self.read(address, [([int(self.scratch.ctypes.data)], [remote], [8])])

    def close(self) -> None:
        self.ep.close()


def te_params(side: PrefillDecode) -> list[dict]:
    """Per rank, the ``mooncake`` transport of ``side``'s descriptor (its rank engine's address and
    the addresses of its caches in that rank's process)."""
    return [r["transports"]["mooncake"] for r in side.descriptor(["ipc", "mooncake"])["ranks"]]


def remote_bases(params: dict, layers: int) -> dict[str, np.ndarray]:
    bases: dict[str, list[int]] = {}
    for kind, layer, ptr, _ in params["regions"]:
        bases.setdefault(kind, [0] * layers)[layer] = int(ptr)
    return {k: np.asarray(v, dtype=np.int64) for k, v in bases.items()}


def local_bases(rank_views: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.asarray([int(v.ctypes.data) for v in layers], dtype=np.int64) for k, layers in rank_views.items()}


def runs_for(local: dict[str, np.ndarray], remote: dict[str, np.ndarray], stride: int, local_ids: list[int],
             remote_ids: list[int], layers: range) -> tuple[list[int], list[int], list[int]]:
    """What ``PeerTransfers._copy_te`` builds: per kind, every layer, contiguous blocks coalesced."""
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    for kind in local:
        runs = coalesce(block_addresses(local[kind], stride, local_ids, layers),
                        block_addresses(remote[kind], stride, remote_ids, layers), stride)
        for acc, part in zip(out, runs):
            acc += part
    return out


def batches(runs: tuple[list[int], list[int], list[int]], max_slices: int) -> list[tuple]:
    """The runs in order, cut into batches of at most ``max_slices`` transport slices."""
    out: list[tuple] = []
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    slices = 0
    for lo, ro, n in zip(*runs):
        k = -(-n // TE_SLICE)
        if cur[2] and slices + k > max_slices:
            out.append(cur)
            cur, slices = ([], [], []), 0
        cur[0].append(lo)
        cur[1].append(ro)
        cur[2].append(n)
        slices += k
    if cur[2]:
        out.append(cur)
    return out
