"""vLLM's KV event wire format (``vllm/distributed/kv_events.py``), written with ``msgpack``.

A ZMQ PUB message is three frames: ``(topic, sequence, payload)``; the sequence is 8 bytes big-endian
and the payload a msgpack ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]``.  vLLM declares
the batch ``array_like`` with ``omit_defaults``, and msgspec never thins an array, so the batch always
has its three elements (``data_parallel_rank`` nil when unset).

Two event layouts, both by msgspec's rules (``tag=True``, ``omit_defaults=True``):

* ``"map"`` (the default; vLLM main since PR #42892, merged 2026-06-09, and every release after
  v0.23): each event is a map whose ``"type"`` names it, then its fields by name; fields that have no
  default are always present (nil when unset), those with one are left out when they hold it.
* ``"array"`` (vLLM v0.9 to v0.23): each event is an array, its tag first, then every field in
  declaration order, nil when unset.  Ours ends at ``extra_keys``; vLLM's later arrays add
  ``group_idx`` and two cache-spec fields, which its decoders default when absent.

Events: ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys=None)``, ``BlockRemoved(block_hashes, medium)``, ``AllBlocksCleared()``.

**Block hashes** go on the wire as the 32 bytes of our SHA-256 block hash (vLLM's ``ExternalBlockHash``
is ``bytes | int``; vLLM sends its own digests as bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
``decode_batch`` gives bytes back as lower-case hex, the form the engine uses, and ints as ints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # our host tier
MEDIUM_STORAGE = "STORAGE"  # our storage tier
LAYOUTS = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay endpoint's end marker

WireHash = Union[bytes, int]


@dataclass
class BlockStored:
    """Blocks now held in ``medium``: a chain, ``parent_block_hash`` the parent of the first."""

    block_hashes: list
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None  # one entry per block


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class KVEventBatch:
    ts: float
    events: list = field(default_factory=list)
    data_parallel_rank: int | None = None


def wire_hash(block_hash: str) -> bytes:
    """Our hex block hash as it goes on the wire: its bytes (32 for our SHA-256 chain hashes)."""
    try:
        raw = bytes.fromhex(block_hash)
    except (TypeError, ValueError):
        raise ValueError(f"block hash {block_hash!r:.80} is not hex") from None
    if not raw:
        raise ValueError("block hash '' is empty")
    return raw


def hash_key(value: WireHash) -> str | int:
    """A wire hash as an index key: bytes as lower-case hex (our form), an int as itself."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"block hash {value!r:.80} is neither bytes nor an int")


# ---------------------------------------------------------------------------- encoding
def _event_fields(event: Event) -> tuple[str, list[tuple[str, Any, bool]]]:
    """The event's tag and its (name, value, has_default) in declaration order."""
    if isinstance(event, BlockStored):
        extra = None if event.extra_keys is None else [None if k is None else list(k) for k in event.extra_keys]
        return "BlockStored", [("block_hashes", list(event.block_hashes), False),
                               ("parent_block_hash", event.parent_block_hash, False),
                               ("token_ids", list(event.token_ids), False), ("block_size", event.block_size, False),
                               ("lora_id", event.lora_id, False), ("medium", event.medium, False),
                               ("lora_name", event.lora_name, False), ("extra_keys", extra, True)]
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [("block_hashes", list(event.block_hashes), False), ("medium", event.medium, False)]
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", []
    raise TypeError(f"{type(event).__name__} is not a KV event")


def encode_event(event: Event, layout: str = "map") -> Any:
    tag, fields = _event_fields(event)
    if layout == "array":
        return [tag] + [value for _, value, _ in fields]
    if layout == "map":
        out: dict[str, Any] = {"type": tag}
        for name, value, has_default in fields:
            if not (has_default and value is None):  # omit_defaults: every default here is None
                out[name] = value
        return out
    raise ValueError(f"layout {layout!r} must be one of {LAYOUTS}")


def encode_batch(batch: KVEventBatch, layout: str = "map") -> bytes:
    """The msgpack payload of one ZMQ message, byte for byte what vLLM's msgspec encoder writes."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} must be one of {LAYOUTS}")
    if not isinstance(batch.ts, float) or not math.isfinite(batch.ts):
        raise ValueError(f"batch ts {batch.ts!r} must be a finite float")
    return msgpack.packb([batch.ts, [encode_event(e, layout) for e in batch.events], batch.data_parallel_rank],
                         use_bin_type=True)


# ---------------------------------------------------------------------------- decoding
_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                           "lora_name", "extra_keys"),
           "BlockRemoved": ("block_hashes", "medium"),
           "AllBlocksCleared": ()}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}  # leading fields a decoder needs


def decode_event(raw: Any) -> Event | None:
    """One event in either layout; None for an event type this decoder does not know (a newer
    vLLM's).  Unknown trailing fields or map keys are ignored, absent optional ones default."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        names = _FIELDS.get(tag) if isinstance(tag, str) else None
        if names is None:
            if not isinstance(tag, str):
                raise ValueError(f"KV event map without a string 'type': {str(raw)[:80]}")
            return None
        missing = [n for n in names[:_REQUIRED[tag]] if n not in raw]
        values = [raw.get(n) for n in names]
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _FIELDS.get(tag)
        if names is None:
            return None
        missing = list(names[len(raw) - 1:_REQUIRED[tag]])
        values = list(raw[1:1 + len(names)]) + [None] * max(0, len(names) + 1 - len(raw))
    else:
        raise ValueError(f"KV event is neither a tagged array nor a map: {str(raw)[:80]}")
    if missing:
        raise ValueError(f"{tag} lacks {missing}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(values[0], list):
        raise ValueError(f"{tag} block_hashes {str(values[0])[:60]} is not a list")
    if tag == "BlockRemoved":
        return BlockRemoved(*values)
    stored = BlockStored(*values)
    if stored.extra_keys is not None:
        stored.extra_keys = [None if k is None else tuple(k) for k in stored.extra_keys]
    return stored


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """A payload back to its batch; also returns how many events were of an unknown type (skipped)."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise ValueError(f"KV event batch is not msgpack: {exc}") from None
    if not isinstance(raw, (list, tuple)) or not 2 <= len(raw) or not isinstance(raw[1], list):
        raise ValueError(f"KV event batch is not [ts, events, data_parallel_rank]: {str(raw)[:80]}")
    events = [decode_event(e) for e in raw[1]]
    known = [e for e in events if e is not None]
    return KVEventBatch(float(raw[0]), known, raw[2] if len(raw) > 2 else None), len(events) - len(known)
