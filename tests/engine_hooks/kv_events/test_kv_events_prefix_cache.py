"""KV events from a TieredPrefixCache over real CTMs (TP=2, file store): a subscriber that joins late
and misses a stretch while disconnected catches up through the replay endpoint, and its index equals
the cache's host tier (CPU) and stored blocks (STORAGE) exactly; salted blocks carry the salt's tag,
never the salt; a read that misses a block believed stored removes it; an RL clear empties the index."""
from concurrent.futures import Future

import pytest

from engine_hooks.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared, KVEventPublisher, KVEventSubscriber
from engine_hooks.kv_events.wire import decode_batch
from engine_hooks.prefix_cache import TieredPrefixCache
from tests.prefix_cache_helpers import file_service
from transfer_factory.keys import chain_hash_ids, salt_tag, salted_hashes

SALT = "tenant-a-secret"


@pytest.fixture
def svc2(tmp_path):
    yield from file_service(tmp_path, tp=2)


def requests(phase: int) -> list[tuple[list[str], str | None]]:
    """Chains that share prefixes, longer than the tiers hold, some of them salted."""
    out = []
    for i in range(4):
        chain = chain_hash_ids([f"p{(phase + i) % 3}", f"q{i % 2}", f"r{phase}-{i}"])
        out.append((chain[:2 + i % 2], SALT if i == 3 else None))
    return out


def serve(cache, svc, reqs) -> None:
    for i, (hashes, salt) in enumerate(reqs):
        lease = cache.acquire(hashes, cache_salt=salt)
        cache.commit(lease)
        cache.release(lease)
        cache.reap()


def host_hashes(cache, known) -> set[str]:
    return {h for h in known if cache.host_slot_of(h) is not None}


def test_a_late_and_interrupted_subscriber_ends_with_the_tiers_exactly(svc2):
    known: set[str] = set()

    def phase(n):
        reqs = requests(n)
        for hashes, salt in reqs:
            known.update(salted_hashes(hashes, salt))
        serve(cache, svc2, reqs)

    with KVEventPublisher() as pub:
        cache = TieredPrefixCache(svc2, 4, 3, kv_events=pub)  # 4 device blocks, 3 host slots
        phase(0)  # before anyone subscribed
        assert cache.stats.swap_out_blocks and cache.stats.storage_write_blocks
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            phase(1)
            cache.drain()
            assert pub.flush() and sub.sync_to(pub.last_sequence)
            assert sub.counts["replayed_batches"] > 0  # what it missed by joining late
            index, resume = sub.index, sub.next_sequence
        phase(2)  # while it is disconnected
        phase(3)
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, index=index, start=resume) as sub:
            phase(4)
            serve(cache, svc2, requests(0))  # storage and host hits again
            cache.drain()
            cache.reap()
            assert pub.flush() and sub.sync_to(pub.last_sequence)
            host = host_hashes(cache, known)
            assert host and cache.stored_hashes
            assert index.hashes(MEDIUM_CPU) == host
            assert index.hashes(MEDIUM_STORAGE) == set(cache.stored_hashes)
            assert sub.index.in_sync and sub.counts["lost_batches"] == 0 and sub.counts["replayed_batches"] > 0
            salted = set(salted_hashes(requests(0)[3][0], SALT))
            assert salted & set(index.hashes(MEDIUM_STORAGE))
            assert {index.tags[h] for h in salted if h in index.tags} == {(salt_tag(SALT),)}
            assert all(tag == (salt_tag(SALT),) for tag in index.tags.values())
            sent = [decode_batch(p)[0] for p in payloads(pub)]
            kinds = {(type(e).__name__, getattr(e, "medium", None)) for b in sent for e in b.events}
            assert {("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockStored", "STORAGE")} <= kinds
            assert not any(SALT.encode() in payload for payload in payloads(pub))

            cache.forget_all()  # an RL clear
            assert pub.flush() and sub.sync_to(pub.last_sequence)
            assert len(index) == 0 and sub.index.in_sync
            last, _ = decode_batch(payloads(pub)[-1])
            assert last.events == [AllBlocksCleared()]


def test_a_read_that_misses_a_block_believed_stored_removes_it(svc2, monkeypatch):
    """Storage lost a block behind the engine's back (evicted, spoiled): the read that finds only
    the blocks before it makes the engine forget it (it is written again) and says BlockRemoved STORAGE."""
    a, b = chain_hash_ids(["a1", "a2", "a3"]), chain_hash_ids(["b1", "b2", "b3", "b4"])
    with KVEventPublisher() as pub, KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        cache = TieredPrefixCache(svc2, 4, 0, kv_events=pub)  # no host tier: evicted means storage only
        serve(cache, svc2, [(a, None), (b, None)])
        cache.drain()
        cache.reap()
        assert set(a) <= cache.stored_hashes
        real = svc2.read_storage

        def storage_lost_a2(keys, gpu_block_ids, *args, **kw):
            loaded = real(keys, gpu_block_ids, *args, **kw).result(30)
            truncated = Future()
            truncated.set_result(loaded[:1])  # a2 is no longer there: the read stops before it
            return truncated

        monkeypatch.setattr(svc2, "read_storage", storage_lost_a2)
        lease = cache.acquire(a)
        assert lease.sources == ["storage", "miss", "miss"]
        assert a[1] not in cache.stored_hashes and a[0] in cache.stored_hashes
        assert pub.flush() and sub.sync_to(pub.last_sequence)
        assert sub.index.hashes(MEDIUM_STORAGE) == set(cache.stored_hashes)
        cache.commit(lease)
        cache.release(lease)  # write_through writes it again
        cache.drain()
        cache.reap()
        assert pub.flush() and sub.sync_to(pub.last_sequence)
        assert a[1] in cache.stored_hashes and sub.index.hashes(MEDIUM_STORAGE) == set(cache.stored_hashes)


def payloads(pub) -> list[bytes]:
    import zmq
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if not payload:
                return out
            out.append(payload)
        raise AssertionError("no end marker")
    finally:
        ctx.destroy(linger=0)
