#!/usr/bin/env python3
"""Cross-host read and write rates of a Mooncake pool, on the two-host bed (tests/two_hosts.py).

Host a runs the master (``start_mooncake_master.py --rpc-address``) and one client that mounts the
pool's only segment; a client with no segment of its own writes ``--blocks`` objects of
``--block-kib`` KiB in one batch (``batch_put_from``) and reads them back (``batch_get_into``),
``--repeats`` times with fresh keys, through this repo's ``MooncakeStore``
(``scripts/mooncake_pool_client.py``).  Two writers in the same run:

  cross_host  the writer on host b: every byte crosses the veth pair between the hosts' network
              namespaces (TCP transport; the kernel's veth, no NIC, no wire)
  same_host   the writer on host a beside the segment: the same TCP transport over the host's own
              address, the floor a cross-host figure is read against

Each figure is the median of the repeats (GiB/s = bytes of the batch / seconds of the call).  The
bed is one machine: the ratio of the two is the cost of the path between namespaces, not of a
network.  Needs root (network namespaces) and the Mooncake wheel.  Prints a table, then one JSON
line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import _common  # puts the repo on sys.path

from scripts.mooncake_pool_client import PoolClient  # noqa: E402
from tests import two_hosts as bed_lib  # noqa: E402

REPO = _common.REPO_ROOT
STEP_S = 60.0


def _ask(client: PoolClient, **cmd) -> dict:
    answer = client.ask(STEP_S, **cmd)
    if "error" in answer:
        raise RuntimeError(f"{client.name}: {answer['error']}")
    return answer


def _client(host: bed_lib.Host, master: str, *args: str) -> PoolClient:
    client = PoolClient.start(host, master, *args)
    if not client.ready(STEP_S).get("ready"):
        raise RuntimeError(f"pool client on host {host.name}: {client.info}")
    return client


def _rates(answer: dict) -> dict:
    gib = answer["bytes"] / (1 << 30)
    put, get = statistics.median(answer["put_s"]), statistics.median(answer["get_s"])
    return {"put_gib_s": round(gib / put, 3), "get_gib_s": round(gib / get, 3),
            "put_ms": round(put * 1e3, 2), "get_ms": round(get * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="objects per batch")
    p.add_argument("--block-kib", type=int, default=512, help="KiB per object")
    p.add_argument("--repeats", type=int, default=5, help="batches per writer (the median is reported)")
    args = p.parse_args(argv)
    size = args.block_kib << 10
    batch = args.blocks * size
    # every batch fits at once: a read's lease (1 s) can keep a batch past its delete
    segment = max((2 * args.repeats + 2) * batch, 64 << 20)
    common = ["--buffer-size", str(16 << 20), "--arena", str(2 * batch + (1 << 20))]
    try:
        bed = bed_lib.make_bed(2)
    except bed_lib.BedUnavailable as e:
        print(json.dumps({"error": f"no two-host bed: {e}"}))
        return 2
    try:
        a, b = bed.a, bed.b
        env = {**os.environ, "PYTHONPATH": REPO}
        master = a.popen([sys.executable, "scripts/start_mooncake_master.py", "--rpc-address", a.address,
                          "--lease-ttl-ms", "1000"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        line = master.stdout.readline()     # the script gives up within its --start-timeout (20 s)
        if not line:
            raise RuntimeError(f"start_mooncake_master.py on host a exited with status {master.wait(10)}")
        addr = json.loads(line)["master_server_addr"]
        holder = _client(a, addr, "--segment-size", str(segment), *common)
        writers = {"cross_host": _client(b, addr, "--segment-size", "0", *common),
                   "same_host": _client(a, addr, "--segment-size", "0", *common)}
        out: dict = {"blocks": args.blocks, "block_kib": args.block_kib, "repeats": args.repeats,
                     "path": "TCP transport; two network namespaces on one machine joined by a veth pair"}
        for name, client in writers.items():
            out[name] = _rates(_ask(client, op="bench", blocks=args.blocks, size=size, repeats=args.repeats))
        for client in (*writers.values(), holder):
            client.quit()
        out["cross_over_same"] = {k: round(out["cross_host"][k] / out["same_host"][k], 3)
                                  for k in ("put_gib_s", "get_gib_s")}
    finally:
        bed.close()
    print(f"{'':12} {'put GiB/s':>10} {'get GiB/s':>10} {'put ms':>8} {'get ms':>8}")
    for name in ("cross_host", "same_host"):
        r = out[name]
        print(f"{name:12} {r['put_gib_s']:>10} {r['get_gib_s']:>10} {r['put_ms']:>8} {r['get_ms']:>8}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
