"""Storage backends behind one KVCacheStorage interface (mooncake, file, attention_store, ems)."""
