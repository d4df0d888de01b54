"""MooncakeStore's configuration (options, the environment, a JSON file), with a real
mooncake_master where the store connects; no mocks.

Needs the mooncake-transfer-engine(-non-cuda) wheel; skipped without it.
"""
import json
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from transfer_factory import create_storage_backend  # noqa: E402
from transfer_factory.kvcache_storage import UNAVAILABLE, StorageConfigError  # noqa: E402
from scripts.local_mooncake_master import free_port  # noqa: E402
from transfer_factory.mooncake import MooncakeConnectionError, MooncakeStore  # noqa: E402
from transfer_factory.mooncake.config import load_mooncake_config, parse_size  # noqa: E402
from tests import mooncake_helpers  # noqa: E402
from tests.mooncake_helpers import SMALL, Buffers, keys_for  # noqa: E402

_clean_mooncake_env = mooncake_helpers._clean_mooncake_env  # the shared fixtures, under their names here
master = mooncake_helpers.master



# ---- configuration -----------------------------------------------------------------------------

def test_config_from_env_vars_fastdeploy_names(master, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", master.master_server_addr)
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", master.metadata_server)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MOONCAKE_DEVICE", "")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "64mb")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", str(16 << 20))
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    s = create_storage_backend("mooncake", namespace="envns", rank=0)
    try:
        assert isinstance(s, MooncakeStore)
        assert s.config.master_server_addr == master.master_server_addr
        assert s.config.metadata_server == master.metadata_server
        assert s.config.global_segment_size == 64 << 20 and s.config.local_buffer_size == 16 << 20
        assert s.config.source == "the environment"
        b = Buffers(s, 2, 4096, seed=8)
        keys = keys_for("envns", "e", 2)
        assert s.batch_set(keys, b.src_ptrs(), b.sizes()) == [0, 0]
        assert s.batch_get(keys, b.dst_ptrs(), b.sizes()) == [4096, 4096]
        assert np.array_equal(b.src, b.dst)
        s.clear()
    finally:
        s.close()
    # Closed: idempotent, and calls fail with a code instead of touching the closed client.
    s.close()
    assert s.exists(keys) == [UNAVAILABLE] * 2
    assert s.batch_get(keys, b.dst_ptrs(), b.sizes()) == [UNAVAILABLE] * 2


def test_config_from_env_vars_mooncake_names():
    env = {"MOONCAKE_MASTER_SERVER_ADDR": "10.0.0.1:50051", "MOONCAKE_METADATA_SERVER": "http://10.0.0.1:8080/metadata",
           "MOONCAKE_RDMA_DEVICES": "mlx5_0", "LOCAL_HOSTNAME": "10.0.0.2", "MOONCAKE_PROTOCOL": "RDMA"}
    cfg, _ = load_mooncake_config({}, env)
    assert (cfg.master_server_addr, cfg.metadata_server, cfg.rdma_devices, cfg.local_hostname, cfg.protocol) == (
        "10.0.0.1:50051", "http://10.0.0.1:8080/metadata", "mlx5_0", "10.0.0.2", "rdma")
    assert cfg.global_segment_size == 512 << 20 and cfg.local_buffer_size == 64 << 20
    cfg, _ = load_mooncake_config({}, {"MOONCAKE_MASTER": "h:1"})
    assert (cfg.metadata_server, cfg.protocol, cfg.local_hostname) == ("P2PHANDSHAKE", "tcp", "127.0.0.1")


def test_config_from_json_file(master, tmp_path, monkeypatch):
    # FastDeploy's spellings: master_server_address, device_name.
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": master.metadata_server,
                                "master_server_address": master.master_server_addr, "protocol": "tcp",
                                "device_name": "", "global_segment_size": 64 << 20, "local_buffer_size": "16MB"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    monkeypatch.setenv("MOONCAKE_MASTER", "192.0.2.1:1")          # the file wins over the environment
    s = MooncakeStore(namespace="jsonns", rank=0, options={"local_buffer_size": "8mb"})
    try:
        assert s.config.master_server_addr == master.master_server_addr
        assert s.config.local_buffer_size == 8 << 20                   # options override the file
        assert s.config.source == f"config file {path} and options"
        b = Buffers(s, 1, 4096, seed=9)
        key = keys_for("jsonns", "j", 1)
        assert s.batch_set(key, b.src_ptrs(), [4096]) == [0]
        assert s.batch_get(key, b.dst_ptrs(), [4096]) == [4096]
        s.clear()
    finally:
        s.close()


def test_config_both_spellings():
    for master_key in ("master_server_addr", "master_server_address"):
        for dev_key in ("rdma_devices", "device_name"):
            cfg, _ = load_mooncake_config({master_key: "h:50051", dev_key: "mlx5_1"}, {})
            assert cfg.master_server_addr == "h:50051" and cfg.rdma_devices == "mlx5_1"
    cfg, _ = load_mooncake_config({"master_server_addr": "h:1", "master_server_address": "h:1"}, {})
    assert cfg.master_server_addr == "h:1"
    with pytest.raises(StorageConfigError, match="master_server_addr=.*master_server_address="):
        load_mooncake_config({"master_server_addr": "h:1", "master_server_address": "h:2"}, {})


def test_sizes():
    assert parse_size(1024) == 1024
    assert parse_size("65536") == 65536
    assert parse_size("1gb") == 1 << 30
    assert parse_size("512MB") == 512 << 20
    assert parse_size("2 GiB") == 2 << 30
    assert parse_size("1.5k") == 1536
    for bad in ("lots", "-1", "1x", "", True, None, -5):
        with pytest.raises(StorageConfigError):
            parse_size(bad)


@pytest.mark.parametrize("options, env, needle", [
    ({}, {}, "master_server_addr"),
    ({"protocol": "tcp"}, {}, "master_server_addr"),
    ({"master_server_addr": "no-port"}, {}, "master_server_addr"),
    ({"master_server_addr": "h:99999"}, {}, "master_server_addr"),
    ({"master_server_addr": "h:1", "protocol": "carrier-pigeon"}, {}, "protocol"),
    ({"master_server_addr": "h:1", "global_segment_size": "lots"}, {}, "global_segment_size"),
    ({"master_server_addr": "h:1", "local_buffer_size": -1}, {}, "local_buffer_size"),
    ({"master_server_addr": "h:1", "rpc_timeout_ms": 0}, {}, "rpc_timeout_ms"),
    ({"master_server_addr": "h:1", "retry_interval": "soon"}, {}, "retry_interval"),
    ({"master_server_addr": "h:1", "segment_prefault": "eagerly"}, {}, "segment_prefault"),
    ({"master_server_addr": "h:1", "segment_prefault": True}, {}, "segment_prefault"),
    ({"master_server_addr": "h:1", "io_thread_nice": 20}, {}, "io_thread_nice"),
    ({"master_server_addr": "h:1", "io_thread_nice": -1}, {}, "io_thread_nice"),
    ({}, {"MOONCAKE_MASTER": "h:1", "MOONCAKE_PROTOCOL": "smoke"}, "protocol"),
    ({}, {"MOONCAKE_MASTER": "h:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "big"}, "global_segment_size"),
    ({}, {"MOONCAKE_MASTER": "h:1", "MOONCAKE_MASTER_SERVER_ADDR": "h:2"}, "MOONCAKE_MASTER_SERVER_ADDR"),
])
def test_bad_config_raises_naming_the_key(options, env, needle, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    with pytest.raises(StorageConfigError, match=needle) as info:
        MooncakeStore(namespace="bad", rank=0, options=options)
    assert not isinstance(info.value, MooncakeConnectionError)       # refused before connecting
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]", '{"protocol": "tcp"}'])
def test_bad_config_file_raises_naming_the_file(content, tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    with pytest.raises(StorageConfigError, match=str(path)) as info:
        MooncakeStore(namespace="bad", rank=0)
    assert not isinstance(info.value, MooncakeConnectionError)
    if content == '{"protocol": "tcp"}':
        assert "master_server_addr" in str(info.value)


def test_no_master_fails_fast_naming_the_address():
    addr = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(MooncakeConnectionError, match=addr) as info:
        MooncakeStore(namespace="nomaster", rank=0, options={"master_server_addr": addr, **SMALL})
    assert isinstance(info.value, StorageConfigError) and isinstance(info.value, ConnectionError)
    assert time.monotonic() - start < 5.0
