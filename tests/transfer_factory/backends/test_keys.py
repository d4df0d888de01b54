"""Storage keys: deterministic across processes, chained, and namespaced by everything that changes bytes."""
import os
import subprocess
import sys

import pytest

from transfer_factory.keys import Namespace, chain_hash_ids, chain_hashes, storage_key

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NS = dict(model_id="org/model", model_version="v1", tp_size=2, cache_dtype="bfloat16", block_size=4, num_layers=8)


def test_hashes_are_the_same_in_every_process():
    code = "from transfer_factory.keys import chain_hashes; print(chain_hashes(list(range(12)), 4))"
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": REPO, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert outs == {str(chain_hashes(list(range(12)), 4)) + "\n"}


def test_each_hash_depends_on_the_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1], "the same block after a different prefix must hash differently"
    assert chain_hashes([1, 2, 3, 4, 5, 6], 4) == a[:1], "a trailing partial block has no hash"
    assert chain_hashes([5, 6, 7, 8], 4, parent=a[0]) == a[1:]
    assert chain_hash_ids([7, 8]) != chain_hash_ids([8, 7])
    assert chain_hash_ids([7, 8])[1:] == chain_hash_ids([8], parent=chain_hash_ids([7])[0])


@pytest.mark.parametrize("field,value", [("model_id", "org/other"), ("model_version", "v2"), ("tp_size", 4),
                                         ("cache_dtype", "uint8"), ("block_size", 8), ("num_layers", 9),
                                         ("layout_version", 2)])
def test_every_namespace_field_changes_the_key(field, value):
    base = Namespace(**NS)
    other = Namespace(**{**NS, field: value})
    assert storage_key(base, "ab", 0, "k") != storage_key(other, "ab", 0, "k")


def test_keys_are_path_safe_and_validated():
    key = storage_key(Namespace(**NS), "ab" * 32, 1, "v_scale")
    ns, h, rank, kind = key.split("/")
    assert (h, rank, kind) == ("ab" * 32, "1", "v_scale") and ns.startswith("model-tp2-")
    assert storage_key(Namespace(**NS), "ab", 0, "latent_caches").endswith("/0/latent_caches")  # a group's tag
    for bad in ("X", "../k", "k/v", "", "latent-caches", 3):
        with pytest.raises(ValueError, match="must be one of"):
            storage_key(Namespace(**NS), "ab", 0, bad)
    with pytest.raises(ValueError, match="tp_size 0"):
        Namespace(**{**NS, "tp_size": 0})
    with pytest.raises(ValueError, match="token id 'a'"):
        chain_hashes([1, 2, "a", 4], 4)


def test_a_salt_changes_every_hash_and_no_salt_changes_none():
    from transfer_factory.keys import salt_tag, salted_hashes

    hashes = chain_hashes(list(range(12)), 4)
    assert salted_hashes(hashes, None) == hashes and salted_hashes(hashes, "") == hashes
    a, b = salted_hashes(hashes, "tenant-a"), salted_hashes(hashes, "tenant-b")
    assert not set(a) & set(b) and not set(a) & set(hashes)
    # fixed vector: SHA256("ctm-cache-salt\0" || len(salt) as 2 bytes big-endian || salt || h)
    h = "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"  # SHA256(b"x")
    assert salted_hashes([h], "tenant-a") == [
        __import__("hashlib").sha256(b"ctm-cache-salt\x00\x00\x08tenant-a" + bytes.fromhex(h)).hexdigest()]
    assert salt_tag(None) == "" and len(salt_tag("tenant-a")) == 16 and salt_tag("tenant-a") != salt_tag("tenant-b")
    assert "tenant-a" not in salt_tag("tenant-a")
    for bad in (b"bytes", 7, "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            salted_hashes(hashes, bad)
