"""Peer descriptors (DESIGN §3.11): what a rank publishes, and the link-time layout check that
refuses, before any byte moves, two caches that would not mean the same thing block for block."""
import dataclasses

import re

import pytest

from cache_manager.queue import wire
from transfer_factory.peer import LayoutMismatch, PeerDescriptor, choose_transport, compatible_layouts
from transfer_factory.peer.descriptor import PeerLayout

LAYOUT = PeerLayout(model_id="qwen", model_version="RL-STEP3", cache_dtype="bfloat16", block_size=64,
                     num_layers=4, kv_heads=2, head_dim=128, mla=False, num_blocks=32, block_bytes=65536)


def descriptor(instance="P", role="prefill", boot="boot-a", transports=None, **layout):
    return PeerDescriptor(instance_id=instance, role=role, rank=1, tp=2, layout=dataclasses.replace(LAYOUT, **layout),
                          boot_id=boot, transports={"ipc": {}, "mooncake": {"address": "127.0.0.1:1"}}
                          if transports is None else transports)


def test_a_descriptor_crosses_the_wire_as_plain_data_and_back():
    d = descriptor()
    secret = wire.new_secret()
    back = PeerDescriptor.from_wire(wire.decode(wire.encode({"type": "descriptor", "d": d.to_wire()}, secret), secret)["d"])
    assert back == d


@pytest.mark.parametrize("field,value", [("model_version", "RL-STEP4"), ("cache_dtype", "uint8"), ("block_size", 32),
                                         ("num_layers", 5), ("head_dim", 64), ("kv_heads x tp", 4),
                                         ("mla", True), ("model_id", "llama")])
def test_a_link_between_layouts_that_differ_is_refused_naming_the_field(field, value):
    with pytest.raises(LayoutMismatch, match=field) as err:
        compatible_layouts(descriptor(), descriptor(instance="D", role="decode",
                                                    **{field.split()[0]: value}))
    assert err.value.field == field


def test_different_tp_sizes_link_when_they_hold_the_same_heads_in_all():
    half = dataclasses.replace(LAYOUT, kv_heads=1, block_bytes=LAYOUT.block_bytes // 2)
    four = dataclasses.replace(descriptor(instance="D"), tp=4, rank=3, layout=half)
    compatible_layouts(descriptor(), four)  # 2 heads x 2 ranks = 1 head x 4 ranks
    with pytest.raises(LayoutMismatch, match="kv_heads x tp") as err:  # 2 x 2 here, 1 x 2 there
        compatible_layouts(descriptor(), dataclasses.replace(four, tp=2, rank=1))
    assert "2 x 2" in str(err.value) and "1 x 2" in str(err.value)
    padded = dataclasses.replace(four, layout=dataclasses.replace(half, block_bytes=LAYOUT.block_bytes))
    with pytest.raises(LayoutMismatch, match="block_bytes per kv head"):
        compatible_layouts(descriptor(), padded)
    mla = dict(mla=True, kv_heads=1, block_bytes=4096)
    compatible_layouts(descriptor(**mla), dataclasses.replace(descriptor(instance="D", **mla), tp=4, rank=2))
    with pytest.raises(LayoutMismatch, match="kv_heads"):  # a latent is replicated, never split
        compatible_layouts(descriptor(**mla), descriptor(instance="D", **dict(mla, kv_heads=2, block_bytes=8192)))


def test_an_instance_linked_to_itself_is_refused():
    with pytest.raises(LayoutMismatch, match="instance_id"):
        compatible_layouts(descriptor(), descriptor())
    compatible_layouts(descriptor(), descriptor(instance="D", role="decode", num_blocks=64))  # pools may differ


def test_the_transport_is_chosen_by_capability_and_ipc_needs_one_host():
    here = descriptor()
    routable = {"ipc": {}, "mooncake": {"address": "10.1.2.3:17001"}}
    assert choose_transport(here, descriptor(instance="D")) == "ipc"
    assert choose_transport(here, descriptor(instance="D", boot="boot-b", transports=routable)) == "mooncake"
    assert choose_transport(here, descriptor(instance="D"), forced="mooncake") == "mooncake"
    with pytest.raises(ValueError, match="'ipc' is not offered"):
        choose_transport(here, descriptor(instance="D", boot="boot-b", transports=routable), forced="ipc")
    with pytest.raises(ValueError, match=r"no transport in common.*another host needs the Transfer Engine"):
        choose_transport(here, descriptor(instance="D", boot="boot-b", transports={"ipc": {}}))


@pytest.mark.parametrize("address", ["127.0.0.1:17001", "127.9.9.9:1", "localhost:17001", "[::1]:17001"])
def test_a_peer_on_another_host_advertising_a_loopback_address_is_refused_naming_it(address):
    """Two hosts both left at pod_ip 127.0.0.1: the address would reach this host's own engine."""
    here = descriptor()
    there = descriptor(instance="D", boot="boot-b", transports={"ipc": {}, "mooncake": {"address": address}})
    for forced in (None, "mooncake"):
        with pytest.raises(ValueError, match=f"another host.*loopback Transfer Engine address {re.escape(address)}"):
            choose_transport(here, there, forced=forced)
    one_host = descriptor(instance="D", transports={"ipc": {}, "mooncake": {"address": address}})
    assert choose_transport(here, one_host, forced="mooncake") == "mooncake"  # one host: loopback is right


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(rank=2), "rank"), (lambda d: d.update(tp=0), "tp"), (lambda d: d.update(role="both"), "role"),
    (lambda d: d.update(instance_id=""), "instance_id"), (lambda d: d.update(instance_id="x" * 300), "instance_id"),
    (lambda d: d["layout"].update(block_size=-1), "block_size"), (lambda d: d["layout"].update(mla=1), "mla"),
    (lambda d: d["layout"].update(num_layers=True), "num_layers"), (lambda d: d.update(layout=[1]), "layout"),
    (lambda d: d.update(transports={"rdma-magic": {}}), "transports"), (lambda d: d.update(transports={"ipc": 1}), "transports"),
    (lambda d: d["layout"].pop("head_dim"), "head_dim"),
])
def test_a_malformed_descriptor_is_refused_naming_the_field(mutate, field):
    d = descriptor().to_wire()
    mutate(d)
    with pytest.raises(ValueError, match=field):
        PeerDescriptor.from_wire(d)
