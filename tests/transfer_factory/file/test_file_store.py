"""FileStore (transfer_factory/file/store.py): round trips, status codes, the factory, and option
checking.  Damage, capacity and restart, directories, and concurrency are in test_file_store_damage.py,
test_file_store_capacity.py, test_file_store_directories.py and test_file_store_concurrency.py."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.file_store_helpers import NS, get, key, open_store, put, rand_bytes, store_fixture
from transfer_factory import StorageAccess, StorageConfigError, create_storage_backend
from transfer_factory.file.store import FileStore
from transfer_factory.kvcache_storage import BUFFER_TOO_SMALL, INVALID, NOT_FOUND, OK, UNAVAILABLE

HSETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
store = store_fixture  # the shared fixture (tests/file_store_helpers.py), under the name the tests ask for


# ------------------------------------------------------------------------------------ round trips
@HSETTINGS
@given(k=st.text(min_size=1, max_size=300), data=st.binary(min_size=1, max_size=4096))
def test_round_trip_any_key_bit_exact(store, k, data):
    src = np.frombuffer(data, dtype=np.uint8).copy()
    assert put(store, k, src) == OK
    assert store.exists([k]) == [1]
    code, out = get(store, k, len(data) + 17)
    assert code == len(data)
    assert out[:code].tobytes() == data
    assert not out[code:].any()                           # nothing written past the payload
    assert store.delete([k]) == [OK]
    assert store.exists([k]) == [0]


@HSETTINGS
@given(sizes=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_round_trip_random_sizes_batched(store, sizes, seed):
    srcs = [rand_bytes(n, seed + i) for i, n in enumerate(sizes)]
    keys = [key(seed * 8 + i) for i in range(len(sizes))]
    assert store.batch_set(keys, [a.ctypes.data for a in srcs], sizes) == [OK] * len(sizes)
    outs = [np.empty(n, dtype=np.uint8) for n in sizes]
    assert store.batch_get(keys, [o.ctypes.data for o in outs], sizes) == sizes
    for src, out in zip(srcs, outs):
        assert np.array_equal(src, out)
    store.clear()


@HSETTINGS
@given(pieces=st.lists(st.integers(0, 70000), min_size=1, max_size=8).filter(lambda p: sum(p) > 0),
       seed=st.integers(0, 2**32 - 1), split=st.integers(1, 5))
def test_multi_buffer_round_trip(store, pieces, seed, split):
    assert store.supports_multi_buffer
    srcs = [rand_bytes(n, seed + i) for i, n in enumerate(pieces)]
    k = key(seed)
    assert store.batch_set_multi([k], [[a.ctypes.data for a in srcs]], [pieces]) == [OK]
    total = sum(pieces)
    outs = [np.empty(n, dtype=np.uint8) for n in pieces]
    assert store.batch_get_multi([k], [[o.ctypes.data for o in outs]], [pieces]) == [total]
    for src, out in zip(srcs, outs):
        assert np.array_equal(src, out)
    # One file is the concatenation in order: read it back whole and in another split.
    code, whole = get(store, k, total)
    assert code == total and np.array_equal(whole, np.concatenate(srcs))
    bounds = np.linspace(0, total, split + 1).astype(int)
    parts = [np.empty(b - a, dtype=np.uint8) for a, b in zip(bounds[:-1], bounds[1:])]
    assert store.batch_get_multi([k], [[p.ctypes.data for p in parts]], [[p.nbytes for p in parts]]) == [total]
    assert np.array_equal(np.concatenate(parts), whole)
    # Scattering into buffers that are too small in total is refused.
    small = [np.empty(n, dtype=np.uint8) for n in pieces]
    small[-1] = np.empty(max(pieces[-1] - 1, 0), dtype=np.uint8)
    if sum(s.nbytes for s in small) < total:
        assert store.batch_get_multi([k], [[s.ctypes.data for s in small]], [[s.nbytes for s in small]]) \
            == [BUFFER_TOO_SMALL]
    store.delete([k])


def test_existing_key_put_is_success(store):
    """The key names the content (the same key is the same prefix's KV), so a put of a present key
    is a success that writes nothing and keeps the object first stored."""
    a, b = rand_bytes(5000, 1), rand_bytes(5000, 2)
    k = key(1)
    assert put(store, k, a) == OK
    used, disk, where = store.used_bytes, store.disk_bytes, store.object_location(k)
    assert put(store, k, b) == OK
    assert store.used_bytes == used and len(store) == 1
    assert store.object_location(k) == where and store.disk_bytes == disk   # not rewritten
    code, out = get(store, k, 5000)
    assert code == 5000 and np.array_equal(out, a)


def test_codes_for_bad_requests(store):
    a = rand_bytes(1000, 3)
    k = key(2)
    assert get(store, k, 1000)[0] == NOT_FOUND
    assert store.batch_set([k], [a.ctypes.data], [0]) == [INVALID]
    assert store.batch_set([k], [0], [1000]) == [INVALID]
    assert store.batch_set([""], [a.ctypes.data], [1000]) == [INVALID]
    assert store.batch_set_multi([k], [[]], [[]]) == [INVALID]
    assert store.batch_get([k], [a.ctypes.data], [-1]) == [INVALID]
    with pytest.raises(ValueError):
        store.batch_set([k, key(3)], [a.ctypes.data], [1000])
    assert put(store, k, a) == OK
    assert get(store, k, 999)[0] == BUFFER_TOO_SMALL
    assert store.exists([k]) == [1]                       # a too-small buffer does not damage anything
    assert store.delete([k, key(3)]) == [OK, NOT_FOUND]
    store.register_buffer(a.ctypes.data, a.nbytes)
    store.register_buffer(a.ctypes.data, a.nbytes)        # twice is harmless
    for ptr, size in ((0, 10), (-5, 10), (a.ctypes.data, 0), (a.ctypes.data, -1), ("x", 10)):
        with pytest.raises(ValueError):
            store.register_buffer(ptr, size)


def test_query_counts_the_present_prefix(store):
    arrs = [rand_bytes(100, i) for i in range(4)]
    keys = [key(i) for i in range(4)]
    store.batch_set(keys[:2] + keys[3:], [a.ctypes.data for a in arrs[:2] + arrs[3:]], [100] * 3)
    assert store.exists(keys) == [1, 1, 0, 1]
    assert store.query(keys) == 2


def test_close_is_idempotent_and_later_calls_fail_softly(tmp_path):
    s = open_store(tmp_path)
    a = rand_bytes(64, 0)
    assert put(s, key(0), a) == OK
    s.close()
    s.close()
    assert put(s, key(1), a) == UNAVAILABLE
    assert get(s, key(0), 64)[0] == UNAVAILABLE
    assert s.exists([key(0)]) == [UNAVAILABLE]


def test_factory_builds_a_file_store(tmp_path):
    s = create_storage_backend("file", namespace=NS, rank=1, options={"root": str(tmp_path), "fsync": True})
    try:
        assert isinstance(s, FileStore) and s.name == "file" and s.access is StorageAccess.HOST_STAGED
        assert s.directory == tmp_path / NS / "rank1"
        a = rand_bytes(3000, 9)
        assert put(s, key(0, rank=1), a) == OK
        assert np.array_equal(get(s, key(0, rank=1), 3000)[1], a)
    finally:
        s.close()


# ------------------------------------------------------------------------------------ options
@pytest.mark.parametrize("options, name", [
    ({"root": ""}, "root"),
    ({"root": 42}, "root"),
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": -1}, "capacity_bytes"),
    ({"capacity_bytes": 1.5}, "capacity_bytes"),
    ({"capacity_bytes": True}, "capacity_bytes"),
    ({"capacity_bytes": "lots"}, "capacity_bytes"),
    ({"fsync": "maybe"}, "fsync"),
    ({"fsync": 2}, "fsync"),
    ({"read_piece_bytes": -1}, "read_piece_bytes -1"),
    ({"read_piece_bytes": True}, "read_piece_bytes True"),
    ({"read_piece_bytes": "4M"}, "read_piece_bytes '4M'"),
    ({"capcity_bytes": 10}, "capcity_bytes"),
])
def test_bad_options_name_the_option(tmp_path, options, name):
    with pytest.raises(StorageConfigError, match=name):
        FileStore(namespace=NS, rank=0, options={"root": str(tmp_path), **options})


def test_bad_root_namespace_rank_env(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StorageConfigError, match="root"):
        FileStore(namespace=NS, rank=0, options={"root": str(afile)})
    for ns in ("", "..", "a/b"):
        with pytest.raises(StorageConfigError, match="namespace"):
            FileStore(namespace=ns, rank=0, options={"root": str(tmp_path)})
    for rank in (-1, "0", True):
        with pytest.raises(StorageConfigError, match="rank"):
            FileStore(namespace=NS, rank=rank, options={"root": str(tmp_path)})
    monkeypatch.setenv("CTM_FILE_STORE_CAPACITY", "plenty")
    with pytest.raises(StorageConfigError, match="capacity_bytes.*CTM_FILE_STORE_CAPACITY"):
        FileStore(namespace=NS, rank=0, options={"root": str(tmp_path)})


def test_defaults_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("CTM_FILE_STORE_ROOT", raising=False)
    monkeypatch.delenv("CTM_FILE_STORE_CAPACITY", raising=False)
    monkeypatch.delenv("FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with FileStore(namespace=NS, rank=3, options={}) as s:
        assert s.directory == tmp_path / "home/.cache/cache-transfer-manager/kv" / NS / "rank3"
        assert s.capacity_bytes == 64 << 30 and s.fsync is True and s.staged_read_piece_bytes == 4 << 20
    monkeypatch.setenv("FILE_BACKEND_STORAGE_DIR", str(tmp_path / "fastdeploy"))  # FastDeploy's variable
    with FileStore(namespace=NS, rank=1, options={}) as s:
        assert s.directory == tmp_path / "fastdeploy" / NS / "rank1"
    monkeypatch.setenv("CTM_FILE_STORE_ROOT", str(tmp_path / "envroot"))  # ours wins over FastDeploy's
    monkeypatch.setenv("CTM_FILE_STORE_CAPACITY", "2G")
    with FileStore(namespace=NS, rank=0, options={"fsync": "false"}) as s:
        assert s.directory == tmp_path / "envroot" / NS / "rank0"
        assert s.capacity_bytes == 2 << 30 and s.fsync is False
    with FileStore(namespace=NS, rank=0, options={"root": tmp_path / "opt", "capacity_bytes": 12345}) as s:
        assert s.directory == tmp_path / "opt" / NS / "rank0" and s.capacity_bytes == 12345
