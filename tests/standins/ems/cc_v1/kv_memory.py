"""The registered KV caches of the EMS contract stand-in (tests only; not the Huawei SDK).

``register_kvcache`` takes ``List[List[tensor]]``, one inner list per layer: ``[K, V]`` (MHA) or
``[K]`` (MLA), every tensor in EMS's documented shape ``[GPU_blocks, Block_size, heads,
head_size]``.  Rejected with ``EMS_INVALID_ARGUMENT``: an empty or non-list argument, an inner
list of the wrong length for the ``kvcache_type``, an object without ``data_ptr()``, ``shape`` and
``element_size()``, a shape that is not 4-D of positive sizes, a null pointer, a non-contiguous
tensor, a tensor not in host memory (paddle ``place`` other than CPU or pinned), and tensors that
differ in shape, element size or dtype.

The real SDK takes NPU tensors only and reads/writes device memory itself.  On this CPU-only
host the stand-in accepts host-addressable tensors and reads/writes them through the pointers
``data_ptr()`` gave at registration, with ``ctypes.string_at``/``ctypes.memmove``.  Token slot
``s`` of a tensor is the row at ``data_ptr + (s // block_size) * block_bytes + (s % block_size) *
row_bytes`` (``row_bytes = heads * head_size * element_size``, ``block_bytes = block_size *
row_bytes``); a block's bytes are those rows layer-major, then K before V, then in token order.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

from ..errors import invalid
from ..options import is_int
from .cc_config import KVCacheType


def _describe(tensor: Any) -> tuple[int, list[int], int, str]:
    """(data pointer, shape, element size, dtype text) of one tensor, or ``EMS_INVALID_ARGUMENT``."""
    if not callable(getattr(tensor, "data_ptr", None)) or not callable(getattr(tensor, "element_size", None)) \
            or not hasattr(tensor, "shape"):
        raise invalid(f"register_kvcache: {type(tensor).__name__} is not a tensor (needs data_ptr(), shape and "
                      f"element_size())")
    place = getattr(tensor, "place", None)
    if place is not None and callable(getattr(place, "is_cpu_place", None)):
        pinned = getattr(place, "is_cuda_pinned_place", None)
        if not place.is_cpu_place() and not (callable(pinned) and pinned()):
            raise invalid(f"register_kvcache: tensor on {place} is not host-addressable (the stand-in reads tensors "
                          f"through data_ptr() on the host)")
    contiguous = getattr(tensor, "is_contiguous", None)
    if callable(contiguous) and not contiguous():
        raise invalid("register_kvcache: tensor is not contiguous")
    shape = list(tensor.shape)
    if len(shape) != 4 or not all(is_int(d) and d > 0 for d in shape):
        raise invalid(f"register_kvcache: tensor shape {shape} is not [GPU_blocks, Block_size, heads, head_size] "
                      f"(4-D, every size > 0)")
    ptr, size = tensor.data_ptr(), tensor.element_size()
    if not is_int(ptr) or ptr == 0:
        raise invalid(f"register_kvcache: tensor data_ptr() {ptr!r} is not a valid address")
    if not is_int(size) or size <= 0:
        raise invalid(f"register_kvcache: tensor element_size() {size!r} is not a positive int")
    return ptr, shape, size, str(getattr(tensor, "dtype", ""))


def _runs(slots: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """``slots`` as (first slot, count) runs of consecutive slots inside one block, in order."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs:
            first, count = runs[-1]
            last = first + count - 1
            if s == last + 1 and s // block_size == first // block_size:
                runs[-1] = (first, count + 1)
                continue
        runs.append((s, 1))
    return runs


class RegisteredCaches:
    """One rank's registered caches: validated geometry plus the base pointers to read and write."""

    def __init__(self, kvcache: Any, kvcache_type: KVCacheType) -> None:
        if not isinstance(kvcache, list) or not kvcache:
            raise invalid("register_kvcache: kvcache must be a non-empty list (one list of tensors per layer)")
        per_layer = kvcache_type.tensors_per_layer
        self.tensors: list[list[Any]] = []  # kept alive: the pointers below point into them
        self.pointers: list[list[int]] = []
        first: tuple[list[int], int, str] | None = None
        for i, layer in enumerate(kvcache):
            if not isinstance(layer, list) or len(layer) != per_layer:
                raise invalid(f"register_kvcache: layer {i} must be a list of {per_layer} tensor(s) for "
                              f"{kvcache_type.name}, got {layer!r:.80}")
            ptrs = []
            for tensor in layer:
                ptr, shape, size, dtype = _describe(tensor)
                if first is None:
                    first = (shape, size, dtype)
                elif (shape, size, dtype) != first:
                    raise invalid(f"register_kvcache: layer {i} tensor (shape {shape}, element size {size}, {dtype}) "
                                  f"differs from the first (shape {first[0]}, element size {first[1]}, {first[2]})")
                ptrs.append(ptr)
            self.tensors.append(list(layer))
            self.pointers.append(ptrs)
        assert first is not None
        (self.num_blocks, self.block_size, heads, head_size), self.element_size, _ = first
        self.row_bytes = heads * head_size * self.element_size
        self.block_bytes = self.block_size * self.row_bytes
        self.token_bytes = self.row_bytes * len(self.pointers) * per_layer  # one token, every layer and tensor
        self.num_slots = self.num_blocks * self.block_size

    def _spans(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """(address, bytes) of every piece of ``slots``, in the stored byte order."""
        runs = _runs(slots, self.block_size)
        bs, block_bytes, row_bytes = self.block_size, self.block_bytes, self.row_bytes
        return [(base + (s // bs) * block_bytes + (s % bs) * row_bytes, n * row_bytes)
                for layer in self.pointers for base in layer for s, n in runs]

    def gather(self, slots: Sequence[int]) -> bytes:
        """The bytes of ``slots`` (layer-major, K then V, token order)."""
        return b"".join(ctypes.string_at(addr, n) for addr, n in self._spans(slots))

    def scatter(self, slots: Sequence[int], data: bytes) -> None:
        """Write ``data`` (as ``gather`` lays it out) into ``slots``."""
        if len(data) != len(slots) * self.token_bytes:
            raise ValueError(f"scatter: {len(data)} bytes for {len(slots)} slots of {self.token_bytes} bytes")
        buf = ctypes.create_string_buffer(data, len(data))
        src = ctypes.addressof(buf)
        offset = 0
        for addr, n in self._spans(slots):
            ctypes.memmove(addr, src + offset, n)
            offset += n
