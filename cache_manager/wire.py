"""The queue's wire format: authenticated msgpack frames, never pickle.

A frame is ``MAGIC | version | msgpack(body) | HMAC-SHA256(secret, MAGIC|version|body)``.
``decode`` returns the body or raises ``BadFrame`` with the reason; the caller drops
the frame and logs.  Frames over ``MAX_FRAME_BYTES`` are refused before any parsing
(and the sockets refuse them at the transport with ``zmq.MAXMSGSIZE``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgpack

MAGIC = b"CTMQ"
PROTOCOL_VERSION = 1
TAG_BYTES = 32
HEADER = MAGIC + bytes([PROTOCOL_VERSION])
MAX_FRAME_BYTES = 16 * 1024 * 1024

SECRET_ENV = "CTM_QUEUE_SECRET"
SECRET_FILE_ENV = "CTM_QUEUE_SECRET_FILE"


class BadFrame(ValueError):
    """A frame that is not a well-formed, authenticated message of this protocol."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def load_secret() -> bytes:
    """The engine's shared secret, as hex in ``CTM_QUEUE_SECRET`` or in the 0600 file ``CTM_QUEUE_SECRET_FILE``."""
    if os.environ.get(SECRET_ENV):
        text, source = os.environ[SECRET_ENV], SECRET_ENV
    elif os.environ.get(SECRET_FILE_ENV):
        path = os.environ[SECRET_FILE_ENV]
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"{SECRET_FILE_ENV} {path} has mode {mode:o}; it must be readable by its owner only")
        with open(path) as f:
            text, source = f.read(), f"{SECRET_FILE_ENV} {path}"
    else:
        raise ValueError(f"no queue secret: set {SECRET_ENV} or {SECRET_FILE_ENV}")
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{source} must hold the secret as hex") from None
    if len(secret) < 16:
        raise ValueError("the queue secret must be at least 16 bytes")
    return secret


def encode(body: dict, secret: bytes) -> bytes:
    payload = HEADER + msgpack.packb(body, use_bin_type=True)
    if len(payload) + TAG_BYTES > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return payload + hmac.new(secret, payload, hashlib.sha256).digest()


def decode(frame: bytes, secret: bytes) -> dict:
    if len(frame) > MAX_FRAME_BYTES:
        raise BadFrame(f"oversized frame ({len(frame)} bytes)")
    if len(frame) < len(HEADER) + TAG_BYTES + 1:
        raise BadFrame(f"short frame ({len(frame)} bytes)")
    if frame[: len(MAGIC)] != MAGIC:
        raise BadFrame("bad magic")
    if frame[len(MAGIC)] != PROTOCOL_VERSION:
        raise BadFrame(f"protocol version {frame[len(MAGIC)]}, expected {PROTOCOL_VERSION}")
    payload, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise BadFrame("authentication failed")
    try:
        body = msgpack.unpackb(payload[len(HEADER):], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for corrupt input
        raise BadFrame(f"undecodable body: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise BadFrame("body is not a map with a 'type'")
    return body
