"""Fuzzing of the C input checks (issue 24): the queue's frame sealing (csrc/wire_seal.c through
``wire.open_frame``), the body check (csrc/wire_check.c through ``wire.check_plain`` and
``wire.parse_body``) and the file store's record scanner (``segments.scan`` with the C header
parser ``_records.parse_headers``, and whole-store reads of damaged segments).

Valid inputs are built with the real sealing and writing code, then bit-flipped, truncated,
spliced and extended.  Every batch of C calls runs in a forked child, so a crash fails the test
(with its input) instead of killing pytest; the checks run in the child and come back as text.
Each C answer is compared with an independent reference in Python (``hmac``, a recursive plain-
data check, ``zlib.crc32`` of the header), so "rejects" is checked as exactly as "accepts"."""
import hmac
import math
import os
import pickle
import shutil
import signal
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cache_manager.queue import wire
from tests.file_store_segment_helpers import key_of, open_store, payload, put_ids, read_one, segments
from transfer_factory.file import _records, segments as seg

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
PREFIX = len(wire.HEADER) + wire.ENVELOPE.size


def in_child(fn, *args):
    """Runs ``fn(*args)`` in a forked child; fails the test if the child crashes or ``fn`` raises."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            try:
                data = pickle.dumps(("ok", fn(*args)))
            except BaseException:  # an assertion or an unexpected error type: the test's failure
                data = pickle.dumps(("raised", traceback.format_exc()))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:
            code = 70
        os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail(f"the child died of {signal.Signals(os.WTERMSIG(status)).name} on {args!r:.2000}")
    assert os.WEXITSTATUS(status) == 0 and chunks, f"the child exited {os.WEXITSTATUS(status)}"
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "raised":
        pytest.fail(value)
    return value


# -- mutations of a valid input ----------------------------------------------------------------------
@st.composite
def mutated(draw, original: bytes, others: list[bytes]):
    """``original`` bit-flipped, truncated, spliced with another input, or grown; a few at a time."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["flip", "flip", "truncate", "splice", "insert", "delete", "append"]))
        n = len(data)
        if how == "flip" and n:
            i = draw(st.integers(0, n - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "truncate":
            del data[draw(st.integers(0, n)):]
        elif how == "splice":
            other = draw(st.sampled_from(others))
            cut, at = draw(st.integers(0, n)), draw(st.integers(0, len(other)))
            data = data[:cut] + bytearray(other[at:])
        elif how == "insert":
            i = draw(st.integers(0, n))
            data[i:i] = draw(st.binary(min_size=1, max_size=64))
        elif how == "delete" and n:
            i = draw(st.integers(0, n - 1))
            del data[i:i + draw(st.integers(1, 64))]
        elif how == "append":
            data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


# -- wire_seal: open_frame --------------------------------------------------------------------------
SECRET = bytes(range(7, 39))


def reference_open(frame: bytes, secret: bytes):
    """What open_frame must answer, from the wire format's definition: an envelope tuple, or None."""
    if len(frame) > wire.MAX_FRAME_BYTES or len(frame) < PREFIX + wire.TAG_BYTES + 1:
        return None
    if frame[:len(wire.HEADER)] != wire.HEADER:
        return None
    body, tag = frame[:-wire.TAG_BYTES], frame[-wire.TAG_BYTES:]
    if not hmac.compare_digest(hmac.digest(secret, body, "sha256"), tag):
        return None
    session, stream, counter = wire.ENVELOPE.unpack_from(frame, len(wire.HEADER))
    return (session, stream, counter, frame[PREFIX:-wire.TAG_BYTES])


def open_verdicts(frames: list[bytes], secret: bytes) -> None:
    for frame in frames:
        want = reference_open(frame, secret)
        for form in (frame, bytearray(frame), memoryview(frame)):
            try:
                got = tuple(wire.open_frame(form, secret))
            except wire.BadFrame:
                got = None  # any other exception type escapes: the test fails with it
            assert got == want, f"open_frame({frame!r:.300}) = {got!r:.300}, want {want!r:.300}"


envelopes = st.tuples(st.binary(min_size=1, max_size=300), st.binary(min_size=16, max_size=16),
                      st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
sealed = envelopes.map(lambda e: (e, wire.seal(e[0], SECRET, e[1], e[2], e[3])))


@FUZZ
@given(st.lists(st.binary(max_size=400), min_size=1, max_size=40),
       st.lists(st.binary(max_size=400).map(lambda b: wire.HEADER + b), max_size=40))
def test_open_frame_refuses_random_bytes(noise, headed):
    in_child(open_verdicts, noise + headed, SECRET)


@FUZZ
@given(st.data(), sealed, st.lists(sealed, min_size=1, max_size=3))
def test_open_frame_never_accepts_a_mutated_frame(data, frame, others):
    (payload_, session, stream, counter), raw = frame
    others_raw = [raw] + [o[1] for o in others]
    bad = data.draw(st.lists(mutated(raw, others_raw), min_size=1, max_size=25))
    # A mutation that happens to give back a valid frame (the original, or a splice that rebuilt
    # another sealed frame whole) must open as exactly that frame; anything else is refused.
    in_child(open_verdicts, [raw, *others_raw, *bad], SECRET)
    assert reference_open(raw, SECRET) == (session, stream, counter, payload_)


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=600), st.binary(min_size=16, max_size=16))
def test_frames_sealed_under_another_secret_are_refused_and_macs_match_hmac(secret, data, session):
    other = bytes(b ^ 0x5A for b in secret) or b"\x01"

    def child():
        assert wire._mac(secret, data) == hmac.digest(secret, data, "sha256")  # SHA-NI or portable rounds
        frame = wire.seal(data or b"\x00", other, session, 1, 2)
        try:
            wire.open_frame(frame, secret)
        except wire.BadFrame as exc:
            assert "authentication failed" in str(exc)
        else:
            raise AssertionError("a frame sealed under another secret opened")
    in_child(child)


def test_open_frame_refuses_non_buffers_and_oversized_frames():
    def child():
        out = []
        for junk in ("a str", 12, None, [1, 2]):
            try:
                wire.open_frame(junk, SECRET)
            except TypeError:
                out.append("TypeError")
        try:
            wire.open_frame(bytes(wire.MAX_FRAME_BYTES + 1), SECRET)
        except wire.BadFrame as exc:
            out.append(str(exc))
        return out
    assert in_child(child) == ["TypeError"] * 4 + [f"oversized frame ({wire.MAX_FRAME_BYTES + 1} bytes)"]


# -- wire_check: check_plain and parse_body ---------------------------------------------------------
def reference_plain(obj, max_depth: int, max_items: int) -> bool:
    """wire.check_plain's rules, recursively: a list or str/bytes-keyed dict at the root."""
    items = 0

    def ok(v, depth):
        nonlocal items
        if v is None or type(v) in (bool, int, str, bytes):
            return True
        if type(v) is float:
            return math.isfinite(v)
        if type(v) not in (list, dict) or depth > max_depth:
            return False
        items += len(v)
        if type(v) is dict:
            return all(type(k) in (str, bytes) for k in v) and all(ok(x, depth + 1) for x in v.values())
        return all(ok(x, depth + 1) for x in v)
    if type(obj) not in (list, dict):
        return False
    return ok(obj, 1) and items <= max_items


class Weird(float):
    pass


scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5)
           | st.binary(max_size=5) | st.sampled_from([Weird(1.0), (1, 2), {3}, frozenset(), object(), bytearray(b"x"),
                                                       float("nan"), float("-inf"), True]))
keys_ = st.text(max_size=3) | st.binary(max_size=3) | st.sampled_from([1, None, (1,), 2.5, False])
plain_trees = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys_, kids, max_size=4)
                           | st.tuples(kids), max_leaves=30)


def check_verdicts(cases) -> None:
    for obj, depth, items in cases:
        why = wire._wire_check.check(obj, depth, items)
        assert why is None or isinstance(why, str), repr(why)
        want = reference_plain(obj, depth, items)
        assert (why is None) == want, f"check({obj!r:.300}, {depth}, {items}) = {why!r}, reference says {want}"
        try:
            wire.check_plain(obj, depth, items)
            assert want
        except wire.BadFrame:
            assert not want


@FUZZ
@given(st.lists(st.tuples(plain_trees, st.integers(0, 6), st.integers(0, 40)), min_size=1, max_size=25))
def test_check_plain_agrees_with_a_reference_on_random_trees(cases):
    in_child(check_verdicts, cases)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 40), st.sampled_from(["list", "dict", "cycle", "wide"]))
def test_deep_cyclic_and_wide_structures_are_refused_without_crashing(depth, max_depth, shape):
    def child():
        if shape == "cycle":
            obj = [1]
            obj.append({"again": obj})
            want = False
        elif shape == "wide":
            obj = [[0] * depth for _ in range(3)]
            want = 3 * depth + 3 <= 1000 and max_depth >= 2
        else:
            obj = inner = [] if shape == "list" else {}
            for _ in range(depth - 1):
                nxt = [] if shape == "list" else {}
                inner.append(nxt) if shape == "list" else inner.__setitem__("k", nxt)
                inner = nxt
            want = depth <= max_depth
        why = wire._wire_check.check(obj, max_depth, 1000)
        assert (why is None) == want, (why, want)
    in_child(child)


def parse_verdicts(bodies: list[bytes]) -> None:
    for body in bodies:
        try:
            parsed = wire.parse_body(body)
        except wire.BadFrame:
            continue
        assert isinstance(parsed, dict) and isinstance(parsed.get("type"), str)
        assert reference_plain(parsed, wire.MAX_DEPTH, wire.MAX_ITEMS), f"parse_body let {parsed!r:.300} through"


msgpack_bodies = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5)
                              | st.binary(max_size=5),
                              lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=3), kids,
                                                                                        max_size=4), max_leaves=25)


@FUZZ
@given(st.data(), st.lists(st.dictionaries(st.text(max_size=3), msgpack_bodies, max_size=4), min_size=1, max_size=3))
def test_parse_body_refuses_or_bounds_random_and_mutated_bodies(data, maps):
    valid = [wire.pack({**m, "type": "t"}) for m in maps]
    bodies = valid + data.draw(st.lists(mutated(valid[0], valid), max_size=25)) + data.draw(
        st.lists(st.binary(max_size=200), max_size=5))
    in_child(parse_verdicts, bodies)


# -- the segment scanner -----------------------------------------------------------------------------
def build_segment(payloads: list[bytes], dead: list[bool]) -> tuple[bytes, list[tuple[int, bytes]]]:
    """A segment written with the real header code: (bytes, [(offset, header + payload)])."""
    out, records = bytearray(), []
    for i, (p, d) in enumerate(zip(payloads, dead)):
        h = seg.pack_header(len(p), seg.payload_checksum([p]), _records.sha256(f"key{i}".encode()),
                            seg.DEAD if d else seg.LIVE)
        records.append((len(out), h + p))
        out += h + p
    return bytes(out), records


def scan_bytes(data: bytes, tmp: str):
    path = os.path.join(tmp, f"seg-{os.getpid()}")
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        found, nxt, skipped = seg.scan(fd, 0, len(data))
    finally:
        os.close(fd)
        os.unlink(path)
    prev_end = 0
    for fnd in found:  # every record yielded is a valid header inside the input, in order, disjoint
        raw = data[fnd.offset:fnd.offset + seg.HEADER_SIZE]
        assert fnd.offset >= prev_end and seg.parse_header(raw) == fnd.header
        prev_end = fnd.offset + seg.HEADER_SIZE + fnd.header.payload_len
        assert prev_end <= len(data)
        assert _records.parse_headers(raw, 1) == bytes([1 if fnd.header.live else 2])
    assert 0 <= skipped <= len(data) and prev_end <= nxt <= len(data)
    return [(f.offset, data[f.offset:f.offset + seg.HEADER_SIZE + f.header.payload_len]) for f in found], nxt


payload_lists = st.lists(st.binary(min_size=1, max_size=200).map(lambda b: b.replace(b"CTK", b"ctk")),
                         min_size=1, max_size=8)


@FUZZ
@given(data=st.data(), payloads=payload_lists)
def test_scan_finds_every_record_but_the_damaged_ones(data, payloads, tmp_path):
    dead = data.draw(st.lists(st.booleans(), min_size=len(payloads), max_size=len(payloads)))
    image, records = build_segment(payloads, dead)
    whole = {r for _, r in records}
    hit = data.draw(st.integers(0, len(records) - 1))
    off, rec = records[hit]
    flip = off + data.draw(st.integers(0, seg.HEADER_SIZE - 1))
    flipped = bytearray(image)
    flipped[flip] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(image)))
    others = [image, build_segment(payloads[::-1], dead)[0]]
    spliced = data.draw(st.lists(mutated(image, others), min_size=1, max_size=4))

    def child():
        assert scan_bytes(image, str(tmp_path)) == (records, len(image))  # intact: all, nothing skipped
        found, _ = scan_bytes(bytes(flipped), str(tmp_path))  # a damaged header costs only its record
        assert found == records[:hit] + records[hit + 1:], f"flip at {flip} of record {hit}"
        found, nxt = scan_bytes(image[:cut], str(tmp_path))   # a cut stops the scan at the cut record
        want = [(o, r) for o, r in records if o + len(r) <= cut]
        assert found == want and nxt == (want[-1][0] + len(want[-1][1]) if want else 0)
        # Whatever the damage: only records of the inputs come back.  The header CRC leaves the magic
        # (live or dead) out by design, so that deleting a record is one 4-byte write (segments.py):
        # damage to the magic alone can turn a dead record live, which is then the right object for
        # its own key.  Every other header byte must be one that was written.
        for damaged in spliced:
            for _, r in scan_bytes(damaged, str(tmp_path))[0]:
                same_header = [w for w in whole | {r for _, r in build_segment(payloads[::-1], dead)[1]}
                               if w[len(seg.LIVE):seg.HEADER_SIZE] == r[len(seg.LIVE):seg.HEADER_SIZE]]
                assert same_header, "a header that was never written was found valid"
    in_child(child)


@FUZZ
@given(st.data(), payload_lists)
def test_c_header_parser_agrees_with_python_on_damaged_headers(data, payloads):
    image, records = build_segment(payloads, [False] * len(payloads))
    headers = [r[:seg.HEADER_SIZE] for _, r in records]
    damaged = [data.draw(mutated(h, headers)) for h in headers]
    cases = [d[:seg.HEADER_SIZE].ljust(seg.HEADER_SIZE, b"\0") for d in damaged]
    cases += [data.draw(st.binary(min_size=seg.HEADER_SIZE, max_size=seg.HEADER_SIZE)) for _ in range(3)]

    def child():
        status = _records.parse_headers(b"".join(cases), len(cases))
        for h, s in zip(cases, status):
            p = seg.parse_header(h)
            assert s == (0 if p is None else 1 if p.live else 2), (h, s, p)
    in_child(child)


# -- whole-store reads of damaged segments ------------------------------------------------------------
IDS = list(range(1, 9))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-store") / "kv"
    with open_store(root) as store:
        put_ids(store, IDS)
    (path,) = segments(root)
    return root, path.relative_to(root), path.read_bytes()


def read_damaged(root: Path, seg_path: Path, damaged: bytes, work: Path) -> int:
    copy = work / f"kv-{os.getpid()}"
    shutil.copytree(root, copy)
    (copy / seg_path).write_bytes(damaged)
    try:
        with open_store(copy) as store:
            return sum(read_one(store, i) > 0 for i in IDS)  # asserts each hit is bit-exact
    finally:
        shutil.rmtree(copy)


@FUZZ
@given(data=st.data())
def test_a_store_over_a_damaged_segment_serves_only_the_bytes_it_wrote(data, stored, tmp_path):
    root, seg_path, image = stored
    damaged = data.draw(mutated(image, [image, image[::-1]]))
    assume(damaged != image)
    hits = in_child(read_damaged, root, seg_path, damaged, tmp_path)
    assert 0 <= hits <= len(IDS)


def test_the_undamaged_store_serves_every_key(stored, tmp_path):
    root, seg_path, image = stored
    assert in_child(read_damaged, root, seg_path, image, tmp_path) == len(IDS)
    assert key_of(IDS[0]) and payload(IDS[0]).size
