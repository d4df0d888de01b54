"""The FileStore's bulk paths end to end (transfer_factory/file/csrc/records.c through the store):
many 16 KiB objects in one batch, mixed sizes, damage in the middle of a big batch, batches that
leave the bulk path, and note_blocks against its Python definition."""
import ctypes
import random

import numpy as np
import pytest

from tests.file_store_record_helpers import key, open_store
from transfer_factory.file import _records as fr
from transfer_factory.file.segments import DEAD, HEADER_SIZE
from transfer_factory.keys import KINDS
from transfer_factory.kvcache_storage import BUFFER_TOO_SMALL, CORRUPT, INVALID, NOT_FOUND, OK


# ------------------------------------------------------------------------------------ the store, in bulk
def test_many_16k_objects_in_one_batch_bit_exact_and_after_reopen(tmp_path):
    n, size = 4096, 16 << 10
    src = np.random.default_rng(5).integers(0, 256, n * size, dtype=np.uint8)
    keys = [key(i // 2, "kv"[i % 2]) for i in range(n)]
    ptrs = [src.ctypes.data + i * size for i in range(n)]
    with open_store(tmp_path) as store:
        assert store.batch_set(keys, ptrs, [size] * n) == [OK] * n
        dst = np.zeros_like(src)
        assert store.batch_get(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n) == [size] * n
        assert np.array_equal(dst, src)
        # Out of file order, with room to spare: each object lands in its own buffer, nothing past it.
        order = list(range(n))
        random.Random(6).shuffle(order)
        dst = np.zeros(n * (size + 8), dtype=np.uint8)
        codes = store.batch_get([keys[i] for i in order], [dst.ctypes.data + j * (size + 8) for j in range(n)],
                                [size + 8] * n)
        assert codes == [size] * n
        for j, i in enumerate(order[:300]):
            start = j * (size + 8)
            assert dst[start:start + size].tobytes() == src[i * size:(i + 1) * size].tobytes()
            assert not dst[start + size:start + size + 8].any()
    with open_store(tmp_path) as store:                    # the index is rebuilt by scanning
        assert len(store) == n
        dst = np.zeros_like(src)
        assert store.batch_get(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n) == [size] * n
        assert np.array_equal(dst, src)


def test_mixed_sizes_and_buffer_counts_in_one_batch(tmp_path):
    rng = np.random.default_rng(7)
    sizes = [1, 55, 56, 57, 4096, 16 << 10, (16 << 10) + 1, 600 << 10, 3, 100000] * 6
    arrays = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    keys = [key(i, KINDS[i % 4]) for i in range(len(sizes))]
    with open_store(tmp_path) as store:
        half = len(keys) // 2
        assert store.batch_set(keys[:half], [a.ctypes.data for a in arrays[:half]], sizes[:half]) == [OK] * half
        # The other half as multi-buffer objects, split in up to three pieces (one may be empty).
        ptr_lists, size_lists = [], []
        for a in arrays[half:]:
            cut1, cut2 = sorted(rng.integers(0, a.nbytes + 1, 2))
            ptr_lists.append([a.ctypes.data, a.ctypes.data + int(cut1), a.ctypes.data + int(cut2)])
            size_lists.append([int(cut1), int(cut2 - cut1), int(a.nbytes - cut2)])
        assert store.batch_set_multi(keys[half:], ptr_lists, size_lists) == [OK] * (len(keys) - half)
        outs = [np.zeros(s, dtype=np.uint8) for s in sizes]
        assert store.batch_get(keys, [o.ctypes.data for o in outs], sizes) == sizes
        assert all(np.array_equal(o, a) for o, a in zip(outs, arrays))
        # Multi-buffer reads of everything: each object split across two buffers of its own.
        outs = [np.zeros(s + 5, dtype=np.uint8) for s in sizes]
        codes = store.batch_get_multi(keys, [[o.ctypes.data, o.ctypes.data + s // 2] for o, s in zip(outs, sizes)],
                                      [[s // 2, s - s // 2 + 5] for s in sizes])
        assert codes == sizes
        assert all(np.array_equal(o[:s], a) and not o[s:].any() for o, a, s in zip(outs, arrays, sizes))


@pytest.mark.parametrize("damage", ["payload", "header"])
def test_damage_in_the_middle_of_a_big_batch_costs_only_that_object(tmp_path, damage, caplog):
    n, size = 600, 16 << 10
    src = np.random.default_rng(8).integers(0, 256, n * size, dtype=np.uint8)
    keys = [key(i // 2, "kv"[i % 2]) for i in range(n)]
    ptrs = [src.ctypes.data + i * size for i in range(n)]
    victim = 333
    with open_store(tmp_path) as store:
        assert store.batch_set(keys, ptrs, [size] * n) == [OK] * n
        loc = store.object_location(keys[victim])
        with open(loc.path, "r+b") as f:
            at = loc.offset + (HEADER_SIZE + 1000 if damage == "payload" else 30)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
        dst = np.zeros_like(src)
        codes = store.batch_get(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n)
        assert codes[victim] == CORRUPT
        assert codes[:victim] + codes[victim + 1:] == [size] * (n - 1)
        others = np.ones(n, dtype=bool)
        others[victim] = False
        assert np.array_equal(dst.reshape(n, size)[others], src.reshape(n, size)[others])
        assert "corrupt" in caplog.text
        # Afterwards a plain miss, and the rest still reads in bulk.
        assert store.batch_get([keys[victim]], [dst.ctypes.data], [size]) == [NOT_FOUND]
        if damage == "payload":                            # a valid header: marked dead on disk
            with open(loc.path, "rb") as f:
                f.seek(loc.offset)
                assert f.read(4) == DEAD


def test_batches_that_leave_the_bulk_path_report_per_object(tmp_path):
    """Duplicates, invalid buffers, stored keys, missing keys and small buffers in one batch: the
    per-object path reports each exactly as before."""
    a = np.arange(5000, dtype=np.uint8)
    with open_store(tmp_path) as store:
        assert store.batch_set([key(1)], [a.ctypes.data], [100]) == [OK]
        codes = store.batch_set(["x/dup", "x/dup", key(1), "x/bad", "", "x/zero", "x/new"],
                                [a.ctypes.data, a.ctypes.data, a.ctypes.data, 0, a.ctypes.data, a.ctypes.data,
                                 a.ctypes.data + 7], [10, 10, 100, 10, 10, 0, 20])
        assert codes == [OK, OK, OK, INVALID, INVALID, INVALID, OK]
        out = np.zeros(200, dtype=np.uint8)
        codes = store.batch_get(["x/new", "x/missing", key(1), "x/dup", "", "x/dup"],
                                [out.ctypes.data, out.ctypes.data, out.ctypes.data + 100, out.ctypes.data, 0,
                                 out.ctypes.data + 50], [20, 20, 100, 5, 10, 10])
        assert codes == [20, NOT_FOUND, 100, BUFFER_TOO_SMALL, INVALID, 10]
        assert out[100:200].tobytes() == a[:100].tobytes()
        assert out[50:60].tobytes() == a[:10].tobytes()


def test_raw_pointers_are_written_without_copies_of_the_caller_buffer(tmp_path):
    """The payload reaches the file from the caller's memory (no stale copy): a buffer changed
    between two keys' writes is stored as it was at each write."""
    buf = (ctypes.c_char * 4096)()
    with open_store(tmp_path) as store:
        ctypes.memset(buf, 1, 4096)
        assert store.batch_set([key(1)], [ctypes.addressof(buf)], [4096]) == [OK]
        ctypes.memset(buf, 2, 4096)
        assert store.batch_set([key(2)], [ctypes.addressof(buf)], [4096]) == [OK]
        out = np.zeros(4096, dtype=np.uint8)
        assert store.batch_get([key(1)], [out.ctypes.data], [4096]) == [4096] and (out == 1).all()
        assert store.batch_get([key(2)], [out.ctypes.data], [4096]) == [4096] and (out == 2).all()


def _note_blocks_reference(groups, digests, done, index):
    """The Python definition note_blocks replaces (FileStore._note_blocks before it moved to C)."""
    siblings, blocks, failed = {}, {}, set()
    for group, d, ok in zip(groups, digests, done):
        if group is not None and d is not None:
            blocks.setdefault(group, []).append(d)
            if not ok:
                failed.add(group)
    for group, members in blocks.items():
        if group not in failed and len(members) > 1:
            t = tuple(members)
            for d in t:
                if d in index:
                    siblings[d] = t
    return siblings


@pytest.mark.parametrize("seed", range(40))
def test_note_blocks_matches_its_python_definition(seed):
    """Adjacent blocks (the bulk path), shuffled ones, failed members, keys without a digest, and
    objects no longer in the index."""
    rng = random.Random(seed)
    keys = [key(b, kind) for b in range(rng.randint(0, 30)) for kind in KINDS[:rng.randint(1, 4)]]
    keys += [f"other/{i}" for i in range(rng.randint(0, 3))]
    if seed % 2:
        rng.shuffle(keys)
    groups = fr.key_groups(keys, KINDS)
    digests = [None if rng.random() < 0.03 else d for d in fr.key_digests(keys)]
    done = [rng.random() > 0.05 for _ in keys]
    index = {d: 1 for d in digests if d is not None and rng.random() > 0.05}
    siblings = {}
    fr.note_blocks(groups, digests, done, index, siblings)
    assert siblings == _note_blocks_reference(groups, digests, done, index)


def test_reads_without_the_bound_xxh3_check_the_same(tmp_path, monkeypatch):
    """Where xxhash's library exports no XXH3 symbol, reads take read_records + a checksum call per
    object: the same hits, and a flipped payload byte is still CORRUPT."""
    from transfer_factory.file import store_read as file_store_read
    monkeypatch.setattr(file_store_read, "XXH3_DIRECT", False)
    n, size = 300, 16 << 10
    src = np.random.default_rng(9).integers(0, 256, n * size, dtype=np.uint8)
    keys = [key(i // 2, "kv"[i % 2]) for i in range(n)]
    with open_store(tmp_path) as store:
        assert store.batch_set(keys, [src.ctypes.data + i * size for i in range(n)], [size] * n) == [OK] * n
        loc = store.object_location(keys[100])
        with open(loc.path, "r+b") as f:
            f.seek(loc.offset + HEADER_SIZE + 5)
            b = f.read(1)
            f.seek(loc.offset + HEADER_SIZE + 5)
            f.write(bytes([b[0] ^ 1]))
        dst = np.zeros_like(src)
        codes = store.batch_get(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n)
        assert codes[100] == CORRUPT and codes[:100] + codes[101:] == [size] * (n - 1)
        keep = np.arange(n) != 100
        assert np.array_equal(dst.reshape(n, size)[keep], src.reshape(n, size)[keep])


def test_a_bulk_read_notes_blocks_it_did_not_know(tmp_path):
    """After a reopen no block is known; a bulk read of whole blocks makes them known (eviction
    then takes a block whole), and a second read leaves them as they are."""
    a = np.arange(4096, dtype=np.uint8)
    keys = [key(b, kind) for b in range(20) for kind in ("k", "v")]
    with open_store(tmp_path) as store:
        assert store.batch_set(keys, [a.ctypes.data] * len(keys), [4096] * len(keys)) == [OK] * len(keys)
    with open_store(tmp_path) as store:
        assert store.index.known_blocks() == {}
        out = np.zeros(4096 * len(keys), dtype=np.uint8)
        ptrs = [out.ctypes.data + 4096 * i for i in range(len(keys))]
        assert store.batch_get(keys, ptrs, [4096] * len(keys)) == [4096] * len(keys)
        digests = fr.key_digests(keys)
        assert store.index.known_blocks() == {d: (digests[i & ~1], digests[i | 1]) for i, d in enumerate(digests)}
        before = dict(store.index.known_blocks())
        assert store.batch_get(keys, ptrs, [4096] * len(keys)) == [4096] * len(keys)
        assert store.index.known_blocks() == before
