"""Contract stand-in of the AttentionStore SDK, as FastDeploy calls it (tests only; not the vendor SDK).

The real ``attentionstore_sdk`` cannot be installed on this host.  This package reproduces the
part of its API that FastDeploy uses (``attentionstore_sdk.sdk.AttentionStoreSDK`` and ``Tokens``,
``attentionstore_sdk.utils.err.AttentionStoreSDKError`` and the media constants of
``attentionstore_sdk.api.common.common_pb2``), checks every argument the way the SDK documents and
rejects what it rejects, and keeps the blocks in files under ``$ATTENTIONSTORE_STANDIN_DIR``.  See
``attentionstore_sdk.sdk`` for the contract, the on-disk layout and the fault knobs.

The directory that holds this package (``tests/standins``) is put on ``sys.path`` only by tests.
"""
