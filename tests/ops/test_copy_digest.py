"""The block copy that hashes each block it stored (``_block_copy.copy_blocks_digest``, the same-host
P/D pull with digests on): the bytes land as ``copy_blocks`` lands them and every digest is XXH3-64
of the block written; bad ids raise before a byte moves."""
import numpy as np
import pytest
import xxhash

from ops import _block_copy
from transfer_factory.peer.digests import xxh3_address


def caches(layers: int, blocks: int, block_bytes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.random.default_rng(seed).integers(0, 256, (layers, blocks, block_bytes), dtype=np.uint8)
    return a, np.array([a[layer].ctypes.data for layer in range(layers)], dtype=np.int64)


@pytest.mark.parametrize("block_bytes,threads", [(4096, 1), (4096, 2), (300_000, 2)])
def test_every_block_lands_and_its_digest_is_xxh3_of_what_landed(block_bytes, threads):
    src, sb = caches(3, 12, block_bytes, 1)
    dst, db = caches(3, 12, block_bytes, 2)
    caps = np.full(3, 12, dtype=np.int64)
    src_ids, dst_ids = [5, 0, 11, 3], [1, 7, 2, 9]
    out = np.zeros(3 * 4, dtype=np.uint64)
    _block_copy.copy_blocks_digest(sb, caps, block_bytes, src_ids, "src", db, caps, block_bytes, dst_ids, "dst",
                                   block_bytes, threads, xxh3_address(), out)
    assert np.array_equal(dst[:, dst_ids], src[:, src_ids])
    want = [xxhash.xxh3_64_intdigest(dst[layer, b].tobytes()) for layer in range(3) for b in dst_ids]
    assert out.tolist() == want


def test_a_bad_id_raises_and_nothing_is_copied():
    src, sb = caches(2, 4, 1024, 3)
    dst, db = caches(2, 4, 1024, 4)
    before = dst.copy()
    caps = np.full(2, 4, dtype=np.int64)
    out = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError):
        _block_copy.copy_blocks_digest(sb, caps, 1024, [0, 9], "src", db, caps, 1024, [1, 2], "dst", 1024, 1,
                                       xxh3_address(), out)
    with pytest.raises(ValueError, match="out holds"):
        _block_copy.copy_blocks_digest(sb, caps, 1024, [0], "src", db, caps, 1024, [1], "dst", 1024, 1,
                                       xxh3_address(), out)
    assert np.array_equal(dst, before)
