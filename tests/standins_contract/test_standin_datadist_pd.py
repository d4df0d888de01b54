"""The LLM-DataDist stand-in's prefill/decode contract (tests/standins/llm_datadist): each documented
refusal and each injected failure, fast, mostly with two clusters in this process (P on device 0,
D on device 1); "peer gone" with a second process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.npu_helpers import forget_standin_modules, use_acl_standin

BLOCKS, ELEMS, LAYERS = 8, 16, 3  # per tensor [8 blocks, 16 bf16] = 32 bytes a block
BB = ELEMS * 2
P_ID, D_ID = 101, 202


class Pair:
    """A listening prefill cluster P with a keyed device cache of LAYERS x (K, V) tensors, and a
    decode cluster D (listening too) with a device cache of the same shape and a host cache."""

    def __init__(self, acl, dd, d_options=None):
        self.acl, self.dd = acl, dd
        assert acl.init() in (0, 100002)
        self.p = dd.LLMDataDist(dd.LLMRole.PROMPT, P_ID)
        self.p.init(self.options(0, 26000))
        self.d = dd.LLMDataDist(dd.LLMRole.DECODER, D_ID)
        self.d.init({**self.options(1, 26001), **(d_options or {})})
        self.pm, self.dm = self.p.cache_manager, self.d.cache_manager
        rng = np.random.default_rng(7)
        self.want = rng.integers(0, 256, (2 * LAYERS, BLOCKS, BB), dtype=np.uint8)
        self.p_addrs = [self.malloc(0, t) for t in self.want]
        self.d_addrs = [self.malloc(1, np.zeros((BLOCKS, BB), np.uint8)) for _ in range(2 * LAYERS)]
        self.host = [np.zeros((BLOCKS, BB), np.uint8) for _ in range(2 * LAYERS)]
        self.p_cache = self.pm.register_blocks_cache(self.desc(), self.p_addrs, dd.BlocksCacheKey(P_ID, 0))
        self.d_cache = self.dm.register_blocks_cache(self.desc(), self.d_addrs)
        self.h_cache = self.dm.register_blocks_cache(self.desc(host=True), [int(h.ctypes.data) for h in self.host],
                                                     remote_accessible=True)

    @staticmethod
    def options(dev, port, **extra):
        return {"llm.EnableCacheManager": "1", "ge.exec.deviceId": str(dev), "llm.listenIpInfo": f"127.0.0.1:{port}",
                "llm.MemPoolConfig": json.dumps({"memory_size": 100 * 2**20}), **extra}

    def desc(self, host=False, tensors=2 * LAYERS, blocks=BLOCKS):
        dd = self.dd
        return dd.CacheDesc(tensors, [blocks, ELEMS], dd.DataType.DT_BF16,
                            dd.Placement.HOST if host else dd.Placement.DEVICE)

    def malloc(self, dev, data):
        assert self.acl.rt.set_device(dev) == 0
        ptr, ret = self.acl.rt.malloc(data.nbytes, 0)
        assert ret == 0 and self.acl.rt.memcpy(ptr, data.nbytes, int(data.ctypes.data), data.nbytes, 1) == 0
        return ptr

    def device_bytes(self, dev, ptr):
        out = np.zeros((BLOCKS, BB), np.uint8)
        assert self.acl.rt.set_device(dev) == 0
        assert self.acl.rt.memcpy(int(out.ctypes.data), out.nbytes, ptr, out.nbytes, 2) == 0
        return out

    def info(self, remote=P_ID, port=26000, local_port=26001):
        info = self.dd.LLMClusterInfo()
        info.remote_cluster_id = remote
        info.append_local_ip_info("127.0.0.1", local_port)
        info.append_remote_ip_info("127.0.0.1", port)
        return info

    def link(self):
        ret, rets = self.d.link_clusters([self.info()], 1000)
        assert ret == self.dd.LLMStatusCode.LLM_SUCCESS, rets

    def key(self):
        return self.dd.BlocksCacheKey(P_ID, 0)

    def close(self):
        for x in (self.d, self.p):
            x.finalize()


@pytest.fixture
def standin(tmp_path, monkeypatch):
    acl_dir = use_acl_standin(tmp_path, monkeypatch)
    import acl
    import llm_datadist

    yield acl, llm_datadist, acl_dir
    forget_standin_modules()


@pytest.fixture
def pair(standin):
    acl, dd, _ = standin
    made = Pair(acl, dd)
    yield made
    made.close()


def knobs(standin, **values):
    (standin[2] / "llm_datadist_faults.json").write_text(json.dumps(values))


def code(exc_info):
    return exc_info.value.status_code.name


def test_link_clusters_answers_per_cluster_and_refuses_bad_arguments(pair):
    dd, S = pair.dd, pair.dd.LLMStatusCode
    with pytest.raises(TypeError):
        pair.d.link_clusters(pair.info())
    with pytest.raises(TypeError):
        pair.d.link_clusters([object()])
    unnamed = dd.LLMClusterInfo()
    unnamed.append_remote_ip_info("127.0.0.1", 26000)
    with pytest.raises(ValueError, match="remote_cluster_id"):
        pair.d.link_clusters([unnamed])
    no_local = dd.LLMClusterInfo()
    no_local.remote_cluster_id = P_ID
    no_local.append_remote_ip_info("127.0.0.1", 26000)
    with pytest.raises(ValueError, match="one remote and one local"):
        pair.d.link_clusters([no_local])
    with pytest.raises(ValueError):
        pair.d.link_clusters([pair.info()], 0)
    with pytest.raises(ValueError):
        pair.info().append_remote_ip_info("not-an-ip", 1)
    with pytest.raises(ValueError):
        pair.info().append_remote_ip_info("127.0.0.1", 70000)
    assert pair.d.link_clusters([pair.info()] * 17) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * 17)
    start = time.monotonic()
    ret, rets = pair.d.link_clusters([pair.info(), pair.info(remote=999, port=26999)], 2000)
    assert (ret, rets) == (S.LLM_LINK_FAILED, [S.LLM_SUCCESS, S.LLM_LINK_FAILED])
    assert time.monotonic() - start < 0.5, "nobody listening is refused at once"
    assert pair.d.link_clusters([pair.info()]) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    assert pair.d.link_clusters([pair.info(remote=303)])[1] == [S.LLM_LINK_FAILED], "another cluster listens there"


def test_a_transfer_needs_a_link_from_the_caller_and_moves_the_bytes_bit_exact(pair):
    with pytest.raises(pair.dd.LLMException) as exc:
        pair.dm.pull_blocks(pair.key(), pair.d_cache, [1, 2], [5, 6])
    assert code(exc) == "LLM_NOT_YET_LINK"
    pair.link()
    with pytest.raises(pair.dd.LLMException) as exc:  # P never linked to D: the client moves the bytes
        pair.pm.push_cache(pair.dd.CacheKeyByIdAndIndex(D_ID, pair.d_cache.cache_id, 0), pair.p_cache, 0)
    assert code(exc) == "LLM_NOT_YET_LINK"
    pair.dm.pull_blocks(pair.key(), pair.d_cache, [1, 2, 7], [5, 6, 0])
    for t, ptr in enumerate(pair.d_addrs):
        got = pair.device_bytes(1, ptr)
        assert np.array_equal(got[[5, 6, 0]], pair.want[t][[1, 2, 7]])
        assert not got[[1, 2, 3, 4, 7]].any(), "nothing outside the destination blocks"
    pair.dm.pull_blocks(pair.key(), pair.h_cache, (3,), (4,), src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
    for layer, (src_layer) in enumerate((1, 2)):
        for kv in range(2):
            assert np.array_equal(pair.host[2 * layer + kv][4], pair.want[2 * src_layer + kv][3])
    assert not pair.host[4].any() and not pair.host[5].any(), "layer 2 of the destination untouched"
    assert pair.dd.standin_calls()["transfer_bytes"] == (3 * 6 + 4) * BB


def test_argument_and_layer_range_refusals(pair):
    pair.link()
    dm, key, dst, LE = pair.dm, pair.key(), pair.d_cache, pair.dd.LLMException
    for bad in ([1.0], "12", None):
        with pytest.raises((TypeError, AttributeError)):
            dm.pull_blocks(key, dst, bad, [1])
    with pytest.raises(AttributeError):
        dm.pull_blocks(key, None, [1], [1])
    with pytest.raises(ValueError, match="can not be empty"):
        dm.pull_blocks(key, dst, [], [])
    with pytest.raises(ValueError):
        dm.pull_blocks(key, dst, [1, 2], [1])
    with pytest.raises(ValueError, match="twice"):
        dm.pull_blocks(key, dst, [1, 2], [3, 3])
    with pytest.raises(ValueError, match="outside"):
        dm.pull_blocks(key, dst, [1], [BLOCKS])
    with pytest.raises(LE) as exc:
        dm.pull_blocks(key, dst, [BLOCKS], [1])
    assert code(exc) == "LLM_PARAM_INVALID", "a remote index is the runtime's to refuse"
    with pytest.raises(TypeError):
        dm.pull_blocks(key, dst, [1], [1], src_layer_range=[0, 1], dst_layer_range=[0, 1])
    with pytest.raises(ValueError, match="tensor_num_per_layer"):
        dm.pull_blocks(key, dst, [1], [1], tensor_num_per_layer=2 * LAYERS + 1)
    for ranges, tnpl in (((range(0, 3, 2), range(0, 3, 2)), 2), ((range(0, 2), range(0, 1)), 2),
                         ((range(0, 1), None), 2), ((range(0, 4), range(0, 4)), 2), ((range(0, 1), range(0, 1)), 4)):
        with pytest.raises(LE) as exc:
            dm.pull_blocks(key, dst, [1], [1], src_layer_range=ranges[0], dst_layer_range=ranges[1],
                           tensor_num_per_layer=tnpl)
        assert code(exc) == "LLM_PARAM_INVALID", ranges
    pair.p.link_clusters([pair.info(remote=D_ID, port=26001, local_port=26000)])
    target = pair.dd.CacheKeyByIdAndIndex(D_ID, pair.d_cache.cache_id, 1)
    with pytest.raises(LE, match="must be equal"):  # a push: equal ranges only
        pair.pm.push_cache(target, pair.p_cache, 0, src_layer_range=range(0, 1), dst_layer_range=range(1, 2))
    with pytest.raises(ValueError, match="only -1"):
        pair.pm.push_cache(target, pair.p_cache, 0, size=BB)
    pair.pm.push_cache(target, pair.p_cache, 2, src_layer_range=range(1, 2), dst_layer_range=range(1, 2))
    assert np.array_equal(pair.device_bytes(1, pair.d_addrs[2])[1], pair.want[2][2])
    assert np.array_equal(pair.device_bytes(1, pair.d_addrs[3])[1], pair.want[3][2])
    assert not pair.device_bytes(1, pair.d_addrs[0])[1].any() and not pair.device_bytes(1, pair.d_addrs[4])[1].any()


def test_placements_memory_pool_and_registration_order(standin):
    acl, dd, _ = standin
    pair = Pair(acl, dd, d_options={"llm.MemPoolConfig": json.dumps({"memory_size": 2**20})})
    try:
        pair.link()
        late = pair.dm.register_blocks_cache(pair.desc(), [pair.malloc(1, np.zeros((BLOCKS, BB), np.uint8))
                                                           for _ in range(2 * LAYERS)])
        with pytest.raises(dd.LLMException, match="registered after the link"):
            pair.dm.pull_blocks(pair.key(), late, [1], [1])
        with pytest.raises(dd.LLMException) as exc:
            pair.dm.pull_blocks(pair.key(), pair.h_cache, [1], [1])
        assert code(exc) == "LLM_FEATURE_NOT_ENABLED", "D2H needs a device memory pool of 100 MB on the host side"
        host = np.zeros((BLOCKS, BB), np.uint8)
        plain = pair.dm.register_blocks_cache(pair.desc(host=True, tensors=1), [int(host.ctypes.data)])
        with pytest.raises(dd.LLMException, match="remote_accessible"):
            pair.dm.pull_blocks(pair.key(), plain, [1], [1], src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                                tensor_num_per_layer=1)
        with pytest.raises(ValueError, match="PROMPT"):
            pair.dm.register_blocks_cache(pair.desc(), pair.d_addrs, dd.BlocksCacheKey(D_ID, 0))
        with pytest.raises(dd.LLMException, match="already names"):
            pair.pm.register_blocks_cache(pair.desc(), pair.p_addrs, dd.BlocksCacheKey(P_ID, 0))
    finally:
        pair.close()


def test_host_to_device_needs_blocks_caches_for_blocks_calls_and_contiguous_ones_for_push_cache(pair):
    dd = pair.dd
    hp = np.arange(BLOCKS * BB, dtype=np.uint8).reshape(BLOCKS, BB) % 251
    p_host = pair.pm.register_blocks_cache(pair.desc(host=True, tensors=1), [int(hp.ctypes.data)],
                                           dd.BlocksCacheKey(P_ID, 5), remote_accessible=True)
    contiguous = pair.pm.register_cache(pair.desc(host=True, tensors=1), [int(hp.ctypes.data)], remote_accessible=True)
    d_one = pair.dm.register_blocks_cache(pair.desc(tensors=1), [pair.malloc(1, np.zeros((BLOCKS, BB), np.uint8))])
    d_contiguous = pair.dm.register_cache(pair.desc(tensors=1), [pair.malloc(1, np.zeros((BLOCKS, BB), np.uint8))])
    pair.link()
    pair.dm.pull_blocks(dd.BlocksCacheKey(P_ID, 5), d_one, [3], [0], tensor_num_per_layer=1)  # H2D, two blocks caches
    assert np.array_equal(pair.device_bytes(1, d_one.tensor_addrs[0])[0], hp[3])
    with pytest.raises(dd.LLMException, match="host to host"):
        pair.dm.pull_blocks(dd.BlocksCacheKey(P_ID, 5), pair.h_cache, [3], [0], src_layer_range=range(0, 1),
                            dst_layer_range=range(0, 1), tensor_num_per_layer=1)
    pair.p.link_clusters([pair.info(remote=D_ID, port=26001, local_port=26000)])
    with pytest.raises(dd.LLMException, match="contiguous"):  # host-side push: contiguous caches only
        pair.pm.push_cache(dd.CacheKeyByIdAndIndex(D_ID, d_one.cache_id, 0), p_host, 1, tensor_num_per_layer=1)
    assert contiguous.cache_id and d_contiguous.cache_id  # registered before the link: usable both


def test_a_transfer_past_sync_kv_timeout_fails_and_breaks_the_link_until_relinked(standin):
    acl, dd, _ = standin
    pair = Pair(acl, dd, d_options={"llm.SyncKvCacheWaitTime": "200"})
    try:
        pair.link()
        knobs(standin, stall_ms={"pull_blocks": 5000})
        start = time.monotonic()
        with pytest.raises(dd.LLMException) as exc:
            pair.dm.pull_blocks(pair.key(), pair.d_cache, [1], [1])
        assert code(exc) == "LLM_TIMEOUT" and 0.19 < time.monotonic() - start < 0.6
        knobs(standin)
        with pytest.raises(dd.LLMException, match="unlink and link again") as exc:
            pair.dm.pull_blocks(pair.key(), pair.d_cache, [1], [1])
        assert code(exc) == "LLM_LINK_FAILED"
        S = dd.LLMStatusCode
        assert pair.d.unlink_clusters([pair.info()]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        pair.link()
        pair.dm.pull_blocks(pair.key(), pair.d_cache, [1], [1])
    finally:
        pair.close()
    with pytest.raises(ValueError):
        dd.LLMDataDist(dd.LLMRole.DECODER, 9).init(Pair.options(0, 26009, **{"llm.SyncKvCacheWaitTime": "0"}))


def test_link_down_and_unreachable_knobs(pair, standin):
    dd, S = pair.dd, pair.dd.LLMStatusCode
    pair.link()
    knobs(standin, link_down=[P_ID])
    with pytest.raises(dd.LLMException, match="down") as exc:
        pair.dm.pull_blocks(pair.key(), pair.d_cache, [1], [1])
    assert code(exc) == "LLM_LINK_FAILED"
    assert pair.p.link_clusters([pair.info(remote=D_ID, port=26001, local_port=26000)])[0] == S.LLM_SUCCESS
    knobs(standin, unreachable=[D_ID])
    pair.p.unlink_clusters([pair.info(remote=D_ID, port=26001)], force=True)
    start = time.monotonic()
    assert pair.p.link_clusters([pair.info(remote=D_ID, port=26001, local_port=26000)], 300)[0] == S.LLM_LINK_FAILED
    assert 0.29 < time.monotonic() - start < 0.8, "no answer: it fails when its timeout ends"


def test_unlink_roles_and_a_server_tearing_the_link_down(pair):
    dd, S = pair.dd, pair.dd.LLMStatusCode
    assert pair.d.unlink_clusters([pair.info()]) == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    pair.link()
    assert pair.p.unlink_clusters([pair.info(remote=D_ID)])[0] == S.LLM_UNLINK_FAILED, "the client's to make"
    assert pair.p.unlink_clusters([pair.info(remote=D_ID)], force=True)[0] == S.LLM_SUCCESS
    with pytest.raises(dd.LLMException, match="torn down") as exc:
        pair.dm.pull_blocks(pair.key(), pair.d_cache, [1], [1])
    assert code(exc) == "LLM_LINK_FAILED"


def test_init_options_and_cluster_uniqueness(pair):
    dd = pair.dd
    for bad in ({"llm.listenIpInfo": "127.0.0.1"}, {"llm.MemPoolConfig": "{"}, {"llm.MemPoolConfig": '{"memory_size": 0}'},
                {"llm.SyncKvCacheWaitTime": "x"}):
        with pytest.raises(ValueError):
            dd.LLMDataDist(dd.LLMRole.PROMPT, 7).init({**Pair.options(0, 26100), **bad})
    with pytest.raises(dd.LLMException, match="in use"):
        dd.LLMDataDist(dd.LLMRole.PROMPT, P_ID).init(Pair.options(0, 26100))
    with pytest.raises(dd.LLMException, match="already listened"):
        dd.LLMDataDist(dd.LLMRole.PROMPT, 8).init(Pair.options(0, 26000))
    with pytest.raises(dd.LLMException):
        dd.LLMDataDist(dd.LLMRole.PROMPT, 8).link_clusters([pair.info()])
    with pytest.raises(dd.LLMException) as exc:  # the register limits still hold: 6 + 251 > 256 addresses
        pair.pm.register_blocks_cache(pair.desc(tensors=251), pair.p_addrs[:1] * 251)
    assert code(exc) == "LLM_EXCEED_LIMIT"


def test_register_cache_keys_and_remove_cache_key(pair):
    dd = pair.dd
    key = dd.CacheKey(P_ID, req_id=42)
    bound = pair.pm.register_cache(pair.desc(tensors=1), pair.p_addrs[:1], [key])
    with pytest.raises(dd.LLMException) as exc:
        pair.pm.register_cache(pair.desc(tensors=1), pair.p_addrs[1:2], [dd.CacheKey(P_ID, 42)])
    assert code(exc) == "LLM_REPEAT_REQUEST"
    d_one = pair.dm.register_cache(pair.desc(tensors=1), [pair.malloc(1, np.zeros((BLOCKS, BB), np.uint8))])
    pair.link()
    pair.dm.pull_cache(dd.CacheKey(P_ID, 42), d_one, 0, tensor_num_per_layer=1)
    assert np.array_equal(pair.device_bytes(1, d_one.tensor_addrs[0])[0], pair.want[0][0])
    with pytest.raises(dd.LLMException, match="PROMPT"):
        pair.dm.remove_cache_key(dd.CacheKey(D_ID, 1))
    pair.pm.remove_cache_key(key)
    pair.pm.remove_cache_key(key)  # not bound any more: a no-op
    with pytest.raises(dd.LLMException) as exc:
        pair.dm.pull_cache(dd.CacheKey(P_ID, 42), d_one, 0, tensor_num_per_layer=1)
    assert code(exc) == "LLM_KV_CACHE_NOT_EXIST" and bound.cache_id


def test_link_by_rank_table_needs_register_mem_status_ok_before_use(pair, standin):
    dd, S = pair.dd, pair.dd.RegisterMemStatus
    with pytest.raises(ValueError):
        pair.d.link("c", {D_ID: 0, P_ID: 1, 1: 2, 2: 3, 3: 4}, "{}")
    with pytest.raises(ValueError):
        pair.d.link("c", {D_ID: 0, P_ID: 1}, "not json")
    with pytest.raises(dd.LLMException):
        pair.d.query_register_mem_status(99)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("p", pair.p.link("comm", {D_ID: 0, P_ID: 1}, "{}")))
    worker.start()
    comm = pair.d.link("comm", {D_ID: 0, P_ID: 1}, "{}")
    worker.join(timeout=10)
    assert "p" in out
    knobs(standin, preparing_queries=1)
    with pytest.raises(dd.LLMException, match="query_register_mem_status") as exc:
        pair.dm.pull_blocks(pair.key(), pair.d_cache, [1], [1])
    assert code(exc) == "LLM_NOT_YET_LINK"
    assert pair.d.query_register_mem_status(comm) == S.PREPARING
    assert pair.d.query_register_mem_status(comm) == S.OK
    pair.dm.pull_blocks(pair.key(), pair.d_cache, [4], [4])
    assert np.array_equal(pair.device_bytes(1, pair.d_addrs[0])[4], pair.want[0][4])
    knobs(standin, mem_status="FAILED")
    assert pair.p.query_register_mem_status(out["p"]) == S.FAILED
    pair.d.unlink(comm)
    with pytest.raises(dd.LLMException):
        pair.d.unlink(comm)


SERVER = """
import json, sys, time
import acl, llm_datadist as dd
acl.init(); acl.rt.set_device(0)
ptr, _ = acl.rt.malloc(4096, 0)
p = dd.LLMDataDist(dd.LLMRole.PROMPT, 303)
p.init({"llm.EnableCacheManager": "1", "ge.exec.deviceId": "0", "llm.listenIpInfo": "127.0.0.1:26300"})
p.cache_manager.register_blocks_cache(dd.CacheDesc(1, [8, 16], dd.DataType.DT_BF16), [ptr], dd.BlocksCacheKey(303, 0))
print("ready", flush=True)
time.sleep(60)
"""


def test_a_peer_whose_process_died_fails_every_transfer_and_the_unlink_must_be_forced(pair):
    dd, S = pair.dd, pair.dd.LLMStatusCode
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, env=dict(os.environ))
    try:
        assert server.stdout.readline().strip() == b"ready"
        assert pair.d.link_clusters([pair.info(remote=303, port=26300)])[0] == S.LLM_SUCCESS
        one = pair.dm.register_blocks_cache(pair.desc(tensors=1), pair.d_addrs[:1])
        pair.d.unlink_clusters([pair.info(remote=303, port=26300)])
        pair.d.link_clusters([pair.info(remote=303, port=26300)])
        pair.dm.pull_blocks(dd.BlocksCacheKey(303, 0), one, [1], [2], tensor_num_per_layer=1)
    finally:
        server.kill()
        server.wait(timeout=10)
    with pytest.raises(dd.LLMException, match=r"peer cluster 303 \(pid \d+\) is gone") as exc:
        pair.dm.pull_blocks(dd.BlocksCacheKey(303, 0), one, [1], [2], tensor_num_per_layer=1)
    assert code(exc) == "LLM_LINK_FAILED"
    assert pair.d.unlink_clusters([pair.info(remote=303, port=26300)])[0] == S.LLM_UNLINK_FAILED
    assert pair.d.unlink_clusters([pair.info(remote=303, port=26300)], force=True)[0] == S.LLM_SUCCESS
