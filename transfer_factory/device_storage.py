"""DeviceKVStorage: backends that read and write the registered device caches themselves.

EMS (ContextCaching V1) and AttentionStore do not store byte objects from host buffers the way
the file store and Mooncake do: the engine registers its per-layer device caches with the SDK
once, and every later call names *blocks* (device block ids plus what identifies their
contents) and lets the SDK move the bytes.  They differ in how a block's contents are named:

* ``Addressing.BLOCK_HASH``: by the chained block hash (EMS's ``hashes``);
* ``Addressing.TOKENS``: by the prefix's token ids and a block index (AttentionStore's ``Tokens``).

The CTM asks ``access`` and ``addressing``; it never branches on a backend's name.  Every
storage task already carries both the block hashes (``keys``) and ``token_ids``, so the mover
builds one ``BlockSpan`` and each backend takes what it addresses by.

Primitives and their contracts (every call may block; the mover runs each on an I/O thread and
passes what is left of the task's deadline as ``timeout``):

``register_caches(caches)``
    Called once, before any other call, with one rank's ``RankCaches``.  A layout the SDK cannot
    take (for example fp8 scale caches on EMS) raises ``StorageConfigError`` naming what is missing,
    so the CTM fails at start rather than serving half a cache.
``lookup(span, timeout) -> int``
    How many leading blocks of ``span`` the store holds for every registered cache kind.
``save(span, timeout) -> int``
    Store the blocks of ``span`` from its ``gpu_block_ids``; the number of leading blocks stored.
``load(span, timeout) -> int``
    Fill ``span.gpu_block_ids`` from the store; the number of leading blocks loaded.  Blocks after
    the first that failed may or may not have been written; the engine never reads them, since
    only the leading run counts.
``close()``
    Release the SDK.  Idempotent.

A documented SDK error or timeout is a result of 0 blocks, never an exception out of
``lookup``/``save``/``load``.  A call can still outlive its task (a hung SDK); the mover then
answers in time with 0 blocks and holds the task's blocks until the call returns (two-phase
completion), since the SDK may still write them.
"""
from __future__ import annotations

import enum
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from transfer_factory.kvcache_storage import StorageAccess, StorageConfigError


class Addressing(enum.Enum):
    BLOCK_HASH = "block_hash"
    TOKENS = "tokens"


@dataclass(frozen=True)
class RankCaches:
    """One rank's device caches as a device-direct backend registers them.

    ``kinds`` maps a kind tag (``k``, ``v``, ``k_scale``, ``v_scale``) to that kind's per-layer
    tensors, every one ``[blocks, ...]``; speculative extra layers come after the model's layers.
    """

    rank: int
    tp_size: int
    device_id: int
    block_size: int  # tokens per block
    kinds: Mapping[str, Sequence[Any]]
    device_blocks: int  # block ids valid in every layer

    @property
    def num_layers(self) -> int:
        return len(self.kinds["k"])

    @property
    def mla(self) -> bool:
        return "v" not in self.kinds

    @property
    def fp8_scales(self) -> bool:
        return "k_scale" in self.kinds

    def block_bytes(self, tag: str) -> int:
        """Bytes of one block of one layer of kind ``tag``."""
        t = self.kinds[tag][0]
        n = 1
        for d in list(t.shape)[1:]:
            n *= int(d)
        return n * t.element_size()

    def layer_ptrs(self, tag: str) -> list[int]:
        return [int(t.data_ptr()) for t in self.kinds[tag]]


@dataclass(frozen=True)
class BlockSpan:
    """Consecutive blocks of one prefix: where they are on device and what identifies them."""

    hashes: Sequence[str]  # chained block hashes (DESIGN §3.7), one per block of the span
    gpu_block_ids: Sequence[int]  # one per block of the span
    start_block: int = 0  # position of the span's first block in the prefix
    token_ids: Sequence[int] = field(default_factory=list)  # the prefix's tokens from its first block on

    def __len__(self) -> int:
        return len(self.gpu_block_ids)

    def tail(self, skip: int) -> "BlockSpan":
        """The span without its first ``skip`` blocks."""
        return BlockSpan(self.hashes[skip:], self.gpu_block_ids[skip:], self.start_block + skip, self.token_ids)


class DeviceKVStorage(ABC):
    """A storage backend that moves the blocks of registered device caches itself."""

    name: str = "abstract-device"
    access: StorageAccess = StorageAccess.DEVICE_DIRECT
    addressing: Addressing = Addressing.BLOCK_HASH

    @abstractmethod
    def register_caches(self, caches: RankCaches) -> None: ...

    @abstractmethod
    def lookup(self, span: BlockSpan, timeout: float) -> int: ...

    @abstractmethod
    def save(self, span: BlockSpan, timeout: float) -> int: ...

    @abstractmethod
    def load(self, span: BlockSpan, timeout: float) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "DeviceKVStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def import_sdk(backend: str, module: str, what: str) -> Any:
    """Import a vendor SDK module, or fail with a message naming the backend and the module."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise StorageConfigError(f"storage backend {backend!r} needs {what}: module {module!r} cannot be imported "
                                 f"({exc})") from None


def namespaced_digest(namespace: str, block_hash: str) -> bytes:
    """A block's identity inside one namespace (model, version, TP layout, dtype, ...): two models or
    two TP layouts with the same tokens never share a block in a store that only sees this digest."""
    return hashlib.sha256(f"{namespace}/{block_hash}".encode()).digest()


def option(options: Mapping[str, Any], key: str, env: Mapping[str, str], env_key: str, default: Any) -> Any:
    """An option from ``options``, else the environment variable, else the default."""
    if key in options:
        return options[key]
    if env.get(env_key):
        return env[env_key]
    return default
