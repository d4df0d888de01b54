#!/usr/bin/env python3
"""Start a mooncake_master (on loopback, or on an address other hosts reach) and run until SIGINT/SIGTERM.

Prints one JSON line with what a client needs (master_server_addr, metadata_server, protocol,
local_hostname, ...), usable as a ``MOONCAKE_CONFIG_PATH`` file or as the storage options of
the CTM, e.g.:

    python scripts/start_mooncake_master.py --config-out /tmp/mooncake.json &
    MOONCAKE_CONFIG_PATH=/tmp/mooncake.json python -m cache_manager.cache_transfer_manager ... \\
        --kvcache_storage_backend mooncake

Everything listens on 127.0.0.1; ports are free ones unless given.  ``--rpc-address ADDR`` (also
spelled ``--rpc_address``, ``--host``; an IP address of this host) binds the master's RPC port to
that address only and probes it there, for a pool across hosts; the printed config then has no
``local_hostname``: each client sets its own host's address (``MOONCAKE_LOCAL_HOSTNAME`` or the
``local_hostname`` option; a loopback one is refused with a non-loopback master), e.g.

    python scripts/start_mooncake_master.py --rpc-address 10.0.0.1 --rpc-port 50051 --client-ttl 10

The metrics port stays on 127.0.0.1 either way.  Clients use P2PHANDSHAKE
metadata, so no metadata server runs (``--http-metadata`` starts the master's embedded one,
which Mooncake 0.3.13 binds to every interface).  The master's log is appended to
``<--log-dir>/mooncake_master.log`` (default ``$CTM_LOG_DIR``, else ``./log``).  The master is
stopped (SIGTERM, then SIGKILL) when this script gets SIGINT or SIGTERM, and, on Linux, if
this script dies.  Exit status: 0 after a requested stop, 1 if the master could not start or
exited by itself (its log tail is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import _common  # puts the repo on sys.path

from scripts.local_mooncake_master import LocalMooncakeMaster, MooncakeMasterError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rpc-port", type=int, default=None, help="master RPC port (default: a free one)")
    p.add_argument("--rpc-address", "--rpc_address", "--host", dest="rpc_address", default="127.0.0.1",
                   help="the IP address of this host the RPC port binds to, which clients on other hosts "
                        "connect to (default: 127.0.0.1, this host only)")
    p.add_argument("--http-metadata", action="store_true",
                   help="run the master's HTTP metadata server (it listens on every interface in Mooncake 0.3.13)")
    p.add_argument("--http-port", type=int, default=None,
                   help="HTTP metadata server port, with --http-metadata (default: a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="metrics port (default: a free one)")
    p.add_argument("--lease-ttl-ms", type=int, default=5000, help="--default_kv_lease_ttl of the master (ms)")
    p.add_argument("--client-ttl", type=int, default=None, help="--client_ttl of the master (s)")
    p.add_argument("--start-timeout", type=float, default=20.0, help="seconds to wait for the master to answer")
    p.add_argument("--config-out", default=None, help="also write the config JSON to this file")
    p.add_argument("--log-dir", default=None,
                   help="directory of mooncake_master.log (default: $CTM_LOG_DIR, else ./log)")
    p.add_argument("--binary", default=None, help="mooncake_master binary (default: next to python, or on PATH)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("extra", nargs="*", help="extra mooncake_master flags, after --")
    args = p.parse_args(argv)
    _common.setup_logging(args.verbose)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        master = LocalMooncakeMaster(lease_ttl_ms=args.lease_ttl_ms, client_ttl_s=args.client_ttl,
                                     rpc_port=args.rpc_port, http_port=args.http_port, metrics_port=args.metrics_port,
                                     extra_args=args.extra, binary=args.binary, start_timeout=args.start_timeout,
                                     log_dir=args.log_dir, http_metadata=args.http_metadata, host=args.rpc_address)
        master.start()
    except MooncakeMasterError as e:
        print(f"start_mooncake_master: {e}", file=sys.stderr)
        return 1
    try:
        config = {**master.config(), "pid": master.pid, "log": master.log_path, "metrics_port": master.metrics_port}
        if args.http_metadata:
            config["http_port"] = master.http_port
        line = json.dumps(config)
        if args.config_out:
            tmp = f"{args.config_out}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(line + "\n")
            os.replace(tmp, args.config_out)
        print(line, flush=True)
        while not stop.wait(0.5):
            if not master.is_running():
                print(f"start_mooncake_master: mooncake_master exited by itself; log tail:\n{master.log_tail()}",
                      file=sys.stderr)
                return 1
        return 0
    finally:
        master.stop()


if __name__ == "__main__":
    sys.exit(main())
