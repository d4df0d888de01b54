"""FileStore concurrency (transfer_factory/file/store.py): threads, and processes, on one directory
never read a wrong payload."""
import json
import os
import subprocess
import sys
import threading

import numpy as np

from tests.file_store_helpers import REPO, open_store
from transfer_factory.kvcache_storage import NOT_FOUND


# ------------------------------------------------------------------------------------ concurrency
# Every writer stores one of VARIANTS payloads per key (sizes differ, so a put over another variant
# rewrites the file while others read it); every successful read must equal one variant exactly.
_WORKLOAD = r"""
import numpy as np
from transfer_factory.kvcache_storage import NOT_FOUND, OK

KEYS, VARIANTS, MAXLEN = 24, 3, 48000

def payload(k, v):
    n = 1000 + (k * 7919 + v * 15013) % (MAXLEN - 1000)
    return np.random.default_rng(k * 100 + v).integers(0, 256, n, dtype=np.uint8)

def workload(store, seed, iters):
    rng = np.random.default_rng(seed)
    expected = {k: {payload(k, v).tobytes() for v in range(VARIANTS)} for k in range(KEYS)}
    out = np.empty(MAXLEN, dtype=np.uint8)
    stats = {"hits": 0, "wrong": 0, "bad_codes": []}
    for _ in range(iters):
        k = int(rng.integers(KEYS))
        name = "ns/%064x/0/k" % k
        op = rng.random()
        if op < 0.45:
            src = payload(k, int(rng.integers(VARIANTS)))
            code = store.batch_set([name], [src.ctypes.data], [src.nbytes])[0]
            if code != OK:
                stats["bad_codes"].append(("set", code))
        elif op < 0.93:
            code = store.batch_get([name], [out.ctypes.data], [MAXLEN])[0]
            if code > 0:
                stats["hits"] += 1
                if out[:code].tobytes() not in expected[k]:
                    stats["wrong"] += 1
            elif code != NOT_FOUND:
                stats["bad_codes"].append(("get", code))
        else:
            code = store.delete([name])[0]
            if code not in (OK, NOT_FOUND):
                stats["bad_codes"].append(("delete", code))
    return stats
"""
_PROCESS = _WORKLOAD + r"""
import json, sys
from transfer_factory.file.store import FileStore
root, seed, iters, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with FileStore(namespace="shared", rank=0, options={"root": root, "fsync": False, "capacity_bytes": cap}) as s:
    print("ready", flush=True)
    sys.stdin.readline()                                # start together with the other writers
    print(json.dumps(workload(s, seed, iters)))
"""
_ns: dict = {}
exec(_WORKLOAD, _ns)
CAPACITY = 10 * 48000                                  # about half the keys fit: eviction churns too


def _check(stats):
    assert stats["wrong"] == 0, stats
    assert stats["bad_codes"] == [], stats


def test_concurrent_threads_never_read_a_wrong_payload(tmp_path):
    shared = open_store(tmp_path, namespace="shared", capacity_bytes=CAPACITY)
    other = open_store(tmp_path, namespace="shared", capacity_bytes=CAPACITY)   # a second index, same files
    results = [None] * 6

    def run(i):
        results[i] = _ns["workload"](shared if i % 2 else other, 1000 + i, 600)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for stats in results:
        _check(stats)
    assert sum(r["hits"] for r in results) > 100
    shared.close()
    other.close()


def test_concurrent_processes_never_read_a_wrong_payload(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(tmp_path), str(seed), "1500", str(CAPACITY)],
                              cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    with open_store(tmp_path, namespace="shared", capacity_bytes=CAPACITY) as mine:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        local = _ns["workload"](mine, 3, 1500)              # this process joins in meanwhile
        results = [local]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append(json.loads(out))
        for stats in results:
            _check(stats)
        assert sum(r["hits"] for r in results) > 100
        # Afterwards every file on disk is whole: each present key reads back as one variant.
        buf = np.empty(48000, dtype=np.uint8)
        for k in range(_ns["KEYS"]):
            code = mine.batch_get(["ns/%064x/0/k" % k], [buf.ctypes.data], [48000])[0]
            assert code == NOT_FOUND or buf[:code].tobytes() in {
                _ns["payload"](k, v).tobytes() for v in range(_ns["VARIANTS"])}
    assert not list(tmp_path.rglob("*.new"))
