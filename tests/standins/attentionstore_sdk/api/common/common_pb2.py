"""Media constants of ``attentionstore_sdk.api.common.common_pb2`` (contract stand-in; tests only).

FastDeploy passes these to ``AttentionStoreSDK.flush_token_index`` as ``src_media``/``dst_media``.
Only the three documented values exist here; any other value is rejected by the stand-in.
"""
from __future__ import annotations

MEDIA_HBM: int = 1
MEDIA_DRAM: int = 2
MEDIA_SSD: int = 3
