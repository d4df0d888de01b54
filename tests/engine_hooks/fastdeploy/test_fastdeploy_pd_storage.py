"""FastDeploy's P/D through the store (``FD_PD_TRANSFER_VIA_STORAGE``, FastDeploy #7839), over our CTMs.

A prefill instance and a decode instance, each a FastDeploy-API façade with two CTMs launched from
FastDeploy's own line (README changes applied) with ``--splitwise_role prefill`` / ``decode``, share one
store (a file store, or a real Mooncake master).  P writes a request's whole cache with one GPU2STORAGE
task, keyed by chained block hashes, the last one ``<hash>:partial:<N>`` for a partial last block
(``write_all_cache_to_storage``); D reads every key with one STORAGE2GPU task into other block ids
(``read_cache_from_storage_for_pd``) and takes the request only if every block came back.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from cache_manager.queue.wire import SECRET_FILE_ENV
from tests.fastdeploy_pd_engine import FastDeployPDEngine, pd_storage_keys
from tests.fastdeploy_types import FDCacheStatus, FDReadStorageTask, FDWriteStorageTask

BLOCK = 4  # tests.fastdeploy_engine.SPEC.block_size


def decode_result(signals: list, keys: list) -> list[int]:
    """What FastDeploy's D does with the read's done signals (one per rank): the blocks if every key
    loaded on every rank, else [] (the request fails over)."""
    blocks = [list(s[3]) for s in signals]
    return blocks[0] if all(len(b) == len(keys) for b in blocks) else []


@pytest.fixture(scope="module", params=["file", "mooncake"])
def pd(request, tmp_path_factory):
    master = None
    if request.param == "file":
        root = str(tmp_path_factory.mktemp("pd-store"))
        env = {"FILE_BACKEND_STORAGE_DIR": root}  # FastDeploy's file backend's variable
    else:
        pytest.importorskip("mooncake.store")
        from scripts.local_mooncake_master import LocalMooncakeMaster
        master = LocalMooncakeMaster(lease_ttl_ms=500).start()
        root = None
        env = {"MOONCAKE_MASTER": master.master_server_addr, "MOONCAKE_TE_META_DATA_SERVER": master.metadata_server,
               "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
               "MOONCAKE_GLOBAL_SEGMENT_SIZE": "32mb", "MOONCAKE_LOCAL_BUFFER_SIZE": "16mb"}
    model = str(tmp_path_factory.mktemp("model"))  # one model, one TP size: one storage namespace
    saved = os.environ.get(SECRET_FILE_ENV)
    engines: list[FastDeployPDEngine] = []
    try:
        for role in ("prefill", "decode"):
            engines.append(FastDeployPDEngine(role, storage_backend=request.param, model_path=model, env=env))
            engines[-1].start()
        p, d = engines
        p.fill(1)
        d.fill(2)
        yield p, d, root
    finally:
        leftovers = [e.close() for e in engines]
        if master is not None:
            master.stop()
        if saved is None:
            os.environ.pop(SECRET_FILE_ENV, None)
        else:
            os.environ[SECRET_FILE_ENV] = saved
    assert leftovers == [[]] * len(engines), f"segments left in /dev/shm: {leftovers}"


def write(p: FastDeployPDEngine, task_id: str, keys: list, tokens: list, src: list) -> None:
    p.queue.put_transfer_task((FDCacheStatus.GPU2STORAGE, FDWriteStorageTask(
        task_id=task_id, keys=keys, token_ids=tokens, gpu_block_ids=src)))
    assert p.signals_for(p.tp) == [(FDCacheStatus.GPU2STORAGE, task_id, keys, src)] * p.tp  # one per rank: stored on every rank


def read(d: FastDeployPDEngine, task_id: str, keys: list, tokens: list, dst: list) -> list:
    d.queue.put_transfer_task((FDCacheStatus.STORAGE2GPU, FDReadStorageTask(
        task_id=task_id, keys=keys, token_ids=tokens, gpu_block_ids=dst, start_read_block_idx=0)))
    signals = d.signals_for(d.tp)  # FastDeploy's D waits for one per rank
    assert all(s[:3] == (FDCacheStatus.STORAGE2GPU, task_id, keys) for s in signals)
    return signals


def test_decode_reads_the_whole_request_prefill_wrote_bit_exact_its_partial_block_included(pd):
    p, d, root = pd
    tokens = list(range(1000, 1000 + 4 * BLOCK + 3))  # 4 full blocks and one of 3 tokens
    keys = pd_storage_keys(tokens, BLOCK)
    assert keys[-1].endswith(":partial:3") and ":" not in "".join(keys[:-1])
    src, dst = [3, 7, 1, 12, 5], [9, 2, 14, 0, 6]
    write(p, "req-1-write", keys, tokens, src)
    before = {k: v.copy() for k, v in d.views().items()}
    assert decode_result(read(d, "req-1-read", keys, tokens, dst), keys) == dst
    p_views = p.views()
    for (rank, kind, layer), view in d.views().items():
        # whole blocks move: every byte of each block, the partial one's slots past its 3 tokens too
        assert np.array_equal(view[dst], p_views[rank, kind, layer][src]), f"rank {rank} {kind} layer {layer}"
        others = [b for b in range(view.shape[0]) if b not in dst]
        assert np.array_equal(view[others], before[rank, kind, layer][others]), "a block not read changed"
    if root is not None:  # P and D (same model, same TP, roles apart) wrote and read one namespace
        assert os.listdir(root) == [str(p.spec.storage_namespace(p.model_path, "", p.tp))]


@pytest.mark.parametrize("missing", [2, 4])  # a full block's key; the partial block's key
def test_a_key_missing_from_the_store_reads_fewer_blocks_and_decode_fails_over(pd, missing):
    p, d, _ = pd
    tokens = list(range(5000 + 100 * missing, 5000 + 100 * missing + 4 * BLOCK + 1))
    keys = pd_storage_keys(tokens, BLOCK)
    src, dst = [2, 4, 6, 8, 10], [1, 3, 5, 7, 11]
    kept = [i for i in range(len(keys)) if i != missing]  # P's write of that one block never landed
    write(p, f"req-miss{missing}-write", [keys[i] for i in kept], tokens, [src[i] for i in kept])
    signals = read(d, f"req-miss{missing}-read", keys, tokens, dst)
    assert all(list(s[3]) == dst[:missing] for s in signals), signals  # the leading run, on every rank
    assert decode_result(signals, keys) == []
    p_views = p.views()
    for (rank, kind, layer), view in d.views().items():  # what was reported is P's bytes
        assert np.array_equal(view[dst[:missing]], p_views[rank, kind, layer][src[:missing]])
