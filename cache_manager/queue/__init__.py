"""EngineCacheQueue: the engine's ordered broadcast of tasks to N ranks and their results back.

The engine runs one ``EngineCacheQueueServer``; every CTM rank runs one ``EngineCacheQueueClient``.
Layers, from the bytes up:

- ``wire``: frame seal/open (HMAC-SHA256 in C), the msgpack body and its checks; no pickle.
- ``session``: per-connection sessions and per-direction counters (replays and reorders dropped).
- ``checks``: what a well-MACed body must hold, and the rate-limited drop log.
- ``zmq_sockets`` / ``local_link`` / ``local_links``: the two transports (zmq ROUTER/DEALER for any
  host, a Unix socket for ranks on the engine's host) and the poller both loops wait in.
- ``barriers``: rank barriers with timeouts that fail every rank alike.
- ``task_port``: the sending side: the task port, the send lock and the sequence number that
  order every rank's task stream.
- ``server`` / ``client``: the two ends.
"""
from cache_manager.queue.client import EngineCacheQueueClient
from cache_manager.queue.server import EngineCacheQueueServer

__all__ = ["EngineCacheQueueClient", "EngineCacheQueueServer"]
