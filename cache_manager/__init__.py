"""The CacheTransferManager process and what it shares with the engine: signals, tasks, the queue."""
