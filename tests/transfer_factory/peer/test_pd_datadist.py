"""The LLM-DataDist peer transport (transfer_factory/peer/datadist.py) between two real rank
processes over the contract stand-ins (tests/standins/llm_datadist on tests/standins/acl): a
prefill rank on device 0 and a decode rank on device 1, each with K/V caches interleaved per layer
(and a 'scale' kind of another block size: a second cache group).  Bytes are checked bit for bit;
faults (a retracted handle, a link down, a timeout, a killed prefill rank) fail in time, naming the
peer.  The test process plays both engines: it owns the exposure board and the layer board."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cache_manager.layer_progress import pack
from ops.shm import SharedMemorySegment
from tests.npu_helpers import STANDINS, forget_standin_modules
from tests.transfer_factory.peer.test_pd_datadist_agent import Agent, AgentError
from transfer_factory.peer.handles import BOARD_BYTES, ExposureBoard, holds

KINDS = {"key": 64, "value": 64, "scale": 16}  # bytes of one block of one layer
LAYERS, BLOCKS, HOST_BLOCKS = 3, 16, 8
LAYER_BOARD_WORDS = 64


class Setup:
    """The engines' boards and a linked prefill/decode pair of rank processes."""

    def __init__(self, tag: str, p_port: int, d_port: int, sync_ms: int = 1000):
        self.board_seg = SharedMemorySegment(f"pdtest.{os.getpid()}.{tag}.board", BOARD_BYTES, create=True)
        self.layer_seg = SharedMemorySegment(f"pdtest.{os.getpid()}.{tag}.layers", LAYER_BOARD_WORDS * 8, create=True)
        self.board = ExposureBoard(np.frombuffer(self.board_seg.buf, dtype=np.int64), "prefill-0")
        self.layer_words = np.frombuffer(self.layer_seg.buf, dtype=np.int64)
        self.p, self.d = Agent(), Agent()
        common = dict(kinds=KINDS, layers=LAYERS, num_blocks=BLOCKS, host_blocks=HOST_BLOCKS, sync_ms=sync_ms)
        self.p_params = self.p.call("setup", role="prefill", dev=0, cluster=1000 + p_port, port=p_port, seed=1,
                                    board=self.board_seg.name, **common)
        self.d_params = self.d.call("setup", role="decode", dev=1, cluster=1000 + d_port, port=d_port, seed=2,
                                    layer_board=self.layer_seg.name, **common)
        self.d.call("link", name="prefill-0", params=self.p_params)

    def blocks(self, agent: Agent, placement: str = "device") -> dict:
        """(kind, layer) -> [blocks, block bytes] array of that rank's memory."""
        return {(k, l): np.frombuffer(agent.call("blocks", kind=k, layer=l, placement=placement),
                                      dtype=np.uint8).reshape(-1, bb) for k, bb in KINDS.items() for l in range(LAYERS)}

    def close(self) -> None:
        for agent in (self.d, self.p):
            agent.stop()
        self.board = None
        self.layer_words = None
        for seg in (self.board_seg, self.layer_seg):
            seg.close()
            seg.unlink()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The stand-ins importable here and in the spawned ranks; one $ACL_STANDIN_DIR for the module."""
    with pytest.MonkeyPatch.context() as mp:
        acl_dir = tmp_path_factory.mktemp("acl")
        mp.syspath_prepend(STANDINS)
        mp.setenv("ACL_STANDIN_DIR", str(acl_dir))
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (STANDINS, os.environ.get("PYTHONPATH")) if p))
        yield acl_dir
        forget_standin_modules()


@pytest.fixture(scope="module")
def pd(env):
    made = Setup("m", 27000, 27001)
    yield made
    made.close()


@pytest.fixture
def knobs(env):
    path = Path(env) / "llm_datadist_faults.json"

    def write(**values) -> None:
        path.write_text(json.dumps(values))

    yield write
    path.unlink(missing_ok=True)


def test_pulls_into_device_and_host_blocks_are_bit_exact_and_touch_nothing_else(pd):
    src = pd.blocks(pd.p)
    before = pd.blocks(pd.d)
    moved = pd.d.call("pull", name="prefill-0", src=[1, 4, 5, 9], dst=[2, 3, 10, 15], layers=(0, LAYERS))
    assert moved == 4 * LAYERS * sum(KINDS.values())
    after = pd.blocks(pd.d)
    for key, data in after.items():
        assert np.array_equal(data[[2, 3, 10, 15]], src[key][[1, 4, 5, 9]]), key
        others = [b for b in range(BLOCKS) if b not in (2, 3, 10, 15)]
        assert np.array_equal(data[others], before[key][others]), f"{key}: a block outside the destination changed"
    pd.d.call("pull", name="prefill-0", src=[7], dst=[0], layers=(1, 3))  # a layer range
    ranged = pd.blocks(pd.d)
    for (kind, layer), data in ranged.items():
        want = src[(kind, layer)][7] if layer >= 1 else after[(kind, layer)][0]
        assert np.array_equal(data[0], want), (kind, layer)
    pd.d.call("pull", name="prefill-0", src=[11, 12, 0], dst=[5, 6, 7], layers=(0, LAYERS), placement="host")
    host = pd.blocks(pd.d, "host")
    for key, data in host.items():  # D2H into swap slots
        assert np.array_equal(data[[5, 6, 7]], src[key][[11, 12, 0]]), key
        assert not data[:5].any(), f"{key}: a swap slot outside the destination changed"


def test_a_layerwise_push_is_bit_exact_and_publishes_each_layer_after_its_bytes(pd):
    pd.p.call("link", name="decode-0", params=pd.d_params)
    src, before = pd.blocks(pd.p), pd.blocks(pd.d)
    seq, slot = 77, 5
    for layer in range(LAYERS):
        pd.p.call("push", name="decode-0", src=[3, 8], dst=[12, 13], layers=(layer, layer + 1))
        pd.p.call("write_layer_word", name="decode-0", index=slot, value=pack(seq, layer + 1))
        assert int(pd.layer_words[slot]) == pack(seq, layer + 1), "the layer is published on D's layer board"
        now = pd.blocks(pd.d)
        for (kind, l), data in now.items():
            want = src[(kind, l)][[3, 8]] if l <= layer else before[(kind, l)][[12, 13]]
            assert np.array_equal(data[[12, 13]], want), (kind, l, layer)
    assert int(pd.layer_words[slot + 1]) == 0, "no other word written"


def test_a_handle_retracted_while_its_blocks_are_pulled_is_not_counted(pd, knobs):
    live = pd.board.expose("req-live")
    assert holds(pd.d.call("read_board", name="prefill-0", slot=live.slot), live)
    pd.d.call("pull", name="prefill-0", src=[2], dst=[4], layers=(0, LAYERS))
    assert holds(pd.d.call("read_board", name="prefill-0", slot=live.slot), live), "nothing retracted: it counts"
    doomed = pd.board.expose("req-doomed")
    assert holds(pd.d.call("read_board", name="prefill-0", slot=doomed.slot), doomed), "checked before, as a pull does"
    knobs(stall_ms={"pull_blocks": 300})
    pull = threading.Thread(target=pd.d.call, kwargs=dict(cmd="pull", name="prefill-0", src=[2], dst=[4],
                                                          layers=(0, LAYERS)))
    pull.start()
    time.sleep(0.1)
    assert pd.board.retract(doomed)  # the engine retracts (and may reuse the blocks) mid-pull
    pull.join(timeout=10)
    knobs()
    word = pd.d.call("read_board", name="prefill-0", slot=doomed.slot)
    assert not holds(word, doomed), "a pull that overlapped the retraction must not count"
    pd.board.retract(live)


def test_a_link_down_or_a_stalled_transfer_fails_in_time_naming_the_peer_and_relinking_recovers(pd, knobs):
    knobs(link_down=[pd.p_params["cluster_id"]])
    start = time.monotonic()
    with pytest.raises(AgentError, match="peer prefill-0 .*down") as exc:
        pd.d.call("pull", name="prefill-0", src=[1], dst=[1], layers=(0, LAYERS))
    assert exc.value.status == "LLM_LINK_FAILED" and time.monotonic() - start < 1.0
    with pytest.raises(AgentError, match="peer prefill-0: not linked"):  # torn down: link again
        pd.d.call("pull", name="prefill-0", src=[1], dst=[1], layers=(0, LAYERS))
    knobs(stall_ms={"pull_blocks": 10_000})
    pd.d.call("link", name="prefill-0", params=pd.p_params)
    start = time.monotonic()
    with pytest.raises(AgentError, match="peer prefill-0 .*timed out") as exc:
        pd.d.call("pull", name="prefill-0", src=[1], dst=[1], layers=(0, LAYERS))
    assert exc.value.status == "LLM_TIMEOUT" and 0.9 < time.monotonic() - start < 2.0, "bounded by sync_kv_timeout"
    knobs()
    pd.d.call("link", name="prefill-0", params=pd.p_params)
    pd.d.call("pull", name="prefill-0", src=[1], dst=[1], layers=(0, LAYERS))


def test_peers_that_cannot_exchange_whole_blocks_are_refused_at_link(pd):
    for field, value, why in (("tp", 2, "different TP sizes"), ("num_layers", LAYERS + 1, "num_layers differs"),
                              ("port", "x", "port")):
        with pytest.raises(AgentError, match=why):
            pd.d.call("link", name="other", params={**pd.p_params, field: value})
    groups = [dict(g, block_bytes=g["block_bytes"] * 2) for g in pd.p_params["groups"]]
    with pytest.raises(AgentError, match="cache groups differ"):
        pd.d.call("link", name="other", params={**pd.p_params, "groups": groups})
    with pytest.raises(AgentError, match=r"link_clusters to cluster \d+ at 127.0.0.1:27999 failed \(LLM_LINK_FAILED\)"):
        pd.d.call("link", name="other", params={**pd.p_params, "port": 27999, "cluster_id": 4242})


def test_a_prefill_rank_killed_mid_pull_fails_the_pull_in_time_naming_it(env, knobs):
    pd = Setup("k", 27010, 27011, sync_ms=5000)
    try:
        knobs(stall_ms={"pull_blocks": 4000})
        result = {}

        def pull() -> None:
            try:
                pd.d.call("pull", name="prefill-0", src=[1], dst=[1], layers=(0, LAYERS), timeout=8)
            except AgentError as exc:
                result["error"] = exc
            result["at"] = time.monotonic()

        puller = threading.Thread(target=pull)
        puller.start()
        time.sleep(0.3)
        killed = time.monotonic()
        pd.p.kill()
        puller.join(timeout=10)
        assert "error" in result, "a pull from a dead peer must fail"
        assert result["error"].status == "LLM_LINK_FAILED" and "peer prefill-0" in str(result["error"])
        assert result["at"] - killed < 1.0, "it fails when the peer dies, not at the timeout"
    finally:
        pd.close()


def test_open_refuses_a_cache_llm_datadist_cannot_register(env, monkeypatch):
    """Over 256 tensor addresses (register_cache + register_blocks_cache): refused at open, naming why."""
    import acl
    from transfer_factory.peer.datadist import DataDistEndpoint, DataDistError

    assert acl.init() in (0, 100002) and acl.rt.set_device(2) == 0
    ptr, ret = acl.rt.malloc(BLOCKS * 64, 0)
    assert ret == 0
    ep = DataDistEndpoint("prefill", 2, 31337, __import__("logging").getLogger("t"))
    with pytest.raises(DataDistError, match="register_blocks_cache .* 256 tensor addresses"):
        ep.open({"key": [ptr] * 130, "value": [ptr] * 130}, {"key": 64, "value": 64}, BLOCKS, "bfloat16", 130,
                "127.0.0.1", 27020)
    ep.close()
    with pytest.raises(ValueError, match="role"):
        DataDistEndpoint("router", 2, 1, __import__("logging").getLogger("t"))
    assert acl.rt.free(ptr) == 0
    assert "llm_datadist" in sys.modules


def test_the_transport_is_chosen_by_capability_and_datadist_never_links_different_tp_sizes():
    from transfer_factory.peer.descriptor import PeerLayout, PeerDescriptor, choose_transport

    layout = PeerLayout("m", "", "bfloat16", 4, 2, 2, 8, False, 16, 256)

    def rank(instance, tp, transports, boot="b1"):
        return PeerDescriptor(instance, "mixed", 0, tp, layout, boot, {t: {} for t in transports})

    npu = rank("p", 2, ["datadist", "mooncake"])
    assert choose_transport(npu, rank("d", 2, ["datadist", "mooncake"])) == "datadist"
    assert choose_transport(npu, rank("d", 4, ["datadist", "mooncake"])) == "mooncake", "whole blocks only"
    with pytest.raises(ValueError, match="whole blocks only: it cannot link TP 2 to TP 4"):
        choose_transport(npu, rank("d", 4, ["datadist"]), forced="datadist")
    with pytest.raises(ValueError, match="no transport in common"):
        choose_transport(rank("p", 2, ["ipc"]), rank("d", 2, ["datadist"]))
    cpu = rank("p", 2, ["ipc", "mooncake"])
    assert choose_transport(cpu, rank("d", 2, ["ipc", "mooncake"])) == "ipc"
