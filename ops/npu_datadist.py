"""LLM-DataDist as a second copy engine of the NPU platform, for host swap space.

``NpuPlatform(copy_engine="llm_datadist")`` (CTM flag ``--npu_copy_engine llm_datadist``) routes
every *swap-space* plan (``plan_all_layers``: per-layer device caches <-> per-layer host swap
buffers) to a ``DataDistCopier``; every other plan keeps the pyACL path of ``ops/npu.py``.

How a plan maps onto LLM-DataDist (``llm_datadist``, CANN 8.x; written against its documentation
and tested over the contract stand-in ``tests/standins/llm_datadist``, never run on hardware):

* one ``LLMDataDist(LLMRole.DECODER, cluster_id)`` per copier (per CTM process and device), ``init``
  with ``{"llm.EnableCacheManager": "1", "ge.exec.deviceId": "<device>"}``, its ``cache_manager``;
* the device side of a plan is registered once: ``register_blocks_cache(CacheDesc(num_tensors=layers,
  shape=[blocks, block_elements], data_type, Placement.DEVICE), [layer base addresses])``, where
  ``blocks`` is the smallest layer's block count (the same bound the pyACL path checks ids against);
  the host side is wrapped once with ``Cache.create_cpu_cache`` (``KvCache`` in older releases) over
  the per-layer swap buffers.  Registrations are keyed by address, so a plan rebuilt over the same
  memory reuses them; freeing the memory through the platform unregisters them;
* ``run`` makes ONE ``swap_blocks(src, dst, {src_block: dst_block})`` per plan and direction,
  which moves the listed blocks of every layer.  Ids are checked first (range, and a destination
  listed twice is refused) and nothing moves on a bad id.  A dict cannot name one source block
  for two destinations: such a plan is split into as many calls as the most repeated source has
  destinations (the k-th occurrence of each source goes to call k); destinations are distinct, so
  the split never reorders writes;
* the documented limits are checked before registering, and refused with a ``ValueError`` naming
  the limit: at most ``MAX_REGISTERED_ADDRESSES`` (256) tensor addresses over every registration of
  the process, at most ``MAX_REGISTERED_DEVICE_BYTES`` (50 GB, read as 50 * 10**9 bytes) of device
  memory.  Registration happens when the plan is built, so a CTM fails at start, not at its first swap.

Why only swap space: ``swap_blocks`` moves whole blocks between two caches of the same shape (same
``num_tensors``, same bytes per block).  The storage staging buffer of ``plan_layout`` is
block-major (``[block, layer, *block_shape]``): block ``i`` of layer ``l`` is not block ``i`` of a
per-layer tensor, so it has no ``CacheDesc`` and keeps the pyACL batched copy.

Failures: a refused swap (for example a swap-in that cannot allocate LLM-DataDist's device staging
area of 4 blocks, which the docs advise reserving device memory for) raises ``RuntimeError`` naming
``swap_blocks`` and the direction; the library allocates that area before moving bytes, so such a
swap-in leaves the destination blocks as they were and the task fails.  A failure part-way through
(a runtime copy error, or the second call of a split plan) may leave some destination blocks
written, as with the pyACL path: the task fails and its blocks must not be used.

Threads: ``swap_blocks`` calls are serialised (LLM-DataDist documents no thread safety for the
cache manager); the caller binds the thread to the device first (``NpuPlatform.set_device``).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from .layout import CopyPlan, check_side_ids, orient
from .modes import DEVICE_TO_HOST, BlockIds

logger = logging.getLogger(__name__)

MAX_REGISTERED_ADDRESSES = 256  # over register_cache + register_blocks_cache (240 in some releases)
MAX_REGISTERED_DEVICE_BYTES = 50 * 10**9
DATA_TYPES = {"bfloat16": "DT_BF16", "float16": "DT_FLOAT16", "float32": "DT_FLOAT", "uint8": "DT_UINT8"}
OPTIONS = {"llm.EnableCacheManager": "1"}


def import_llm_datadist() -> Any:
    try:
        import llm_datadist  # CANN's LLM-DataDist: source <cann>/set_env.sh
    except ImportError as exc:
        raise RuntimeError(f"--npu_copy_engine llm_datadist needs CANN's 'llm_datadist' package, which cannot be "
                           f"imported ({exc}); the default copy engine is 'acl'") from exc
    return llm_datadist


def split_by_source(src_ids: list[int], dst_ids: list[int]) -> list[dict[int, int]]:
    """``{src: dst}`` mappings, as few as possible: the k-th occurrence of a source goes to mapping k."""
    calls: list[dict[int, int]] = []
    seen: dict[int, int] = {}
    for s, d in zip(src_ids, dst_ids):
        k = seen.get(s, 0)
        seen[s] = k + 1
        if k == len(calls):
            calls.append({})
        calls[k][s] = d
    return calls


def is_swap_space_plan(plan: CopyPlan) -> bool:
    """Both sides per-layer ``[blocks, block]`` arrays: what ``swap_blocks`` can move."""
    return plan.device.stride == plan.block_bytes and plan.host.stride == plan.block_bytes


@dataclass
class _Registration:
    cache: Any  # the device Cache from register_blocks_cache
    addrs: tuple[int, ...]
    nbytes: int


class DataDistCopier:
    """LLM-DataDist's ``swap_blocks`` for the swap-space plans of one CTM rank (one device)."""

    def __init__(self, device_id: int, cluster_id: int | None = None, role: str = "DECODER", module: Any = None):
        self._dd = module if module is not None else import_llm_datadist()
        self.device_id = int(device_id)
        self._cache_cls = getattr(self._dd, "Cache", None) or self._dd.KvCache
        self.cluster_id = os.getpid() if cluster_id is None else int(cluster_id)
        self._llm = self._dd.LLMDataDist(self._dd.LLMRole[role], self.cluster_id)
        self._llm.init({**OPTIONS, "ge.exec.deviceId": str(self.device_id)})
        try:
            self._manager = self._llm.cache_manager
        except BaseException:
            self._llm.finalize()
            raise
        self._lock = threading.Lock()  # registrations
        self._swap_lock = threading.Lock()  # swap_blocks calls
        self._device: dict[tuple, _Registration] = {}
        self._host: dict[tuple, Any] = {}
        self._closed = False
        logger.info("LLM-DataDist copy engine on npu:%d (cluster id %d)", self.device_id, self.cluster_id)

    # -- registration ----------------------------------------------------------------
    def _data_type(self, plan: CopyPlan) -> Any:
        name = DATA_TYPES.get(plan.dtype.name)
        if name is None:
            raise ValueError(f"LLM-DataDist copy engine: no DataType for cache dtype {plan.dtype.name}")
        return getattr(self._dd.DataType, name)

    def prepare(self, plan: CopyPlan) -> tuple[Any, Any]:
        """Register the plan's device caches and wrap its host swap space (once per address set);
        ``(device cache, host cache)``, the host cache None when the plan has no host blocks."""
        if self._closed:
            raise RuntimeError("the LLM-DataDist copy engine was closed")
        if not is_swap_space_plan(plan):
            raise ValueError("LLM-DataDist swaps whole blocks of per-layer caches; this plan is block-major "
                             "(storage staging) and goes through the pyACL copy")
        bb, itemsize = plan.block_bytes, plan.dtype.itemsize
        layers = len(plan.device.bases)
        dev_addrs = tuple(int(a) for a in plan.device.bases)
        blocks = int(plan.device.capacities.min())
        host_addrs = tuple(int(a) for a in plan.host.bases)
        host_blocks = int(plan.host.capacities.min()) if plan.host.capacities.size else 0
        dt = self._data_type(plan)
        with self._lock:
            dkey = (dev_addrs, blocks, bb, plan.dtype.name)
            reg = self._device.get(dkey)
            if reg is None:
                nbytes = layers * blocks * bb
                have_addrs = sum(len(r.addrs) for r in self._device.values())
                have_bytes = sum(r.nbytes for r in self._device.values())
                if have_addrs + layers > MAX_REGISTERED_ADDRESSES:
                    raise ValueError(
                        f"LLM-DataDist registers at most {MAX_REGISTERED_ADDRESSES} tensor addresses per process "
                        f"(register_cache + register_blocks_cache): this swap plan needs {layers}, {have_addrs} are "
                        f"registered; use --npu_copy_engine acl for this model")
                if have_bytes + nbytes > MAX_REGISTERED_DEVICE_BYTES:
                    raise ValueError(
                        f"LLM-DataDist registers at most 50 GB ({MAX_REGISTERED_DEVICE_BYTES} bytes) of device memory "
                        f"per process: this swap plan describes {nbytes} bytes, {have_bytes} are registered; "
                        f"use --npu_copy_engine acl for this model")
                desc = self._dd.CacheDesc(layers, [blocks, bb // itemsize], dt, self._dd.Placement.DEVICE)
                try:
                    cache = self._manager.register_blocks_cache(desc, list(dev_addrs))
                except Exception as exc:
                    raise RuntimeError(f"LLM-DataDist register_blocks_cache of {layers} caches x {blocks} blocks "
                                       f"on npu:{self.device_id} failed: {exc}") from exc
                reg = self._device[dkey] = _Registration(cache, dev_addrs, nbytes)
                logger.info("LLM-DataDist: registered %d device caches of %d blocks x %d bytes", layers, blocks, bb)
            if host_blocks == 0:
                return reg.cache, None
            hkey = (host_addrs, host_blocks, bb, plan.dtype.name)
            host = self._host.get(hkey)
            if host is None:
                desc = self._dd.CacheDesc(layers, [host_blocks, bb // itemsize], dt, self._dd.Placement.HOST)
                host = self._host[hkey] = self._cache_cls.create_cpu_cache(desc, list(host_addrs))
            return reg.cache, host

    # -- copies ------------------------------------------------------------------------
    def run(self, plan: CopyPlan, device_ids: BlockIds, host_ids: BlockIds, mode: int) -> int:
        """Copy the listed blocks of every layer with one ``swap_blocks`` per plan and direction (more
        only when a source block goes to several destinations).  Returns the block copies made."""
        c = orient(plan, device_ids, host_ids, mode)
        check_side_ids(c.src_ids, c.src, unique=False)
        check_side_ids(c.dst_ids, c.dst, unique=True)
        if c.src_ids.size == 0:
            return 0
        device, host = self.prepare(plan)
        src, dst = (device, host) if c.mode == DEVICE_TO_HOST else (host, device)
        what = "swap out (device->host)" if c.mode == DEVICE_TO_HOST else "swap in (host->device)"
        calls = split_by_source(c.src_ids.tolist(), c.dst_ids.tolist())
        with self._swap_lock:
            for i, mapping in enumerate(calls):
                try:
                    self._manager.swap_blocks(src, dst, mapping)
                except Exception as exc:
                    part = f", call {i + 1} of {len(calls)}" if len(calls) > 1 else ""
                    raise RuntimeError(f"LLM-DataDist swap_blocks {what} of {len(mapping)} blocks x "
                                       f"{len(plan.device.bases)} layers on npu:{self.device_id} failed{part}: "
                                       f"{exc}") from exc
        return int(c.src_ids.size) * len(plan.device.bases)

    # -- lifetime ----------------------------------------------------------------------
    def forget(self, ptr: int) -> bool:
        """Drop every registration that uses the memory at ``ptr`` (it is being freed); whether any remain."""
        ptr = int(ptr)
        with self._lock:
            gone = [k for k, r in self._device.items() if ptr in r.addrs]
            regs = [self._device.pop(k) for k in gone]
            for k in [k for k in self._host if ptr in k[0]]:
                del self._host[k]
            remaining = bool(self._device or self._host)
        for reg in regs:
            self._manager.unregister_cache(reg.cache.cache_id)
        return remaining

    def close(self) -> None:
        """Unregister everything and finalise LLM-DataDist (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regs, self._device, self._host = list(self._device.values()), {}, {}
        try:
            for reg in regs:
                self._manager.unregister_cache(reg.cache.cache_id)
        finally:
            self._llm.finalize()
