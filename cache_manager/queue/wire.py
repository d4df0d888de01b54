"""The queue's wire format: authenticated msgpack frames, never pickle.

A frame is ``MAGIC | version | envelope | msgpack(body) | HMAC-SHA256(secret, everything before)``,
where the envelope is ``session (16 bytes) | stream (u32) | counter (u64)``, big-endian.  The
envelope sits under the MAC and outside the body, so a receiver checks that a frame belongs
to this connection's session and stream, and is the next one in order, before it parses any
of the body: a replayed, reordered or cross-connection frame costs one HMAC and is dropped.

``open_frame`` checks the MAC and returns the envelope; ``parse_body`` decodes the body and
bounds it: plain msgpack data only (no ext types), at most ``MAX_DEPTH`` levels and
``MAX_ITEMS`` items, finite floats, checked without recursion.  Both raise ``BadFrame``
with the reason; the caller drops the frame and logs.  Frames over ``MAX_FRAME_BYTES``
are refused before any parsing (and the sockets refuse them at the transport with
``zmq.MAXMSGSIZE``).
"""
from __future__ import annotations

import os
import secrets
import stat
import struct

import msgpack

from cache_manager.queue import _wire_check
from cache_manager.queue import _wire_seal

MAGIC = b"CTMQ"
PROTOCOL_VERSION = 2
TAG_BYTES = 32
HEADER = MAGIC + bytes([PROTOCOL_VERSION])
ENVELOPE = struct.Struct(">16sIQ")  # session, stream, counter
SESSION_BYTES = 16
NO_SESSION = bytes(SESSION_BYTES)  # a hello: the session does not exist yet
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 32  # tasks and results are a few levels deep; 10,000 levels must never reach a consumer
MAX_ITEMS = 1 << 22
MAX_SECRET_FILE_BYTES = 4096

SECRET_ENV = "CTM_QUEUE_SECRET"
SECRET_FILE_ENV = "CTM_QUEUE_SECRET_FILE"


class BadFrame(ValueError):
    """A frame that is not a well-formed, authenticated message of this protocol."""


# (session, stream, counter, payload): what ``open_frame`` returns, the body not yet parsed.
Envelope = _wire_seal.Envelope


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def new_session() -> bytes:
    return secrets.token_bytes(SESSION_BYTES)


# -- secret ----------------------------------------------------------------------
def load_secret() -> bytes:
    """The engine's shared secret, as hex in ``CTM_QUEUE_SECRET`` or in the private file ``CTM_QUEUE_SECRET_FILE``."""
    if os.environ.get(SECRET_ENV):
        text, source = os.environ[SECRET_ENV], SECRET_ENV
    elif os.environ.get(SECRET_FILE_ENV):
        path = os.environ[SECRET_FILE_ENV]
        text, source = read_private_file(path), f"{SECRET_FILE_ENV} {path}"
    else:
        raise ValueError(f"no queue secret: set {SECRET_ENV} or {SECRET_FILE_ENV}")
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{source} must hold the secret as hex") from None
    if len(secret) < 16:
        raise ValueError("the queue secret must be at least 16 bytes")
    return secret


def read_private_file(path: str) -> str:
    """The text of ``path``, which must be a regular file of the current user that nobody else can read.

    The checks run on the open descriptor (``fstat``), not on the name, so the file that is
    checked is the file that is read: a rename or symlink swap in between changes nothing."""
    what = f"{SECRET_FILE_ENV} {path}"
    try:  # O_NONBLOCK: opening a FIFO must not hang; O_NOCTTY: a tty must not become ours
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise ValueError(f"{what}: cannot open it: {exc.strerror}") from None
    try:
        _check_private(os.fstat(fd), what)
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{what}: larger than {MAX_SECRET_FILE_BYTES} bytes; it must hold only the secret as hex")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{what} must hold the secret as hex") from None


def _check_private(st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: not a regular file")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what}: owned by uid {st.st_uid}, not by the current user (uid {os.geteuid()})")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{what} has mode {mode:o}; it must be readable by its owner only (chmod 600)")


# -- frames ----------------------------------------------------------------------
_KEYS: dict[bytes, _wire_seal.Key] = {}
_MAX_KEYS = 16  # an engine and its ranks use one secret; tests a few


def _key(secret: bytes) -> _wire_seal.Key:
    """The secret's HMAC-SHA256 key, its inner and outer SHA-256 states computed once (RFC 2104):
    sealing and opening a frame is then one C call (``csrc/wire_seal.c``)."""
    key = _KEYS.get(secret)
    if key is None:
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        key = _KEYS[secret] = _wire_seal.Key(secret, MAGIC, PROTOCOL_VERSION, MAX_FRAME_BYTES, BadFrame)
    return key


def _mac(secret: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data``: the same bytes as ``hmac.digest(secret, data, "sha256")``."""
    return _key(secret).mac(data)


def pack(body: dict) -> bytes:
    """The msgpack body, to ``seal`` once per receiver (a broadcast packs once)."""
    return msgpack.packb(body, use_bin_type=True)


def seal(payload: bytes, secret: bytes, session: bytes = NO_SESSION, stream: int = 0, counter: int = 0) -> bytes:
    """The frame of ``payload``; ``ValueError`` if it would exceed ``MAX_FRAME_BYTES``."""
    return _key(secret).seal(payload, session, stream, counter)


def encode(body: dict, secret: bytes, session: bytes = NO_SESSION, stream: int = 0, counter: int = 0) -> bytes:
    return _key(secret).seal(pack(body), session, stream, counter)


def open_frame(frame: bytes, secret: bytes) -> Envelope:
    """Check size, magic, version and MAC; return the envelope and the unparsed body, or raise
    ``BadFrame`` with the reason."""
    return _key(secret).open(frame)


def parse_body(payload: bytes) -> dict:
    """Decode an authenticated body: a map with a string ``type``, of bounded plain data."""
    try:
        # msgpack's own stack limit stops absurd nesting before Python sees it; ext types
        # (timestamps, custom codes) are not plain data and are refused outright.
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types for corrupt input
        raise BadFrame(f"undecodable body: {type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise BadFrame("body is not a map with a 'type'")
    check_plain(body)
    return body


def decode(frame: bytes, secret: bytes) -> dict:
    """``open_frame`` then ``parse_body``, ignoring the envelope (tools and tests)."""
    return parse_body(open_frame(frame, secret).payload)


def check_plain(obj: object, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> None:
    """Raise ``BadFrame`` unless ``obj`` is plain data (None, bool, int, finite float, str, bytes,
    lists and str/bytes-keyed maps) at most ``max_depth`` deep and ``max_items`` in all.
    In C (``csrc/wire_check.c``), with an explicit stack: the depth of hostile input must not
    decide the C stack's, and every task and result of a round trip passes here."""
    why = _wire_check.check(obj, max_depth, max_items)
    if why is not None:
        raise BadFrame(why)
