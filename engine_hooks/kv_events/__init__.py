"""KV events in vLLM's wire format (DESIGN §4.2): the prefix cache's host and storage tiers as
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` over ZMQ, with a bounded replay endpoint,
and the index a router keeps from them.  Off unless a ``KVEventPublisher`` is given to
``TieredPrefixCache(..., kv_events=publisher)``."""
from .publisher import KVEventPublisher, is_loopback
from .subscriber import KVEventIndex, KVEventSubscriber
from .wire import (END_SEQ, LAYOUTS, MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved,
                   BlockStored, KVEventBatch, decode_batch, encode_batch, hash_key, wire_hash)

__all__ = ["END_SEQ", "LAYOUTS", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "AllBlocksCleared", "BlockRemoved",
           "BlockStored", "KVEventBatch", "KVEventIndex", "KVEventPublisher", "KVEventSubscriber", "decode_batch",
           "encode_batch", "hash_key", "is_loopback", "wire_hash"]
