"""The queue's local link: tasks and results over a Unix socket for ranks on the engine's host.

Real sockets, real clients with their own poll threads, and a real second process where a
peer's pid matters.  Each test asserts what arrived, in which order, what was dropped and
counted, and that the queue still works afterwards.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from cache_manager.queue import wire
from cache_manager.cache_tasks import RankResult
from cache_manager.queue.server import EngineCacheQueueServer
from cache_manager.queue.local_link import LENGTH, FrameStream, LinkClosed
from tests import queue_helpers as hardening
from tests.queue_helpers import SECRET, Rank

TIMEOUT = 10.0


def wait_for(cond, timeout: float = TIMEOUT) -> bool:
    return hardening.wait_for(cond, timeout)


@pytest.fixture
def server():
    results: list[RankResult] = []
    srv = EngineCacheQueueServer(2, SECRET, on_result=results.append)
    srv.results = results
    yield srv
    srv.close()


@pytest.fixture
def ranks(server):
    made = [Rank(0, 2, server.address), Rank(1, 2, server.address)]
    assert wait_for(lambda: server.registered_ranks() == {0, 1})
    yield made
    for r in made:
        r.close()


def result(task_id: str, rank: int) -> RankResult:
    return RankResult(task_id, rank, True, value=[1, 2])


def record_frames(link: FrameStream) -> list[bytes]:
    """Keep a copy of every frame ``link`` receives from now on."""
    seen: list[bytes] = []
    real = link.recv_frames

    def recording(limit: int) -> list[bytes]:
        frames = real(limit)
        seen.extend(frames)
        return frames

    link.recv_frames = recording
    return seen


# ------------------------------------------------------------------ the framing itself
def test_frames_of_every_size_cross_in_order_through_a_backlog():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = FrameStream(a), FrameStream(b)
    sizes = [0, 1, 3, 4, 5, 4095, 65535, 65536, 65537, 3 * 1024 * 1024, 17, 2 * 1024 * 1024 + 3]
    frames = [os.urandom(n) for n in sizes]
    for frame in frames:  # nobody reads yet: the socket fills and the rest waits in order
        assert sender.send(frame)
    assert sender.backlogged, "megabytes of frames did not fill the socket's buffer"
    got: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    # Room appears a little at a time while more frames are sent: a new frame must queue behind
    # the backlog, never slip into the room ahead of it.
    for i in range(500):
        frame = i.to_bytes(2, "big") * (1 + i % 300)
        frames.append(frame)
        assert sender.send(frame)
        got += receiver.recv_frames(1)
    while len(got) < len(frames) and time.monotonic() < deadline:
        assert sender.flush()
        got += receiver.recv_frames(64)
    assert got == frames
    assert not sender.backlogged
    sender.close()
    with pytest.raises(LinkClosed, match="closed"):
        receiver.recv_frames(4)
    receiver.close()


def test_a_length_no_frame_can_have_closes_the_link():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = FrameStream(b)
    a.sendall(LENGTH.pack(5) + b"hello" + LENGTH.pack(wire.MAX_FRAME_BYTES + 1) + b"x" * 100)
    with pytest.raises(LinkClosed, match=str(wire.MAX_FRAME_BYTES + 1)):
        receiver.recv_frames(4)
    a.close()
    receiver.close()


def test_a_send_on_a_link_whose_peer_is_gone_says_so():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = FrameStream(a)
    b.close()
    assert sender.send(b"task") is False
    assert sender.broken
    sender.close()


# ------------------------------------------------------------------ the queue on it
def test_ranks_on_the_engines_host_take_the_local_link(server, ranks):
    assert server.local_ranks() == {0, 1}
    for i in range(50):
        assert server.broadcast({"task_id": f"t{i}"}) == []
    assert wait_for(lambda: all(r.ids() == [f"t{i}" for i in range(50)] for r in ranks))
    for i in range(50):
        ranks[i % 2].client.send_result(result(f"t{i}", i % 2))
    assert wait_for(lambda: len(server.results) == 50)
    assert sorted(r.task_id for r in server.results) == sorted(f"t{i}" for i in range(50))
    assert server.dropped_frames == 0 and server.loop_errors == 0


def test_the_socket_has_no_file_and_its_name_goes_with_the_server(tmp_path):
    before = set(os.listdir(tempfile.gettempdir()))
    srv = EngineCacheQueueServer(1, SECRET)
    path = srv.local_path
    assert path.startswith("\0"), "a socket file could outlive a SIGKILLed engine"
    assert set(os.listdir(tempfile.gettempdir())) == before
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(path)
    probe.close()
    srv.close()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        probe.connect(path)
    probe.close()


_OTHER_USER = r"""
import os, socket, sys
os.setgid(65534)
os.setuid(65534)  # nobody
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])  # an abstract name: argv cannot hold its NUL
s.settimeout(5)
print("closed" if s.recv(1) == b"" else "open", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_process_of_another_user_is_turned_away_at_once(server, ranks, caplog):
    caplog.set_level("WARNING", logger="cache_manager.queue.server")
    out = subprocess.run([sys.executable, "-c", _OTHER_USER, server.local_path[1:]], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.stdout.strip() == "closed", out.stderr
    assert "of uid 65534" in caplog.text
    assert server.broadcast({"task_id": "still"}) == []
    assert wait_for(lambda: all(r.ids() == ["still"] for r in ranks))


def test_a_rank_that_cannot_reach_the_path_takes_the_task_port(server):
    # As from another host or network namespace: nothing listens under the name it is given.
    server._local.listener.path = "\0ctm-queue-nobody-listens-" + secrets.token_hex(8)
    made = [Rank(0, 2, server.address), Rank(1, 2, server.address)]
    try:
        assert wait_for(lambda: server.registered_ranks() == {0, 1})
        assert server.local_ranks() == set()
        assert server.broadcast({"task_id": "over-zmq"}) == []
        assert wait_for(lambda: all(r.ids() == ["over-zmq"] for r in made))
        made[1].client.send_result(result("over-zmq", 1))
        assert wait_for(lambda: [r.task_id for r in server.results] == ["over-zmq"])
    finally:
        for r in made:
            r.close()


def test_a_broadcast_never_blocks_on_a_rank_that_does_not_read(server, ranks):
    ranks[1].paused.set()
    time.sleep(0.1)  # a poll already under way returns
    keys = [secrets.token_hex(32) for _ in range(1000)]  # ~70 KB a task: the socket fills fast
    t0 = time.monotonic()
    for i in range(100):
        assert server.broadcast({"task_id": f"big{i}", "keys": keys}) == []
    assert time.monotonic() - t0 < TIMEOUT / 2
    assert server._reg.live[1].local.backlogged, "7 MB of tasks fit in the socket of a rank that does not read"
    assert wait_for(lambda: len(ranks[0].ids()) == 100)
    assert len(ranks[1].ids()) == 0
    ranks[1].paused.clear()
    want = [f"big{i}" for i in range(100)]
    assert wait_for(lambda: ranks[1].ids() == want), "the backlog did not arrive whole and in order"
    assert all(t["keys"] == keys for t in ranks[1].tasks)
    assert ranks[0].ids() == want


def test_a_replayed_task_frame_on_the_local_link_never_runs(server, ranks):
    seen = record_frames(ranks[0].client._local)
    assert server.broadcast({"task_id": "a"}) == []
    assert wait_for(lambda: all(r.ids() == ["a"] for r in ranks) and len(seen) == 1)
    with server._task_sender.lock:  # the same bytes again, on the same link and on rank 1's
        server._reg.live[0].local.send(seen[0])
        server._reg.live[1].local.send(seen[0])
    assert wait_for(lambda: [r.client.dropped_frames for r in ranks] == [1, 1])
    assert server.broadcast({"task_id": "b"}) == []
    assert wait_for(lambda: all(r.ids() == ["a", "b"] for r in ranks))
    assert all(r.client.loop_errors == 0 for r in ranks)


def test_a_replayed_result_frame_on_the_local_link_is_dropped(server, ranks):
    link = server._reg.live[0].local
    seen = record_frames(link)
    ranks[0].client.send_result(result("r1", 0))
    assert wait_for(lambda: len(server.results) == 1 and len(seen) == 1)
    with ranks[0].client._local_lock:
        ranks[0].client._local.send(seen[0])
    assert wait_for(lambda: server.drop_reasons.get("replayed", 0) == 1)
    ranks[0].client.send_result(result("r2", 0))  # the stream goes on after the replay
    assert wait_for(lambda: [r.task_id for r in server.results] == ["r1", "r2"])
    assert server.io_thread_alive() and server.loop_errors == 0


_IMPOSTOR = r"""
import socket, struct, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])  # an abstract name: argv cannot hold its NUL
frame = bytes.fromhex(sys.argv[2])
s.sendall(struct.pack(">I", len(frame)) + frame)
s.settimeout(5)
print("closed" if s.recv(1) == b"" else "open", flush=True)
"""


def test_a_hello_from_another_process_is_refused_and_its_link_closed(server, ranks, caplog):
    """Another process replays rank 0's real hello (a valid MAC in a live session): the kernel
    says its pid is not the rank's, so the link is refused and closed; the rank keeps working."""
    caplog.set_level("WARNING", logger="cache_manager.queue.server")
    hello = wire.encode({"type": "hello", "channel": "tasks"}, SECRET, server._reg.live[0].sid,
                        wire_stream_tasks_up(), 0)
    out = subprocess.run([sys.executable, "-c", _IMPOSTOR, server.local_path[1:], hello.hex()],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.stdout.strip() == "closed", out.stderr
    assert server.drop_reasons.get("refused", 0) == 1
    assert f"whose pid is {os.getpid()}" in caplog.text
    assert server.local_ranks() == {0, 1}
    assert server.broadcast({"task_id": "still"}) == []
    assert wait_for(lambda: all(r.ids() == ["still"] for r in ranks))


def test_a_second_hello_for_a_bound_rank_is_refused_even_from_its_own_pid(server, ranks, caplog):
    caplog.set_level("WARNING", logger="cache_manager.queue.server")
    hello = wire.encode({"type": "hello", "channel": "tasks"}, SECRET, server._reg.live[0].sid,
                        wire_stream_tasks_up(), 0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.local_path)
    s.sendall(LENGTH.pack(len(hello)) + hello)
    s.settimeout(TIMEOUT)
    assert s.recv(1) == b"", "the server kept a link that replayed a bound hello"
    s.close()
    assert server.drop_reasons.get("refused", 0) == 1
    assert "task channel of rank 0 already bound" in caplog.text
    assert server.broadcast({"task_id": "after"}) == []
    assert wait_for(lambda: all(r.ids() == ["after"] for r in ranks))


def test_a_rank_whose_link_closes_is_unreachable_and_the_rest_carry_on(server, ranks):
    ranks[1].close()  # its process went away: the kernel closes its end of the link
    assert wait_for(lambda: server.local_ranks() == {0})
    assert server.broadcast({"task_id": "x"}) == [1], "a task was reported sent to a rank that is gone"
    assert wait_for(lambda: ranks[0].ids() == ["x"])
    assert server.io_thread_alive() and server.loop_errors == 0


def test_a_local_hello_replayed_to_the_task_port_after_the_link_broke_is_refused(server, monkeypatch):
    """Rank 1's task-channel hello, captured on its local link, is replayed to the zmq task port
    once that link broke with the process alive: the session's task channel was bound already
    (on the local link), so the replay is refused and counted, rank 1 is reported unreachable
    rather than fed to the replaying connection, and rank 0 still gets its tasks."""
    sent: list[bytes] = []
    real_send = FrameStream.send

    def capturing(link: FrameStream, frame: bytes) -> bool:
        sent.append(bytes(frame))
        return real_send(link, frame)

    monkeypatch.setattr(FrameStream, "send", capturing)
    made = [Rank(0, 2, server.address), Rank(1, 2, server.address)]
    ctx = zmq.Context()
    try:
        assert wait_for(lambda: server.local_ranks() == {0, 1})
        monkeypatch.undo()
        sid = server._reg.live[1].sid
        hello = next(f for f in sent if wire.open_frame(f, SECRET).session == sid)
        made[1].client._local.sock.shutdown(socket.SHUT_RDWR)  # the link breaks; the process lives
        assert wait_for(lambda: server.local_ranks() == {0})
        replayer = hardening.raw_socket(ctx, f"{server.address.rsplit(':', 1)[0]}:{server.task_port}")
        replayer.send(hello)
        assert wait_for(lambda: hardening.reasons(server).get("refused", 0) == 1)
        assert server.registered_ranks() == {0}
        assert server.broadcast({"task_id": "after"}) == [1], "rank 1's task went to the replaying connection"
        assert wait_for(lambda: made[0].ids() == ["after"])
        assert hardening.recv_all(replayer, 200) == []
        assert made[1].ids() == [] and server.loop_errors == 0
    finally:
        ctx.destroy(0)
        for r in made:
            r.close()


def wire_stream_tasks_up() -> int:
    from cache_manager.queue.session import TASKS, UP, stream
    return stream(TASKS, UP)

