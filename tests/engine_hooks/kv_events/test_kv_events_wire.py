"""The KV event wire format, byte for byte as vLLM's msgspec structs encode it (fixed vectors built by
hand from the msgpack spec), in both layouts; decoding tolerates what newer vLLM versions add."""
import msgpack
import pytest

from engine_hooks.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch,
                                    encode_batch, hash_key, wire_hash)

H1 = "11" * 32
H2 = "22" * 32
TAG = "0123456789abcdef"


def s(text: str) -> bytes:
    """A msgpack fixstr (< 32 bytes)."""
    return bytes([0xa0 | len(text)]) + text.encode()


def bin32(hex_hash: str) -> bytes:
    return b"\xc4\x20" + bytes.fromhex(hex_hash)


NIL = b"\xc0"
TS = b"\xcb" + bytes.fromhex("3ff8000000000000")  # 1.5 as float64, as msgspec writes every float

BATCH = KVEventBatch(1.5, [BlockStored([wire_hash(H1), wire_hash(H2)], wire_hash(H2), [], 16, None, "CPU", None,
                                       [(TAG,), None]),
                           BlockRemoved([wire_hash(H1)], "STORAGE"), AllBlocksCleared()], 0)


def test_array_layout_is_vllms_legacy_bytes():
    """vLLM <= 0.23: [ts, events, dp_rank]; each event an array, tag first, every field, nil when unset."""
    stored = (b"\x99" + s("BlockStored") + b"\x92" + bin32(H1) + bin32(H2) + bin32(H2) + b"\x90" + b"\x10"
              + NIL + s("CPU") + NIL + b"\x92" + b"\x91" + s(TAG) + NIL)
    removed = b"\x93" + s("BlockRemoved") + b"\x91" + bin32(H1) + s("STORAGE")
    cleared = b"\x91" + b"\xb0AllBlocksCleared"
    assert encode_batch(BATCH, "array") == b"\x93" + TS + b"\x93" + stored + removed + cleared + b"\x00"


def test_map_layout_is_vllms_current_bytes():
    """vLLM after PR #42892: the batch stays an array; events are maps keyed by field name after
    "type"; fields without a default always present, extra_keys only when set."""
    stored = (b"\x89" + s("type") + s("BlockStored") + s("block_hashes") + b"\x92" + bin32(H1) + bin32(H2)
              + s("parent_block_hash") + bin32(H2) + s("token_ids") + b"\x90" + s("block_size") + b"\x10"
              + s("lora_id") + NIL + s("medium") + s("CPU") + s("lora_name") + NIL
              + s("extra_keys") + b"\x92" + b"\x91" + s(TAG) + NIL)
    removed = b"\x83" + s("type") + s("BlockRemoved") + s("block_hashes") + b"\x91" + bin32(H1) + s("medium") \
        + s("STORAGE")
    cleared = b"\x81" + s("type") + b"\xb0AllBlocksCleared"
    assert encode_batch(BATCH, "map") == b"\x93" + TS + b"\x93" + stored + removed + cleared + b"\x00"
    unsalted = KVEventBatch(1.5, [BlockStored([wire_hash(H1)], None, [], 16, None, "CPU", None)], None)
    assert b"extra_keys" not in encode_batch(unsalted, "map")
    assert encode_batch(unsalted, "map").endswith(NIL)  # data_parallel_rank nil: an array is never thinned


@pytest.mark.parametrize("layout", ["array", "map"])
def test_a_batch_round_trips_in_both_layouts(layout):
    batch, unknown = decode_batch(encode_batch(BATCH, layout))
    assert unknown == 0
    assert batch == BATCH
    assert [hash_key(h) for h in batch.events[0].block_hashes] == [H1, H2]


def test_decode_takes_what_newer_and_older_vllms_send():
    """Longer arrays (group_idx, cache-spec fields), unknown map keys, int hashes, a short pre-medium
    array and an event type this decoder does not know (skipped and counted)."""
    payload = msgpack.packb([2.0, [
        ["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU", None, None, 0, "full_attention", None],
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "CPU", "group_idx": 0, "locality": "x"},
        ["BlockStored", [8], 7, [5, 6, 7, 8], 4, None],
        {"type": "BlockMigrated", "block_hashes": [9]},
    ], 3], use_bin_type=True)
    batch, unknown = decode_batch(payload)
    assert unknown == 1 and batch.data_parallel_rank == 3
    first, removed, old = batch.events
    assert (first.block_hashes, first.medium, first.token_ids) == ([7], "GPU", [1, 2, 3, 4])
    assert (hash_key(removed.block_hashes[0]), removed.medium) == ("01" * 32, "CPU")
    assert (old.parent_block_hash, old.medium, old.extra_keys) == (7, None, None)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="block hash 'xyz' is not hex"):
        wire_hash("xyz")
    with pytest.raises(ValueError, match="block hash '' is empty"):
        wire_hash("")
    with pytest.raises(ValueError, match="layout 'json' must be one of"):
        encode_batch(BATCH, "json")
    with pytest.raises(ValueError, match="BlockStored lacks"):
        decode_batch(msgpack.packb([1.0, [["BlockStored", [1]]], None]))
    with pytest.raises(ValueError, match="not msgpack|not \\[ts"):
        decode_batch(b"\x01")
