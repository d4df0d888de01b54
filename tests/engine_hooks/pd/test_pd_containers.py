"""Two containers on one node: one kernel (one boot id), two ``/dev/shm``s.  The same-host transport
(``ipc``) was chosen from the boot id alone and the link failed with ``No such file or directory``,
with no fallback although both sides offered the Transfer Engine.  On the two-host bed, both hosts
given one boot id: the link proves it can open the peer's segments, falls back to the Transfer
Engine, and a pull is bit-exact on every rank, kind and layer.  Needs root (the bed) and the
Mooncake wheel."""
from __future__ import annotations

import importlib
import uuid

import pytest

from tests import two_hosts as bed_lib
from tests.pd_hosts import HostInstance

try:
    importlib.import_module("mooncake.engine")
except ImportError as exc:
    pytest.skip(f"the Mooncake Transfer Engine (mooncake.engine) is not importable: {exc}", allow_module_level=True)

host_bed_factory = bed_lib.host_bed_factory
SPEC = dict(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8)
OFFER = ["ipc", "mooncake"]


def test_a_peer_on_this_kernel_without_our_dev_shm_is_linked_over_the_transfer_engine(host_bed_factory, tmp_path):
    kernel = str(uuid.uuid4())
    bed = host_bed_factory(2, boot_ids={"a": kernel, "b": kernel})
    p = HostInstance(bed.a, "prefill-0", SPEC, seed=81, log_dir=str(tmp_path))
    d = HostInstance(bed.b, "decode-0", SPEC, seed=82, log_dir=str(tmp_path))
    try:
        p.wait_ready()
        d.wait_ready()
        theirs = p.call("descriptor", offer=OFFER)
        assert {r["boot_id"] for r in theirs["ranks"]} == {kernel}
        assert d.call("link", peer=theirs, transport="auto", offer=OFFER) == "mooncake"
        handle = p.call("expose", req_id="c1")
        d.call("pull", name="c1", peer="prefill-0", handle=handle, src=[1, 2], dst=[5, 6], timeout=10)
        assert d.call("outcome", name="c1", wait=20, answer_within=50).get("value") == [5, 6]
        assert d.call("digest", ids=[5, 6]) == p.call("digest", ids=[1, 2])
    finally:
        d.close()
        p.close()
