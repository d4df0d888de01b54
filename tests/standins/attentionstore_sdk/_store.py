"""Block storage of the AttentionStore SDK stand-in (tests only).

Block identity and keys, the object paths under ``$ATTENTIONSTORE_STANDIN_DIR``, atomic file I/O,
and the stand-in-only test helpers ``block_key_for_tests`` and ``remove_block_for_tests``.  See
``attentionstore_sdk.sdk`` for the key derivation and the on-disk layout.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Iterator

from ._checks import is_int, pack_token_ids
from .utils.err import AttentionStoreSDKError


# ---------------------------------------------------------------------------------------- keys
def identity_bytes(namespace: str, model_version: str, shard_num: int, shard_id: int, block_token_size: int) -> bytes:
    """What names a block besides its tokens, each field length-prefixed (no two identities collide)."""
    out = bytearray()
    for part in (namespace, model_version, str(shard_num), str(shard_id), str(block_token_size)):
        raw = part.encode()
        out += len(raw).to_bytes(8, "little") + raw
    return bytes(out)


def block_keys(identity: bytes, packed: bytes, block_token_size: int, start: int, stop: int) -> Iterator[str]:
    """Keys of blocks ``start .. stop - 1``: SHA-256 of the identity and the prefix's int64 bytes."""
    step = 8 * block_token_size
    digest = hashlib.sha256(identity)
    digest.update(packed[:start * step])
    for b in range(start, stop):
        digest.update(packed[b * step:(b + 1) * step])
        yield digest.copy().hexdigest()


def object_path(root: Path, key: str, layer: int) -> Path:
    return root / "data" / key[:2] / f"{key}.{layer}"


# ---------------------------------------------------------------------------------------- test helpers
def block_key_for_tests(namespace: str, model_version: str, shard_num: int, shard_id: int, block_token_size: int,
                        token_ids: list[int], block_idx: int) -> str:
    """Stand-in only (no such call in the SDK): the key of block ``block_idx`` of ``token_ids``."""
    packed = pack_token_ids(token_ids, block_token_size)  # checks them as Tokens(...) does
    if not is_int(block_idx) or not 0 <= block_idx < len(token_ids) // block_token_size:
        raise ValueError(f"block_idx {block_idx!r} is not a full block of the {len(token_ids)} tokens")
    identity = identity_bytes(namespace, model_version, shard_num, shard_id, block_token_size)
    return next(block_keys(identity, packed, block_token_size, block_idx, block_idx + 1))


def remove_block_for_tests(root: str | os.PathLike[str], shard_id: int, shard_num: int, token_ids: list[int],
                           block_token_size: int, block_idx: int, *, namespace: str | None = None,
                           model_version: str | None = None) -> int:
    """Stand-in only: delete block ``block_idx`` of ``token_ids`` (every layer) from shard
    ``shard_id`` of ``shard_num``, for every SDK identity ever constructed under ``root`` with that
    shard and block size (narrowed by ``namespace``/``model_version`` when given).  Returns the
    number of files removed."""
    root = Path(root)
    removed = 0
    for record in sorted((root / "identities").glob("*.json")):
        ident = json.loads(record.read_text())
        if (ident["shard_id"], ident["shard_num"], ident["block_token_size"]) != (shard_id, shard_num,
                                                                                  block_token_size):
            continue
        if namespace is not None and ident["namespace"] != namespace:
            continue
        if model_version is not None and ident["model_version"] != model_version:
            continue
        key = block_key_for_tests(ident["namespace"], ident["model_version"], shard_num, shard_id, block_token_size,
                                  token_ids, block_idx)
        for path in (root / "data" / key[:2]).glob(f"{key}.*"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


# ---------------------------------------------------------------------------------------- file I/O
def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def record_identity(root: Path, identity: bytes, namespace: str, model_version: str, shard_id: int,
                    shard_num: int, block_token_size: int) -> None:
    """Keep ``root/identities/<sha256>.json`` (once per identity) for ``remove_block_for_tests``."""
    record = {"namespace": namespace, "model_version": model_version, "shard_id": shard_id,
              "shard_num": shard_num, "block_token_size": block_token_size}
    path = root / "identities" / f"{hashlib.sha256(identity).hexdigest()}.json"
    if not path.exists():
        atomic_write(path, json.dumps(record, sort_keys=True).encode())


def store_object(root: Path, key: str, layer: int, data: bytes) -> None:
    try:
        atomic_write(object_path(root, key, layer), data)
    except OSError as exc:
        raise AttentionStoreSDKError(f"cannot store block {key[:12]} layer {layer}: {exc}") from None


def stored_size(root: Path, key: str, layer: int) -> int | None:
    try:
        return object_path(root, key, layer).stat().st_size
    except FileNotFoundError:
        return None


def load_object(root: Path, key: str, layer: int, size: int) -> bytes | None:
    """The object's bytes, or None when it is missing or not ``size`` bytes long."""
    try:
        with open(object_path(root, key, layer), "rb") as f:
            data = f.read(size + 1)
    except FileNotFoundError:
        return None
    return data if len(data) == size else None
