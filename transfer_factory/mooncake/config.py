"""Configuration of the Mooncake store client: options, a JSON file, or environment variables.

Configuration: the ``options`` dict when it names the master, else the JSON file named by
``MOONCAKE_CONFIG_PATH``, else ``MOONCAKE_*`` environment variables; in the last two cases
keys given in ``options`` override the file's or the environment's.  Both FastDeploy's and
Mooncake's spellings are accepted (two spellings with different values are an error):

    master_server_addr | master_server_address   MOONCAKE_MASTER | MOONCAKE_MASTER_SERVER_ADDR    (required)
    metadata_server                              MOONCAKE_TE_META_DATA_SERVER | MOONCAKE_METADATA_SERVER
                                                   (default "P2PHANDSHAKE": no metadata service needed)
    protocol                                     MOONCAKE_PROTOCOL                    (default "tcp")
    rdma_devices | device_name                   MOONCAKE_DEVICE | MOONCAKE_RDMA_DEVICES (default "")
    local_hostname                               MOONCAKE_LOCAL_HOSTNAME | LOCAL_HOSTNAME (default 127.0.0.1;
                                                   also read from the environment when a JSON file
                                                   leaves it out)
    global_segment_size                          MOONCAKE_GLOBAL_SEGMENT_SIZE  (default 512 MiB; int or "1gb")
    local_buffer_size                            MOONCAKE_LOCAL_BUFFER_SIZE    (default 64 MiB)

A pool across hosts: ``local_hostname`` is the address other hosts reach this client's segment
at (Mooncake names the segment after it and advertises it to readers).  A loopback one with a
master that is not on loopback is refused (``check_pool_addresses``, at the store's start): the
client's writes would succeed while no other host could read them.

Tuning (``options`` or the JSON file): ``rpc_timeout_ms`` (5000), ``rpc_connect_timeout_ms``
(2000), ``setup_retries`` (3), ``probe_timeout`` (1.0 s), ``retry_interval`` (1.0 s),
``reconnect_after`` (15 s), ``close_timeout`` (10 s, the wait for calls in flight),
``replica_num`` (1: memory replicas of every object put, each on another segment, best effort),
``segment_prefault`` ("populate": fault the mounted segment in at setup, ~0.35 s per GiB;
"hugepage": the same on transparent huge pages, 2-3 s per GiB for compaction; "off": leave it
to the first writes, each page's first write a page fault; see ``prefault.py``),
``placement`` ("local": every object written prefers the writer's own segment, so a block's
objects, all its ranks' and kinds', sit on the host that wrote them and a host cut off past the
master's ``client_ttl`` takes whole blocks with it, not a piece of nearly every block; "random":
Mooncake's default, a segment picked at random per object; docs/deployment.md has the figures),
``io_thread_nice`` (19: the nice value of a storage mover's I/O threads, which call Mooncake;
its batch calls busy-poll for completion, so the caller spins on a core for the whole transfer;
0 leaves them at the process's priority).  A missing
or malformed value, an unknown protocol, an unreadable or invalid JSON file raise
``StorageConfigError`` naming the key or the file, at construction, before anything connects.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from transfer_factory.kvcache_storage import StorageConfigError

log = logging.getLogger(__name__)

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
PROTOCOLS = ("tcp", "rdma", "ascend", "efa", "cxi", "nvlink", "hip")
DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_GLOBAL_SEGMENT_SIZE = 512 << 20
DEFAULT_LOCAL_BUFFER_SIZE = 64 << 20

# canonical key -> accepted spellings in options / the JSON file, and environment variables
_KEYS: dict[str, tuple[str, ...]] = {
    "master_server_addr": ("master_server_addr", "master_server_address"),
    "metadata_server": ("metadata_server",),
    "protocol": ("protocol",),
    "rdma_devices": ("rdma_devices", "device_name"),
    "local_hostname": ("local_hostname",),
    "global_segment_size": ("global_segment_size",),
    "local_buffer_size": ("local_buffer_size",),
}
_ENV: dict[str, tuple[str, ...]] = {
    "master_server_addr": ("MOONCAKE_MASTER", "MOONCAKE_MASTER_SERVER_ADDR"),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_METADATA_SERVER"),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "rdma_devices": ("MOONCAKE_DEVICE", "MOONCAKE_RDMA_DEVICES"),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE",),
}
# tuning key -> (default, kind); kind "ms"/"count" are ints >= 1, "nice" ints 0-19, "s" floats >= 0,
# "s>0" floats > 0
_TUNING: dict[str, tuple[float, str]] = {
    "rpc_timeout_ms": (5000, "ms"),
    "rpc_connect_timeout_ms": (2000, "ms"),
    "setup_retries": (3, "count"),
    "probe_timeout": (1.0, "s>0"),
    "retry_interval": (1.0, "s"),
    "reconnect_after": (15.0, "s"),
    "close_timeout": (10.0, "s"),
    "replica_num": (1, "count"),
    "io_thread_nice": (19, "nice"),
}
# tuning key -> (default, allowed values)
_CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "segment_prefault": ("populate", ("populate", "hugepage", "off")),
    "placement": ("local", ("local", "random")),
}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string such as "512MB", "1gb", "2 GiB", "65536" (1 KB = 1024 B)."""
    if isinstance(value, bool):
        raise StorageConfigError(f"Mooncake {key} {value!r} is not a size")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or (m.group(3) and m.group(3).lower() == "i"):
            raise StorageConfigError(f"Mooncake {key} {value!r} is not a size (e.g. 536870912, \"512MB\", \"1gb\")")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise StorageConfigError(f"Mooncake {key} {value!r} is not a size")
    if n < 0:
        raise StorageConfigError(f"Mooncake {key} {value!r} must not be negative")
    return n


@dataclass(frozen=True)
class MooncakeConfig:
    master_server_addr: str
    metadata_server: str = DEFAULT_METADATA_SERVER
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    source: str = "options"

    def master_host_port(self) -> tuple[str, int] | None:
        """(host, port) of a plain ``host:port`` master address; None for other forms (HA URLs)."""
        if "://" in self.master_server_addr:
            return None
        host, _, port = self.master_server_addr.rpartition(":")
        return host.strip("[]"), int(port)


def _pick(source: Mapping[str, Any], names: Sequence[str], canonical: str, where: str) -> Any:
    present = [(n, source[n]) for n in names if n in source and source[n] is not None and source[n] != ""]
    if len({json.dumps(v, sort_keys=True, default=str) for _, v in present}) > 1:
        spelled = ", ".join(f"{n}={v!r}" for n, v in present)
        raise StorageConfigError(f"Mooncake {canonical} is given twice with different values in {where}: {spelled}")
    return present[0][1] if present else None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise StorageConfigError(f"Mooncake config file {path} ({CONFIG_PATH_ENV}) cannot be read: {e}") from None
    except ValueError as e:
        raise StorageConfigError(f"Mooncake config file {path} ({CONFIG_PATH_ENV}) is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise StorageConfigError(f"Mooncake config file {path} ({CONFIG_PATH_ENV}) must hold a JSON object")
    return data


def _tuning(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (default, allowed) in _CHOICES.items():
        value = raw.get(key, default)
        if not isinstance(value, str) or value.strip().lower() not in allowed:
            raise StorageConfigError(f"Mooncake {key} {value!r} in {where} must be one of {', '.join(allowed)}")
        out[key] = value.strip().lower()
    for key, (default, kind) in _TUNING.items():
        value = raw.get(key, default)
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if kind in ("ms", "count"):
                if not number.is_integer() or number < 1:
                    raise ValueError
                number = int(number)
            elif kind == "nice":
                if not number.is_integer() or not 0 <= number <= 19:
                    raise ValueError
                number = int(number)
            elif number < 0 or (kind == "s>0" and number == 0) or number != number:
                raise ValueError
        except (TypeError, ValueError):
            need = {"ms": "a positive integer", "count": "a positive integer", "nice": "an integer from 0 to 19",
                    "s": "a number of seconds >= 0", "s>0": "a number of seconds > 0"}[kind]
            raise StorageConfigError(f"Mooncake {key} {value!r} in {where} must be {need}") from None
        out[key] = number
    return out


def _canonical(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    values = {}
    for canonical, names in _KEYS.items():
        value = _pick(raw, names, canonical, where)
        if value is not None:
            values[canonical] = value
    return values


def load_mooncake_config(options: Mapping[str, Any] | None = None,
                         environ: Mapping[str, str] | None = None) -> tuple[MooncakeConfig, dict[str, Any]]:
    """The connection settings and tuning.  Source: ``options`` when they name the master; else
    the JSON file at ``MOONCAKE_CONFIG_PATH``; else the ``MOONCAKE_*`` environment.  In the last
    two cases keys given in ``options`` (sizes, protocol, ...) override the source's."""
    environ = os.environ if environ is None else environ
    options = dict(options or {})
    known = {n for names in _KEYS.values() for n in names}
    unknown = sorted(set(options) - known - set(_TUNING) - set(_CHOICES))
    if unknown:
        log.warning("Mooncake options ignored (unknown): %s", ", ".join(unknown))
    overrides = _canonical(options, "options")
    if "master_server_addr" in overrides:
        values, tuning_raw, where = overrides, options, "options"
    elif environ.get(CONFIG_PATH_ENV):
        path = environ[CONFIG_PATH_ENV]
        where = f"config file {path}"
        data = _read_json(path)
        values = {**_canonical(data, where), **overrides}
        tuning_raw = {**data, **{k: v for k, v in options.items() if k in _TUNING or k in _CHOICES}}
        if "local_hostname" not in values:       # one file for every host, each host's own address
            own = _pick(environ, _ENV["local_hostname"], "local_hostname", "the environment")
            if own is not None:
                values["local_hostname"] = own
                where += " and the environment"
    else:
        where = "the environment"
        env = {canonical: _pick(environ, names, canonical, where) for canonical, names in _ENV.items()}
        values = {**{k: v for k, v in env.items() if v is not None}, **overrides}
        tuning_raw = options
        if "master_server_addr" not in values:
            raise StorageConfigError(
                "Mooncake master_server_addr is not configured: pass options {'master_server_addr': 'host:port', ...}, "
                f"set {CONFIG_PATH_ENV} to a JSON file, or set MOONCAKE_MASTER")
    if overrides and where != "options":
        where += " and options"

    master = values.get("master_server_addr")
    if master is None:
        raise StorageConfigError(f"Mooncake master_server_addr (or master_server_address) is missing in {where}")
    if not isinstance(master, str) or not _valid_master(master):
        raise StorageConfigError(f"Mooncake master_server_addr {master!r} in {where} must be host:port")
    for key in ("metadata_server", "local_hostname", "rdma_devices", "protocol"):
        if key in values and not isinstance(values[key], str):
            raise StorageConfigError(f"Mooncake {key} {values[key]!r} in {where} must be a string")
    protocol = values.get("protocol", "tcp").strip().lower()
    if protocol not in PROTOCOLS:
        raise StorageConfigError(f"Mooncake protocol {values['protocol']!r} in {where} is unknown; known: {', '.join(PROTOCOLS)}")
    sizes = {}
    for key in ("global_segment_size", "local_buffer_size"):
        if key in values:
            try:
                sizes[key] = parse_size(values[key], key)
            except StorageConfigError as e:
                raise StorageConfigError(f"{e} (in {where})") from None
    config = MooncakeConfig(
        master_server_addr=master.strip(),
        metadata_server=values.get("metadata_server", DEFAULT_METADATA_SERVER).strip() or DEFAULT_METADATA_SERVER,
        protocol=protocol,
        rdma_devices=values.get("rdma_devices", "").strip(),
        local_hostname=values.get("local_hostname", "127.0.0.1").strip() or "127.0.0.1",
        global_segment_size=sizes.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
        local_buffer_size=sizes.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE),
        source=where,
    )
    return config, _tuning(tuning_raw, where)


def _host_kind(host: str) -> str:
    """"loopback", "remote" (any other address, or a name resolving to one), or "unknown" (a name
    that does not resolve: the master probe reports that)."""
    name = host.strip().strip("[]")
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        if name.lower() == "localhost":
            return "loopback"
        try:
            addr = ipaddress.ip_address(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, ValueError, IndexError):
            return "unknown"
    return "loopback" if addr.is_loopback else "remote"


def _master_hosts(addr: str) -> list[str]:
    """The hosts of a master address: ``host:port``, or the endpoints of an HA URL (``etcd://a:1;b:2``)."""
    rest = addr.split("://", 1)[1] if "://" in addr else addr
    hosts = []
    for part in re.split(r"[;,]", rest.split("/", 1)[0]):
        host, sep, port = part.strip().rpartition(":")
        if sep and host and port.isdigit():
            hosts.append(host)
    return hosts


def check_pool_addresses(config: MooncakeConfig) -> None:
    """Refuses (``StorageConfigError``) a client whose ``local_hostname`` is a loopback address while
    its master is not on loopback: in a pool across hosts such a client mounts a segment named
    after 127.0.0.1, its writes land there and succeed, and every other host that reads them
    connects to its own loopback and fails (1-2 blocks of 6 read back on the two-host bed)."""
    if _host_kind(config.local_hostname) != "loopback":
        return
    remote = [h for h in _master_hosts(config.master_server_addr) if _host_kind(h) == "remote"]
    if remote:
        raise StorageConfigError(
            f"Mooncake local_hostname {config.local_hostname!r} is a loopback address but the master "
            f"{config.master_server_addr} is not on loopback (config from {config.source}; 127.0.0.1 is the "
            "default when local_hostname is not set): other hosts could not read this client's segment. "
            "Set local_hostname (MOONCAKE_LOCAL_HOSTNAME, or the local_hostname storage option) to this "
            "host's address that the other hosts reach, or run the master on 127.0.0.1 for one host")


def _valid_master(addr: str) -> bool:
    addr = addr.strip()
    if "://" in addr:          # e.g. an HA address; Mooncake checks it at setup
        return True
    host, sep, port = addr.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536)
