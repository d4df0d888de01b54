"""EmsStore: Huawei Elastic Memory Service (EMS), ContextCaching V1, as a device-direct backend.

Written against the documented Python SDK (``from ems import Ems, EmsConfig, CcConfig_v1,
CcKvOption, EmsException, EmsErrorCode``): the rank registers its device caches once with
``cc.register_kvcache([[K, V] per layer])`` and EMS reads and writes device memory itself.  Our
tasks map onto its hash semantics:

* ``slot_mapping``: every token of every block, ``block_id * block_size + offset``;
* ``hashes``: one int per block, a digest of our namespace and the chained block hash, so two
  models, versions, TP layouts or dtypes never share a block (EMS's own ``model_id`` only
  separates models);
* ``offsets``: ``block_size`` per block (we move whole blocks only).

``save``/``load`` return ``CcResult(success, total)`` with ``success`` the leading consecutive
blocks done; a partial save is not an error, its missing blocks miss later.  ``exists`` answers
the same way.  An ``EmsException`` or an unhealthy service is 0 blocks, with a log line; the
mover bounds every call by the task's deadline and passes what is left as ``CcKvOption.timeout``.

Layout: EMS documents its caches as ``[blocks, block_size, heads, head_dim]``; ours are
``[blocks, heads, block_size, head_dim]``.  We register same-memory views in EMS's shape.  Since
every call moves whole blocks (all ``block_size`` slots of a block, saved and loaded alike), the
order of bytes inside a block never matters and every block round-trips bit-exact.  ContextCaching
V1 registers K and V (or K alone for MLA) per layer and nothing else, so fp8 scale caches are
refused at start-up.

Configuration (``--storage_options`` JSON, else the documented environment, else the default):
``model_id`` (``MODEL_ID``; default: our namespace), ``access_id`` (``ACCELERATE_ID``),
``access_key`` (``ACCELERATE_KEY``), ``timeout_ms`` (``EMS_TIMEOUT``, 5000), ``write_rcache``
(``EMS_ENABLE_WRITE_RCACHE``, true), ``read_local_only`` (``EMS_ENABLE_READ_LOCAL_ONLY``, false),
``llm_engine`` ("fastdeploy").  EMS takes NPU tensors only: on the CPU platform this backend runs
only against the contract stand-in of the tests (``tests/standins/ems``).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

from transfer_factory.device_storage import Addressing, BlockSpan, DeviceKVStorage, RankCaches, import_sdk, namespaced_digest, option
from transfer_factory.kvcache_storage import StorageConfigError, parse_bool

logger = logging.getLogger(__name__)

_KNOWN_OPTIONS = {"model_id", "access_id", "access_key", "timeout_ms", "write_rcache", "read_local_only", "llm_engine"}
HEALTH_CHECK_INTERVAL = 1.0  # seconds a health answer is trusted


def block_hash_int(namespace: str, block_hash: str) -> int:
    """EMS's ``hashes`` are ints: 63 bits of the namespaced digest, non-negative in any int64."""
    return int.from_bytes(namespaced_digest(namespace, block_hash)[:8], "big") >> 1


class EmsStore(DeviceKVStorage):
    name = "ems"
    addressing = Addressing.BLOCK_HASH

    def __init__(self, *, namespace: str, rank: int, options: Mapping[str, Any] | None = None):
        self._ems = import_sdk(self.name, "ems", "the Huawei EMS SDK")
        self._cc_config = import_sdk(self.name, "ems.cc_v1.cc_config", "the Huawei EMS SDK")
        options = dict(options or {})
        unknown = set(options) - _KNOWN_OPTIONS
        if unknown:
            raise StorageConfigError(f"unknown ems option(s) {sorted(unknown)}; known: {sorted(_KNOWN_OPTIONS)}")
        env = os.environ
        self.namespace = namespace
        self.rank = rank
        self.model_id = str(option(options, "model_id", env, "MODEL_ID", namespace))
        self.access_id = str(option(options, "access_id", env, "ACCELERATE_ID", ""))
        self.access_key = str(option(options, "access_key", env, "ACCELERATE_KEY", ""))
        self.llm_engine = str(options.get("llm_engine", "fastdeploy"))
        timeout = option(options, "timeout_ms", env, "EMS_TIMEOUT", 5000)
        try:
            self.timeout_ms = int(timeout)
        except (TypeError, ValueError):
            self.timeout_ms = 0
        if self.timeout_ms <= 0:
            raise StorageConfigError(f"ems option timeout_ms (EMS_TIMEOUT) {timeout!r} must be a positive integer")
        self.write_rcache = parse_bool("ems option write_rcache (EMS_ENABLE_WRITE_RCACHE)", option(options, "write_rcache", env, "EMS_ENABLE_WRITE_RCACHE",
                                                              True))
        self.read_local_only = parse_bool("ems option read_local_only (EMS_ENABLE_READ_LOCAL_ONLY)", option(options, "read_local_only", env,
                                                                    "EMS_ENABLE_READ_LOCAL_ONLY", False))
        self.cc: Any = None
        self.block_size = 0
        self._healthy_until = 0.0

    # ------------------------------------------------------------------ set-up
    def register_caches(self, caches: RankCaches) -> None:
        if caches.fp8_scales:
            raise StorageConfigError("storage backend 'ems' cannot store block_wise_fp8 caches: ContextCaching V1 "
                                     "registers [K, V] per layer and has no place for the scale caches")
        ems, cfg = self._ems, self._cc_config
        cc_config = ems.CcConfig_v1(caches.rank, caches.device_id, self.model_id, caches.tp_size, 1, caches.rank, 0,
                                    self.llm_engine)
        if caches.mla:
            cc_config.kvcache_type = cfg.KVCacheType.MLA
        tags = ["k"] if caches.mla else ["k", "v"]
        try:
            ems.Ems.init(ems.EmsConfig(self.access_id, self.access_key, cc_config))
            self.cc = ems.Ems.get_cc()
            if self.cc is None:
                raise StorageConfigError("EMS initialised but Ems.get_cc() returned None")
            layers = [[self._ems_view(caches.kinds[tag][layer], caches.device_blocks) for tag in tags]
                      for layer in range(caches.num_layers)]
            self.cc.register_kvcache(layers)
        except ems.EmsException as exc:
            raise StorageConfigError(f"EMS set-up failed: {exc} (status {exc.status_code()})") from None
        self.block_size = caches.block_size
        logger.info("ems: registered %d layers of rank %d (model_id %s)", caches.num_layers, caches.rank,
                    self.model_id)

    @staticmethod
    def _ems_view(tensor: Any, blocks: int) -> Any:
        """The same memory in EMS's documented shape [blocks, block_size, heads, head_dim].  EMS takes
        one shape for every layer; speculative layers have more blocks, and only the first
        ``blocks`` (the ids valid in every layer) are ever named, so each layer is registered cut
        to those (a leading slice: same memory, still contiguous)."""
        _, h, b, d = list(tensor.shape)
        return tensor[:blocks].reshape([blocks, b, h, d])

    # ------------------------------------------------------------------ calls
    def _option(self, timeout: float) -> Any:
        ms = max(1, min(self.timeout_ms, int(timeout * 1000)))
        return self._ems.CcKvOption(write_rcache=self.write_rcache, read_local_only=self.read_local_only, timeout=ms)

    def _hashes(self, span: BlockSpan) -> list[int]:
        return [block_hash_int(self.namespace, h) for h in span.hashes]

    def _slots(self, span: BlockSpan) -> list[int]:
        bs = self.block_size
        return [gid * bs + offset for gid in span.gpu_block_ids for offset in range(bs)]

    def _healthy(self) -> bool:
        now = time.monotonic()
        if now < self._healthy_until:
            return True
        if not self._ems.Ems.check_health():
            logger.error("ems: Ems.check_health() is false: 0 blocks")
            return False
        self._healthy_until = now + HEALTH_CHECK_INTERVAL
        return True

    def _run(self, call: str, *args: Any) -> int:
        if self.cc is None:
            raise RuntimeError("ems: register_caches was not called")
        if not self._healthy():
            return 0
        try:
            result = getattr(self.cc, call)(*args)
        except self._ems.EmsException as exc:
            self._healthy_until = 0.0  # ask again before the next call
            logger.error("ems %s failed: %s (status %s): 0 blocks", call, exc, exc.status_code())
            return 0
        return int(result.success)

    def lookup(self, span: BlockSpan, timeout: float) -> int:
        return self._run("exists", self._hashes(span), self._option(timeout))

    def save(self, span: BlockSpan, timeout: float) -> int:
        return self._run("save", self._slots(span), self._hashes(span), [self.block_size] * len(span),
                         self._option(timeout))

    def load(self, span: BlockSpan, timeout: float) -> int:
        return self._run("load", self._slots(span), self._hashes(span), [self.block_size] * len(span),
                         self._option(timeout))

    def close(self) -> None:
        self.cc = None
