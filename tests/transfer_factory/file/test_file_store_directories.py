"""FileStore directories (transfer_factory/file/store.py): namespaces and ranks isolated from each
other, and the modes of the files and directories it makes."""
import os

import numpy as np

from tests.file_store_helpers import get, key, open_store, put, rand_bytes
from transfer_factory.kvcache_storage import OK


# ------------------------------------------------------------------------------------ isolation
def test_namespaces_and_ranks_are_isolated(tmp_path):
    stores = {(ns, r): open_store(tmp_path, namespace=ns, rank=r) for ns in ("nsA", "nsB") for r in (0, 1)}
    k = "same/key/for/everyone"
    arrs = {}
    for i, (where, s) in enumerate(stores.items()):
        assert s.exists([k]) == [0]
        arrs[where] = rand_bytes(777 + i, i)
        assert put(s, k, arrs[where]) == OK
    for where, s in stores.items():
        code, out = get(s, k, 1000)
        assert code == arrs[where].nbytes and np.array_equal(out[:code], arrs[where])
    assert put(stores[("nsA", 0)], "only-A0", arrs[("nsA", 0)]) == OK
    for where, s in stores.items():
        assert s.exists(["only-A0"]) == [int(where == ("nsA", 0))]
    stores[("nsA", 0)].clear()
    assert stores[("nsA", 0)].exists([k, "only-A0"]) == [0, 0]
    for where, s in stores.items():
        if where != ("nsA", 0):
            assert s.exists([k]) == [1] and len(s) == 1
    assert sorted(p.name for p in (tmp_path / "nsA").iterdir()) == ["rank0", "rank1"]
    for s in stores.values():
        s.close()


# ------------------------------------------------------------------------------------ modes
def _modes(root):
    return {str(p.relative_to(root)): p.stat().st_mode & 0o7777 for p in [root, *root.rglob("*")]}


def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path):
    root = tmp_path / "fresh" / "kv"                      # every directory below tmp_path is the store's
    a = rand_bytes(4096, 1)
    old = os.umask(0)
    try:
        with open_store(root, capacity_bytes=1 << 20) as s:   # 64 KiB segments
            for i in range(20):                           # enough bytes to fill more than one segment
                assert put(s, key(i), a) == OK
            assert s.batch_set_multi([key(99)], [[a.ctypes.data, a.ctypes.data]], [[100, 200]]) == [OK]
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "fresh")
    files = {p: m for p, m in modes.items() if (tmp_path / "fresh" / p).is_file()}
    dirs = {p: m for p, m in modes.items() if p not in files}
    assert len(files) >= 2 and all(p.endswith(".seg") for p in files), files
    assert set(files.values()) == {0o600}, files
    assert len(dirs) == 4 and set(dirs.values()) == {0o700}, dirs   # fresh, kv, namespace, rank0


def test_a_store_left_readable_by_an_older_version_is_made_private(tmp_path):
    a = rand_bytes(512, 2)
    with open_store(tmp_path) as s:
        assert put(s, key(1), a) == OK
        path = s.object_location(key(1)).path           # the segment file
    for p in (path, path.parent, path.parent.parent):
        p.chmod(0o755 if p.is_dir() else 0o644)
    tmp_path.chmod(0o755)
    with open_store(tmp_path) as s:
        assert np.array_equal(get(s, key(1), 512)[1], a)
    assert path.stat().st_mode & 0o777 == 0o600
    assert {p.stat().st_mode & 0o777 for p in (path.parent, path.parent.parent)} == {0o700}
    assert tmp_path.stat().st_mode & 0o777 == 0o755       # the root existed before: not the store's to change
