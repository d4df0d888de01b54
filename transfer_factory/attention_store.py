"""AttentionStore (as FastDeploy calls it) as a device-direct, token-addressed backend.

Written against the SDK FastDeploy uses (``from attentionstore_sdk.sdk import AttentionStoreSDK,
Tokens`` and ``from attentionstore_sdk.utils.err import AttentionStoreSDKError``):

* ``AttentionStoreSDK(namespace, pod_name, model_version, shard_id, shard_num, layer_num,
  block_token_size, bytes_per_shard_layer_per_block, device_id, dp_id)``, one per rank (shard);
* ``match(tokens, start_block_idx, timeout) -> int``: leading blocks stored from that index;
* ``read``/``write(layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout) -> int``:
  the SDK copies block ``gpu_block_ids[i]`` of every layer to or from the store itself, at
  ``ptr[layer] + gpu_block_id * bytes_per_shard_layer_per_block``.

The store names a block by the prefix's **tokens**, not by our block hash, so a task must carry
``token_ids`` (the mover refuses one that does not).  Our namespace (model, version, TP layout,
dtype, block size, layers) goes into the SDK's ``model_version``, so two models or TP layouts never
share a block; ``shard_id``/``shard_num`` are the rank and the TP size.  fp8 scale caches have their
own block size, so they get a second SDK instance (``model_version`` + ``.scales``) over the scale
caches, and a block counts only when both instances hold it.

While the SDK reports that device memory is not ready, set-up retries ``match`` as FastDeploy
does, bounded by ``ready_timeout`` seconds and logged; past it the CTM fails to start.  At run time
an ``AttentionStoreSDKError`` (not ready included) is 0 blocks with a log line.

Configuration (``--storage_options`` JSON, else the environment, else the default): ``namespace``
(``AS_NAMESPACE``, "default_ns"), ``pod_name`` (``AS_POD_NAME``, the host name), ``model_version``
(``AS_MODEL_VERSION``, "v0"), ``dp_id`` (0), ``ready_timeout`` (120 s), ``ready_interval`` (1 s).
On the CPU platform this backend runs only against the tests' contract stand-in
(``tests/standins/attentionstore_sdk``).
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any, Mapping

from transfer_factory.device_storage import Addressing, BlockSpan, DeviceKVStorage, RankCaches, import_sdk, option
from transfer_factory.kvcache_storage import StorageConfigError

logger = logging.getLogger(__name__)

_KNOWN_OPTIONS = {"namespace", "pod_name", "model_version", "dp_id", "ready_timeout", "ready_interval"}
NOT_READY = "memory not ready"  # FastDeploy matches "cuda memory not ready"; on an NPU the device differs


def _positive(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    if not math.isfinite(out) or out <= 0:
        raise StorageConfigError(f"attention_store option {name} {value!r} must be a positive number of seconds")
    return out


class AttentionStore(DeviceKVStorage):
    name = "attention_store"
    addressing = Addressing.TOKENS

    def __init__(self, *, namespace: str, rank: int, options: Mapping[str, Any] | None = None):
        sdk = import_sdk(self.name, "attentionstore_sdk.sdk", "the AttentionStore SDK")
        err = import_sdk(self.name, "attentionstore_sdk.utils.err", "the AttentionStore SDK")
        self._SDK, self._Tokens, self._Error = sdk.AttentionStoreSDK, sdk.Tokens, err.AttentionStoreSDKError
        self._hbm = import_sdk(self.name, "attentionstore_sdk.api.common.common_pb2", "the AttentionStore SDK").MEDIA_HBM
        options = dict(options or {})
        unknown = set(options) - _KNOWN_OPTIONS
        if unknown:
            raise StorageConfigError(f"unknown attention_store option(s) {sorted(unknown)}; known: "
                                     f"{sorted(_KNOWN_OPTIONS)}")
        env = os.environ
        self.store_namespace = str(option(options, "namespace", env, "AS_NAMESPACE", "default_ns"))
        self.pod_name = str(option(options, "pod_name", env, "AS_POD_NAME", socket.gethostname() or "pod"))
        self.model_version = f'{option(options, "model_version", env, "AS_MODEL_VERSION", "v0")}.{namespace}'
        dp_id = options.get("dp_id", 0)
        if not isinstance(dp_id, int) or isinstance(dp_id, bool) or dp_id < 0:
            raise StorageConfigError(f"attention_store option dp_id {dp_id!r} must be a non-negative integer")
        self.dp_id = dp_id
        self.ready_timeout = _positive("ready_timeout", options.get("ready_timeout", 120.0))
        self.ready_interval = _positive("ready_interval", options.get("ready_interval", 1.0))
        self.rank = rank
        self.block_size = 0
        # (sdk, layer ids, K pointers, V pointers) per SDK instance: the caches, then the fp8 scales
        self._shards: list[tuple[Any, list[int], list[int], list[int]]] = []

    # ------------------------------------------------------------------ set-up
    def register_caches(self, caches: RankCaches) -> None:
        groups = [("k", "v", "")] + ([("k_scale", "v_scale", ".scales")] if caches.fp8_scales else [])
        layer_ids = list(range(caches.num_layers))
        try:
            for k_tag, v_tag, suffix in groups:
                block_bytes = caches.block_bytes(k_tag)
                if not caches.mla and caches.block_bytes(v_tag) != block_bytes:
                    raise StorageConfigError(f"attention_store needs K and V blocks of one size "
                                             f"({k_tag}: {block_bytes} B, {v_tag}: {caches.block_bytes(v_tag)} B)")
                sdk = self._SDK(self.store_namespace, self.pod_name, self.model_version + suffix, caches.rank,
                                caches.tp_size, caches.num_layers, caches.block_size, block_bytes, caches.device_id,
                                self.dp_id)
                v_ptrs = [] if caches.mla else caches.layer_ptrs(v_tag)
                self._shards.append((sdk, layer_ids, caches.layer_ptrs(k_tag), v_ptrs))
        except self._Error as exc:
            raise StorageConfigError(f"AttentionStoreSDK set-up failed: {exc}") from None
        self.block_size = caches.block_size
        for sdk, *_ in self._shards:
            self._wait_ready(sdk)
        logger.info("attention_store: rank %d of %d registered (namespace %s, model_version %s)", caches.rank,
                    caches.tp_size, self.store_namespace, self.model_version)

    def _wait_ready(self, sdk: Any) -> None:
        """Retry ``match`` while the SDK reports device memory not ready, as FastDeploy does; bounded."""
        probe = self._Tokens(list(range(self.block_size + 1)), self.block_size)
        deadline = time.monotonic() + self.ready_timeout
        tries = 0
        while True:
            tries += 1
            try:
                sdk.match(probe, 0, self.ready_interval)
                if tries > 1:
                    logger.info("attention_store: device memory ready after %d tries", tries)
                return
            except self._Error as exc:
                if NOT_READY not in str(exc):
                    raise StorageConfigError(f"AttentionStoreSDK is not usable: {exc}") from None
                if time.monotonic() + self.ready_interval > deadline:
                    raise StorageConfigError(f"AttentionStoreSDK still reports '{exc}' after {self.ready_timeout:g}s "
                                             f"({tries} tries)") from None
                logger.warning("attention_store: %s; retrying in %gs", exc, self.ready_interval)
                time.sleep(self.ready_interval)

    # ------------------------------------------------------------------ calls
    def _each(self, what: str, span: BlockSpan, timeout: float, call: Any) -> int:
        """The minimum over the SDK instances of what ``call(sdk, ...)`` reports; 0 on an SDK error."""
        if not self._shards:
            raise RuntimeError("attention_store: register_caches was not called")
        tokens = self._Tokens(list(span.token_ids), self.block_size)
        deadline = time.monotonic() + timeout
        done = len(span)
        for shard in self._shards:
            left = deadline - time.monotonic()
            if left <= 0:
                return 0
            try:
                done = min(done, int(call(shard, tokens, left)))
            except self._Error as exc:
                logger.error("attention_store %s failed: %s: 0 blocks", what, exc)
                return 0
        return max(0, done)

    def lookup(self, span: BlockSpan, timeout: float) -> int:
        return self._each("match", span, timeout, lambda s, tokens, t: s[0].match(tokens, span.start_block, t))

    def save(self, span: BlockSpan, timeout: float) -> int:
        ids = list(span.gpu_block_ids)
        done = self._each("write", span, timeout,
                          lambda s, tokens, t: s[0].write(s[1], tokens, span.start_block, s[2], s[3], ids, t))
        self._flush_token_index(span, src=self._hbm, dst=None)
        return done

    def load(self, span: BlockSpan, timeout: float) -> int:
        ids = list(span.gpu_block_ids)
        done = self._each("read", span, timeout,
                          lambda s, tokens, t: s[0].read(s[1], tokens, span.start_block, s[2], s[3], ids, t))
        if done:
            self._flush_token_index(span, src=None, dst=self._hbm)
        return done

    def _flush_token_index(self, span: BlockSpan, src: Any, dst: Any) -> None:
        """Rank 0 tells the store where the prefix's KV now resides (in HBM after a load, out of it
        after a write), as FastDeploy does; best effort, since the blocks themselves are done."""
        if self.rank != 0:
            return
        sdk, layer_ids, _, _ = self._shards[0]
        try:
            sdk.flush_token_index(layer_ids, self._Tokens(list(span.token_ids), self.block_size), 0, src, dst)
        except self._Error as exc:
            logger.warning("attention_store flush_token_index failed: %s", exc)

    def close(self) -> None:
        self._shards = []
