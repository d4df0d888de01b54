"""Check the NPU platform on an Ascend host: swap round trips, bit-exact, and their bandwidth.

Run on an Ascend host with CANN's pyACL on the path (``source <cann>/set_env.sh``)::

    python scripts/check_npu.py --device 0 [--copy-engine acl|llm_datadist]

It allocates per-layer caches with ``acl.rt.malloc``, exports and imports them through IPC as an
engine and a CTM do, fills them with random bytes, swaps scattered blocks out to pinned host swap
space and back into other blocks, and compares every byte.  Then it times device->host and
host->device swaps of random scattered blocks against one contiguous ``acl.rt.memcpy`` per layer
of the same bytes in the same run, and prints the ratios and a final JSON line.  Without Ascend
hardware it runs over the tests' pyACL stand-in (``PYTHONPATH=tests/standins ACL_STANDIN_DIR=...``),
which checks the calls, not the speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ops  # noqa: E402
from ops.modes import DEVICE_TO_HOST, HOST_TO_DEVICE  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=256, help="device blocks per layer")
    p.add_argument("--block-bytes", type=int, default=128 << 10, help="bytes of one block of one layer")
    p.add_argument("--copy-engine", choices=["acl", "llm_datadist"], default="acl")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    for name in ("layers", "blocks", "block_bytes", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.block_bytes % 2:
        p.error(f"--block-bytes {args.block_bytes} must be even (bf16 caches)")

    kwargs = {} if args.copy_engine == "acl" else {"copy_engine": args.copy_engine}
    engine = ops.get_platform("npu", instance=f"check{os.getpid()}", **kwargs)
    ctm = ops.get_platform("npu", instance=f"check{os.getpid()}", **kwargs)
    engine.set_device(args.device)
    ctm.set_device(args.device)
    shape = [args.blocks, args.block_bytes // 2]
    rng = np.random.default_rng(0)
    exported, attached, hosts = [], [], []
    try:
        for layer in range(args.layers):
            t = engine.empty(shape, "bfloat16")
            engine.write_bytes(t, rng.integers(0, 256, (args.blocks, args.block_bytes), dtype=np.uint8))
            name = f"key_caches_{layer}_rank0.device{args.device}"
            engine.set_data_ipc(t, name)
            exported.append(t)
            attached.append(ctm.share_external_data_(SimpleNamespace(dtype="bfloat16"), name, shape))
            hosts.append(ctm.host_alloc(args.blocks * args.block_bytes))
        plan = ctm.plan_all_layers(attached, hosts, args.blocks)

        # bit-exact round trip of scattered blocks
        half = args.blocks // 2
        src = rng.permutation(args.blocks)[:half].tolist()
        dst = [b for b in range(args.blocks) if b not in set(src)][:half]
        want = [engine.read_bytes(t)[src] for t in exported]
        ctm.run_plan(plan, src, list(range(half)), DEVICE_TO_HOST)
        for t in exported:
            engine.write_bytes(t, np.zeros((args.blocks, args.block_bytes), np.uint8))
        ctm.run_plan(plan, dst, list(range(half)), HOST_TO_DEVICE)
        exact = all(np.array_equal(engine.read_bytes(t)[dst], w) for t, w in zip(exported, want))
        print(f"round trip of {half} scattered blocks x {args.layers} layers through host swap space: "
              f"{'bit-exact' if exact else 'MISMATCH'}")

        # bandwidth: scattered swaps against one contiguous copy per layer of the same bytes
        perm = rng.permutation(args.blocks).tolist()
        nbytes = args.blocks * args.block_bytes * args.layers
        rates: dict[str, list[float]] = {"d2h": [], "h2d": [], "memcpy_d2h": [], "memcpy_h2d": []}
        for _ in range(args.repeat):
            for key, mode in (("d2h", DEVICE_TO_HOST), ("h2d", HOST_TO_DEVICE)):
                t0 = time.perf_counter()
                ctm.run_plan(plan, perm, list(range(args.blocks)), mode)
                rates[key].append(nbytes / (time.perf_counter() - t0) / 1e9)
            for key, kind in (("memcpy_d2h", 2), ("memcpy_h2d", 1)):
                t0 = time.perf_counter()
                for view, host in zip(attached, hosts):
                    size = args.blocks * args.block_bytes
                    dst_ptr, src_ptr = (host, view.data_ptr()) if kind == 2 else (view.data_ptr(), host)
                    ret = ctm._acl.rt.memcpy(dst_ptr, size, src_ptr, size, kind)
                    if ret != 0:
                        raise RuntimeError(f"acl.rt.memcpy failed with {ret}")
                rates[key].append(nbytes / (time.perf_counter() - t0) / 1e9)
        med = {k: float(np.median(v)) for k, v in rates.items()}
        result = {"device": args.device, "copy_engine": args.copy_engine, "layers": args.layers,
                  "blocks": args.blocks, "block_bytes": args.block_bytes, "bit_exact": exact,
                  "d2h_gbps": round(med["d2h"], 3), "h2d_gbps": round(med["h2d"], 3),
                  "memcpy_d2h_gbps": round(med["memcpy_d2h"], 3), "memcpy_h2d_gbps": round(med["memcpy_h2d"], 3),
                  "d2h_ratio": round(med["d2h"] / med["memcpy_d2h"], 3),
                  "h2d_ratio": round(med["h2d"] / med["memcpy_h2d"], 3)}
        print(f"device->host {med['d2h']:.2f} GB/s ({result['d2h_ratio']:.2f}x a contiguous memcpy of "
              f"{med['memcpy_d2h']:.2f} GB/s); host->device {med['h2d']:.2f} GB/s "
              f"({result['h2d_ratio']:.2f}x {med['memcpy_h2d']:.2f} GB/s); median of {args.repeat}")
        print(json.dumps(result))
        return 0 if exact else 1
    finally:
        for ptr in hosts:
            ctm.host_free(ptr)
        for layer, (t, view) in enumerate(zip(exported, attached)):
            name = f"key_caches_{layer}_rank0.device{args.device}"
            ctm.unset_data_ipc(view, name, close_ipc=True)
            engine.unset_data_ipc(t, name, close_ipc=False, unlink_shm=True)
            engine.free(t)
        for t in exported[len(attached):]:
            engine.free(t)


if __name__ == "__main__":
    sys.exit(main())
