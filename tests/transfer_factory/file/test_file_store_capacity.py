"""FileStore capacity and restart (transfer_factory/file/store.py): LRU eviction, blocks stored
all or none, a batch never evicting what it stored, and the index rebuilt on reopen."""
import numpy as np

from tests.file_store_helpers import get, key, open_store, put, rand_bytes, store_fixture
from transfer_factory.file.store import HEADER_SIZE
from transfer_factory.kvcache_storage import INVALID, NO_SPACE, OK

store = store_fixture  # the shared fixture (tests/file_store_helpers.py), under the name the tests ask for


# ------------------------------------------------------------------------------------ capacity
def test_lru_eviction_order_and_no_space(tmp_path):
    n = 1000
    s = open_store(tmp_path, capacity_bytes=3 * (HEADER_SIZE + n))
    arrs = [rand_bytes(n, i) for i in range(6)]
    for i in range(3):
        assert put(s, key(i), arrs[i]) == OK
    assert s.used_bytes == 3 * (HEADER_SIZE + n)
    assert get(s, key(0), n)[0] == n                     # key 0 is now the most recently used
    assert put(s, key(3), arrs[3]) == OK                 # evicts key 1
    assert s.exists([key(i) for i in range(4)]) == [1, 0, 1, 1]
    assert put(s, key(2), arrs[2]) == OK                 # a put of a present key refreshes it too
    assert put(s, key(4), arrs[4]) == OK                 # evicts key 0
    assert s.exists([key(i) for i in range(5)]) == [0, 0, 1, 1, 1]
    big = rand_bytes(3 * n + 2 * HEADER_SIZE + 1, 9)     # its file alone exceeds the capacity
    assert put(s, key(9), big) == NO_SPACE
    assert s.exists([key(i) for i in (2, 3, 4, 9)]) == [1, 1, 1, 0]   # nothing was evicted for it
    double = rand_bytes(2 * n + HEADER_SIZE, 10)         # needs two slots: evicts the two LRU objects
    assert put(s, key(10), double) == OK
    assert s.exists([key(i) for i in (2, 3, 4, 10)]) == [0, 0, 1, 1]
    assert s.used_bytes == 3 * (HEADER_SIZE + n)
    for i in (4, 10):
        src = arrs[4] if i == 4 else double
        assert np.array_equal(get(s, key(i), src.nbytes)[1], src)
    s.close()


def block(i, kind, rank=0):
    """A key of one kind of one block, as the CTM builds them: a block's kinds form one group."""
    return key(i, rank=rank, kind=kind)


def test_a_block_is_stored_all_or_none(store):
    n = 3000
    k = {i: rand_bytes(n, 10 + i) for i in range(3)}
    v = {i: rand_bytes(n, 20 + i) for i in range(3)}
    # The CTM's order: every K of the batch, then every V.  Block 1's V fails (a null pointer).
    keys = [block(0, "k"), block(1, "k"), block(2, "k"), block(0, "v"), block(1, "v"), block(2, "v")]
    ptrs = [k[0].ctypes.data, k[1].ctypes.data, k[2].ctypes.data, v[0].ctypes.data, 0, v[2].ctypes.data]
    assert store.batch_set(keys, ptrs, [n] * 6) == [OK, INVALID, OK, OK, INVALID, OK]
    assert store.exists(keys) == [1, 0, 1, 1, 0, 1]      # block 1's K, already written, was removed
    assert store.object_location(block(1, "k")) is None and len(store) == 4
    # A failed first member: the rest of its block is not even written.
    assert store.batch_set([block(5, "k"), block(5, "v")], [0, v[0].ctypes.data], [n, n]) == [INVALID, INVALID]
    assert store.object_location(block(5, "v")) is None and len(store) == 4
    # Keys that are not a block's kinds are independent of each other.
    assert store.batch_set(["x/1", "x/2"], [0, k[0].ctypes.data], [n, n]) == [INVALID, OK]
    for i in (0, 2):
        assert np.array_equal(get(store, block(i, "k"), n)[1], k[i])
        assert np.array_equal(get(store, block(i, "v"), n)[1], v[i])


def test_a_lone_k_left_by_a_crash_is_completed_by_the_next_write(store):
    n = 2000
    kk, vv = rand_bytes(n, 1), rand_bytes(n, 2)
    assert put(store, block(0, "k"), kk) == OK            # as if the writer died before the V
    assert store.batch_set([block(0, "k"), block(0, "v")], [kk.ctypes.data, vv.ctypes.data], [n, n]) == [OK, OK]
    assert np.array_equal(get(store, block(0, "v"), n)[1], vv)


def test_the_capacity_never_evicts_what_the_running_batch_stored(tmp_path):
    n = 1000
    s = open_store(tmp_path, capacity_bytes=3 * (HEADER_SIZE + n))
    arrs = [rand_bytes(n, i) for i in range(5)]
    assert put(s, "other", arrs[4]) == OK
    keys = [block(0, "k"), block(1, "k"), block(0, "v"), block(1, "v")]
    # K0, K1 fit; V0 evicts the unrelated LRU object; V1 would have to evict this batch's own K0.
    assert s.batch_set(keys, [a.ctypes.data for a in arrs[:4]], [n] * 4) == [OK, NO_SPACE, OK, NO_SPACE]
    assert s.exists(keys + ["other"]) == [1, 0, 1, 0, 0]
    assert len(s) == 2 and s.used_bytes == 2 * (HEADER_SIZE + n)
    assert np.array_equal(get(s, block(0, "k"), n)[1], arrs[0])
    assert np.array_equal(get(s, block(0, "v"), n)[1], arrs[2])
    s.close()


def test_index_is_rebuilt_on_reopen(tmp_path):
    n = 2000
    cap = 4 * (HEADER_SIZE + n)
    s = open_store(tmp_path, capacity_bytes=cap)
    arrs = [rand_bytes(n, i) for i in range(6)]
    for i in range(4):
        assert put(s, key(i), arrs[i]) == OK
    directory = s.directory
    s.close()
    # Some garbage in the directory, and an empty segment left by a crash.
    (directory / "README").write_text("not an object")
    (directory / "ab").mkdir()                          # the older one-file-per-object layout
    (directory / "ab" / ("ab" + "0" * 62 + ".kv")).write_bytes(b"x" * 100)
    empty = directory / "0000000000000001.deadbeef.seg"
    empty.write_bytes(b"")

    s = open_store(tmp_path, capacity_bytes=cap)
    assert len(s) == 4 and s.used_bytes == cap
    assert not empty.exists() and not (directory / "ab").exists() and (directory / "README").exists()
    for i in range(4):
        assert np.array_equal(get(s, key(i), n)[1], arrs[i])
    assert get(s, key(0), n)[0] == n                     # key 0 is the most recently used now
    assert put(s, key(4), arrs[4]) == OK                 # full: evicts key 1, the least recently used
    assert s.exists([key(i) for i in range(5)]) == [1, 0, 1, 1, 1]
    assert s.used_bytes == cap
    s.close()

    # After a restart the order is the write order (reads are not recorded on disk); an object
    # evicted but still in its segment may come back, with its own bytes.
    s = open_store(tmp_path, capacity_bytes=2 * (HEADER_SIZE + n))   # a smaller capacity: trimmed at once
    assert len(s) == 2 and s.used_bytes == 2 * (HEADER_SIZE + n)
    present = [i for i in range(5) if s.exists([key(i)]) == [1]]
    assert len(present) == 2
    for i in present:
        assert np.array_equal(get(s, key(i), n)[1], arrs[i])
    s.close()
