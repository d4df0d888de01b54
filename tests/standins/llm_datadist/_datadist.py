"""``LLMDataDist`` in the stand-in (tests only): init and its options, ``cache_manager``, the link
calls (``_links``) and ``finalize`` (see the package docstring for the contract)."""
from __future__ import annotations

import json
import os
import secrets
from typing import Any, Dict, List, Optional, Tuple, Union

import acl

from . import _links, _registry
from ._manager import CacheManager
from ._pd_types import LLMClusterInfo, RegisterMemStatus, parse_listen
from ._state import counted
from ._types import LLMException, LLMRole, LLMStatusCode, check_type

OPTION_CACHE_MANAGER = "llm.EnableCacheManager"
OPTION_DEVICE_ID = "ge.exec.deviceId"
OPTION_LISTEN = "llm.listenIpInfo"
OPTION_SYNC_KV_TIMEOUT = "llm.SyncKvCacheWaitTime"  # ms; LLMConfig.sync_kv_timeout
OPTION_MEM_POOL = "llm.MemPoolConfig"  # '{"memory_size": N}'; LLMConfig.mem_pool_cfg
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000  # "不配置默认为1000ms"
ACL_ERROR_REPEAT_INITIALIZE = 100002


def _none(name: str, value: Any) -> None:
    """The vendor's Python layer dereferences before it checks types: None is an AttributeError."""
    if value is None:
        raise AttributeError(f"'NoneType' object ({name}) has no attribute to read")


def _positive_int(option: str, raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ValueError(f"option {option!r} must be a positive integer string, got {raw!r}")
    return int(raw)


def _mem_pool(raw: str) -> int:
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"option {OPTION_MEM_POOL!r} must be JSON like '{{\"memory_size\": N}}', got {raw!r}") from None
    size = cfg.get("memory_size") if isinstance(cfg, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"option {OPTION_MEM_POOL!r} needs a positive integer memory_size, got {raw!r}")
    return size


def _ours(key: str, link: dict, me: str) -> bool:
    """Whether this process is the client or the server of a registry link as cluster ``me``."""
    client, server = key.split(">")
    pid = os.getpid()
    return (client == me and link["client_pid"] == pid) or (server == me and link["server_pid"] == pid)


class LLMDataDist:
    """``LLMDataDist(role, cluster_id)``; ``init(options)``; ``cache_manager``; the link calls; ``finalize()``."""

    def __init__(self, role: LLMRole, cluster_id: int):
        check_type("role", role, LLMRole)
        check_type("cluster_id", cluster_id, int)
        if not 0 <= cluster_id < 1 << 64:
            raise ValueError(f"cluster_id {cluster_id} must be in [0, 2**64)")
        self.role = role
        self.cluster_id = cluster_id
        self.device_id: Optional[int] = None
        self._options: Dict[str, str] = {}
        self._initialized = False
        self._manager: Optional[CacheManager] = None
        self._listen: Optional[str] = None
        self._mem_pool = 0
        self._sync_kv_timeout_s = DEFAULT_SYNC_KV_TIMEOUT_MS / 1000
        self._published = False
        self._token = secrets.token_hex(8)  # tells this LLMDataDist from another of the same cluster id
        self._link_table = _links.LinkTable()

    def init(self, options: Dict[str, str]) -> None:
        with counted("init"):
            _none("options", options)
            check_type("options", options, dict)
            for k, v in options.items():
                if not isinstance(k, str) or not isinstance(v, str):
                    raise TypeError(f"options must map str to str, got {k!r}: {v!r}")
            if self._initialized:
                raise LLMException("LLMDataDist is already initialised", LLMStatusCode.LLM_FAILED)
            raw = options.get(OPTION_DEVICE_ID)
            if raw is None or not raw.strip().isdigit():
                raise ValueError(f"option {OPTION_DEVICE_ID!r} must name the device (a non-negative integer string), "
                                 f"got {raw!r}")
            if options.get(OPTION_CACHE_MANAGER, "0") not in ("0", "1"):
                raise ValueError(f"option {OPTION_CACHE_MANAGER!r} must be '0' or '1'")
            listen = parse_listen(options[OPTION_LISTEN]) if OPTION_LISTEN in options else None
            timeout_ms = _positive_int(OPTION_SYNC_KV_TIMEOUT, options.get(OPTION_SYNC_KV_TIMEOUT,
                                                                           str(DEFAULT_SYNC_KV_TIMEOUT_MS)))
            mem_pool = _mem_pool(options[OPTION_MEM_POOL]) if OPTION_MEM_POOL in options else 0
            ret = acl.init()  # the runtime under LLM-DataDist shares the process's ACL
            if ret not in (0, ACL_ERROR_REPEAT_INITIALIZE):
                raise LLMException(f"[init] acl.init failed with aclError {ret}")
            devices, ret = acl.rt.get_device_count()
            if ret != 0 or not 0 <= int(raw) < devices:
                raise LLMException(f"[init] device {raw} does not exist ({devices} devices)", LLMStatusCode.LLM_PARAM_INVALID)
            self.device_id = int(raw)
            self._options = dict(options)
            self._listen, self._mem_pool, self._sync_kv_timeout_s = listen, mem_pool, timeout_ms / 1000
            if options.get(OPTION_CACHE_MANAGER) == "1":
                self._manager = CacheManager(self)
            if listen is not None:
                self._publish()
            self._initialized = True

    def _publish(self) -> None:
        """Make this cluster (and its caches) findable by peers: it listens, or joins a domain."""
        if self._published:
            return
        with _registry.update() as table:
            for cid, server in table["servers"].items():
                if server["token"] == self._token:
                    continue
                if int(cid) == self.cluster_id:
                    raise LLMException(f"[init] cluster_id {self.cluster_id} is in use by process {server['pid']}: "
                                       "it must be unique among linked clusters", LLMStatusCode.LLM_PARAM_INVALID)
                if self._listen is not None and server["listen"] == self._listen:
                    raise LLMException(f"[init] {self._listen} is already listened on by cluster {cid} "
                                       f"(process {server['pid']})", LLMStatusCode.LLM_PARAM_INVALID)
            table["servers"][str(self.cluster_id)] = {"cluster": self.cluster_id, "pid": os.getpid(),
                                                      "token": self._token, "listen": self._listen,
                                                      "mem_pool": self._mem_pool}
            if self._manager is not None:
                for cache in self._manager.caches():
                    table["caches"][f"{self.cluster_id}/{cache.cache_id}"] = _registry.cache_entry(
                        self.cluster_id, cache, os.getpid())
        self._published = True

    def _check_ready(self, call: str) -> None:
        if not self._initialized:
            raise LLMException(f"[{call}] LLMDataDist.init has not been called", LLMStatusCode.LLM_NOT_INITIALIZED)
        if self._manager is None:
            raise LLMException(f"[{call}] needs option {OPTION_CACHE_MANAGER!r} = '1' at init",
                               LLMStatusCode.LLM_FEATURE_NOT_ENABLED)

    @property
    def cache_manager(self) -> CacheManager:
        with counted("cache_manager"):
            if not self._initialized:
                raise LLMException("LLMDataDist.init has not been called", LLMStatusCode.LLM_NOT_INITIALIZED)
            if self._manager is None:
                raise LLMException(f"the cache manager needs option {OPTION_CACHE_MANAGER!r} = '1' at init",
                                   LLMStatusCode.LLM_FAILED)
            return self._manager

    # -- links (see _links) ------------------------------------------------------------
    def link_clusters(self, clusters: Union[List[LLMClusterInfo], Tuple[LLMClusterInfo]],
                      timeout: int = 3000) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        return _links.link_clusters(self, clusters, timeout)

    def unlink_clusters(self, clusters: Union[List[LLMClusterInfo], Tuple[LLMClusterInfo]], timeout: int = 3000,
                        force: bool = False) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
        return _links.unlink_clusters(self, clusters, timeout, force)

    def link(self, comm_name: str, cluster_rank_info: Dict[int, int], rank_table: str) -> int:
        return _links.link(self, comm_name, cluster_rank_info, rank_table)

    def unlink(self, comm_id: int) -> None:
        _links.unlink(self, comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        return _links.query_register_mem_status(self, comm_id)

    def finalize(self) -> None:
        with counted("finalize"):
            if self._manager is not None:
                self._manager._close()
            self._manager = None
            self._initialized = False
            if self._published or self._link_table.links:
                me = str(self.cluster_id)
                with _registry.update() as table:  # peers see the links torn down, the caches gone
                    if table["servers"].get(me, {}).get("token") == self._token:
                        del table["servers"][me]
                        table["caches"] = {k: v for k, v in table["caches"].items() if v["cluster"] != self.cluster_id}
                    table["links"] = {k: v for k, v in table["links"].items() if not _ours(k, v, me)}
                self._published = False
            self._link_table = _links.LinkTable()
