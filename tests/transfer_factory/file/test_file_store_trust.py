"""The FileStore serves only files and directories of its own user (DESIGN §4): a segment another
user owns, a symlink named like a segment, a FIFO named like one are refused and logged, never
read (no hang on the FIFO, no chmod through the symlink); the store keeps serving its own records;
its root, namespace and rank directories must be its own directories, not symlinks."""
import logging
import os
import secrets
import shutil
import stat
import time

import pytest

from tests.file_store_helpers import NS, get, key, open_store, put, rand_bytes
from transfer_factory.file.segments import SEG_RE
from transfer_factory.kvcache_storage import NOT_FOUND, OK, UNAVAILABLE, StorageConfigError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting files of another uid needs root")

NOBODY = 65534
SIZE = 4096
OURS = [key(i) for i in range(4)]
PLANTED = [key(100 + i) for i in range(4)]
CHILD_TIMEOUT_S = 10.0
OPEN_TIMEOUT_S = 20.0


def _fresh_name():
    return f"{time.time_ns():016x}.{secrets.token_hex(4)}.seg"


def _their_segment(tmp_path):
    """A well-formed segment holding PLANTED (written by a store elsewhere), its path and bytes."""
    with open_store(tmp_path / "theirs") as s:
        for i, k in enumerate(PLANTED):
            assert put(s, k, rand_bytes(SIZE, 1000 + i)) == OK
    rank_dir = tmp_path / "theirs" / NS / "rank0"
    [path] = [p for p in rank_dir.iterdir() if SEG_RE.match(p.name)]
    path.chmod(0o644)
    return path, path.read_bytes()


def _put_ours(store):
    for i, k in enumerate(OURS):
        assert put(store, k, rand_bytes(SIZE, i)) == OK


def _check(store):
    """Planted keys are misses, ours bit-exact."""
    assert store.exists(PLANTED) == [0] * len(PLANTED)
    for k in PLANTED:
        assert get(store, k, SIZE)[0] == NOT_FOUND
    assert store.exists(OURS) == [1] * len(OURS)
    for i, k in enumerate(OURS):
        code, out = get(store, k, SIZE)
        assert code == SIZE and (out == rand_bytes(SIZE, i)).all()   # bytes read


def _plant_as_root(rank_dir, data, target):
    """As root: a copy of ``data`` handed to uid 65534 (mode 0666), a symlink to ``target``, FIFOs
    named like a segment and like a segment being created."""
    foreign, link, fifo, fifo_new = (rank_dir / _fresh_name() for _ in range(4))
    fifo_new = fifo_new.with_name(fifo_new.name + ".new")
    foreign.write_bytes(data)
    os.chown(foreign, NOBODY, NOBODY)
    os.chmod(foreign, 0o666)
    os.symlink(target, link)
    os.mkfifo(fifo)
    os.mkfifo(fifo_new)
    return [foreign, link, fifo, fifo_new]


def _plant_as_nobody(rank_dir, data, target):
    """The same, created by a child running as uid/gid 65534 (through a directory fd, as the test's
    tmp directories are root's 0700)."""
    names = [_fresh_name() for _ in range(4)]
    names[3] += ".new"
    dfd = os.open(rank_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        pid = os.fork()
        if pid == 0:                                             # the child: only system calls, then _exit
            code = 1
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                fd = os.open(names[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dfd)
                os.fchmod(fd, 0o666)
                os.write(fd, data)
                os.close(fd)
                os.symlink(target, names[1], dir_fd=dfd)
                os.mkfifo(names[2], dir_fd=dfd)
                os.mkfifo(names[3], dir_fd=dfd)
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the planting child did not finish")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(dfd)
    planted = [rank_dir / n for n in names]
    assert all(os.lstat(p).st_uid == NOBODY for p in planted)
    return planted


def _unplant(paths):
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _open_without_hang(root, planted):
    """Opens the store in a thread with a timeout; a hang on a planted FIFO is a failure (the
    FIFOs are then opened for writing, which releases the opener)."""
    import threading
    result = {}

    def run():
        try:
            result["store"] = open_store(root)
        except BaseException as exc:  # noqa: B902 - reported below
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(OPEN_TIMEOUT_S)
    if t.is_alive():
        for p in planted:
            if stat.S_ISFIFO(os.lstat(p).st_mode):
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
        t.join(OPEN_TIMEOUT_S)
        pytest.fail("opening the store hung on a planted FIFO")
    if "error" in result:
        raise result["error"]
    return result["store"]


@pytest.mark.parametrize("planter", [_plant_as_root, _plant_as_nobody], ids=["chowned", "by_uid_65534"])
@pytest.mark.parametrize("when", ["open", "refresh"])
def test_foreign_symlinked_and_fifo_segments_are_never_read(tmp_path, caplog, planter, when):
    target, data = _their_segment(tmp_path)
    root = tmp_path / "kv"
    rank_dir = root / NS / "rank0"
    store = open_store(root)
    planted = []
    try:
        _put_ours(store)
        rank_dir.chmod(0o777)                                   # a loose directory others can write into
        planted = planter(rank_dir, data, target)
        if when == "open":
            store.close()
            with caplog.at_level(logging.WARNING, logger="transfer_factory.file.store"):
                store = _open_without_hang(root, planted)
            assert rank_dir.stat().st_mode & 0o777 == 0o700    # ours, left open: tightened
        else:
            with caplog.at_level(logging.WARNING, logger="transfer_factory.file.store"):
                store.segment_log.refresh()
        _check(store)
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o644   # never chmod-ed through the symlink
        with caplog.at_level(logging.WARNING, logger="transfer_factory.file.store"):
            for _ in range(3):
                store.segment_log.refresh()
        _check(store)
        for p in planted[:3]:                                   # each .seg refused and logged once
            assert sum(p.name in r.getMessage() and "refused" in r.getMessage() for r in caplog.records) == 1
        assert all(not str(s.path).startswith(str(p)) for s in store.segment_log.segments() for p in planted)
    finally:
        store.close()
        _unplant(planted)
    with open_store(root) as again:                             # and with them gone, ours are all there
        _check(again)


def test_a_replaced_rank_directory_that_is_a_symlink_is_unavailable(tmp_path):
    target, _ = _their_segment(tmp_path)
    root = tmp_path / "kv"
    rank_dir = root / NS / "rank0"
    with open_store(root) as store:
        _put_ours(store)
        moved = rank_dir.with_name("rank0.moved")
        rank_dir.rename(moved)
        rank_dir.symlink_to(target.parent)                      # the other directory, full of PLANTED
        try:
            assert store.exists(PLANTED) == [UNAVAILABLE] * len(PLANTED)
            assert get(store, PLANTED[0], SIZE)[0] == UNAVAILABLE
        finally:
            rank_dir.unlink()
            moved.rename(rank_dir)


@pytest.mark.parametrize("which", ["root", "namespace", "rank"])
@pytest.mark.parametrize("how", ["owned_by_65534", "symlink"])
def test_store_directories_must_be_ours_and_not_symlinks(tmp_path, which, how):
    root = tmp_path / "kv"
    path = {"root": root, "namespace": root / NS, "rank": root / NS / "rank0"}[which]
    path.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    if how == "symlink":
        elsewhere.mkdir(mode=0o700)
        path.symlink_to(elsewhere)
    else:
        path.mkdir(mode=0o700)
        os.chown(path, NOBODY, NOBODY)
    try:
        with pytest.raises(StorageConfigError) as info:
            open_store(root)
        assert repr(str(path)) in str(info.value)
        assert ("symlink" if how == "symlink" else "uid 65534") in str(info.value)
        assert not (elsewhere / NS).exists() and not (elsewhere / "rank0").exists()
    finally:
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path)
