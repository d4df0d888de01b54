"""What a rank's LLM-DataDist endpoint tells its peers (``DataDistParams``), and the checks that
two endpoints can exchange blocks.  Plain data: it travels inside the rank's ``PeerDescriptor``
(over the authenticated control plane or a router's channel), so ``from_wire`` trusts nothing and
names the first bad field.
"""
from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

ROLES = ("prefill", "decode", "mixed")
MAX_GROUPS = 16
MAX_TEXT = 256
BOARD_MODEL_ID = 1 << 20  # the exposure board's BlocksCacheKey model id; KV groups use 0, 1, ...


def cluster_id_for(instance_id: str, rank: int) -> int:
    """A cluster id for rank ``rank`` of ``instance_id``: LLM-DataDist wants one unique among every
    cluster that links, so it is a 62-bit hash of both (never a pid, which repeats across hosts)."""
    digest = hashlib.blake2b(f"{instance_id}\0{rank}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << 62) - 1)) | (1 << 32)  # above every pid, below 2**63


@dataclass(frozen=True)
class GroupParams:
    """One registered cache: the cache kinds it interleaves per layer (K, V, ...), equal block bytes."""

    model_id: int  # its BlocksCacheKey model id (pull source); -1 when it has no key (decode role)
    cache_id: int  # what register_blocks_cache returned (push target, CacheKeyByIdAndIndex)
    kinds: tuple[str, ...]
    block_bytes: int  # one block of one kind of one layer
    num_blocks: int


@dataclass(frozen=True)
class DataDistParams:
    cluster_id: int
    ip: str
    port: int
    role: str
    tp: int
    rank: int
    num_layers: int
    data_type: str
    groups: tuple[GroupParams, ...]
    board_model_id: int  # -1: no exposure board (not a pull source)
    layer_board_cache_id: int  # -1: no layer board (not a push target)
    layer_board_words: int

    def to_wire(self) -> dict:
        out = asdict(self)
        out["groups"] = [dict(g, kinds=list(g["kinds"])) for g in out["groups"]]
        return out

    @classmethod
    def from_wire(cls, d: Any) -> "DataDistParams":
        """The params a peer sent; ValueError naming the first bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"datadist params must be a map, got {type(d).__name__}")
        ip = _text("ip", d.get("ip"))
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ValueError(f"datadist params field ip {ip!r:.80} is not an IP address") from None
        role = d.get("role")
        if role not in ROLES:
            raise ValueError(f"datadist params field role {role!r:.40} must be one of {ROLES}")
        groups = d.get("groups")
        if not isinstance(groups, list) or not 0 < len(groups) <= MAX_GROUPS:
            raise ValueError(f"datadist params field groups must be a list of 1 to {MAX_GROUPS} maps")
        return cls(cluster_id=_int("cluster_id", d.get("cluster_id"), 1, 1 << 63), ip=ip,
                   port=_int("port", d.get("port"), 1, 65536), role=role, tp=_int("tp", d.get("tp"), 1, 1 << 16),
                   rank=_int("rank", d.get("rank"), 0, 1 << 16), num_layers=_int("num_layers", d.get("num_layers"), 1, 1 << 16),
                   data_type=_text("data_type", d.get("data_type")),
                   groups=tuple(_group(i, g) for i, g in enumerate(groups)),
                   board_model_id=_int("board_model_id", d.get("board_model_id"), -1, 1 << 63),
                   layer_board_cache_id=_int("layer_board_cache_id", d.get("layer_board_cache_id"), -1, 1 << 63),
                   layer_board_words=_int("layer_board_words", d.get("layer_board_words"), 0, 1 << 40))


def _group(i: int, g: Any) -> GroupParams:
    if not isinstance(g, dict):
        raise ValueError(f"datadist params field groups[{i}] must be a map")
    kinds = g.get("kinds")
    if not isinstance(kinds, list) or not kinds or not all(type(k) is str and 0 < len(k) <= MAX_TEXT for k in kinds):
        raise ValueError(f"datadist params field groups[{i}].kinds must be a non-empty list of names")
    return GroupParams(model_id=_int(f"groups[{i}].model_id", g.get("model_id"), -1, 1 << 63),
                       cache_id=_int(f"groups[{i}].cache_id", g.get("cache_id"), 0, 1 << 63), kinds=tuple(kinds),
                       block_bytes=_int(f"groups[{i}].block_bytes", g.get("block_bytes"), 1, 1 << 40),
                       num_blocks=_int(f"groups[{i}].num_blocks", g.get("num_blocks"), 1, 1 << 40))


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise ValueError(f"datadist params field {name} {value!r:.40} must be an integer in [{lo}, {hi})")
    return value


def _text(name: str, value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_TEXT:
        raise ValueError(f"datadist params field {name} {value!r:.80} must be a non-empty string")
    return value


def check_peer(local: DataDistParams, peer: DataDistParams, name: str) -> None:
    """Refuse, before any link, a peer whose blocks do not map onto ours one for one, naming why.
    Whole blocks only: a peer of another TP size holds other kv heads per block."""
    if peer.tp != local.tp:
        raise ValueError(f"peer {name}: TP {peer.tp} here {local.tp}: LLM-DataDist moves whole blocks, so "
                         "instances of different TP sizes cannot exchange blocks over it")
    if peer.rank != local.rank:
        raise ValueError(f"peer {name}: rank {peer.rank} links to rank {local.rank}; rank r links to rank r")
    if peer.cluster_id == local.cluster_id:
        raise ValueError(f"peer {name}: cluster id {peer.cluster_id} is this endpoint's own")
    for field in ("num_layers", "data_type"):
        if getattr(peer, field) != getattr(local, field):
            raise ValueError(f"peer {name}: {field} differs (here {getattr(local, field)!r}, "
                             f"peer {getattr(peer, field)!r})")
    mine = [(g.kinds, g.block_bytes) for g in local.groups]
    theirs = [(g.kinds, g.block_bytes) for g in peer.groups]
    if mine != theirs:
        raise ValueError(f"peer {name}: cache groups differ (here {mine}, peer {theirs})")


def cache_groups(kinds: list[str], block_bytes: Mapping[str, int]) -> list[list[str]]:
    """Kinds with equal block bytes share one cache (interleaved per layer), in order of first use."""
    out: dict[int, list[str]] = {}
    for kind in kinds:
        out.setdefault(block_bytes[kind], []).append(kind)
    return list(out.values())


def checked_blocks(src: Sequence[int], dst: Sequence[int], layers: range,
                   num_layers: int) -> tuple[list[int], list[int], range]:
    """Block lists of one transfer and its layer range, checked before any library call."""
    src, dst = [int(i) for i in src], [int(i) for i in dst]
    if not src or len(src) != len(dst):
        raise ValueError(f"need equally many source and destination blocks, got {len(src)} and {len(dst)}")
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= num_layers:
        raise ValueError(f"layers {layers} must be a non-empty step-1 range inside [0, {num_layers})")
    return src, dst, layers
