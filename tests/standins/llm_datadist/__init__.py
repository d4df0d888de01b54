"""Contract stand-in for Huawei's LLM-DataDist (``llm_datadist``, CANN 8.x), for tests only.

Not the vendor package: importable as ``llm_datadist`` only when a test puts ``tests/standins`` on
``sys.path``.  It runs ON the pyACL stand-in (``tests/standins/acl``): every byte it moves goes
through ``acl.rt.memcpy`` with the kind the move needs, and its swap-in staging area comes from
``acl.rt.malloc``/``acl.rt.free``, so device memory stays unreachable from the host and a full
device refuses a swap-in as hardware would.  The swap subset ``ops/npu_datadist.py`` uses:

``LLMDataDist(LLMRole.PROMPT | DECODER | MIX, cluster_id)``, ``init(options)``, ``cache_manager``,
``finalize()``; ``CacheDesc(num_tensors, shape, data_type, placement=Placement.DEVICE, ...)``;
``BlocksCacheKey(prompt_cluster_id, model_id=0)``; ``cache_manager.register_blocks_cache(desc, addrs,
blocks_cache_key=None) -> Cache``, ``cache_manager.unregister_cache(cache_id)``,
``Cache.create_cpu_cache(desc, addrs)`` (``KvCache`` is the same class, its name in older releases),
``cache_manager.swap_blocks(src, dst, src_to_dst) -> None``; ``DataType``, ``Placement``,
``LLMException`` (a ``RuntimeError`` with ``status_code``), ``LLMStatusCode``.

What it enforces (documented, or the strict reading where the docs are silent):

* ``init(options)``: options map str to str (``TypeError``); ``ge.exec.deviceId`` names an existing
  device (``ValueError`` / ``LLMException``); init twice is ``LLMException``; init runs ``acl.init``
  (accepting a process that already did);
* ``cache_manager`` before ``init``, or without ``options["llm.EnableCacheManager"] == "1"``:
  ``LLMException``; every call after ``finalize()``: ``LLMException``, and its caches are invalid;
* ``CacheDesc``: ints and enums of the right types (``TypeError``), dimensions in range
  (``ValueError``); a blocks cache is PagedAttention only: ``shape[0]`` the block count on dim 0,
  every dimension positive, ``num_tensors > 0`` (``ValueError``);
* ``register_blocks_cache``: ``None`` for the desc or the addresses is ``AttributeError``; a
  non-list or non-int address ``TypeError``; no addresses, ``len(addrs) != num_tensors``, a zero
  address, a ``blocks_cache_key`` on a non-PROMPT role ``ValueError``; at most 256 addresses over
  every registration (knob ``max_addresses``, e.g. 240 as in some releases), at most 50 GB of
  device and 20 GB of host memory registered (decimal GB, the stricter reading): ``LLMException``
  (``LLM_EXCEED_LIMIT``) naming the limit; each tensor's whole range must be device memory of this
  process on the init device (host memory for ``Placement.HOST``): ``LLMException``.
  ``unregister_cache`` gives the addresses and bytes back;
* ``create_cpu_cache``: placement HOST, ``num_tensors == len(addrs)``, a blocks shape (``ValueError``);
* ``swap_blocks(src, dst, src_to_dst)``: caches of the right type (``TypeError``; ``None`` is
  ``AttributeError``), valid (not unregistered, not finalised, not another LLMDataDist's);
  ``src_to_dst`` a ``dict`` of ``int`` to ``int`` (``TypeError``; numpy ints and bools are refused);
  equal block size, ``num_tensors`` and ``data_type``, one side HOST and the other DEVICE
  (``ValueError``); every index in range (``ValueError`` naming the bad index); a destination
  named twice (``ValueError``: the docs are silent, the stand-in refuses); the calling thread bound
  to the init device (``acl.rt.set_device``, an assumption: the stand-in does not bind threads
  itself).  Swap out copies device->host per block per tensor; swap in allocates a device
  staging area of 4 blocks (of every tensor) first, then copies host->staging->device; a failed
  staging allocation is ``LLMException`` (``LLM_DEVICE_OUT_OF_MEMORY``) before any byte moves.
  Any pyACL error becomes ``LLMException`` naming the call.  Returns ``None``.

The prefill/decode calls (``_datadist``, ``_links``, ``_transfer``; what each enforces is in those
modules' docstrings): ``init`` options ``llm.listenIpInfo`` ("ip:port": this cluster is a server
peers link to), ``llm.SyncKvCacheWaitTime`` (ms, default 1000: the bound of every transfer call),
``llm.MemPoolConfig`` ('{"memory_size": N}': a host cache in a transfer needs N >= 100 MB);
``link_clusters`` / ``unlink_clusters`` with ``LLMClusterInfo`` -> ``(ret, rets)``; ``link`` /
``unlink`` / ``query_register_mem_status`` -> ``RegisterMemStatus``; ``cache_manager.register_cache``
(with ``CacheKey`` s), ``remove_cache_key``, ``pull_blocks``, ``push_blocks``, ``push_cache``
(``CacheKeyByIdAndIndex``), ``pull_cache``.  The clusters of a test are its processes: they find
each other through ``$ACL_STANDIN_DIR/llm_datadist_registry.json`` (``_registry``) and the stand-in
moves the bytes itself, through the pyACL stand-in's device files and the shared files behind host
memory (``_memory``), so a test checks them bit for bit.  A peer whose process died fails every
transfer with ``LLM_LINK_FAILED``.

Test-only helpers: ``standin_calls()`` (API call name -> count in this process, plus the pyACL
calls made for them: ``acl.rt.memcpy``, ``acl.rt.malloc``, ``acl.rt.free``, and
``transfer_bytes``) and ``standin_reset_calls()``; fault knobs in
``$ACL_STANDIN_DIR/llm_datadist_faults.json`` (see ``llm_datadist._state``), e.g.
``{"fail": {"swap_blocks": 3}}`` raises on the third call, ``{"stall_ms": {"pull_blocks": 300}}``
slows pulls, ``{"link_down": [7]}`` downs cluster 7's links.
"""
from __future__ import annotations

from ._datadist import LLMDataDist
from ._manager import MAX_DEVICE_BYTES, MAX_HOST_BYTES, MAX_REGISTERED_ADDRESSES, CacheManager
from ._pd_types import CacheKey, CacheKeyByIdAndIndex, LLMClusterInfo, RegisterMemStatus
from ._state import standin_calls, standin_reset_calls
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    KvCache,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

__all__ = [
    "BlocksCacheKey", "Cache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "CacheManager", "DataType", "KvCache",
    "LLMClusterInfo", "LLMDataDist", "LLMException", "LLMRole", "LLMStatusCode", "Placement", "RegisterMemStatus",
    "MAX_DEVICE_BYTES", "MAX_HOST_BYTES", "MAX_REGISTERED_ADDRESSES", "standin_calls", "standin_reset_calls",
]
