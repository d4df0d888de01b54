"""CacheLayout: a model's caches as a list of tensor groups, shared by the engine and every CTM.

A group is one kind of per-layer tensor: its name (the IPC name's kind), dtype, the shape of one
block on one rank, the model layers that have it, its kind and its TP rule:

- ``full``: one entry per token of the block (K, V, an MLA latent or rope cache);
- ``sliding_window``: as ``full``, but attention reads only the last ``window`` tokens;
- ``indexer``: a sparse-attention indexer cache (DSA), moved with its block;
- ``scale``: the quantisation scales of another group's block;
- ``state``: one slot per request, not per block (a linear-attention conv + SSM state).

``compress`` is how many tokens one entry stands for (a compressed group's block covers the same
``block_size`` tokens in ``block_size / compress`` entries), so every group shares one block table:
block ``b`` of every group holds the same tokens.  The TP rule says how the group is spread over
ranks: ``split`` (dimension 0 of ``block_shape`` is kv heads, each rank holds its share),
``replicated`` (every rank holds all of it; a reader of another TP size reads one rank's copy), or
``unsplittable`` (a transfer between different TP sizes is refused naming the group).

FastDeploy's flags (``--key_cache_shape`` and friends) describe a legacy layout
(``CacheSpec.layout()``): its groups are exactly today's K, V and scale caches, its IPC names and
storage keys are byte-identical to before.  Any other layout adds its digest to the storage
namespace, so two layouts never share a key.  ``--cache_layout`` carries a layout as JSON (text or a
file), in the form ``to_json`` writes.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ops.dtypes import cache_dtype
from transfer_factory.keys import Namespace

GROUP_KINDS = ("full", "sliding_window", "indexer", "scale", "state")
TP_RULES = ("split", "replicated", "unsplittable")
_GROUP_FIELDS = {"name", "dtype", "block_shape", "layers", "kind", "window", "compress", "tp", "tag", "heads"}
_LAYOUT_FIELDS = {"name", "num_blocks", "block_size", "num_layers", "num_extra_layers", "extra_block_ratio",
                  "state_slots", "groups"}
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_")
# Names FastDeploy gives its own caches; a grouped layout may use them (same meaning, same IPC names).
FASTDEPLOY_KINDS = ("key_caches", "value_caches", "key_cache_scales", "value_cache_scales")
LEGACY_TAGS = {"key_caches": "k", "value_caches": "v", "key_cache_scales": "k_scale", "value_cache_scales": "v_scale"}


def _positive_int(what: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} {value!r} must be a positive integer")
    return value


@dataclass(frozen=True)
class TensorGroup:
    """One kind of per-layer cache tensor (see the module docstring)."""

    name: str
    dtype: str
    block_shape: tuple[int, ...]
    layers: tuple[int, ...]
    kind: str = "full"
    window: int = 0  # tokens; sliding_window only
    compress: int = 1  # tokens per entry
    tp: str = "split"
    tag: str = ""  # the storage key's kind; the name unless a legacy kind
    heads: int = 0  # a split group's kv heads in the whole model, where ranks may replicate them; 0: unsaid

    def __post_init__(self) -> None:
        what = f"cache group {self.name!r}"
        if not isinstance(self.name, str) or not self.name or not set(self.name) <= _NAME_CHARS:
            raise ValueError(f"cache group name {self.name!r} must be lower-case letters, digits and '_'")
        try:
            cache_dtype(self.dtype)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{what}: dtype {self.dtype!r}: {exc}") from None
        shape = tuple(self.block_shape) if isinstance(self.block_shape, (list, tuple)) else None
        if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in shape):
            raise ValueError(f"{what}: block_shape {self.block_shape!r} must be a list of positive integers")
        object.__setattr__(self, "block_shape", shape)
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple, range)) else None
        if not layers or any(not isinstance(l, int) or isinstance(l, bool) or l < 0 for l in layers):
            raise ValueError(f"{what}: layers {self.layers!r} must be a non-empty list of layer indices")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"{what}: layers must be increasing and listed once, got {list(layers)}")
        object.__setattr__(self, "layers", layers)
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"{what}: kind {self.kind!r} must be one of {', '.join(GROUP_KINDS)}")
        if self.tp not in TP_RULES:
            raise ValueError(f"{what}: tp {self.tp!r} must be one of {', '.join(TP_RULES)}")
        _positive_int(f"{what}: compress", self.compress)
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or self.heads < 0:
            raise ValueError(f"{what}: heads {self.heads!r} must be a non-negative integer")
        if self.heads and self.tp != "split":
            raise ValueError(f"{what}: heads (the model's kv heads) is for TP rule split, not {self.tp}")
        if self.heads and self.block_shape[0] not in (max(1, self.heads // n) for n in range(1, 4097)):
            raise ValueError(f"{what}: block_shape[0] {self.block_shape[0]} kv heads per rank cannot split "
                             f"the model's {self.heads}")
        if self.kind == "sliding_window":
            _positive_int(f"{what}: window", self.window)
        elif self.window:
            raise ValueError(f"{what}: window {self.window} is only for kind sliding_window, not {self.kind}")
        if not self.tag:
            object.__setattr__(self, "tag", LEGACY_TAGS.get(self.name, self.name))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (a state group: one slot) of one layer on one rank."""
        return math.prod(self.block_shape) * cache_dtype(self.dtype).itemsize

    @property
    def per_request(self) -> bool:
        """A state group: one slot per request, addressed by slot, not by block."""
        return self.kind == "state"

    def window_blocks(self, block_size: int, aligned: bool = False) -> int | None:
        """How many trailing blocks of a request attention still reads (None: all of them).
        ``aligned``: the request ends at a block boundary (a stored prefix always does); else the
        window may reach one block further back."""
        if self.kind != "sliding_window":
            return None
        return -(-self.window // block_size) + (0 if aligned else 1)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "block_shape": list(self.block_shape),
                               "layers": list(self.layers), "kind": self.kind, "tp": self.tp}
        if self.window:
            out["window"] = self.window
        if self.compress != 1:
            out["compress"] = self.compress
        if self.tag != LEGACY_TAGS.get(self.name, self.name):
            out["tag"] = self.tag
        if self.heads:
            out["heads"] = self.heads
        return out

    @classmethod
    def from_json(cls, value: Any, where: str) -> "TensorGroup":
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be an object, got {type(value).__name__}")
        unknown = set(value) - _GROUP_FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r} (fields: {', '.join(sorted(_GROUP_FIELDS))})")
        missing = {"name", "dtype", "block_shape", "layers"} - set(value)
        if missing:
            raise ValueError(f"{where}: field {sorted(missing)[0]!r} is missing")
        layers = value["layers"]
        if isinstance(layers, Mapping):  # {"start": a, "stop": b, "step": c}: the layers of a range
            try:
                layers = range(layers.get("start", 0), layers["stop"], layers.get("step", 1))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"{where}: layers {value['layers']!r} is not a range ({exc})") from None
        return cls(name=value["name"], dtype=value["dtype"], block_shape=value["block_shape"], layers=layers,
                   kind=value.get("kind", "full"), window=value.get("window", 0), compress=value.get("compress", 1),
                   tp=value.get("tp", "split"), tag=value.get("tag", ""), heads=value.get("heads", 0))


@dataclass(frozen=True)
class CacheLayout:
    """Every cache tensor of one rank, as groups (DESIGN §3.1); see the module docstring."""

    groups: tuple[TensorGroup, ...]
    num_blocks: int
    block_size: int  # tokens per block
    num_layers: int  # the model's layers; layers num_layers.. are speculative (MTP) layers
    num_extra_layers: int = 0
    extra_block_ratio: float = 1.0
    state_slots: int = 0  # request slots of the state groups
    name: str = ""
    legacy: dict | None = field(default=None, compare=False)  # the FastDeploy flags' namespace fields

    def __post_init__(self) -> None:
        _positive_int("num_blocks", self.num_blocks)
        _positive_int("block_size", self.block_size)
        _positive_int("num_layers", self.num_layers)
        if not isinstance(self.num_extra_layers, int) or self.num_extra_layers < 0:
            raise ValueError(f"num_extra_layers {self.num_extra_layers!r} must be a non-negative integer")
        if not isinstance(self.extra_block_ratio, (int, float)) or self.extra_block_ratio <= 0:
            raise ValueError(f"extra_block_ratio {self.extra_block_ratio!r} must be positive")
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ValueError("a cache layout needs at least one group")
        names = [g.name for g in self.groups]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"cache group {name!r} is listed twice")
        tags = [g.tag for g in self.groups]
        for g in self.groups:
            if tags.count(g.tag) > 1:
                raise ValueError(f"cache group {g.name!r}: storage tag {g.tag!r} is used by another group")
            if g.layers[-1] >= self.total_layers:
                raise ValueError(f"cache group {g.name!r} has layer {g.layers[-1]}, the model has "
                                 f"{self.total_layers} layers (0..{self.total_layers - 1})")
            if self.block_size % g.compress:
                raise ValueError(f"cache group {g.name!r}: compress {g.compress} does not divide block_size "
                                 f"{self.block_size}")
        if any(g.per_request for g in self.groups):
            _positive_int("state_slots (a layout with a state group)", self.state_slots)
        if not set(range(self.total_layers)) <= {l for g in self.groups for l in g.layers}:
            missing = sorted(set(range(self.total_layers)) - {l for g in self.groups for l in g.layers})
            raise ValueError(f"layer {missing[0]} has no cache group")

    # ------------------------------------------------------------------ shape
    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_extra_layers

    def layer_blocks(self) -> list[int]:
        """Blocks of each model layer (speculative layers have their own count)."""
        extra = int(self.num_blocks * self.extra_block_ratio)
        return [self.num_blocks] * self.num_layers + [extra] * self.num_extra_layers

    def rows(self, group: TensorGroup) -> list[int]:
        """Rows of each of ``group``'s layer tensors: blocks, or request slots for a state group."""
        if group.per_request:
            return [self.state_slots] * len(group.layers)
        blocks = self.layer_blocks()
        return [blocks[l] for l in group.layers]

    @property
    def request_slots(self) -> int:
        """Request slots of the state groups (0 without one): a task's ``state_slot`` is below it."""
        return self.state_slots if any(g.per_request for g in self.groups) else 0

    def block_groups(self) -> tuple[TensorGroup, ...]:
        """The groups a block id addresses (every group but the state groups)."""
        return tuple(g for g in self.groups if not g.per_request)

    def bytes_per_block(self) -> int:
        """One block of every block group and layer on one rank."""
        return sum(g.block_bytes * len(g.layers) for g in self.block_groups())

    # ------------------------------------------------------------------ identity
    def to_json(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "num_blocks": self.num_blocks, "block_size": self.block_size,
                               "num_layers": self.num_layers, "groups": [g.to_json() for g in self.groups]}
        if self.num_extra_layers:
            out.update(num_extra_layers=self.num_extra_layers, extra_block_ratio=self.extra_block_ratio)
        if self.state_slots:
            out["state_slots"] = self.state_slots
        return out

    def digest(self) -> str:
        """What the bytes of a block mean: the groups, block size and layers, not the capacities
        (two instances with different block counts share it)."""
        meaning = {"block_size": self.block_size, "num_layers": self.num_layers,
                   "num_extra_layers": self.num_extra_layers, "groups": [g.to_json() for g in self.groups]}
        return hashlib.sha256(json.dumps(meaning, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

    def storage_namespace(self, model_id: str, model_version: str, tp_size: int) -> Namespace:
        """The namespace of this model's storage keys; the engine and every CTM build it here.  A
        legacy layout's namespace is today's, byte for byte; any other carries the layout digest."""
        if self.legacy is not None:
            return Namespace(model_id=model_id or "model", model_version=model_version, tp_size=tp_size,
                             cache_dtype=self.legacy["cache_dtype"], block_size=self.block_size,
                             num_layers=self.total_layers)
        return Namespace(model_id=model_id or "model", model_version=model_version, tp_size=tp_size,
                         cache_dtype="grouped", block_size=self.block_size, num_layers=self.total_layers,
                         layout_digest=self.digest())

    def speculative_config(self) -> dict:
        if not self.num_extra_layers:
            return {}
        return {"num_extra_cache_layer": self.num_extra_layers, "num_gpu_block_expand_ratio": self.extra_block_ratio}

    @classmethod
    def from_json(cls, value: Any) -> "CacheLayout":
        if not isinstance(value, Mapping):
            raise ValueError(f"a cache layout must be a JSON object, got {type(value).__name__}")
        unknown = set(value) - _LAYOUT_FIELDS
        if unknown:
            raise ValueError(f"cache layout: unknown field {sorted(unknown)[0]!r} "
                             f"(fields: {', '.join(sorted(_LAYOUT_FIELDS))})")
        for name in ("num_blocks", "block_size", "num_layers", "groups"):
            if name not in value:
                raise ValueError(f"cache layout: field {name!r} is missing")
        groups = value["groups"]
        if not isinstance(groups, list):
            raise ValueError(f"cache layout: groups must be a list, got {type(groups).__name__}")
        return cls(groups=tuple(TensorGroup.from_json(g, f"cache layout groups[{i}]") for i, g in enumerate(groups)),
                   num_blocks=value["num_blocks"], block_size=value["block_size"], num_layers=value["num_layers"],
                   num_extra_layers=value.get("num_extra_layers", 0),
                   extra_block_ratio=value.get("extra_block_ratio", 1.0),
                   state_slots=value.get("state_slots", 0), name=value.get("name", ""))


def load_layout(text_or_path: str) -> CacheLayout:
    """``--cache_layout``'s value: JSON text (starting with ``{``) or the path of a JSON file."""
    text = text_or_path.strip()
    if not text.startswith("{"):
        try:
            with open(text_or_path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the cache layout {text_or_path!r}: {exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the cache layout is not JSON: {exc}") from None
    return CacheLayout.from_json(value)
