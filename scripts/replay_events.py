"""``replay_trace.py --kv-events``: the replay's prefix cache publishes KV events (vLLM's wire format,
``engine_hooks.kv_events``) on loopback, and a subscriber keeps the index a router would; at the end
the index must equal the cache's host tier (CPU) and the blocks it knows are stored (STORAGE).

The subscriber starts with the publisher and is polled after each request (as a router's loop would
read its socket); a batch it misses (its socket's high-water mark, a slow start) is fetched from the
replay endpoint, and the JSON line counts those (``replayed_batches``)."""
from __future__ import annotations

import argparse
import atexit
import logging

from engine_hooks.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVEventPublisher, KVEventSubscriber

log = logging.getLogger("replay_events")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-events", action="store_true",
                   help="publish KV events (vLLM's ZMQ wire format, loopback) and check that a subscriber's "
                        "index equals the host and storage tiers at the end")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.kv_events and (args.pd or args.instances > 1):
        parser.error("--kv-events replays one engine's prefix cache: not with --pd or --instances")


class ReplayEvents:
    """The replay's publisher and subscriber (none without ``--kv-events``); closed by ``finish`` or,
    if the replay fails first, at exit."""

    def __init__(self, enabled: bool):
        self.publisher = KVEventPublisher() if enabled else None
        self.subscriber = (KVEventSubscriber(self.publisher.endpoint, self.publisher.replay_endpoint)
                           if enabled else None)
        if enabled:
            atexit.register(self.close)

    def poll(self) -> None:
        if self.subscriber is not None:
            self.subscriber.poll(0)

    def finish(self, cache) -> dict:
        """Wait for the last batch, compare the index with the tiers, close; the JSON line's entry."""
        if self.publisher is None:
            return {}
        try:
            flushed = self.publisher.flush(30.0)
            last = self.publisher.last_sequence
            synced = flushed and (last is None or self.subscriber.sync_to(last, 30.0))
            index = self.subscriber.index
            cpu, stored = index.hashes(MEDIUM_CPU), index.hashes(MEDIUM_STORAGE)
            # the host tier: every block the index names is there, and as many as the tier holds
            host_ok = (all(cache.host_slot_of(h) is not None for h in cpu)
                       and len(cpu) == cache.block_counts()["host_cached"])
            equal = bool(synced and index.in_sync and host_ok and stored == set(cache.stored_hashes))
            if not equal:
                log.warning("KV event index differs from the tiers: synced %s, in sync %s, host %s, storage %d vs %d",
                            synced, index.in_sync, host_ok, len(stored), len(cache.stored_hashes))
            stats, counts = self.publisher.stats(), self.subscriber.counts
            return {"kv_events": {"batches": stats["published"], "events": index.events, "index_equals_tiers": equal,
                                  "host_blocks": len(cpu), "storage_blocks": len(stored),
                                  "replayed_batches": counts["replayed_batches"],
                                  "lost_batches": counts["lost_batches"], "dropped_batches": stats["dropped"]}}
        finally:
            self.close()

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        if self.publisher is not None:
            self.publisher.close()


def summary_rows(r: dict) -> list[tuple[str, str]]:
    e = r.get("kv_events")
    if not e:
        return []
    return [("KV events", f"{e['batches']} batches, {e['events']} events; subscriber's index "
                          f"{'equals' if e['index_equals_tiers'] else 'DIFFERS FROM'} the tiers "
                          f"({e['host_blocks']} host, {e['storage_blocks']} storage blocks; "
                          f"{e['replayed_batches']} batches replayed, {e['lost_batches']} lost)")]
