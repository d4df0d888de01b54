"""``AttentionStoreSDKError`` of the AttentionStore SDK contract stand-in (tests only; not the vendor SDK).

Every failure the stand-in reports -- a rejected argument, a missing ``ATTENTIONSTORE_STANDIN_DIR``,
an injected fault ("cuda memory not ready", "timeout", ...) -- is this exception; its ``str`` is the
message alone, which is what FastDeploy inspects (``"cuda memory not ready" in str(e)``).
"""
from __future__ import annotations


class AttentionStoreSDKError(Exception):
    """A failure of an AttentionStore SDK call; ``str(exc)`` is the message."""
