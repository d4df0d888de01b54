"""MooncakeStore's data path against a real mooncake_master (LocalMooncakeMaster); no mocks.

Needs the mooncake-transfer-engine(-non-cuda) wheel; skipped without it.  Buffers handed to
the store as raw pointers are numpy arrays kept alive for the whole test.  Segment prefaulting
is in test_mooncake_prefault.py, the configuration in test_mooncake_config.py, the master's
failures and the helper script in test_mooncake_master.py.
"""
import threading

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from transfer_factory.kvcache_storage import BUFFER_TOO_SMALL, INVALID, NOT_FOUND, StorageAccess  # noqa: E402
from transfer_factory.mooncake import MooncakeStore  # noqa: E402
from tests import mooncake_helpers  # noqa: E402
from tests.mooncake_helpers import SMALL, Buffers, keys_for  # noqa: E402

_clean_mooncake_env = mooncake_helpers._clean_mooncake_env  # the shared fixtures, under their names here
master = mooncake_helpers.master


@pytest.fixture(scope="module")
def store(master):
    s = MooncakeStore(namespace="nsA", rank=0, options={**master.config(), **SMALL})
    yield s
    s.close()


# ---- data path ---------------------------------------------------------------------------------

def test_properties(store):
    assert store.name == "mooncake"
    assert store.access is StorageAccess.HOST_STAGED
    assert store.supports_multi_buffer is True


def test_round_trip_is_bit_exact(store):
    b = Buffers(store, 16, 64 << 10, seed=1)
    keys = keys_for("nsA", "rt", 16)
    assert store.batch_set(keys, b.src_ptrs(), b.sizes()) == [0] * 16
    assert store.exists(keys) == [1] * 16
    assert store.batch_get(keys, b.dst_ptrs(), b.sizes()) == [b.size] * 16
    assert np.array_equal(b.src, b.dst)


def test_multi_buffer_round_trip_is_bit_exact(store):
    # One object gathered from four "layer" buffers of different sizes, scattered back into four others.
    parts = [4096, 8192, 1000, 3000]
    n = 8
    rng = np.random.default_rng(2)
    src = [rng.integers(0, 256, (n, p), dtype=np.uint8) for p in parts]
    dst = [np.zeros_like(a) for a in src]
    flat = np.zeros((n, sum(parts)), np.uint8)
    for a in src + dst + [flat]:
        store.register_buffer(a.ctypes.data, a.nbytes)
    keys = keys_for("nsA", "mb", n)
    ptrs = [[a.ctypes.data + i * p for a, p in zip(src, parts)] for i in range(n)]
    sizes = [list(parts)] * n
    assert store.batch_set_multi(keys, ptrs, sizes) == [0] * n
    out = [[a.ctypes.data + i * p for a, p in zip(dst, parts)] for i in range(n)]
    assert store.batch_get_multi(keys, out, sizes) == [sum(parts)] * n
    for a, b in zip(src, dst):
        assert np.array_equal(a, b)
    # The stored object is the concatenation of the parts, readable into one buffer.
    assert store.batch_get(keys, [flat.ctypes.data + i * sum(parts) for i in range(n)], [sum(parts)] * n) == [sum(parts)] * n
    assert np.array_equal(flat, np.concatenate(src, axis=1))


def test_existing_key_put_returns_zero_and_keeps_first_value(store):
    b = Buffers(store, 2, 4096, seed=3)
    key = keys_for("nsA", "dup", 1)
    assert store.batch_set(key, b.src_ptrs(1), [4096]) == [0]
    assert store.batch_set(key, [b.src_ptrs()[1]], [4096]) == [0]
    assert store.batch_get(key, b.dst_ptrs(1), [4096]) == [4096]
    assert np.array_equal(b.dst[0], b.src[0])


def test_missing_key_is_not_found(store):
    b = Buffers(store, 1, 4096)
    key = keys_for("nsA", "missing", 1)
    assert store.exists(key) == [0]
    assert store.batch_get(key, b.dst_ptrs(), [4096]) == [NOT_FOUND]
    assert store.batch_get_multi(key, [b.dst_ptrs()], [[4096]]) == [NOT_FOUND]


def test_buffer_too_small(store):
    b = Buffers(store, 1, 8192, seed=4)
    key = keys_for("nsA", "small", 1)
    assert store.batch_set(key, b.src_ptrs(), [8192]) == [0]
    assert store.batch_get(key, b.dst_ptrs(), [8191]) == [BUFFER_TOO_SMALL]
    assert store.batch_get_multi(key, [[b.dst.ctypes.data, b.dst.ctypes.data + 4096]], [[4096, 4095]]) == [BUFFER_TOO_SMALL]
    # A larger buffer is fine: the result is the object's size.
    big = np.zeros(16384, np.uint8)
    store.register_buffer(big.ctypes.data, big.nbytes)
    assert store.batch_get(key, [big.ctypes.data], [16384]) == [8192]
    assert np.array_equal(big[:8192], b.src[0])


def test_query_counts_the_leading_present_prefix(store):
    b = Buffers(store, 4, 1024, seed=5)
    keys = keys_for("nsA", "q", 4)
    present = [keys[0], keys[1], keys[3]]
    assert store.batch_set(present, b.src_ptrs(3), b.sizes(3)) == [0] * 3
    assert store.query(keys) == 2
    assert store.query(keys[3:]) == 1
    assert store.query(keys[2:]) == 0
    assert store.query([]) == 0


def test_invalid_arguments(store):
    b = Buffers(store, 2, 1024)
    keys = keys_for("nsA", "inv", 2)
    assert store.batch_set(keys, b.src_ptrs(), [1024, 0]) == [0, INVALID]
    assert store.batch_get(keys, [b.dst_ptrs()[0], 0], [1024, 1024]) == [1024, INVALID]
    assert store.batch_set_multi(keys, [[b.src.ctypes.data], []], [[1024], []]) == [0, INVALID]
    assert store.batch_set([], [], []) == [] and store.exists([]) == []
    with pytest.raises(ValueError):
        store.batch_get(keys, b.dst_ptrs(), [1024])
    with pytest.raises(ValueError):
        store.register_buffer(0, 16)


def test_delete(store):
    b = Buffers(store, 2, 1024, seed=6)
    keys = keys_for("nsA", "del", 2)
    assert store.batch_set(keys, b.src_ptrs(), b.sizes()) == [0, 0]
    assert store.delete(keys[:1]) == [0]
    assert store.exists(keys) == [0, 1]
    assert store.delete([keys_for("nsA", "never", 1)[0]]) == [NOT_FOUND]


def test_clear_removes_only_this_namespace_and_rank(master, store):
    """clear() of nsA rank 0 leaves nsB, nsA rank 1 and a namespace with nsA as a prefix alone."""
    others = {
        "nsB": MooncakeStore(namespace="nsB", rank=0, options={**master.config(), **SMALL}),
        "nsA rank 1": MooncakeStore(namespace="nsA", rank=1, options={**master.config(), **SMALL}),
    }
    try:
        b = Buffers(store, 4, 2048, seed=7)
        mine = keys_for("nsA", "clr", 3) + ["loose-key-of-nsA-rank0"]
        theirs = {
            "nsB": keys_for("nsB", "clr", 3),
            "nsA rank 1": keys_for("nsA", "clr", 3, rank=1),
        }
        prefixed = keys_for("nsA2", "clr", 3)          # another namespace starting with "nsA"
        assert store.batch_set(mine, b.src_ptrs(), b.sizes()) == [0] * 4
        for name, keys in theirs.items():
            other = others[name]
            other.register_buffer(b.src.ctypes.data, b.src.nbytes)
            assert other.batch_set(keys, b.src_ptrs(3), b.sizes(3)) == [0] * 3
        assert others["nsB"].batch_set(prefixed, b.src_ptrs(3), b.sizes(3)) == [0] * 3
        store.clear()
        assert store.exists(mine) == [0] * 4
        for name, keys in theirs.items():
            assert others[name].exists(keys) == [1] * 3, name
            assert store.exists(keys) == [1] * 3, name
        assert store.exists(prefixed) == [1] * 3
        others["nsB"].clear()
        assert store.exists(theirs["nsB"]) == [0] * 3
        assert store.exists(theirs["nsA rank 1"]) == [1] * 3
    finally:
        for other in others.values():
            other.clear()
            other.close()


def test_register_buffer_twice_is_harmless(store):
    a = np.arange(4096, dtype=np.uint8)
    store.register_buffer(a.ctypes.data, a.nbytes)
    store.register_buffer(a.ctypes.data, a.nbytes)
    store.register_buffer(a.ctypes.data + 1024, 1024)      # inside a registered range
    key = keys_for("nsA", "reg", 1)
    assert store.batch_set(key, [a.ctypes.data], [4096]) == [0]


def test_concurrent_batches_from_several_threads(store):
    """The CTM calls from its read and write thread pools at once."""
    threads, rounds, n, size = 4, 15, 8, 16 << 10
    bufs = [Buffers(store, n, size, seed=100 + t) for t in range(threads)]
    failures = []

    def worker(t):
        b = bufs[t]
        for r in range(rounds):
            keys = keys_for("nsA", f"conc{t}r{r}x", n)
            if store.batch_set(keys, b.src_ptrs(), b.sizes()) != [0] * n:
                failures.append((t, r, "set"))
            b.dst[:] = 0
            if store.batch_get(keys, b.dst_ptrs(), b.sizes()) != b.sizes() or not np.array_equal(b.src, b.dst):
                failures.append((t, r, "get"))

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(60)
    assert not any(th.is_alive() for th in pool)
    assert failures == []
