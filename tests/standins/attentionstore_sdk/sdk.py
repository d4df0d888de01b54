"""``AttentionStoreSDK`` and ``Tokens``: a contract stand-in of the AttentionStore SDK (tests only).

This is not the vendor SDK.  It implements the calls FastDeploy makes, with the documented
semantics, and rejects (``AttentionStoreSDKError`` naming the argument) every argument the SDK
rejects, so that code passing against it is likely to run on the real SDK.

API
---
* ``Tokens(token_ids, block_token_size)``: ``token_ids`` a non-empty ``list`` of ``int`` (not
  ``bool``, int64 range), ``block_token_size`` a positive ``int``.  It holds
  ``len(token_ids) // block_token_size`` full blocks; a trailing partial block is never addressable.
* ``AttentionStoreSDK(namespace, pod_name, model_version, shard_id, shard_num, layer_num,
  block_token_size, bytes_per_shard_layer_per_block, device_id, dp_id)``, all positional:
  ``namespace``/``pod_name``/``model_version`` non-empty ``str`` shorter than 128 characters,
  ``0 <= shard_id < shard_num``, ``layer_num``/``block_token_size``/``bytes_per_shard_layer_per_block``
  positive ``int``, ``device_id``/``dp_id`` ``int >= 0``.  ``$ATTENTIONSTORE_STANDIN_DIR`` must be set.
* ``match(tokens, start_block_idx, timeout) -> int``: consecutive blocks from ``start_block_idx``
  stored for every layer in ``range(layer_num)``.
* ``read(layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout) -> int`` and
  ``write(...)`` (same arguments): block ``start_block_idx + i`` of layer ``layer_ids[j]`` moves
  from/to ``k_ptrs[j] + gpu_block_ids[i] * bytes_per_shard_layer_per_block`` (and the same offset
  from ``v_ptrs[j]``; ``v_ptrs == []`` means K only, MLA).  Both return the number of leading blocks
  done; ``read`` stops at the first block missing for any requested layer and writes nothing for it
  or after it; ``write`` overwrites a block that exists.
* ``flush_token_index(layer_ids, tokens, start_idx, src_media, dst_media) -> None``: checks its
  arguments (media ``None`` or a ``common_pb2.MEDIA_*`` value, not both ``None``), nothing else.

Checks of ``match``/``read``/``write``: ``tokens`` is a ``Tokens`` of the SDK's block_token_size;
``layer_ids`` a non-empty ``list`` of distinct ``int`` in ``[0, layer_num)``; ``k_ptrs`` a ``list``
of positive ``int`` as long as ``layer_ids``; ``v_ptrs`` empty or likewise; ``gpu_block_ids`` a
``list`` of ``int >= 0`` (non-empty for read/write); ``start_block_idx`` an ``int >= 0`` with
``start_block_idx + len(gpu_block_ids)`` within the full blocks of ``tokens`` (``match``:
``start_block_idx <=`` full blocks); ``timeout`` a finite positive ``int``/``float``.  A pointer is
not checked against the cache it points into: the caller must pass the right one.

Data
----
The key of block ``b`` is the SHA-256 of (namespace, model_version, shard_num, shard_id,
block_token_size, each field length-prefixed) followed by the int64 little-endian bytes of
``token_ids[:(b + 1) * block_token_size]``; ``pod_name``, ``device_id`` and ``dp_id`` are not part
of it (a block written by one pod is read by another of the same namespace, model_version and
shard).  One file per (key, layer) holds the K bytes then the V bytes (K only for MLA), written
atomically (temporary file + ``os.replace``)::

    $ATTENTIONSTORE_STANDIN_DIR/data/<key[:2]>/<key>.<layer>
    $ATTENTIONSTORE_STANDIN_DIR/identities/<sha256>.json   one per SDK identity (for test helpers)
    $ATTENTIONSTORE_STANDIN_DIR/calls.log                  "<pid> <method>" per call (O_APPEND)
    $ATTENTIONSTORE_STANDIN_DIR/faults.json                fault knobs, written by tests

An object whose size is not what the caller expects (``bytes_per_shard_layer_per_block`` times 2,
or times 1 for K only; ``match`` accepts either) is a miss.

Faults
------
At every ``match``/``read``/``write`` call the stand-in re-reads ``faults.json`` (missing or empty:
no faults; malformed or an unknown key: ``ValueError``, a test bug).  Keys:

* ``"not_ready_until"``: epoch seconds; until then every call raises
  ``AttentionStoreSDKError("cuda memory not ready")`` (FastDeploy retries ``match`` on that text);
* ``"raise_on_call"``: ``{"read": N}``: the N-th call (1-based, per process and method) raises;
* ``"raise"``: ``["write", ...]``: every call of those methods raises;
* ``"sleep_s"``: ``{"read": 3.0}``: sleeps that long first, ignoring ``timeout`` (a hung SDK);
* ``"timeout"``: ``["match", ...]``: waits ``timeout`` seconds, then raises ``"timeout"``;
* ``"write_first_k"``: ``k``: a write stores only its first ``k`` blocks and returns ``min(k, n)``.

Device memory: the real SDK reads and writes device memory itself (its own copy engine); on this
CPU-only host the "device" caches are host-addressable, so the stand-in copies with
``ctypes.memmove``.

Code: this module holds ``Tokens`` and ``AttentionStoreSDK``; ``_checks`` the argument checks,
``_faults`` the fault knobs, call counts and ``calls.log``, ``_store`` the keys, object files and
the ``*_for_tests`` helpers (re-exported here).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from . import _checks, _faults
from ._checks import bad, check_int, check_int_list, check_name, check_timeout, is_int, pack_token_ids
from ._faults import begin_call, inject, log_call
from ._store import (block_key_for_tests, block_keys, identity_bytes, load_object, record_identity,
                     remove_block_for_tests, store_object, stored_size)
from .api.common import common_pb2
from .utils.err import AttentionStoreSDKError

__all__ = ["AttentionStoreSDK", "Tokens", "block_key_for_tests", "remove_block_for_tests"]

DIR_ENV = "ATTENTIONSTORE_STANDIN_DIR"
NOT_READY_MESSAGE = _faults.NOT_READY_MESSAGE
MAX_NAME_CHARS = _checks.MAX_NAME_CHARS
FAULT_METHODS = _faults.FAULT_METHODS
_MEDIA = frozenset({common_pb2.MEDIA_HBM, common_pb2.MEDIA_DRAM, common_pb2.MEDIA_SSD})


# ---------------------------------------------------------------------------------------- Tokens
class Tokens:
    """The token ids of a prefix, cut into blocks of ``block_token_size`` tokens.

    ``Tokens(token_ids, block_token_size)``; only full blocks (``len(token_ids) //
    block_token_size``) are addressable.  The ids are copied at construction.
    """

    __slots__ = ("_block_token_size", "_packed", "_count")

    def __init__(self, token_ids: list[int], block_token_size: int) -> None:
        packed = pack_token_ids(token_ids, block_token_size)
        self._block_token_size = block_token_size
        self._count = len(token_ids)
        self._packed = packed

    def _full_blocks(self) -> int:
        return self._count // self._block_token_size

    def __repr__(self) -> str:
        return f"Tokens(<{self._count} ids>, block_token_size={self._block_token_size})"


# ---------------------------------------------------------------------------------------- SDK
class AttentionStoreSDK:
    """One shard's client of the store (stand-in; see the module docstring for the contract)."""

    def __init__(self, namespace: str, pod_name: str, model_version: str, shard_id: int, shard_num: int,
                 layer_num: int, block_token_size: int, bytes_per_shard_layer_per_block: int, device_id: int,
                 dp_id: int, /) -> None:
        self._namespace = check_name("namespace", namespace)
        self._pod_name = check_name("pod_name", pod_name)
        self._model_version = check_name("model_version", model_version)
        self._shard_num = check_int("shard_num", shard_num, 1)
        self._shard_id = check_int("shard_id", shard_id, 0)
        if shard_id >= shard_num:
            raise bad("shard_id", f"< shard_num ({shard_num})", shard_id)
        self._layer_num = check_int("layer_num", layer_num, 1)
        self._block_token_size = check_int("block_token_size", block_token_size, 1)
        self._block_bytes = check_int("bytes_per_shard_layer_per_block", bytes_per_shard_layer_per_block, 1)
        self._device_id = check_int("device_id", device_id, 0)
        self._dp_id = check_int("dp_id", dp_id, 0)
        root = os.environ.get(DIR_ENV, "")
        if not root:
            raise AttentionStoreSDKError(f"{DIR_ENV} is not set: the stand-in has nowhere to keep its blocks")
        self._root = Path(root)
        self._identity = identity_bytes(namespace, model_version, shard_num, shard_id, block_token_size)
        try:
            (self._root / "data").mkdir(parents=True, exist_ok=True)
            record_identity(self._root, self._identity, self._namespace, self._model_version, self._shard_id,
                            self._shard_num, self._block_token_size)
        except OSError as exc:
            raise AttentionStoreSDKError(f"cannot use {DIR_ENV}={root}: {exc}") from None

    def __repr__(self) -> str:
        return (f"AttentionStoreSDK(namespace={self._namespace!r}, model_version={self._model_version!r}, "
                f"shard {self._shard_id}/{self._shard_num}, pod={self._pod_name!r})")

    # ------------------------------------------------------------------ public calls
    def match(self, tokens: Tokens, start_block_idx: int, timeout: float, /) -> int:
        """Consecutive blocks from ``start_block_idx`` stored for every layer of the model."""
        faults, nth = begin_call(self._root, "match")
        self._check_tokens(tokens)
        check_int("start_block_idx", start_block_idx, 0)
        if start_block_idx > tokens._full_blocks():
            raise bad("start_block_idx", f"<= the {tokens._full_blocks()} full blocks of tokens", start_block_idx)
        timeout = check_timeout(timeout)
        inject("match", faults, nth, timeout)
        sizes = (self._block_bytes, 2 * self._block_bytes)
        found = 0
        for key in block_keys(self._identity, tokens._packed, self._block_token_size, start_block_idx,
                              tokens._full_blocks()):
            if not all(stored_size(self._root, key, layer) in sizes for layer in range(self._layer_num)):
                break
            found += 1
        return found

    def read(self, layer_ids: list[int], tokens: Tokens, start_block_idx: int, k_ptrs: list[int],
             v_ptrs: list[int], gpu_block_ids: list[int], timeout: float, /) -> int:
        """Copy stored blocks into the caches; the number of leading blocks read.

        Block ``start_block_idx + i`` of layer ``layer_ids[j]`` lands at ``k_ptrs[j] + gpu_block_ids[i]
        * bytes_per_shard_layer_per_block`` (V likewise at ``v_ptrs[j]``).  The real SDK writes
        device memory itself; the stand-in's caches are host-addressable on this CPU-only host, so it
        uses ``ctypes.memmove``.  It stops at the first block missing (or of the wrong size) for any
        requested layer and writes nothing for it or after it.
        """
        faults, nth = begin_call(self._root, "read")
        self._check_transfer(layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids)
        timeout = check_timeout(timeout)
        inject("read", faults, nth, timeout)
        size = self._block_bytes * (2 if v_ptrs else 1)
        keys = block_keys(self._identity, tokens._packed, self._block_token_size, start_block_idx,
                          start_block_idx + len(gpu_block_ids))
        done = 0
        for key, gpu_block in zip(keys, gpu_block_ids):
            blobs = [load_object(self._root, key, layer, size) for layer in layer_ids]
            if any(blob is None for blob in blobs):
                break
            offset = gpu_block * self._block_bytes
            for j, blob in enumerate(blobs):
                assert blob is not None
                ctypes.memmove(k_ptrs[j] + offset, blob, self._block_bytes)
                if v_ptrs:
                    ctypes.memmove(v_ptrs[j] + offset, blob[self._block_bytes:], self._block_bytes)
            done += 1
        return done

    def write(self, layer_ids: list[int], tokens: Tokens, start_block_idx: int, k_ptrs: list[int],
              v_ptrs: list[int], gpu_block_ids: list[int], timeout: float, /) -> int:
        """Store blocks from the caches (the reverse of ``read``); the number of leading blocks written.

        The real SDK reads device memory itself; the stand-in reads the host-addressable caches
        with ``ctypes.string_at``.  A block that exists is overwritten.
        """
        faults, nth = begin_call(self._root, "write")
        self._check_transfer(layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids)
        timeout = check_timeout(timeout)
        inject("write", faults, nth, timeout)
        count = len(gpu_block_ids)
        if faults.write_first_k is not None:
            count = min(count, faults.write_first_k)
        keys = block_keys(self._identity, tokens._packed, self._block_token_size, start_block_idx,
                          start_block_idx + count)
        for key, gpu_block in zip(keys, gpu_block_ids[:count]):
            offset = gpu_block * self._block_bytes
            for j, layer in enumerate(layer_ids):
                data = ctypes.string_at(k_ptrs[j] + offset, self._block_bytes)
                if v_ptrs:
                    data += ctypes.string_at(v_ptrs[j] + offset, self._block_bytes)
                store_object(self._root, key, layer, data)
        return count

    def flush_token_index(self, layer_ids: list[int], tokens: Tokens, start_idx: int, src_media: int | None,
                          dst_media: int | None, /) -> None:
        """Check the arguments of an index flush between media; the stand-in has no index to flush."""
        log_call(self._root, "flush_token_index")
        self._check_layers(layer_ids)
        self._check_tokens(tokens)
        check_int("start_idx", start_idx, 0)
        if start_idx > tokens._full_blocks():
            raise bad("start_idx", f"<= the {tokens._full_blocks()} full blocks of tokens", start_idx)
        for name, media in (("src_media", src_media), ("dst_media", dst_media)):
            if media is not None and (not is_int(media) or media not in _MEDIA):
                raise bad(name, "None or one of common_pb2.MEDIA_HBM/MEDIA_DRAM/MEDIA_SSD", media)
        if src_media is None and dst_media is None:
            raise AttentionStoreSDKError("invalid argument src_media/dst_media: they must not both be None")

    # ------------------------------------------------------------------ checks
    def _check_tokens(self, tokens: object) -> None:
        if not isinstance(tokens, Tokens):
            raise bad("tokens", "a Tokens", tokens)
        if tokens._block_token_size != self._block_token_size:
            raise bad("tokens", f"a Tokens of block_token_size {self._block_token_size}", tokens)

    def _check_layers(self, layer_ids: object) -> list[int]:
        must = f"a non-empty list of distinct ints in [0, {self._layer_num})"
        if not isinstance(layer_ids, list) or not layer_ids:
            raise bad("layer_ids", must, layer_ids)
        if any(not is_int(x) or not 0 <= x < self._layer_num for x in layer_ids):
            raise bad("layer_ids", must, layer_ids)
        if len(set(layer_ids)) != len(layer_ids):
            raise bad("layer_ids", must + " (duplicates)", layer_ids)
        return layer_ids

    def _check_transfer(self, layer_ids: object, tokens: object, start_block_idx: object, k_ptrs: object,
                        v_ptrs: object, gpu_block_ids: object) -> None:
        layers = self._check_layers(layer_ids)
        self._check_tokens(tokens)
        assert isinstance(tokens, Tokens)
        k = check_int_list("k_ptrs", k_ptrs, 1, non_empty=True)
        if len(k) != len(layers):
            raise bad("k_ptrs", f"a list of {len(layers)} pointers (one per layer id)", k_ptrs)
        v = check_int_list("v_ptrs", v_ptrs, 1, non_empty=False)
        if v and len(v) != len(layers):
            raise bad("v_ptrs", f"[] (K only) or a list of {len(layers)} pointers (one per layer id)", v_ptrs)
        ids = check_int_list("gpu_block_ids", gpu_block_ids, 0, non_empty=True)
        start = check_int("start_block_idx", start_block_idx, 0)
        full = tokens._full_blocks()
        if start + len(ids) > full:
            raise bad("start_block_idx", f"such that start_block_idx + len(gpu_block_ids) ({len(ids)}) <= the "
                       f"{full} full blocks of tokens", start)

