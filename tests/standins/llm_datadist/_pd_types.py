"""Value types of the LLM-DataDist stand-in's prefill/decode calls (tests only): ``CacheKey``,
``CacheKeyByIdAndIndex``, ``LLMClusterInfo`` and ``RegisterMemStatus``.

As in the published Python layer: a wrong type is ``TypeError``, a wrong value ``ValueError``.
"""
from __future__ import annotations

import ipaddress
from enum import Enum
from typing import Any, List, Optional, Tuple, Union

from ._types import check_type

UINT64_MAX = (1 << 64) - 1
MAX_PORT = 65535


class RegisterMemStatus(Enum):
    """What ``query_register_mem_status(comm_id)`` returns."""

    OK = 0
    PREPARING = 1
    FAILED = 2


def _uint64(name: str, value: Any) -> int:
    check_type(name, value, int)
    if not 0 <= value <= UINT64_MAX:
        raise ValueError(f"{name} {value} must be in [0, 2**64)")
    return value


class CacheKey:
    """``CacheKey(cluster_id | prompt_cluster_id, req_id, model_id=0, prefix_id=2**64-1)``: a cache
    registered with ``register_cache(..., cache_keys)`` under a request id; ``remove_cache_key``
    unbinds it, after which ``pull_cache`` no longer finds it."""

    def __init__(self, *args: Any, **kwargs: Any):
        names = ("cluster_id", "req_id", "model_id", "prefix_id")
        if len(args) > len(names):
            raise ValueError(f"CacheKey takes at most {len(names)} positional parameters")
        if "prompt_cluster_id" in kwargs:
            kwargs["cluster_id"] = kwargs.pop("prompt_cluster_id")
        for name, value in zip(names, args):
            if name in kwargs:
                raise ValueError(f"CacheKey got {name} twice")
            kwargs[name] = value
        unknown = set(kwargs) - set(names)
        if unknown:
            raise ValueError(f"unsupported CacheKey parameter {sorted(unknown)[0]!r}")
        for required in ("cluster_id", "req_id"):
            if required not in kwargs:
                raise ValueError(f"CacheKey needs {required}")
        self.cluster_id = _uint64("cluster_id", kwargs["cluster_id"])
        self.req_id = _uint64("req_id", kwargs["req_id"])
        self.model_id = _uint64("model_id", kwargs.get("model_id", 0))
        self.prefix_id = _uint64("prefix_id", kwargs.get("prefix_id", UINT64_MAX))

    @property
    def prompt_cluster_id(self) -> int:
        return self.cluster_id

    def wire(self) -> list[int]:
        return [self.cluster_id, self.req_id, self.model_id, self.prefix_id]

    def __repr__(self) -> str:
        return f"CacheKey(cluster_id={self.cluster_id}, req_id={self.req_id}, model_id={self.model_id})"


class CacheKeyByIdAndIndex:
    """``CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index=0)``: a remote cache named by the id
    its owner's ``register_*`` returned, and one batch of it (a block, for a blocks cache)."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0):
        self.cluster_id = _uint64("cluster_id", cluster_id)
        check_type("cache_id", cache_id, int)
        if cache_id < 0:
            raise ValueError(f"cache_id {cache_id} must not be negative")
        self.cache_id = cache_id
        check_type("batch_index", batch_index, int)
        if batch_index < 0:
            raise ValueError(f"batch_index {batch_index} must not be negative")
        self.batch_index = batch_index

    def __repr__(self) -> str:
        return f"CacheKeyByIdAndIndex({self.cluster_id}, {self.cache_id}, {self.batch_index})"


def _ip(ip: Any) -> str:
    """``Union[str, int]``: a dotted IPv4 string or its little-endian uint32 (ClusterInfo's ``ip``)."""
    if isinstance(ip, bool) or not isinstance(ip, (str, int)):
        raise TypeError(f"ip must be str or int, got {type(ip).__name__}")
    if isinstance(ip, int):
        if not 0 <= ip <= 0xFFFF_FFFF:
            raise ValueError(f"ip {ip} must be a uint32")
        return str(ipaddress.IPv4Address(int.from_bytes(ip.to_bytes(4, "little"), "big")))
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError:
        raise ValueError(f"ip {ip!r} is not an IP address") from None


def _port(port: Any) -> int:
    check_type("port", port, int)
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"port {port} must be in [0, {MAX_PORT}]")
    return port


class LLMClusterInfo:
    """``LLMClusterInfo()`` for ``link_clusters``/``unlink_clusters``: ``remote_cluster_id``,
    ``append_local_ip_info(ip, port)``, ``append_remote_ip_info(ip, port)``."""

    def __init__(self) -> None:
        self._remote_cluster_id: Optional[int] = None
        self.local_ip_infos: List[Tuple[str, int]] = []
        self.remote_ip_infos: List[Tuple[str, int]] = []

    @property
    def remote_cluster_id(self) -> Optional[int]:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = _uint64("remote_cluster_id", value)

    def append_local_ip_info(self, ip: Union[str, int], port: int) -> None:
        self.local_ip_infos.append((_ip(ip), _port(port)))

    def append_remote_ip_info(self, ip: Union[str, int], port: int) -> None:
        self.remote_ip_infos.append((_ip(ip), _port(port)))

    def __repr__(self) -> str:
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, local={self.local_ip_infos}, "
                f"remote={self.remote_ip_infos})")


def parse_listen(value: str) -> str:
    """``llm.listenIpInfo``: one ``"ip:port"``; the normalised form, or ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"option 'llm.listenIpInfo' {value!r} must be 'ip:port'")
    return f"{_ip(host)}:{_port(int(port))}"
