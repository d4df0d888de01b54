"""Short, non-reversible tags for storage keys in log lines.

A storage key holds a chained block hash (DESIGN §3.7): whoever reads a log that prints it can check
whether a prompt they guess was served (hash it, compare) and can fetch the block from a shared
store.  Log lines name a key by ``key_tag(key)`` instead: 8 hex digits of an HMAC-SHA256 under a key
drawn per process, so lines of one process about the same key carry the same tag, while a tag can
neither be reversed nor checked against a guessed prompt.  ``redact`` does the same for text a
library wrote (an exception's message) that may hold keys or hashes.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets

_TAG_KEY = secrets.token_bytes(32)
_HEX_RUN = re.compile(r"[0-9a-fA-F]{32,}")  # a block hash (64 hex digits), or any digest as long


def key_tag(key: str | bytes) -> str:
    """``#`` and 8 hex digits standing for ``key`` in this process's logs."""
    data = key if isinstance(key, bytes) else str(key).encode("utf-8", "surrogatepass")
    return "#" + hmac.new(_TAG_KEY, data, hashlib.sha256).hexdigest()[:8]


def redact(text: object) -> str:
    """``str(text)`` with every run of 32 or more hex digits (a block hash, hence any key holding
    one) replaced by its tag."""
    return _HEX_RUN.sub(lambda m: key_tag(m.group().lower()), str(text))
