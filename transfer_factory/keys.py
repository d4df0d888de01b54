"""Storage keys (DESIGN §3.7): chained SHA-256 block hashes under a model namespace.

``h_0 = SHA256(enc(block_0))``, ``h_n = SHA256(h_{n-1} || enc(block_n))`` where ``enc``
writes each token id as 8 little-endian bytes: never Python's ``hash``, never pickle, so
every process and host computes the same keys.  The key of one rank's share of a block is
``{namespace}/{h_n}/{rank}/{k|v|k_scale|v_scale}``; the namespace carries the model id and
version, TP size, cache dtype, block size, layer count, layout version and (for a grouped cache layout) the layout's
digest, so two models, two TP layouts or two cache layouts never share a key.

**Tenant salts** (vLLM's ``cache_salt``).  ``salted_hashes(hashes, cache_salt)`` is the one place a
request's salt enters a block's identity: with a salt, every block hash becomes
``SHA256("ctm-cache-salt" || salt || h)``, so the storage key, the prefix cache's lookups, the P/D
handle and the KV events of one tenant's blocks never equal another tenant's; with no salt (None or
"") the hashes are returned unchanged, exactly as before salts existed.  ``salt_tag(cache_salt)`` is
what leaves the engine in place of the salt (KV events, P/D tickets): a digest, never the salt.
"""
from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

LAYOUT_VERSION = 1
KINDS = ("k", "v", "k_scale", "v_scale")
_SLUG = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Namespace:
    model_id: str
    model_version: str
    tp_size: int
    cache_dtype: str
    block_size: int
    num_layers: int
    layout_version: int = LAYOUT_VERSION
    layout_digest: str = ""  # a grouped cache layout's digest; empty for FastDeploy's K/V layout

    def __post_init__(self) -> None:
        for name in ("tp_size", "block_size", "num_layers", "layout_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"namespace {name} {value!r} must be a positive integer")
        if not self.model_id:
            raise ValueError("namespace model_id must not be empty")

    def __str__(self) -> str:
        """A readable, path-safe prefix plus a digest of every field (so no two namespaces collide)."""
        values = [self.model_id, self.model_version, self.tp_size, self.cache_dtype, self.block_size,
                  self.num_layers, self.layout_version] + ([self.layout_digest] if self.layout_digest else [])
        fields = "\x00".join(str(v) for v in values)
        digest = hashlib.sha256(fields.encode()).hexdigest()[:16]
        slug = _SLUG.sub("_", self.model_id.rsplit("/", 1)[-1])[:48] or "model"
        return f"{slug}-tp{self.tp_size}-{digest}"


def _encode_block(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error:
        bad = next((t for t in tokens if not isinstance(t, int) or not -2**63 <= t < 2**63), None)
        raise ValueError(f"token id {bad!r} is not a 64-bit integer") from None


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: str | None = None) -> list[str]:
    """Hex hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size {block_size} must be positive")
    out = []
    prev = bytes.fromhex(parent) if parent else b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hashlib.sha256(prev + _encode_block(token_ids[start:start + block_size])).digest()
        out.append(prev.hex())
    return out


def chain_hash_ids(ids: Iterable[object], parent: str | None = None) -> list[str]:
    """Chained hashes over already-hashed block ids (e.g. a trace's ``hash_ids``), one per id."""
    out = []
    prev = bytes.fromhex(parent) if parent else b""
    for block_id in ids:
        prev = hashlib.sha256(prev + str(block_id).encode()).digest()
        out.append(prev.hex())
    return out


_SALT_DOMAIN = b"ctm-cache-salt\x00"
MAX_SALT_BYTES = 256


def _salt_bytes(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b""
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")  # never its value
    raw = cache_salt.encode()
    if len(raw) > MAX_SALT_BYTES:
        raise ValueError(f"cache_salt of {len(raw)} bytes is longer than {MAX_SALT_BYTES}")
    return raw


def salted_hashes(hashes: Sequence[str], cache_salt: str | None) -> list[str]:
    """The block hashes a request with ``cache_salt`` is cached under (unchanged without a salt)."""
    raw = _salt_bytes(cache_salt)
    if not raw:
        return list(hashes)
    prefix = _SALT_DOMAIN + len(raw).to_bytes(2, "big") + raw
    out = []
    for h in hashes:
        try:
            block = bytes.fromhex(h)
        except (TypeError, ValueError):
            raise ValueError(f"block hash {h!r:.40} is not hex") from None
        out.append(hashlib.sha256(prefix + block).hexdigest())
    return out


def salt_tag(cache_salt: str | None) -> str:
    """A 16-hex digest naming the salt (empty without one): what events and tickets carry."""
    raw = _salt_bytes(cache_salt)
    return hashlib.sha256(_SALT_DOMAIN + b"tag\x00" + raw).hexdigest()[:16] if raw else ""


_GROUP_TAG = re.compile(r"[a-z][a-z0-9_]{0,47}")


def storage_key(namespace: Namespace | str, block_hash: str, rank: int, kind: str) -> str:
    """``kind``: one of ``KINDS`` (FastDeploy's caches) or a cache layout group's tag (its name)."""
    if kind not in KINDS and not (isinstance(kind, str) and _GROUP_TAG.fullmatch(kind)):
        raise ValueError(f"kind {kind!r} must be one of {KINDS} or a cache group's tag (lower-case letters, "
                         "digits and '_')")
    return f"{namespace}/{block_hash}/{rank}/{kind}"
