"""The CacheTransferManager's command-line flags: FastDeploy's, checked, and this project's own.

``parse_args`` exits non-zero naming the flag for any bad value, before anything is attached;
``layout_from_args`` is the cache layout the flags describe (the engine built its caches from the same
layout): FastDeploy's ``--key_cache_shape`` family, or this project's ``--cache_layout``.
FastDeploy-only flags are accepted and documented as such, so its launch lines work as they are.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import ops
from transfer_factory import backend_names

from cache_manager.cache_layout import CacheLayout, load_layout
from cache_manager.cache_spec import CacheSpec
from cache_manager.queue.checks import MAX_BARRIER_TIMEOUT
from cache_manager.storage.transfer_modes import TRANSFER_MODES

CACHE_DTYPES = ("uint8", "bfloat16", "block_wise_fp8")


def _shape(text: str) -> list[int]:
    if text in ("", "none", "None"):
        return []
    try:
        dims = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N,H,B,D (comma-separated integers)") from None
    if len(dims) != 4 or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} must be 4 positive integers N,H,B,D")
    return dims


def _json(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _nonneg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def _positive(text: str) -> int:
    value = _nonneg(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _port(text: str) -> int:
    value = _nonneg(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port")
    return value


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean")


NPU_COPY_ENGINE_DEFAULT = "acl"
# FastDeploy (develop, 2026-05) passes --create_cache_tensor when a storage backend is set in mixed mode, and its
# worker then waits for the CTM to allocate the caches.  A CTM never allocates them (DESIGN §1): waiting for a
# cache_ready_signal that no one sets would only fail after --attach_timeout, the worker waiting for ever.
CREATE_CACHE_TENSOR_REFUSED = (
    "argument --create_cache_tensor: this CTM never allocates the device caches; the engine's worker creates "
    "and exports them, then sets cache_ready_signal. FastDeploy passes the flag when its worker waits for the "
    "CTM to create them (a storage backend in mixed mode): make the worker create them (FastDeploy #8046) and "
    "drop --create_cache_tensor from launch_cache_manager's command (docs/fastdeploy.md)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("cache_transfer_manager", description="KV-cache transfer manager for one TP rank")
    p.add_argument("--splitwise_role", default="mixed", choices=["mixed", "prefill", "decode"])
    p.add_argument("--rank", type=_nonneg, default=0)
    p.add_argument("--device_id", type=_nonneg, default=0)
    p.add_argument("--max_model_len", type=_positive, default=8192)
    p.add_argument("--num_layers", type=_positive, default=1)
    p.add_argument("--mp_num", type=_positive, default=1)
    p.add_argument("--cache_dtype", default="bfloat16", choices=CACHE_DTYPES)
    p.add_argument("--default_dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--key_cache_shape", type=_shape, default=None, help="N,H,B,D (required without --cache_layout)")
    p.add_argument("--value_cache_shape", type=_shape, default=[], help="N,H,B,D; empty for MLA")
    p.add_argument("--cache_queue_port", type=_port, required=True)
    p.add_argument("--enable_splitwise", type=_flag, default=False)
    p.add_argument("--pod_ip", default="127.0.0.1")
    p.add_argument("--engine_worker_queue_port", type=_port, required=True)
    p.add_argument("--num_cpu_blocks", type=_nonneg, default=0)
    p.add_argument("--protocol", default="ipc", choices=["ipc", "rdma", "ipc,rdma"])
    p.add_argument("--local_data_parallel_id", type=_nonneg, default=0)
    p.add_argument("--rdma_port", default="")
    p.add_argument("--speculative_config", type=_json, default={})
    p.add_argument("--create_cache_tensor", type=_flag, nargs="?", const=True, default=False,
                   help="FastDeploy's request that the CTM allocate the device caches: refused (a CTM never "
                        "does; the engine's worker creates them); 0 is accepted")
    p.add_argument("--kvcache_storage_backend", default="none", choices=backend_names() + ("none",))
    p.add_argument("--write_policy", default="write_through",
                   choices=["write_through", "write_back", "write_through_selective", "none"],
                   help="accepted for FastDeploy; the engine's prefix cache decides what to write and when")
    p.add_argument("--model_path", default="")
    # this project's own
    p.add_argument("--platform", default=os.environ.get("CTM_PLATFORM", "cpu"), choices=sorted(ops.PLATFORMS))
    p.add_argument("--npu_copy_engine", default=NPU_COPY_ENGINE_DEFAULT, choices=ops.copy_engines("npu"),
                   help="how the NPU platform moves swap-space blocks: acl (pyACL batched copies) or llm_datadist "
                        "(LLM-DataDist swap_blocks); given only to platforms with copy engines (see CacheTransferManager)")
    p.add_argument("--ipc_suffix", default=None,
                   help="FastDeploy passes this in some versions; accepted, signals use --engine_worker_queue_port")
    p.add_argument("--ipc_instance", default=None, help="instance id in CPU segment names (default: engine_worker_queue_port, with the token "
                        "the engine gives in CTM_IPC_TOKEN)")
    p.add_argument("--engine_pid", type=_positive, default=None, help="exit when this process is gone (default: the parent)")
    p.add_argument("--attach_timeout", type=float, default=120.0, help="seconds to wait for cache_ready_signal")
    p.add_argument("--log_dir", default=os.environ.get("CTM_LOG_DIR", "log"))
    p.add_argument("--swap_threads", type=_positive, default=1, help="workers per swap direction")
    p.add_argument("--model_version", default="", help="part of the storage namespace (at start; an RL update "
                                                          "re-reads it from <model_path>/version.yaml)")
    p.add_argument("--rl_barrier_timeout", type=float, default=5.0,
                   help="seconds a rank waits at an RL clear/restore barrier for the other ranks before it logs "
                        "the missing ones and arrives at the next")
    p.add_argument("--storage_options", type=_json, default={}, help="JSON options of the storage backend")
    p.add_argument("--num_cpu_state_slots", type=_nonneg, default=0,
                   help="host swap slots of the cache layout's state groups (a swap's state_slots)")
    p.add_argument("--cache_layout", default=None,
                   help="a grouped cache layout (JSON text or a JSON file; cache_manager/cache_layout.py): MLA latent "
                        "+ rope, indexers, sliding windows, state; replaces the --key_cache_shape family")
    p.add_argument("--storage_transfer", default="auto", choices=TRANSFER_MODES,
                   help="direct: backend reads/writes the caches in place; staged: through a staging buffer")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rank >= args.mp_num:
        parser.error(f"argument --rank: {args.rank} must be below --mp_num {args.mp_num}")
    spec = args.speculative_config
    extra = spec.get("num_extra_cache_layer", 0)
    ratio = spec.get("num_gpu_block_expand_ratio", 1)
    if not isinstance(extra, int) or extra < 0:
        parser.error(f"argument --speculative_config: num_extra_cache_layer {extra!r} must be a non-negative integer")
    if not isinstance(ratio, (int, float)) or ratio <= 0:
        parser.error(f"argument --speculative_config: num_gpu_block_expand_ratio {ratio!r} must be positive")
    if args.cache_layout is not None:
        try:
            args.layout = load_layout(args.cache_layout)
        except ValueError as exc:
            parser.error(f"argument --cache_layout: {exc}")
        args.key_cache_shape = [args.layout.num_blocks, 1, args.layout.block_size, 1]
        given = sys.argv[1:] if argv is None else argv
        if args.layout.num_layers != args.num_layers and any(a.startswith("--num_layers") for a in given):
            parser.error(f"argument --num_layers: {args.num_layers}, the --cache_layout has {args.layout.num_layers}")
        args.num_layers = args.layout.num_layers
    elif not args.key_cache_shape:
        parser.error("the following arguments are required: --key_cache_shape (or --cache_layout)")
    else:
        args.layout = None
    if args.value_cache_shape and args.value_cache_shape[0] != args.key_cache_shape[0]:
        parser.error(f"argument --value_cache_shape: {args.value_cache_shape[0]} blocks, "
                     f"--key_cache_shape has {args.key_cache_shape[0]}")
    if args.create_cache_tensor:
        parser.error(CREATE_CACHE_TENSOR_REFUSED)
    if args.attach_timeout <= 0:
        parser.error(f"argument --attach_timeout: {args.attach_timeout} must be positive")
    if not 0 < args.rl_barrier_timeout <= MAX_BARRIER_TIMEOUT:
        parser.error(f"argument --rl_barrier_timeout: {args.rl_barrier_timeout} must be in (0, {MAX_BARRIER_TIMEOUT:g}]")
    return args


def layout_from_args(args: argparse.Namespace) -> CacheLayout:
    """The cache layout the flags describe (the engine built its caches from the same layout)."""
    return args.layout if args.layout is not None else spec_from_args(args).layout()


def spec_from_args(args: argparse.Namespace) -> CacheSpec:
    """The FastDeploy cache spec of the ``--key_cache_shape`` family of flags."""
    n, heads, block_size, head_dim = args.key_cache_shape
    value = args.value_cache_shape
    spec = args.speculative_config
    return CacheSpec(num_layers=args.num_layers, num_blocks=n, kv_heads=heads, block_size=block_size,
                     head_dim=head_dim, cache_dtype=args.cache_dtype, default_dtype=args.default_dtype,
                     mla=not value, num_extra_layers=spec.get("num_extra_cache_layer", 0),
                     extra_block_ratio=spec.get("num_gpu_block_expand_ratio", 1),
                     value_block_shape=tuple(value[1:]) if value and value[1:] != args.key_cache_shape[1:] else None)
