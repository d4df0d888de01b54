"""Which storage objects a task moves: one per block and cache group, all layers of the group.

A block's objects are keyed ``{namespace}/{block hash}/{rank}/{tag}`` (the group's tag: ``k``,
``v``, ``k_scale``, ``v_scale`` for FastDeploy's caches, the group's name otherwise).  A write
stores every block group's objects, a sliding window's too: any block may end a later request's
prefix hit, and its window must then be there (storing only each write's last window served 13.5%
of a trace whose ceiling is 64%).  A read loads a sliding-window group's objects only for the
window at the end of its run.  A state group (one slot per request) has one object per write,
under its last block, taken from and given to the task's state slot.  So a task says per block
which groups it moves: a mask of ``[blocks, groups]``.  ``None`` is every object of every block,
the common case, on the paths it always took.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from transfer_factory.keys import Namespace, storage_key

Mask = "np.ndarray | None"


@dataclass
class ObjectGroup:
    """One cache group's per-layer tensors, and its window in blocks (None: every block).  A
    ``per_request`` (state) group's rows are request slots: its window is the last block, its
    device row the task's state slot."""

    tag: str
    tensors: list[Any]
    block_bytes: int  # per layer
    layer_ptrs: list[int]
    window: int | None = None
    per_request: bool = False

    @property
    def object_bytes(self) -> int:
        return self.block_bytes * len(self.tensors)


class BlockObjects:
    def __init__(self, groups: Sequence[ObjectGroup]):
        self.groups = list(groups)
        self._windows = np.array([g.window if g.window is not None else -1 for g in self.groups])
        self._state = np.array([g.per_request for g in self.groups], dtype=bool)
        self._windows[self._state] = 1  # a state group: the last block's object, from the state slot
        self.windowed = bool((self._windows >= 0).any())
        self.has_state = bool(self._state.any())
        self._sizes = np.array([g.object_bytes for g in self.groups], dtype=np.int64)

    def _w(self, state: int | None) -> np.ndarray:
        """Each group's window in blocks (-1: every block; 0: none, a state group without a slot)."""
        return self._windows if state is not None or not self.has_state else np.where(self._state, 0, self._windows)

    # ------------------------------------------------------------------ masks
    def write_mask(self, first: int, n: int, total: int, state: int | None = None) -> np.ndarray | None:
        """Blocks ``[first, first + n)`` of a write of ``total`` blocks: every block group's object,
        a state group's only for the write's last block (with a state slot)."""
        if not self.has_state:
            return None
        w = np.where(self._state, self._w(state), -1)
        index = np.arange(first, first + n)[:, None]
        return (w < 0)[None, :] | (index >= total - np.where(w < 0, 0, w)[None, :]) & (w > 0)[None, :]

    def without_windows(self, n: int) -> np.ndarray | None:
        """The first pass of a read: every group but the windowed and state ones."""
        if not self.windowed:
            return None
        return np.broadcast_to(self._windows < 0, (n, len(self.groups))).copy()

    def window_mask(self, n: int, state: int | None = None) -> np.ndarray:
        """The last ``n`` blocks of a read's run: each windowed group's objects of its window."""
        w = self._w(state)
        index = np.arange(n)[:, None]
        return (w > 0)[None, :] & (index >= n - w[None, :])

    def window_end(self, present: np.ndarray, run: int, state: int | None = None) -> int:
        """The longest run ``<= run`` whose windows are all present (``present``: ``[run, groups]``
        of the windowed groups' objects; other columns ignored)."""
        for end in range(run, 0, -1):
            need = self.window_mask(end, state)
            if present[:end][need].all():
                return end
        return 0

    def staging_slots(self, max_blocks: int) -> list[int]:
        """Per group, the slots of its staging buffer: a state group stages one object per task."""
        return [1 if s else max_blocks for s in self._state]

    def slots(self, column: int, n: int) -> list[int]:
        """The staging slots of group ``column`` for a batch's ``n`` blocks (a state group: slot 0)."""
        return [0] * n if self._state[column] else list(range(n))

    def rows(self, column: int, gpu_ids: Sequence[int], state: int | None) -> list[int]:
        """The device rows of group ``column`` for a batch's blocks: the blocks, or for a state
        group the task's state slot."""
        return [state] * len(gpu_ids) if self._state[column] else list(gpu_ids)

    # ------------------------------------------------------------------ batches
    def keys(self, namespace: Namespace | str, rank: int, hashes: Sequence[str], mask: np.ndarray | None) -> list[str]:
        """Block-major (every group of block 0, then of block 1, ...): a store that fills up midway
        keeps whole leading blocks."""
        if mask is None:
            return [storage_key(namespace, h, rank, g.tag) for h in hashes for g in self.groups]
        return [storage_key(namespace, h, rank, g.tag) for h, row in zip(hashes, mask)
                for g, on in zip(self.groups, row) if on]

    def direct(self, gpu_ids: Sequence[int], mask: np.ndarray | None,
               state: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Per object: the address of the block (a state group: the slot) in every layer's cache."""
        rows = mask if mask is not None else np.ones((len(gpu_ids), len(self.groups)), dtype=bool)
        ptrs = [[base + (state if s else gid) * g.block_bytes for base in g.layer_ptrs]
                for gid, row in zip(gpu_ids, rows) for g, on, s in zip(self.groups, row, self._state) if on]
        sizes = [[g.block_bytes] * len(g.layer_ptrs) for row in rows for g, on in zip(self.groups, row) if on]
        return ptrs, sizes

    def staged(self, buffers: Sequence[int], n: int, mask: np.ndarray | None) -> tuple[list[int], list[int]]:
        """Per object: its slot in the group's staging buffer (block ``j``'s slot is ``j``)."""
        if mask is None:
            return ([ptr + j * g.object_bytes for j in range(n) for g, ptr in zip(self.groups, buffers)],
                    [g.object_bytes for _ in range(n) for g in self.groups])
        pairs = [(ptr + (0 if s else j) * g.object_bytes, g.object_bytes) for j in range(n)
                 for g, ptr, on, s in zip(self.groups, buffers, mask[j], self._state) if on]
        return [p for p, _ in pairs], [s for _, s in pairs]

    def sizes(self, n: int, mask: np.ndarray | None) -> np.ndarray:
        """The bytes of each object of a batch, in its order."""
        return np.tile(self._sizes, n) if mask is None else np.broadcast_to(self._sizes, mask.shape)[mask]

    def per_block(self, ok: Sequence[bool], n: int, mask: np.ndarray | None) -> list[bool]:
        """Whether every object a block moved succeeded (a block that moved none did)."""
        if mask is None:
            return np.array(ok, dtype=bool).reshape(n, len(self.groups)).all(axis=1).tolist()
        full = np.ones(mask.shape, dtype=bool)
        full[mask] = np.asarray(ok, dtype=bool)
        return full.all(axis=1).tolist()

    def per_group(self, ok: Sequence[bool], mask: np.ndarray) -> np.ndarray:
        """``[blocks, groups]``: the batch's results in place, False where nothing was asked."""
        out = np.zeros(mask.shape, dtype=bool)
        out[mask] = np.asarray(ok, dtype=bool)
        return out

    def nbytes(self, mask: np.ndarray | None, n: int) -> int:
        return int(self._sizes.sum()) * n if mask is None else int(self.sizes(n, mask[:n]).sum())
