"""Our CTMs driven by FastDeploy's engine side as each FastDeploy version writes it
(``tests/fastdeploy_engine_side.py``; ``--fastdeploy-version`` picks one), real CTMs at TP=2; the
storage writes for every version, the rest (where the versions do not differ) for the first chosen,
release/2.6 by default:

* storage writes answered the way each version waits for them (release/2.6: one done signal per TP
  rank, the shortest block list; develop of 2026-05: the first), then read back bit-exact.  Before:
  one signal per write, so on release/2.6 every write waited out FastDeploy's wait and failed;
* control requests answered where FastDeploy's engine reads them: its ``ctrl_c2e_rank<r>_<port>``
  queues, one ``ControlResponse`` per rank, through the README's change 6 (``FMQ`` from
  ``engine_hooks.fastdeploy_fmq``); a refused request fails FastDeploy's loop naming the queue, and the
  fixed ids ``pause_transfer`` / ``resume_transfer`` are reused freely;
* FastDeploy's ``_control_wakeup`` raising before its resume leaves no CTM paused: a read right after
  the wakeup loads every block (before: 0 of 4 after 30 s);
* two data-parallel engines configured as FastDeploy configures them (each its own queue, its server
  given ``local_data_parallel_size=2``, its in-process handle its ``local_data_parallel_id``, each
  CTM ``--local_data_parallel_id``) share one store bit-exact and answer control requests on their
  own ranks' queues (before: ``ValueError`` at the server).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from cache_manager.queue import wire
from engine_hooks.fastdeploy_queue import EngineCacheQueue
from tests.fastdeploy_engine import FastDeployEngine
from tests.fastdeploy_engine_side import ControlSide, PrefixCacheSide
from tests.fastdeploy_types import FDCacheStatus

KEYS = ["v-blk-a", "v-blk-b", "v-blk-c", "v-blk-d"]
SRC, DST = [2, 3, 4, 5], [8, 9, 10, 11]


@pytest.fixture(autouse=True)
def keep_secret_env():
    before = os.environ.get(wire.SECRET_ENV), os.environ.get(wire.SECRET_FILE_ENV)
    yield
    for name, value in zip((wire.SECRET_ENV, wire.SECRET_FILE_ENV), before):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def start(tmp_path, **kw) -> FastDeployEngine:
    engine = FastDeployEngine(tp=2, storage_root=str(tmp_path / "kv"), model_path=str(tmp_path),
                              fastdeploy_signals=True, storage_grace=0.5, control_timeout=10.0, **kw)
    try:
        return engine.start()
    except BaseException:
        engine.close()
        raise


def port_of(engine: FastDeployEngine) -> int:
    return engine.cache_queue_port or engine.queue.get_server_port()


def same_blocks(engine: FastDeployEngine, src: list[int], dst: list[int], before: dict) -> None:
    for key, view in engine.views().items():
        assert np.array_equal(view[dst], before[key]), f"rank/kind/layer {key}: blocks {dst} differ"


@pytest.fixture
def engine(tmp_path):
    engine = start(tmp_path)
    yield engine
    assert engine.close() == [], "segments left behind"


def test_storage_writes_are_answered_as_each_version_waits(engine, fastdeploy_version):
    side = PrefixCacheSide(engine.queue, engine.tp, fastdeploy_version)
    try:
        engine.fill(seed=3)
        stored = {k: v[SRC].copy() for k, v in engine.views().items()}
        assert side.write("w1", KEYS, SRC, timeout=5.0) == SRC, f"{fastdeploy_version.name}: write not answered"
        assert side.read("r1", KEYS, DST, timeout=5.0) == DST
        same_blocks(engine, SRC, DST, stored)
        # P/D through the store writes a request whose last block is partial, then a second request
        tail = [KEYS[0], KEYS[1] + ":partial:3"]
        assert side.write("w2", tail, [6, 7], timeout=5.0) == [6, 7]
        assert side.read("r2", tail, [12, 13], timeout=5.0) == [12, 13]
    finally:
        side.close()
    assert engine.queue.empty()


def test_control_answers_arrive_on_fastdeploys_per_rank_queues(engine, one_fastdeploy_version):
    control = ControlSide(engine.queue, engine.tp, port_of(engine))
    side = PrefixCacheSide(engine.queue, engine.tp, one_fastdeploy_version)
    try:
        for _ in range(2):  # the fixed ids pause_transfer / resume_transfer, each sent twice
            control.pause(timeout=10)
            control.resume(timeout=10)
        with pytest.raises(Exception, match=rf"Error response from ctrl_c2e_rank0_{port_of(engine)}: "
                                            r"update_weights failed on rank 0: .*paused"):
            control.update_weights("uw-unpaused", timeout=10)  # the CTMs refuse: not paused

        engine.fill(seed=5)
        stored = {k: v[SRC].copy() for k, v in engine.views().items()}
        assert side.write("w", KEYS, SRC, timeout=5.0) == SRC
        answers = control.sleep("sleep-1", timeout=10)
        assert [a["kv_cache"] for a in answers] == ["released", "released"]
        engine.free_caches()
        with pytest.raises(RuntimeError, match="_control_resume"):  # FastDeploy's own wakeup, stock
            control.wakeup("wake-1", timeout=20, after_dispatch=lambda: engine.recreate_caches(seed=6))
        # FastDeploy's engine never sent the resume; our CTMs ended the pause with the wakeup
        assert side.read("after-wake", KEYS, DST, timeout=5.0, wait=10) == DST
        same_blocks(engine, SRC, DST, stored)
        swapped = side.swap("s-out", FDCacheStatus.SWAP2CPU, [DST[0]], [1], wait=10)
        assert swapped == [DST[0]]
    finally:
        side.close()


def test_with_the_wakeup_fix_the_engine_resumes_and_nothing_is_held(engine, one_fastdeploy_version):
    control = ControlSide(engine.queue, engine.tp, port_of(engine), fixed_wakeup=True)
    side = PrefixCacheSide(engine.queue, engine.tp, one_fastdeploy_version)
    try:
        control.sleep("sleep-2", timeout=10)
        engine.free_caches()
        control.wakeup("wake-2", timeout=20, after_dispatch=lambda: engine.recreate_caches(seed=8))
        assert control.is_paused is False
        assert side.swap("s-in", FDCacheStatus.SWAP2CPU, [3], [0], wait=10) == [3]
    finally:
        side.close()


def test_two_data_parallel_engines_start_as_fastdeploy_configures_them(tmp_path, one_fastdeploy_version):
    engines: list[FastDeployEngine] = []
    sides: list[PrefixCacheSide] = []
    try:
        for dp in range(2):  # FastDeploy: local_data_parallel_size=data_parallel_size on every server
            engines.append(start(tmp_path, dp_index=dp, local_data_parallel_size=2))
        for dp, engine in enumerate(engines):
            # FastDeploy's PrefixCacheManager opens its handle with its engine's local_data_parallel_id
            handle = EngineCacheQueue(address=("127.0.0.1", port_of(engine)), is_server=False, num_client=2,
                                      client_id=0, local_data_parallel_id=dp)
            sides.append(PrefixCacheSide(handle, 2, one_fastdeploy_version))
        engines[0].fill(seed=11)
        engines[1].fill(seed=12)
        stored = {k: v[SRC].copy() for k, v in engines[0].views().items()}
        assert sides[0].write("dp0-w", KEYS, SRC, timeout=5.0) == SRC
        assert sides[1].read("dp1-r", KEYS, DST, timeout=5.0) == DST  # engine 1 reads engine 0's blocks
        for key, view in engines[1].views().items():
            assert np.array_equal(view[DST], stored[key]), f"DP engine 1, rank/kind/layer {key} differs"
        control = ControlSide(engines[1].queue, 2, port_of(engines[1]), dp_index=1)
        assert sorted(control._ctrl_output_queues) == [f"ctrl_c2e_rank{r}_{port_of(engines[1])}" for r in (2, 3)]
        control.pause(timeout=10)
        control.resume(timeout=10)
    finally:
        for side in sides:
            side.close()
        for engine in engines:
            assert engine.close() == [], "segments left behind"


def test_a_squatter_on_fastdeploys_control_socket_hears_nothing(engine, tmp_path):
    import zmq
    port = port_of(engine)
    paths = [f"/dev/shm/fmq_ctrl_c2e_rank{r}_{port}.ipc" for r in range(2)]
    context = zmq.Context()
    squatters = []
    try:
        for path in paths:  # another local user's process, bound where FastDeploy's FMQ would bind
            sock = context.socket(zmq.PULL)
            sock.bind(f"ipc://{path}")
            squatters.append(sock)
        control = ControlSide(engine.queue, engine.tp, port)
        control.pause(timeout=10)
        control.resume(timeout=10)
        assert all(sock.poll(200) == 0 for sock in squatters), "a control answer reached the squatter"
    finally:
        for sock in squatters:
            sock.close(linger=0)
        context.term()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_data_parallel_arguments_out_of_range_are_refused_naming_them():
    for size, index in ((0, 0), (2, 2), (2, -1), (True, 0), (1, -1)):
        with pytest.raises(ValueError, match="local_data_parallel_size"):
            EngineCacheQueue(address=("127.0.0.1", 0), is_server=True, num_client=2,
                             local_data_parallel_size=size, local_data_parallel_id=index)
