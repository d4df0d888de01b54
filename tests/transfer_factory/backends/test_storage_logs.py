"""No log line of the storage backends shows a storage key or its block hash (DESIGN §3.7: a key
holds the chained hash of a prompt's tokens): a damaged record, a refused file, an object over the
capacity and a Mooncake call that raises with a key in its message are logged with short tags
(``transfer_factory.log_tags``) or counts only."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import types

import numpy as np
import pytest

from tests.file_store_helpers import NS, key, open_store, put, rand_bytes
from transfer_factory.file.segments import HEADER_SIZE
from transfer_factory.kvcache_storage import CORRUPT, NO_SPACE, OK, UNAVAILABLE
from transfer_factory.log_tags import key_tag, redact
from transfer_factory.mooncake.store import MooncakeStore


def secrets_of(k: str) -> list[str]:
    """What a log line must not contain: the key, its block hash, the hash's halves, its digest."""
    block_hash = k.split("/")[1]
    return [k, block_hash, block_hash[:32], block_hash[32:], hashlib.sha256(k.encode()).hexdigest()]


def assert_no_key(text: str, keys: list[str]) -> None:
    for k in keys:
        for s in secrets_of(k):
            assert s not in text, f"a log line shows {s!r}"
    assert not re.search(r"[0-9a-f]{32,}", text), "a log line shows a long hex string (a hash?)"


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="transfer_factory")
    return caplog


def hashed_key(i: int) -> str:
    """A key with a real-looking block hash (64 hex digits of SHA-256)."""
    return f"{NS}/{hashlib.sha256(str(i).encode()).hexdigest()}/0/k"


def test_a_damaged_record_is_logged_without_its_key(tmp_path, logs):
    k, a = hashed_key(1), rand_bytes(4096, 1)
    with open_store(tmp_path / "kv") as store:
        assert put(store, k, a) == OK
        loc = store.object_location(k)
        with open(loc.path, "r+b") as f:
            f.seek(loc.offset + HEADER_SIZE + 7)
            byte = f.read(1)[0]
            f.seek(loc.offset + HEADER_SIZE + 7)
            f.write(bytes([byte ^ 0xFF]))
        out = np.zeros(a.nbytes, np.uint8)
        assert store.batch_get([k], [out.ctypes.data], [a.nbytes]) == [CORRUPT]
    assert "corrupt" in logs.text
    assert_no_key(logs.text, [k])


def test_a_refused_file_and_a_torn_record_are_logged_without_keys(tmp_path, logs):
    keys = [hashed_key(i) for i in range(3)]
    root = tmp_path / "kv"
    with open_store(root) as store:
        for i, k in enumerate(keys):
            assert put(store, k, rand_bytes(4096, i)) == OK
        loc = store.object_location(keys[2])
    os.truncate(loc.path, loc.offset + HEADER_SIZE + 100)  # the last record torn
    rank_dir = root / NS / "rank0"
    os.symlink(tmp_path / "elsewhere", rank_dir / f"{'ab' * 8}.{'cd' * 4}.seg")  # planted: refused
    with open_store(root) as store:
        assert store.exists(keys) == [1, 1, 0]
    assert "refused" in logs.text
    assert_no_key(logs.text, keys)


def test_an_object_over_the_capacity_is_logged_by_its_tag(tmp_path, logs):
    k = hashed_key(7)
    with open_store(tmp_path / "kv", capacity_bytes=2 * (HEADER_SIZE + 4096)) as store:
        assert put(store, k, rand_bytes(3 * 4096, 7)) == NO_SPACE
    assert key_tag(k) in logs.text
    assert_no_key(logs.text, [k])


def test_a_mooncake_error_naming_a_key_is_redacted(logs):
    k = hashed_key(9)
    store = MooncakeStore.__new__(MooncakeStore)  # only what _run touches
    client = types.SimpleNamespace(store=None)
    store._admit = lambda: client
    store._mark = lambda *a: None
    store._reconnect_in_background = lambda: None
    store._connection = types.SimpleNamespace(release=lambda c: None)

    def fails(_client):
        raise KeyError(f"object {k} not found")

    assert store._run("batch_get", [k], fails, lambda i, c: c) == [UNAVAILABLE]
    assert "KeyError" in logs.text and key_tag(k.split("/")[1]) in logs.text
    assert_no_key(logs.text, [k])


def test_tags_are_short_stable_in_a_process_and_not_the_plain_hash():
    k = hashed_key(3)
    tag = key_tag(k)
    assert re.fullmatch(r"#[0-9a-f]{8}", tag) and key_tag(k) == tag and key_tag(hashed_key(4)) != tag
    assert tag[1:] not in (hashlib.sha256(k.encode()).hexdigest()[:8], k.split("/")[1][:8])  # keyed
    assert redact(f"no {k} here") == f"no {NS}/{key_tag(k.split('/')[1])}/0/k here"
    assert redact("namespace 0123456789abcdef stays") == "namespace 0123456789abcdef stays"
    assert key(1) != hashed_key(1)  # the helpers' keys are zero-padded counters, ours real hashes
