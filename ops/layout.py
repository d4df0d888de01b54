"""Platform-free checks and address plans for block copies.

A copy is described per side (device caches, host buffers) by per-layer base
addresses, a block stride and a capacity in blocks.  Building a plan checks every
argument a user passes; the kernels then only move bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .dtypes import CacheDtype, cache_dtype
from .modes import DEVICE_TO_HOST, HOST_TO_DEVICE


@dataclass(frozen=True)
class TensorInfo:
    """What a copy needs to know about one cache tensor."""

    ptr: int
    shape: tuple[int, ...]
    dtype: CacheDtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def tensor_info(tensor: Any, what: str) -> TensorInfo:
    """Pointer, shape and dtype of a paddle tensor or a numpy array, which must be contiguous."""
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise ValueError(f"{what} must be contiguous")
        return TensorInfo(tensor.ctypes.data, tuple(tensor.shape), cache_dtype(tensor.dtype))
    if not hasattr(tensor, "data_ptr"):
        raise ValueError(f"{what} is a {type(tensor).__name__}, not a tensor")
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    try:
        dtype = cache_dtype(tensor.dtype)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return TensorInfo(int(tensor.data_ptr()), tuple(int(d) for d in tensor.shape), dtype)


_PLAIN_INTS = {int}


def plain_int_list(value: Any) -> bool:
    """Whether ``value`` is a list of plain ints (a bool is not one), checked without a Python
    step per item: the common case of every block id list, on the engine's and the rank's side."""
    return type(value) is list and set(map(type, value)) <= _PLAIN_INTS


def block_ids(ids: Any, what: str) -> np.ndarray:
    """Block ids as a contiguous int64 array; floats, bools and nested lists are refused."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        if arr.ndim == 0:
            raise ValueError(f"{what} must be a sequence of block ids, got {ids!r}")
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        bad = next((v for v in arr.tolist() if not isinstance(v, int) or isinstance(v, bool)), arr[0])
        raise ValueError(f"{what}: block id {bad!r} is not an integer")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_mode(mode: Any) -> int:
    if mode not in (DEVICE_TO_HOST, HOST_TO_DEVICE) or isinstance(mode, bool):
        raise ValueError(f"mode {mode!r} must be 0 (device->host) or 1 (host->device)")
    return int(mode)


def check_same_length(device_ids: np.ndarray, host_ids: np.ndarray) -> None:
    if device_ids.size != host_ids.size:
        raise ValueError(
            f"device_block_ids has {device_ids.size} ids but host_block_ids has {host_ids.size}"
        )


@dataclass(frozen=True)
class Side:
    """One side of a copy: where block ``id`` of layer ``l`` starts is ``bases[l] + id * stride``."""

    name: str
    bases: np.ndarray  # int64 [layers]
    capacities: np.ndarray  # int64 [layers], in blocks
    stride: int


@dataclass(frozen=True)
class CopyPlan:
    device: Side
    host: Side
    block_bytes: int
    dtype: CacheDtype


def layer_range(plan: CopyPlan, first: int, stop: int) -> CopyPlan:
    """The part of ``plan`` that covers layers ``[first, stop)``: what a layer-wise task copies
    before it publishes those layers."""
    layers = len(plan.device.bases)
    if not 0 <= first < stop <= layers:
        raise ValueError(f"layer range [{first}, {stop}) is not inside the plan's {layers} layers")

    def cut(side: Side) -> Side:
        return Side(side.name, side.bases[first:stop], side.capacities[first:stop], side.stride)

    return CopyPlan(cut(plan.device), cut(plan.host), plan.block_bytes, plan.dtype)


def merge_plans(plans: Sequence[CopyPlan]) -> CopyPlan:
    """One plan that copies what every plan of ``plans`` copies, each one's layers in turn; they
    must share block size and strides (e.g. K and V of one layer)."""
    first = plans[0]
    for p in plans[1:]:
        if (p.block_bytes, p.device.stride, p.host.stride) != (first.block_bytes, first.device.stride, first.host.stride):
            raise ValueError("plans with different block sizes or strides cannot be merged")
    if len(plans) == 1:
        return first

    def join(sides: list[Side]) -> Side:
        return Side(sides[0].name, np.concatenate([s.bases for s in sides]),
                    np.concatenate([s.capacities for s in sides]), sides[0].stride)

    return CopyPlan(join([p.device for p in plans]), join([p.host for p in plans]), first.block_bytes, first.dtype)


@dataclass(frozen=True)
class Oriented:
    """A checked copy request: which side is read, which is written, and with which ids."""

    src: "Side"
    dst: "Side"
    src_ids: np.ndarray
    dst_ids: np.ndarray
    mode: int


def orient(plan: "CopyPlan", device_block_ids: Any, host_block_ids: Any, mode: Any) -> Oriented:
    """Checks mode, ids and lengths of a copy request and orients it by ``mode``."""
    mode = check_mode(mode)
    dev = block_ids(device_block_ids, "device_block_ids")
    host = block_ids(host_block_ids, "host_block_ids")
    check_same_length(dev, host)
    if mode == DEVICE_TO_HOST:
        return Oriented(plan.device, plan.host, dev, host, mode)
    return Oriented(plan.host, plan.device, host, dev, mode)


def check_side_ids(ids: np.ndarray, side: Side, unique: bool) -> None:
    """Every id inside every layer's capacity and, for a destination, listed once.

    The CPU kernel makes the same checks in C; platforms without it call this before copying.
    """
    cap = int(side.capacities.min()) if side.capacities.size else 0
    bad = np.flatnonzero((ids < 0) | (ids >= cap))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{side.name} block id {int(ids[i])} at position {i} is out of range [0, {cap})")
    if unique and ids.size > 1:
        order = np.argsort(ids, kind="stable")
        dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
        if dup.size:
            i = int(order[1:][dup].min())
            raise ValueError(f"{side.name} block id {int(ids[i])} appears more than once (again at position {i})")


def describe_caches(caches: Sequence[Any], expect_shape: Sequence[int] | None = None) -> tuple[list[TensorInfo], int]:
    """Checks a list of per-layer caches; returns their infos and the common bytes per block."""
    if isinstance(caches, (str, bytes)) or not hasattr(caches, "__len__") or len(caches) == 0:
        raise ValueError("caches must be a non-empty list of per-layer tensors")
    infos = [tensor_info(t, f"caches[{i}]") for i, t in enumerate(caches)]
    first = infos[0]
    block_bytes = None
    for i, info in enumerate(infos):
        if len(info.shape) < 2 or info.shape[0] <= 0:
            raise ValueError(f"caches[{i}] has shape {list(info.shape)}; expected [num_blocks, ...]")
        if info.dtype != first.dtype:
            raise ValueError(f"caches[{i}] has dtype {info.dtype.name}, caches[0] has {first.dtype.name}")
        # Layers may differ in block count (speculative extra layers), never in block shape.
        if expect_shape is not None and list(info.shape[1:]) != list(expect_shape[1:]):
            raise ValueError(f"caches[{i}] has shape {list(info.shape)}, cache_shape is {list(expect_shape)}")
        this_block = info.nbytes // info.shape[0]
        if block_bytes is None:
            block_bytes = this_block
        elif this_block != block_bytes:
            raise ValueError(
                f"caches[{i}] has {this_block} bytes per block, caches[0] has {block_bytes}"
            )
    return infos, int(block_bytes)


def device_side(infos: Sequence[TensorInfo], block_bytes: int) -> Side:
    return Side(
        "device",
        np.array([i.ptr for i in infos], dtype=np.int64),
        np.array([i.shape[0] for i in infos], dtype=np.int64),
        block_bytes,
    )


class HostAllocations:
    """Bookkeeping of host allocations, so a raw host pointer can be bounds-checked."""

    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}

    def add(self, ptr: int, nbytes: int) -> None:
        self._sizes[ptr] = nbytes

    def pop(self, ptr: int) -> int:
        if ptr not in self._sizes:
            raise ValueError(f"host pointer {ptr:#x} was not returned by host_alloc (or was freed already)")
        return self._sizes.pop(ptr)

    def room(self, ptr: int, what: str) -> int:
        """Bytes from ``ptr`` to the end of the allocation that contains it."""
        if not isinstance(ptr, (int, np.integer)) or isinstance(ptr, bool):
            raise ValueError(f"{what} {ptr!r} is not an integer address")
        ptr = int(ptr)
        for base, size in self._sizes.items():
            if base <= ptr < base + size:
                return base + size - ptr
        raise ValueError(f"{what} {ptr:#x} is not inside any host_alloc allocation")

    def __iter__(self):
        return iter(list(self._sizes))


def all_layers_plan(
    caches: Sequence[Any], host_ptrs: Sequence[int], num_cpu_blocks: int, hosts: HostAllocations
) -> CopyPlan:
    """Plan for ``swap_cache_all_layers``: one host buffer per layer, same block size."""
    infos, block_bytes = describe_caches(caches)
    if isinstance(host_ptrs, (int, np.integer)) or len(host_ptrs) != len(infos):
        n = 1 if isinstance(host_ptrs, (int, np.integer)) else len(host_ptrs)
        raise ValueError(f"caches has {len(infos)} layers but host_ptrs has {n} pointers")
    if not isinstance(num_cpu_blocks, (int, np.integer)) or isinstance(num_cpu_blocks, bool) or num_cpu_blocks < 0:
        raise ValueError(f"num_cpu_blocks {num_cpu_blocks!r} must be a non-negative integer")
    for i, ptr in enumerate(host_ptrs):
        room = hosts.room(ptr, f"host_ptrs[{i}]")
        if int(num_cpu_blocks) * block_bytes > room:
            raise ValueError(
                f"host_ptrs[{i}] has room for {room // block_bytes} blocks of {block_bytes} bytes, "
                f"num_cpu_blocks is {num_cpu_blocks}"
            )
    host = Side(
        "host",
        np.array([int(p) for p in host_ptrs], dtype=np.int64),
        np.full(len(infos), int(num_cpu_blocks), dtype=np.int64),
        block_bytes,
    )
    return CopyPlan(device_side(infos, block_bytes), host, block_bytes, infos[0].dtype)


def layout_plan(
    caches: Sequence[Any], host_base_ptr: int, cache_shape: Sequence[int], hosts: HostAllocations
) -> CopyPlan:
    """Plan for ``swap_cache_layout``: a block-major staging buffer ``[block, layer, *block_shape]``."""
    try:
        shape = [int(d) for d in cache_shape]
    except (TypeError, ValueError):
        raise ValueError(f"cache_shape {cache_shape!r} must be a list of integers") from None
    if len(shape) < 2 or any(d <= 0 for d in shape):
        raise ValueError(f"cache_shape {shape} must be [num_blocks, ...] with positive dimensions")
    infos, block_bytes = describe_caches(caches, expect_shape=shape)
    layers = len(infos)
    room = hosts.room(host_base_ptr, "host_base_ptr")
    staging_blocks = room // (layers * block_bytes)
    host = Side(
        "host",
        np.array([int(host_base_ptr) + l * block_bytes for l in range(layers)], dtype=np.int64),
        np.full(layers, staging_blocks, dtype=np.int64),
        layers * block_bytes,
    )
    return CopyPlan(device_side(infos, block_bytes), host, block_bytes, infos[0].dtype)
