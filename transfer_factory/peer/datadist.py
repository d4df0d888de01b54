"""The Ascend peer transport: LLM-DataDist (CANN's ``llm_datadist``, CacheManager mode).

Written against the documented Python API only (LLMDataDist.md, CacheManager.md, LLMConfig.md,
LLMClusterInfo.md of CANN 8.x / hixl) and tested over the contract stand-in
``tests/standins/llm_datadist``; it has never run on Ascend hardware.  ``llm_datadist`` and ``acl``
are imported when an endpoint is built, so hosts without CANN never need them.

One ``DataDistEndpoint`` per CTM rank:

* ``DataDistEndpoint(role, device_id, cluster_id, log)``: ``LLMDataDist(LLMRole.PROMPT | DECODER,
  cluster_id)`` (a ``"mixed"`` instance is PROMPT: in CacheManager mode the role only labels, and
  only PROMPT may key its caches for pulls); ``cluster_id_for(instance, rank)`` makes a unique id.
* ``open(...) -> params``: ``init`` with ``llm.EnableCacheManager``, ``ge.exec.deviceId``,
  ``llm.listenIpInfo`` (every rank listens: a prefill rank is pulled from, a decode rank pushed into),
  ``llm.SyncKvCacheWaitTime`` and ``llm.MemPoolConfig`` (>= 100 MB: the host caches below take part
  in D2H/H2D moves, which need it); then, once and before any link ("调用该接口前需提前注册所有内存"),
  registers: per group of cache kinds with equal block bytes one blocks cache (described as bytes,
  ``DT_UINT8 [blocks, block_bytes]``: the peers' dtypes are compared at ``link``) whose tensors are the
  layers' kinds interleaved (K0, V0, K1, V1, ...: LLM-DataDist's layer ranges count
  ``tensor_num_per_layer`` tensors per layer) under ``BlocksCacheKey(cluster_id, group)`` on a
  PROMPT rank; the same over the host swap space (``remote_accessible=True``, a pull destination);
  the engine's exposure board, the engine's layer board, and one device word of scratch.  It
  returns the plain-data params a peer needs (``datadist_params.DataDistParams``).
* ``link(name, params, timeout)`` / ``unlink(name)``: ``link_clusters`` / ``unlink_clusters`` with one
  ``LLMClusterInfo`` (this rank's and the peer's ip:port).  The side that moves the bytes is the
  client: a decode rank links to the prefill ranks it pulls from, a prefill rank to the decode
  ranks it pushes into.  ``query_register_mem_status`` belongs to the other link mode (``link`` with
  a rank table, all members at once, at most 4); with ``link_clusters`` the documented guarantee is
  the order above (registered before linked), so it is not called.
* ``pull(name, src, dst, layers, placement, deadline)``: one ``pull_blocks(BlocksCacheKey(peer,
  group), cache, src, dst, src_layer_range=layers, dst_layer_range=layers, tensor_num_per_layer=k)``
  per group, into device blocks (D2D) or host swap slots (D2H).
* ``push(name, src, dst, layers, deadline)``: ``push_cache(CacheKeyByIdAndIndex(peer, cache_id,
  dst_block), cache, src_block, layer ranges)`` per block and group: a DECODER may not key its caches
  (strict reading), so the decode side's caches are named by the ids they were registered under.

**Which bytes count** (DESIGN §3.11).  A pulled block counts only if the prefill engine's exposure
board word for the handle still says LIVE after the bytes arrived; a push publishes each layer on
the decode engine's layer board after the layer's bytes landed.  Over LLM-DataDist the boards are
registered caches too: the prefill rank registers its engine's board (POSIX shared memory it maps)
as a host blocks cache of 4096 one-word blocks under ``BlocksCacheKey(cluster, BOARD_MODEL_ID)``;
``read_board(name, slot)`` pulls block ``slot`` into the device scratch word (H2D, both blocks
caches as documented) and copies it to the host (``acl.rt.memcpy``).  The decode rank registers its
engine's layer board the same way (no key); ``write_layer_word`` stores the word into the scratch
and ``push_cache`` s it into batch ``index`` of that cache (D2H).  The calls are synchronous: one
that returned has finished its bytes.  So a board word read after ``pull`` returned was read after
every KV byte was, and a LIVE word means the engine had not retracted the handle (it retracts before
it reuses a block): the guarantee of the Transfer Engine path.  ``remove_cache_key`` (the issue's
suggestion) cannot give it: it unbinds ``CacheKey`` s of contiguous ``register_cache`` caches, not
block lists, says nothing of a pull already running, and a rank does not learn of a retraction
before the engine reuses the blocks.  Risk on hardware: over RDMA the docs want registered host
memory from ``aclrtMallocHost``; the boards are POSIX shared memory (the stand-in does not check it).

**Time.**  Every call is bounded by ``sync_kv_timeout`` (``LLMException`` past it; the docs say the
link is then unusable, so the endpoint unlinks it and a later ``link`` makes it again).  A call
starts only before the task's deadline, so a task ends at most ``sync_kv_timeout`` after it; calls
of one endpoint are serialised (the docs promise no concurrency).  Errors are ``DataDistError``
naming the peer.  Whole blocks only: peers of another TP size are refused at ``link``.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from transfer_factory.peer.datadist_params import (BOARD_MODEL_ID, DataDistParams, GroupParams, cache_groups,
                                                   check_peer, checked_blocks, cluster_id_for)
from transfer_factory.peer.handles import BOARD_WORDS  # the handle slots, then the generation word

__all__ = ["DataDistEndpoint", "DataDistError", "DataDistParams", "cluster_id_for"]

ROLES = {"prefill": "PROMPT", "decode": "DECODER", "mixed": "PROMPT"}
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_MEM_POOL_BYTES = 100 * 2**20  # "内存池大小至少配置为100M"
SCRATCH_BYTES = 4096
ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 0, 1, 2


class DataDistError(RuntimeError):
    """A link or transfer over LLM-DataDist failed; the message names the peer, ``status`` the
    LLMStatusCode name when the library gave one."""

    def __init__(self, message: str, status: str = ""):
        super().__init__(message)
        self.status = status


@dataclass
class _Peer:
    params: DataDistParams
    info: Any  # the LLMClusterInfo that linked it
    token: int  # which ``link`` made it: a stale ``unlink(name, token)`` leaves a newer link alone


class DataDistEndpoint:
    def __init__(self, role: str, device_id: int, cluster_id: int, log: logging.Logger, *, tp: int = 1,
                 rank: int = 0, sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS,
                 mem_pool_bytes: int = DEFAULT_MEM_POOL_BYTES, module: Any = None, acl_module: Any = None):
        if role not in ROLES:
            raise ValueError(f"role {role!r} must be one of {sorted(ROLES)}")
        if sync_kv_timeout_ms <= 0:
            raise ValueError(f"sync_kv_timeout_ms {sync_kv_timeout_ms} must be positive")
        if module is None:
            import llm_datadist as module  # CANN's LLM-DataDist: source <cann>/set_env.sh
        if acl_module is None:
            import acl as acl_module  # pyACL, for the scratch word
        self._dd, self._acl, self._log = module, acl_module, log
        self.role, self.device_id, self.cluster_id = role, int(device_id), int(cluster_id)
        self.tp, self.rank = tp, rank
        self.sync_kv_timeout_s = sync_kv_timeout_ms / 1000
        self._mem_pool = mem_pool_bytes
        self._llm = module.LLMDataDist(module.LLMRole[ROLES[role]], self.cluster_id)
        self._manager: Any = None
        self._params: DataDistParams | None = None
        self._device: list[Any] = []  # per group: the registered device cache
        self._host: list[Any] = []  # per group: the registered host swap cache (pull into host)
        self._caches: list[Any] = []  # everything registered, for close
        self._scratch_ptr = 0
        self._scratch: Any = None
        self._word = np.zeros(1, dtype=np.int64)  # host side of the scratch word
        self._peers: dict[str, _Peer] = {}
        self._tokens = 0
        self._lock = threading.Lock()  # every library call: the docs promise no concurrency
        self._scratch_lock = threading.Lock()  # one scratch word: a board read or write at a time
        self._bound = threading.local()
        self._initialised = False

    # ------------------------------------------------------------------ open
    def open(self, device: Mapping[str, Sequence[int]], block_bytes: Mapping[str, int], num_blocks: int, dtype: str,
             num_layers: int, ip: str, port: int, host: Mapping[str, Sequence[int]] | None = None,
             host_blocks: int = 0, board: int = 0, layer_board: tuple[int, int] | None = None) -> dict:
        """Initialise LLM-DataDist and register this rank's memory (once); the params peers need.

        ``device``/``host``: per cache kind, the per-layer base addresses of the device caches and
        of the host swap space; ``block_bytes``: per kind, one block of one layer; ``dtype``: the
        cache dtype (a label compared with the peer's at ``link``); ``board``: the
        address of the engine's exposure board as this rank maps it (a prefill rank; 0: none);
        ``layer_board``: (address, bytes) of the engine's layer board (a push target; None: none)."""
        if self._params is not None:
            raise RuntimeError("this LLM-DataDist endpoint is already open")
        dd = self._dd
        kinds = list(device)
        for kind in kinds:
            if len(device[kind]) != num_layers or (host is not None and len(host.get(kind, ())) != num_layers):
                raise ValueError(f"cache kind {kind!r}: need {num_layers} layer addresses for device and host")
        self._llm.init({"llm.EnableCacheManager": "1", "ge.exec.deviceId": str(self.device_id),
                        "llm.listenIpInfo": f"{ip}:{port}",
                        "llm.SyncKvCacheWaitTime": str(int(self.sync_kv_timeout_s * 1000)),
                        "llm.MemPoolConfig": json.dumps({"memory_size": self._mem_pool})})
        self._initialised = True
        try:
            self._manager = self._llm.cache_manager
            self._bind()
            keyed = ROLES[self.role] == "PROMPT"
            dt = dd.DataType.DT_UINT8  # bytes: the peers' dtypes were compared at link (DataDistParams)
            groups: list[GroupParams] = []
            for g, group in enumerate(cache_groups(kinds, block_bytes)):
                bb = block_bytes[group[0]]
                shape = [num_blocks, bb]
                addrs = [int(device[k][layer]) for layer in range(num_layers) for k in group]
                key = dd.BlocksCacheKey(self.cluster_id, g) if keyed else None
                cache = self._register(dd.CacheDesc(len(addrs), shape, dt, dd.Placement.DEVICE), addrs, key)
                self._device.append(cache)
                if host is not None and host_blocks > 0:
                    haddrs = [int(host[k][layer]) for layer in range(num_layers) for k in group]
                    desc = dd.CacheDesc(len(haddrs), [host_blocks, shape[1]], dt, dd.Placement.HOST)
                    self._host.append(self._register(desc, haddrs, None, remote_accessible=True))
                groups.append(GroupParams(g if keyed else -1, cache.cache_id, tuple(group), bb, num_blocks))
            word = dd.DataType.DT_INT64
            if board and keyed:
                self._register(dd.CacheDesc(1, [BOARD_WORDS, 1], word, dd.Placement.HOST), [int(board)],
                               dd.BlocksCacheKey(self.cluster_id, BOARD_MODEL_ID), remote_accessible=True)
            lb_id, lb_words = -1, 0
            if layer_board is not None:
                lb_words = int(layer_board[1]) // 8
                lb = self._register(dd.CacheDesc(1, [lb_words, 1], word, dd.Placement.HOST), [int(layer_board[0])],
                                    None, remote_accessible=True)
                lb_id = lb.cache_id
            self._scratch_ptr = self._acl_call("acl.rt.malloc", self._acl.rt.malloc(SCRATCH_BYTES,
                                                                                     ACL_MEM_MALLOC_HUGE_FIRST))
            self._scratch = self._register(dd.CacheDesc(1, [1, 1], word, dd.Placement.DEVICE), [self._scratch_ptr], None)
        except BaseException:
            self.close()
            raise
        self.ip, self.port = ip, port
        self._params = DataDistParams(self.cluster_id, ip, port, self.role, self.tp, self.rank, num_layers, dtype,
                                      tuple(groups), BOARD_MODEL_ID if board and keyed else -1, lb_id, lb_words)
        self._log.info("LLM-DataDist endpoint open: cluster %d on npu:%d listening at %s:%d, %d cache groups",
                       self.cluster_id, self.device_id, ip, port, len(groups))
        return self._params.to_wire()

    def _register(self, desc: Any, addrs: list[int], key: Any, remote_accessible: bool | None = None) -> Any:
        try:
            cache = self._manager.register_blocks_cache(desc, addrs, key, remote_accessible)
        except Exception as exc:
            raise DataDistError(f"LLM-DataDist register_blocks_cache of {desc} on npu:{self.device_id} failed: {exc}",
                                _status(exc)) from exc
        self._caches.append(cache)
        return cache

    def _bind(self) -> None:
        """Bind the calling thread to the device once (acl contexts are per thread)."""
        if not getattr(self._bound, "done", False):
            self._acl_call("acl.rt.set_device", self._acl.rt.set_device(self.device_id))
            self._bound.done = True

    def _acl_call(self, what: str, result: Any) -> Any:
        value, ret = result if isinstance(result, tuple) else (None, result)
        if ret != 0:
            raise DataDistError(f"{what} on npu:{self.device_id} failed with aclError {ret}")
        return value

    @property
    def params(self) -> DataDistParams:
        if self._params is None:
            raise RuntimeError("open the LLM-DataDist endpoint first")
        return self._params

    # ------------------------------------------------------------------ link / unlink
    def link(self, name: str, params: Any, timeout: float) -> int:
        """Link to the peer ``name`` (this side becomes the client that moves bytes), replacing a
        link of that name; a token for ``unlink``."""
        peer = DataDistParams.from_wire(params)
        check_peer(self.params, peer, name)
        info = self._dd.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_local_ip_info(self.ip, self.port)
        info.append_remote_ip_info(peer.ip, peer.port)
        ms = max(1, int(timeout * 1000))
        with self._lock:
            old = self._peers.pop(name, None)
            if old is not None:
                self._unlink(old.info, force=True)
            ret, rets = self._llm.link_clusters([info], ms)
            if rets and rets[0] == self._dd.LLMStatusCode.LLM_ALREADY_LINK:  # a link left from before: renew
                self._unlink(info, force=True)
                ret, rets = self._llm.link_clusters([info], ms)
            if ret != self._dd.LLMStatusCode.LLM_SUCCESS:
                code = getattr(rets[0] if rets else ret, "name", str(ret))
                raise DataDistError(f"peer {name}: link_clusters to cluster {peer.cluster_id} at {peer.ip}:{peer.port} "
                                    f"failed ({code})", code)
            self._tokens += 1
            self._peers[name] = _Peer(peer, info, self._tokens)
        self._log.info("LLM-DataDist: linked to %s (cluster %d at %s:%d)", name, peer.cluster_id, peer.ip, peer.port)
        return self._tokens

    def unlink(self, name: str, token: int | None = None) -> bool:
        """Unlink ``name`` (only the link ``token`` names, if given); whether one was unlinked."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or (token is not None and peer.token != token):
                return False
            del self._peers[name]
            self._unlink(peer.info, force=False)
        return True

    def _unlink(self, info: Any, force: bool) -> None:
        ok = self._dd.LLMStatusCode.LLM_SUCCESS
        try:
            ret, _ = self._llm.unlink_clusters([info], int(self.sync_kv_timeout_s * 1000) + 1, force=force)
            if ret != ok and not force:  # the peer could not be told (gone): tear down our side alone
                ret, _ = self._llm.unlink_clusters([info], int(self.sync_kv_timeout_s * 1000) + 1, force=True)
            if ret != ok:
                self._log.warning("LLM-DataDist: unlink of cluster %d answered %s", info.remote_cluster_id, ret)
        except Exception as exc:
            self._log.warning("LLM-DataDist: unlink of cluster %d failed: %s", info.remote_cluster_id, exc)

    def linked(self, name: str) -> bool:
        with self._lock:
            return name in self._peers

    # ------------------------------------------------------------------ transfers
    def _call(self, name: str, what: str, deadline: float, fn: Any, *args: Any, **kwargs: Any) -> None:
        """One library call for peer ``name``, started only before ``deadline``; a timed-out link
        is torn down (the docs: unusable until linked again)."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None:
                raise DataDistError(f"peer {name}: not linked over LLM-DataDist (link it before {what})")
            if time.monotonic() >= deadline:
                raise DataDistError(f"peer {name}: {what} not started by its deadline", "LLM_TIMEOUT")
            self._bind()
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                status = _status(exc)
                if status in ("LLM_TIMEOUT", "LLM_LINK_FAILED"):
                    del self._peers[name]
                    self._unlink(peer.info, force=True)
                raise DataDistError(f"peer {name} (cluster {peer.params.cluster_id}): {what} failed: {exc}",
                                    status) from exc

    def _peer(self, name: str) -> DataDistParams:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise DataDistError(f"peer {name}: not linked over LLM-DataDist")
        return peer.params

    def pull(self, name: str, src_ids: Sequence[int], dst_ids: Sequence[int], layers: range, placement: str,
             deadline: float) -> int:
        """Read blocks ``src_ids`` of the peer into ours (``"device"``, or ``"host"``: swap slots);
        the bytes moved."""
        peer = self._peer(name)
        if placement not in ("device", "host"):
            raise ValueError(f"placement {placement!r} must be 'device' or 'host'")
        caches = self._device if placement == "device" else self._host
        if not caches:
            raise ValueError(f"this endpoint registered no {placement} caches to pull into")
        if any(g.model_id < 0 for g in peer.groups):
            raise DataDistError(f"peer {name}: its caches have no BlocksCacheKey (a {peer.role} rank cannot be pulled from)")
        src, dst, layers = checked_blocks(src_ids, dst_ids, layers, self.params.num_layers)
        moved = 0
        for group, cache in zip(peer.groups, caches):
            key = self._dd.BlocksCacheKey(peer.cluster_id, group.model_id)
            self._call(name, f"pull_blocks of {len(src)} blocks, layers [{layers.start}, {layers.stop})", deadline,
                       self._manager.pull_blocks, key, cache, src, dst, src_layer_range=layers,
                       dst_layer_range=layers, tensor_num_per_layer=len(group.kinds))
            moved += len(src) * len(layers) * len(group.kinds) * group.block_bytes
        return moved

    def push(self, name: str, src_ids: Sequence[int], dst_ids: Sequence[int], layers: range, deadline: float) -> int:
        """Write blocks ``src_ids`` of ours into the peer's ``dst_ids``, layers ``layers``; the bytes moved."""
        peer = self._peer(name)
        src, dst, layers = checked_blocks(src_ids, dst_ids, layers, self.params.num_layers)
        moved = 0
        for group, cache in zip(peer.groups, self._device):
            for s, d in zip(src, dst):
                key = self._dd.CacheKeyByIdAndIndex(peer.cluster_id, group.cache_id, d)
                self._call(name, f"push_cache of block {s} to {d}, layers [{layers.start}, {layers.stop})", deadline,
                           self._manager.push_cache, key, cache, s, src_layer_range=layers, dst_layer_range=layers,
                           tensor_num_per_layer=len(group.kinds))
            moved += len(src) * len(layers) * len(group.kinds) * group.block_bytes
        return moved

    def read_board(self, name: str, slot: int, deadline: float) -> int:
        """Word ``slot`` of the peer engine's exposure board, read now (after every earlier call ended)."""
        peer = self._peer(name)
        if peer.board_model_id < 0:
            raise DataDistError(f"peer {name}: registered no exposure board")
        if not 0 <= slot < BOARD_WORDS:
            raise ValueError(f"board slot {slot} outside [0, {BOARD_WORDS})")
        key = self._dd.BlocksCacheKey(peer.cluster_id, peer.board_model_id)
        with self._scratch_lock:
            self._call(name, f"pull_blocks of exposure-board word {slot}", deadline, self._manager.pull_blocks, key,
                       self._scratch, [slot], [0], tensor_num_per_layer=1)
            self._acl_call("acl.rt.memcpy", self._acl.rt.memcpy(int(self._word.ctypes.data), 8, self._scratch_ptr, 8,
                                                                ACL_MEMCPY_DEVICE_TO_HOST))
            return int(self._word[0])

    def write_layer_word(self, name: str, index: int, value: int, deadline: float) -> None:
        """Store ``value`` into word ``index`` of the peer engine's layer board (after every earlier
        call's bytes landed: the calls are synchronous)."""
        peer = self._peer(name)
        if not 0 <= index < peer.layer_board_words:
            raise DataDistError(f"peer {name}: layer-board word {index} outside its {peer.layer_board_words} words")
        key = self._dd.CacheKeyByIdAndIndex(peer.cluster_id, peer.layer_board_cache_id, index)
        with self._scratch_lock:
            self._bind()
            self._word[0] = value
            self._acl_call("acl.rt.memcpy", self._acl.rt.memcpy(self._scratch_ptr, 8, int(self._word.ctypes.data), 8,
                                                                ACL_MEMCPY_HOST_TO_DEVICE))
            self._call(name, f"push_cache of layer-board word {index}", deadline, self._manager.push_cache, key,
                       self._scratch, 0, tensor_num_per_layer=1)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Unlink every peer, unregister everything, finalise LLM-DataDist (idempotent)."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            for peer in peers:
                self._unlink(peer.info, force=True)
            caches, self._caches = self._caches, []
            self._device, self._host, self._scratch = [], [], None
            try:
                if self._manager is not None:
                    for cache in caches:
                        self._manager.unregister_cache(cache.cache_id)
            finally:
                self._manager = None
                if self._scratch_ptr:
                    self._bind()
                    self._acl.rt.free(self._scratch_ptr)
                    self._scratch_ptr = 0
                if self._initialised:
                    self._initialised = False
                    self._llm.finalize()
                self._params = None


def _status(exc: BaseException) -> str:
    code = getattr(exc, "status_code", None)
    return getattr(code, "name", "") if code is not None else ""
