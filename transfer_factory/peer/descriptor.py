"""What a CTM rank publishes to its peers, and whether two ranks can exchange blocks.

A descriptor travels between engines out of band (over the authenticated control plane, or the
router's own channel), so ``from_wire`` trusts nothing: every field is checked for its type and
range and a bad one is named.  ``compatible_layouts`` refuses a link before any byte moves when
the two caches would not mean the same thing block for block: another model or model version,
another dtype, block size, layer count, head size, or MLA on one side only, or a different number
of kv heads in all.  The TP sizes may differ: each rank then exchanges head ranges of blocks with
the peer ranks that hold them (``transfer_factory.peer.heads``), except over LLM-DataDist, which
moves whole blocks.  Transports are chosen by capability (``choose_transport``), never by the peer's name.
"""
from __future__ import annotations

import ipaddress

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

ROLES = ("prefill", "decode", "mixed")  # mixed: an instance that does both
# The transports a rank may offer, best first: the same-host path copies from the peer's
# exported segments and opens no port; LLM-DataDist is Ascend's own (offered only by ranks on the
# NPU platform with CANN's SDK: ``transfer_factory.peer.datadist_rank``); the Transfer Engine
# crosses hosts.
TRANSPORTS = ("ipc", "datadist", "mooncake")
WHOLE_BLOCKS_ONLY = ("datadist",)  # transports that cannot move a head range of a block
MAX_NAME_CHARS = 256


class LayoutMismatch(ValueError):
    """Two ranks whose caches cannot exchange blocks; ``field`` names the first difference."""

    def __init__(self, field_name: str, local: Any, peer: Any):
        super().__init__(f"cannot link: {field_name} differs (here {local!r}, peer {peer!r})")
        self.field = field_name


@dataclass(frozen=True)
class PeerLayout:
    """The cache layout of one rank, as far as a peer needs it to read or write its blocks."""

    model_id: str
    model_version: str
    cache_dtype: str
    block_size: int
    num_layers: int
    kv_heads: int  # per rank
    head_dim: int
    mla: bool
    num_blocks: int  # this rank's device blocks (a peer checks block ids against it)
    block_bytes: int  # bytes of one block of one layer, all kinds together
    # The cache layout's groups (``cache_manager.cache_layout.TensorGroup.to_json``): a link checks
    # them group by group and field by field (``check_groups``).
    groups: tuple = ()
    total_kv_heads: int = 0  # the model's kv heads where the layout says (ranks may replicate them); 0: kv_heads x tp

    # Compared at link time, in this order: the first that differs is named.  The kv heads per
    # rank and so the block bytes may differ with the TP size (checked per head instead).
    MUST_MATCH = ("model_id", "model_version", "cache_dtype", "block_size", "num_layers", "head_dim", "mla")


@dataclass(frozen=True)
class PeerDescriptor:
    instance_id: str
    role: str
    rank: int
    tp: int
    layout: PeerLayout
    boot_id: str  # the host's kernel boot id: the same-host transport needs the same kernel
    transports: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> what a peer needs to use it
    # The generation of the engine's cache memory this descriptor describes (its exposure board's
    # generation word, ``transfer_factory.peer.handles``); a link to it moves bytes only while the
    # word still says so.  0: unknown, and no link is made to it.
    generation: int = 0
    pid: int = 0  # the rank's CTM process (a same-host peer watches it: a dead writer writes no more)

    def __post_init__(self) -> None:
        _text("instance_id", self.instance_id)
        if self.role not in ROLES:
            raise ValueError(f"descriptor role {self.role!r} must be one of {ROLES}")
        _count("tp", self.tp)
        if not (type(self.rank) is int and 0 <= self.rank < self.tp):
            raise ValueError(f"descriptor rank {self.rank!r} must be in [0, tp={self.tp})")
        for name in ("generation", "pid"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < 2**62:
                raise ValueError(f"descriptor field {name} {value!r:.40} must be a non-negative integer")
        unknown = sorted(set(self.transports) - set(TRANSPORTS))
        if unknown:
            raise ValueError(f"descriptor offers unknown transports {unknown}; known: {TRANSPORTS}")

    def to_wire(self) -> dict:
        """Plain data (msgpack-able: str, int, bool, lists and maps), never a pickled object."""
        out = asdict(self)
        out["transports"] = {name: dict(params) for name, params in self.transports.items()}
        return out

    @classmethod
    def from_wire(cls, d: Any) -> "PeerDescriptor":
        """The descriptor a peer sent; raises ValueError naming the first bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"a descriptor must be a map, got {type(d).__name__}")
        layout = d.get("layout")
        if not isinstance(layout, dict):
            raise ValueError("descriptor field 'layout' must be a map")
        transports = d.get("transports", {})
        if not isinstance(transports, dict) or not all(isinstance(v, dict) for v in transports.values()):
            raise ValueError("descriptor field 'transports' must map transport names to maps")
        return cls(instance_id=d.get("instance_id"), role=d.get("role"), rank=d.get("rank"), tp=d.get("tp"),
                   layout=_layout(layout), boot_id=_text("boot_id", d.get("boot_id"), empty=True),
                   transports=transports, generation=d.get("generation", 0), pid=d.get("pid", 0))


GROUP_FIELDS = {"name": str, "dtype": str, "block_shape": list, "layers": list, "kind": str, "tp": str, "window": int,
                "compress": int, "tag": str, "heads": int}
MAX_GROUPS, MAX_GROUP_LIST = 64, 4096


def _groups(value: Any) -> tuple:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_GROUPS:
        raise ValueError(f"descriptor field layout.groups must be a list of at most {MAX_GROUPS} maps")
    out = []
    for i, g in enumerate(value):
        if not isinstance(g, dict) or set(g) - set(GROUP_FIELDS) or "name" not in g:
            raise ValueError(f"descriptor field layout.groups[{i}] must be a map of {sorted(GROUP_FIELDS)} with a name")
        for key, item in g.items():
            kind = GROUP_FIELDS[key]
            if kind is str:
                _text(f"layout.groups[{i}].{key}", item)
            elif kind is int:
                _count(f"layout.groups[{i}].{key}", item)
            elif not isinstance(item, (list, tuple)) or len(item) > MAX_GROUP_LIST or \
                    not all(type(x) is int and 0 <= x < 2**40 for x in item):
                raise ValueError(f"descriptor field layout.groups[{i}].{key} must be a list of integers")
        out.append({k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in g.items()})
    return tuple(out)


def check_groups(mine: PeerDescriptor, theirs: PeerDescriptor) -> None:
    """Raise ``LayoutMismatch`` naming the first group and field in which the two layouts differ,
    but for the kv heads a rank holds of a group split by heads (checked in all after this)."""
    peer = {g["name"]: g for g in theirs.layout.groups}
    for g in mine.layout.groups:
        other = peer.pop(g["name"], None)
        if other is None:
            raise LayoutMismatch(f"cache group {g['name']!r}", "present", "absent")
        for key in sorted(set(g) | set(other)):
            a, b = g.get(key), other.get(key)
            if key == "block_shape" and g.get("tp") == "split" and isinstance(a, list) and isinstance(b, list) \
                    and a[1:] == b[1:]:
                continue  # the heads per rank follow the TP size: "kv_heads x tp" checks them in all
            if a != b:
                raise LayoutMismatch(f"cache group {g['name']!r} {key}", a, b)
    if peer:
        raise LayoutMismatch(f"cache group {sorted(peer)[0]!r}", "absent", "present")


def compatible_layouts(local: PeerDescriptor, peer: PeerDescriptor) -> None:
    """Raise ``LayoutMismatch`` naming the first field that keeps ``local`` and ``peer`` from
    exchanging blocks.  Instances of different TP sizes can, when they hold the same kv heads in
    all (MLA: the same latent on every rank) and a head takes the same bytes on both."""
    if local.instance_id == peer.instance_id:
        raise LayoutMismatch("instance_id", local.instance_id, peer.instance_id)
    for name in PeerLayout.MUST_MATCH:
        if name == "head_dim":  # the groups say what each tensor holds, the summary fields after them
            check_groups(local, peer)
        mine, theirs = getattr(local.layout, name), getattr(peer.layout, name)
        if mine != theirs:
            raise LayoutMismatch(name, mine, theirs)
    mine, theirs = local.layout, peer.layout
    if mine.mla:
        if mine.kv_heads != theirs.kv_heads:
            raise LayoutMismatch("kv_heads", mine.kv_heads, theirs.kv_heads)
    elif mine.total_kv_heads and theirs.total_kv_heads:  # ranks may replicate heads: the model's count decides
        if mine.total_kv_heads != theirs.total_kv_heads:
            raise LayoutMismatch("kv_heads in all", mine.total_kv_heads, theirs.total_kv_heads)
    elif mine.kv_heads * local.tp != theirs.kv_heads * peer.tp:
        raise LayoutMismatch("kv_heads x tp", f"{mine.kv_heads} x {local.tp}", f"{theirs.kv_heads} x {peer.tp}")
    if mine.block_bytes * theirs.kv_heads != theirs.block_bytes * mine.kv_heads:
        raise LayoutMismatch("block_bytes per kv head", mine.block_bytes / mine.kv_heads,
                             theirs.block_bytes / theirs.kv_heads)


def usable_transports(local: PeerDescriptor, peer: PeerDescriptor, forced: str | None = None) -> list[str]:
    """The transports both offer that can link them, best first: ``ipc`` only when both run on one
    kernel (a link still proves it can open the peer's segments, and falls back to the next: two
    containers share a kernel but not ``/dev/shm``).  ``forced`` (``--pd-transport``) must be
    offered by both, or the link is refused naming it."""
    both = [name for name in TRANSPORTS if name in local.transports and name in peer.transports]
    if local.boot_id != peer.boot_id or not local.boot_id:
        both = [name for name in both if name != "ipc"]
        loopback = loopback_address(peer.transports.get("mooncake", {}).get("address"))
        if loopback is not None and "mooncake" in both:  # its pod_ip left at 127.0.0.1: that is this host
            if forced == "mooncake" or both == ["mooncake"]:
                raise ValueError(f"peer {peer.instance_id} rank {peer.rank} runs on another host (boot id "
                                 f"{peer.boot_id[:8]}…) but advertises the loopback Transfer Engine address "
                                 f"{loopback}: start it with a pod_ip this host can reach")
            both.remove("mooncake")
    if local.tp != peer.tp:  # each rank exchanges head ranges of blocks: whole-block transports cannot
        if forced in WHOLE_BLOCKS_ONLY:
            raise ValueError(f"transport {forced!r} moves whole blocks only: it cannot link TP {local.tp} to "
                             f"TP {peer.tp}")
        both = [name for name in both if name not in WHOLE_BLOCKS_ONLY]
    if forced is not None and forced != "auto":
        if forced not in both:
            raise ValueError(f"transport {forced!r} is not offered by both sides here (usable: {both or 'none'})")
        return [forced]
    if not both:
        other_host = local.boot_id != peer.boot_id or not local.boot_id
        hint = (" (a peer on another host needs the Transfer Engine: both describe with offer ['ipc', 'mooncake'], "
                "engine_hooks.pd.offer_for('mooncake'))" if other_host else "")
        raise ValueError(f"no transport in common: here {sorted(local.transports)}, peer {sorted(peer.transports)}"
                         + hint)
    return both


def loopback_address(address: Any) -> str | None:
    """``address`` (``host:port``) if its host is a loopback address (127/8, ::1, localhost), else None."""
    if not isinstance(address, str) or ":" not in address:
        return None
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return address
    try:
        return address if ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # a host name: resolved by the Transfer Engine, not judged here
        return None


def choose_transport(local: PeerDescriptor, peer: PeerDescriptor, forced: str | None = None) -> str:
    """The best of ``usable_transports``."""
    return usable_transports(local, peer, forced)[0]


def _layout(d: dict) -> PeerLayout:
    values = {}
    for name, kind in (("model_id", str), ("model_version", str), ("cache_dtype", str), ("block_size", int),
                       ("num_layers", int), ("kv_heads", int), ("head_dim", int), ("mla", bool),
                       ("num_blocks", int), ("block_bytes", int)):
        value = d.get(name)
        if kind is str:
            _text(f"layout.{name}", value, empty=name == "model_version")
        elif kind is int:
            _count(f"layout.{name}", value)
        elif type(value) is not bool:
            raise ValueError(f"descriptor field layout.{name} {value!r:.80} must be a bool")
        values[name] = value
    total = d.get("total_kv_heads", 0)
    if total:
        _count("layout.total_kv_heads", total)
    return PeerLayout(**values, groups=_groups(d.get("groups", [])), total_kv_heads=total)


def _text(name: str, value: Any, empty: bool = False) -> str:
    if type(value) is not str or len(value) > MAX_NAME_CHARS or (not value and not empty):
        raise ValueError(f"descriptor field {name} {value!r:.80} must be a non-empty string of at most {MAX_NAME_CHARS}")
    return value


def _count(name: str, value: Any) -> int:
    if type(value) is not int or not 0 < value < 2**40:
        raise ValueError(f"descriptor field {name} {value!r:.80} must be a positive integer")
    return value
