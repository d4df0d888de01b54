"""Unit tests of the AttentionStore SDK contract stand-in (``tests/standins/attentionstore_sdk``).

Fast and in-process: numpy buffers play the device caches (a pointer is ``arr.ctypes.data``), the
stand-in's directory is the test's ``tmp_path``.  They pin its round trips, the identity that names
a block, its on-disk layout and its fault knobs; what it rejects is in
test_standin_attentionstore_rejections.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from tests.standin_attentionstore_helpers import (BPB, BTS, LAYERS, attentionstore_standin, caches, make, ptrs,
                                                  toks)


@pytest.fixture
def m(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SimpleNamespace]:
    """The stand-in's modules, freshly imported (per-process call counters start at 0)."""
    yield from attentionstore_standin(monkeypatch, tmp_path)


def write_faults(m: SimpleNamespace, faults: dict) -> None:
    (m.root / "faults.json").write_text(json.dumps(faults))


def calls(m: SimpleNamespace, method: str) -> int:
    lines = (m.root / "calls.log").read_text().splitlines()
    assert all(line.split()[0] == str(os.getpid()) for line in lines)
    return sum(1 for line in lines if line.split()[1] == method)


# ---------------------------------------------------------------------------------------- round trips
def test_round_trip_k_and_v(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 3, extra=2)  # a trailing partial block is ignored
    k, v = caches(seed=1), caches(seed=2)
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [5, 1, 3], 10.0) == 3
    assert sdk.match(tokens, 0, 10.0) == 3
    k2, v2 = caches(fill=0), caches(fill=0)
    assert sdk.read([0, 1], tokens, 0, ptrs(k2), ptrs(v2), [0, 2, 4], 10) == 3
    for layer in range(LAYERS):
        for src, dst in zip([5, 1, 3], [0, 2, 4]):
            assert bytes(k2[layer][dst]) == bytes(k[layer][src])
            assert bytes(v2[layer][dst]) == bytes(v[layer][src])
        for untouched in (1, 3, 5, 6, 7):
            assert not k2[layer][untouched].any() and not v2[layer][untouched].any()


def test_round_trip_k_only_and_size_mismatch_is_a_miss(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 3)
    k = caches(seed=3)
    assert sdk.write([0, 1], tokens, 0, ptrs(k), [], [0, 1, 2], 5) == 3
    assert sdk.match(tokens, 0, 5) == 3
    k2 = caches(fill=0)
    assert sdk.read([0, 1], tokens, 0, ptrs(k2), [], [2, 3, 4], 5) == 3
    for layer in range(LAYERS):
        assert bytes(k2[layer][2:5]) == bytes(k[layer][0:3])
    # a K-only object is the wrong size for a K+V reader: nothing read, nothing touched
    k3, v3 = caches(fill=0xEE), caches(fill=0xEE)
    assert sdk.read([0, 1], tokens, 0, ptrs(k3), ptrs(v3), [0, 1, 2], 5) == 0
    assert all((a == 0xEE).all() for a in k3 + v3)


def test_wrong_block_bytes_is_a_miss(m: SimpleNamespace) -> None:
    tokens = toks(m, 2)
    k, v = caches(seed=4), caches(seed=5)
    assert make(m).write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1], 5) == 2
    other = make(m, bytes_per_shard_layer_per_block=BPB // 2)
    assert other.match(tokens, 0, 5) == 0
    k2, v2 = caches(fill=0, bpb=BPB // 2), caches(fill=0, bpb=BPB // 2)
    assert other.read([0, 1], tokens, 0, ptrs(k2), ptrs(v2), [0, 1], 5) == 0


def test_read_from_a_later_start_block(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 4)
    k, v = caches(seed=6), caches(seed=7)
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1, 2, 3], 5) == 4
    assert sdk.match(tokens, 2, 5) == 2
    k2, v2 = caches(fill=0), caches(fill=0)
    assert sdk.read([0, 1], tokens, 2, ptrs(k2), ptrs(v2), [6, 7], 5) == 2
    for layer in range(LAYERS):
        assert bytes(k2[layer][6:8]) == bytes(k[layer][2:4])
        assert bytes(v2[layer][6:8]) == bytes(v[layer][2:4])
    # a subset of the layers, in any order, reads just those layers
    k3, v3 = caches(fill=0), caches(fill=0)
    assert sdk.read([1], tokens, 1, [ptrs(k3)[1]], [], [0], 5) == 0  # stored K+V: wrong size for K only
    assert sdk.read([1, 0], tokens, 1, ptrs(k3)[::-1], ptrs(v3)[::-1], [0], 5) == 1
    assert bytes(k3[1][0]) == bytes(k[1][1]) and bytes(k3[0][0]) == bytes(k[0][1])
    assert bytes(v3[1][0]) == bytes(v[1][1]) and bytes(v3[0][0]) == bytes(v[0][1])


def test_match_counts_leading_blocks_for_every_layer(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 5)
    k, v = caches(seed=8), caches(seed=9)
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1], 5) == 2
    assert sdk.write([0, 1], tokens, 3, ptrs(k), ptrs(v), [3], 5) == 1
    assert sdk.write([0], tokens, 2, [ptrs(k)[0]], [ptrs(v)[0]], [2], 5) == 1  # layer 1 of block 2 missing
    assert sdk.match(tokens, 0, 5) == 2
    assert sdk.match(tokens, 1, 5) == 1
    assert sdk.match(tokens, 2, 5) == 0
    assert sdk.match(tokens, 3, 5) == 1
    assert sdk.match(tokens, 5, 5) == 0  # start == full blocks is allowed
    # FastDeploy's readiness probe: one full block plus one token, from block 0
    assert sdk.match(m.Tokens(list(range(BTS + 1)), BTS), 0, 5) == 0


def test_read_stops_at_first_missing_block_and_leaves_the_rest(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 5)
    k, v = caches(seed=10), caches(seed=11)
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1], 5) == 2
    assert sdk.write([0, 1], tokens, 3, ptrs(k), ptrs(v), [3, 4], 5) == 2
    assert sdk.write([1], tokens, 2, [ptrs(k)[1]], [ptrs(v)[1]], [2], 5) == 1  # block 2: layer 1 only
    k2, v2 = caches(fill=0xEE), caches(fill=0xEE)
    assert sdk.read([0, 1], tokens, 0, ptrs(k2), ptrs(v2), [7, 6, 5, 4, 3], 5) == 2
    for layer in range(LAYERS):
        assert bytes(k2[layer][7]) == bytes(k[layer][0]) and bytes(v2[layer][6]) == bytes(v[layer][1])
        for untouched in range(6):
            assert (k2[layer][untouched] == 0xEE).all() and (v2[layer][untouched] == 0xEE).all()
    # layer 1 alone holds block 2, so a read of layer 1 goes on through it
    k3, v3 = caches(fill=0, layers=1), caches(fill=0, layers=1)
    assert sdk.read([1], tokens, 0, ptrs(k3), ptrs(v3), [0, 1, 2, 3, 4], 5) == 5


def test_write_overwrites(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 1)
    a, b = caches(seed=12), caches(seed=13)
    assert sdk.write([0, 1], tokens, 0, ptrs(a), ptrs(a), [0], 5) == 1
    assert sdk.write([0, 1], tokens, 0, ptrs(b), ptrs(b), [1], 5) == 1
    out_k, out_v = caches(fill=0), caches(fill=0)
    assert sdk.read([0, 1], tokens, 0, ptrs(out_k), ptrs(out_v), [0], 5) == 1
    assert bytes(out_k[0][0]) == bytes(b[0][1]) and bytes(out_v[1][0]) == bytes(b[1][1])


# ---------------------------------------------------------------------------------------- identity
def test_other_pod_device_and_dp_read_the_same_blocks(m: SimpleNamespace) -> None:
    tokens = toks(m, 2)
    k, v = caches(seed=14), caches(seed=15)
    assert make(m).write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1], 5) == 2
    other = make(m, pod_name="pod-b", device_id=3, dp_id=2)
    assert other.match(tokens, 0, 5) == 2
    k2, v2 = caches(fill=0), caches(fill=0)
    assert other.read([0, 1], tokens, 0, ptrs(k2), ptrs(v2), [0, 1], 5) == 2
    assert bytes(k2[0][:2]) == bytes(k[0][:2]) and bytes(v2[1][:2]) == bytes(v[1][:2])


@pytest.mark.parametrize("override", [{"namespace": "ns2"}, {"model_version": "v2"}, {"shard_num": 2},
                                      {"shard_num": 2, "shard_id": 1}],
                         ids=["namespace", "model_version", "shard_num", "shard_id"])
def test_identities_never_see_each_other(m: SimpleNamespace, override: dict) -> None:
    tokens = toks(m, 2)
    k, v = caches(seed=16), caches(seed=17)
    first, second = make(m), make(m, **override)
    assert first.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1], 5) == 2
    assert second.match(tokens, 0, 5) == 0
    k2, v2 = caches(fill=0), caches(fill=0)
    assert second.read([0, 1], tokens, 0, ptrs(k2), ptrs(v2), [0, 1], 5) == 0
    assert second.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0], 5) == 1
    assert first.match(tokens, 0, 5) == 2 and second.match(tokens, 0, 5) == 1


def test_a_block_is_named_by_its_whole_prefix(m: SimpleNamespace) -> None:
    sdk = make(m)
    k, v = caches(seed=18), caches(seed=19)
    ids = list(range(2 * BTS))
    assert sdk.write([0, 1], m.Tokens(ids, BTS), 0, ptrs(k), ptrs(v), [0, 1], 5) == 2
    changed_first_block = m.Tokens([999] + ids[1:], BTS)  # same tokens in block 1, another prefix
    assert sdk.match(changed_first_block, 1, 5) == 0
    assert sdk.match(m.Tokens(ids + [7] * BTS, BTS), 0, 5) == 2  # a longer prompt shares the prefix


def test_on_disk_layout(m: SimpleNamespace) -> None:
    sdk = make(m)
    ids = list(range(100, 100 + 2 * BTS))
    k, v = caches(seed=20), caches(seed=21)
    assert sdk.write([0, 1], m.Tokens(ids, BTS), 0, ptrs(k), ptrs(v), [3, 4], 5) == 2
    ident = b"".join(len(p).to_bytes(8, "little") + p for p in (b"ns", b"v1", b"1", b"0", str(BTS).encode()))
    for b in range(2):
        key = hashlib.sha256(ident + struct.pack(f"<{(b + 1) * BTS}q", *ids[:(b + 1) * BTS])).hexdigest()
        assert key == m.sdk.block_key_for_tests("ns", "v1", 1, 0, BTS, ids, b)
        for layer in range(LAYERS):
            path = m.root / "data" / key[:2] / f"{key}.{layer}"
            assert path.read_bytes() == bytes(k[layer][3 + b]) + bytes(v[layer][3 + b])
    data_files = [p for p in (m.root / "data").rglob("*") if p.is_file()]
    assert len(data_files) == 2 * LAYERS  # no temporary files left behind


def test_remove_block_for_tests(m: SimpleNamespace) -> None:
    sdk = make(m, shard_id=1, shard_num=2)
    ids = list(range(3 * BTS))
    k, v = caches(seed=22), caches(seed=23)
    assert sdk.write([0, 1], m.Tokens(ids, BTS), 0, ptrs(k), ptrs(v), [0, 1, 2], 5) == 3
    assert m.sdk.remove_block_for_tests(m.root, 0, 2, ids, BTS, 1) == 0  # another shard holds nothing
    assert m.sdk.remove_block_for_tests(str(m.root), 1, 2, ids, BTS, 1) == LAYERS
    assert sdk.match(m.Tokens(ids, BTS), 0, 5) == 1
    assert sdk.match(m.Tokens(ids, BTS), 2, 5) == 1


# ---------------------------------------------------------------------------------------- faults
def test_write_first_k(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 4)
    k, v = caches(seed=24), caches(seed=25)
    write_faults(m, {"write_first_k": 2})
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0, 1, 2, 3], 5) == 2
    assert sdk.write([0, 1], tokens, 3, ptrs(k), ptrs(v), [3], 5) == 1
    assert sdk.match(tokens, 0, 5) == 2 and sdk.match(tokens, 3, 5) == 1
    write_faults(m, {"write_first_k": 0})
    assert sdk.write([0, 1], tokens, 2, ptrs(k), ptrs(v), [2], 5) == 0
    assert sdk.match(tokens, 0, 5) == 2


def test_not_ready_until_then_ready(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 1)
    write_faults(m, {"not_ready_until": time.time() + 0.3})
    for call in (lambda: sdk.match(tokens, 0, 1),
                 lambda: sdk.read([0], tokens, 0, [1], [], [0], 1),  # never reaches the pointer
                 lambda: sdk.write([0], tokens, 0, [1], [], [0], 1)):
        with pytest.raises(m.Error) as info:
            call()
        assert str(info.value) == "cuda memory not ready"
    tries = 1
    while True:  # what FastDeploy does at start-up
        try:
            assert sdk.match(tokens, 0, 1) == 0
            break
        except m.Error as exc:
            assert "cuda memory not ready" in str(exc)
            tries += 1
            time.sleep(0.05)
    assert tries >= 2
    assert calls(m, "match") == tries + 1
    assert calls(m, "read") == 1 and calls(m, "write") == 1


def test_raise_on_call_and_raise(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 1)
    k, v = caches(seed=26), caches(seed=27)
    write_faults(m, {"raise_on_call": {"read": 2}})
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0], 5) == 1
    out_k, out_v = caches(fill=0), caches(fill=0)
    out = ptrs(out_k)
    assert sdk.read([0, 1], tokens, 0, out, ptrs(out_v), [0], 5) == 1
    with pytest.raises(m.Error):
        sdk.read([0, 1], tokens, 0, out, ptrs(out_v), [0], 5)
    assert sdk.read([0, 1], tokens, 0, out, ptrs(out_v), [0], 5) == 1
    write_faults(m, {"raise": ["write"]})
    with pytest.raises(m.Error):
        sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0], 5)
    assert sdk.match(tokens, 0, 5) == 1
    (m.root / "faults.json").unlink()  # re-read at every call
    assert sdk.write([0, 1], tokens, 0, ptrs(k), ptrs(v), [0], 5) == 1


def test_sleep_s_ignores_timeout_and_timeout_raises(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 1)
    write_faults(m, {"sleep_s": {"match": 0.2}})
    began = time.monotonic()
    assert sdk.match(tokens, 0, 0.01) == 0
    assert time.monotonic() - began >= 0.2
    write_faults(m, {"timeout": ["match"]})
    began = time.monotonic()
    with pytest.raises(m.Error, match="^timeout$"):
        sdk.match(tokens, 0, 0.1)
    assert time.monotonic() - began >= 0.1


def test_faults_file_empty_or_malformed(m: SimpleNamespace) -> None:
    sdk = make(m)
    tokens = toks(m, 1)
    (m.root / "faults.json").write_text("")
    assert sdk.match(tokens, 0, 1) == 0
    for bad in ("{not json", json.dumps({"raise": ["save"]}), json.dumps({"sleeps": {}})):
        (m.root / "faults.json").write_text(bad)
        with pytest.raises(ValueError):
            sdk.match(tokens, 0, 1)
