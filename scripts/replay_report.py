"""The replay's report (``replay_trace.py``): the summary table, the plot (hit ratio over time, the
tier breakdown, and with ``--pd`` the transfers, with records the slowest requests' timelines) and
the final JSON line."""
from __future__ import annotations

import argparse
import json

import numpy as np

import replay_events
import replay_instances
import replay_pd
import replay_records
import replay_tenants
from engine_hooks.prefix_cache import TIERS


def print_summary(r: dict, args: argparse.Namespace) -> None:
    gib = 2**30
    policy = r["write_policy"] + (f", threshold {r['write_threshold']}"
                                  if r["write_policy"] == "write_through_selective" else "")
    rows = [
        ("requests replayed", f"{r['requests']} ({r['skipped_requests']} skipped) in {r['elapsed_s']:.1f} s "
                              f"({r['requests_per_s']:.0f} req/s)"),
        ("KV blocks", f"{r['blocks']}  (TP={args.tp}, {args.num_layers} layers, {args.block_bytes} B per layer-block)"
         if not r.get("model") else
         f"{r['blocks']}  (TP={args.tp}, {r['model']}: {r['cache_layers']} layers, dimensions / "
         f"{r['model_dim_scale']}, {r['kv_blocks_per_hash']} blocks of {r['layout_block_tokens']} tokens per "
         f"trace block; {r['bytes_per_block']:,} B per block, naive layout {r['naive_bytes_per_block']:,} B)"),
        ("hit ratio, all tiers", f"{r['hit_ratio']:7.2%}   (trace's ceiling {r['theoretical_hit_ratio']:.2%})"),
        ("  device", f"{r['device_hit_ratio']:7.2%}"),
        ("  host", f"{r['host_hit_ratio']:7.2%}"),
        ("  storage", f"{r['storage_hit_ratio']:7.2%}"),
        ("  miss (computed)", f"{r['miss_ratio']:7.2%}"),
        ("prefill tokens saved", f"{r['prefill_tokens_saved']:,} of {r['prefill_tokens_total']:,} "
                                 f"({r['prefill_tokens_saved'] / max(1, r['prefill_tokens_total']):.1%})"),
        ("moved device->host", f"{r['bytes_d2h'] / gib:8.3f} GiB"),
        ("moved host->device", f"{r['bytes_h2d'] / gib:8.3f} GiB"),
        ("moved to storage", f"{r['bytes_to_storage'] / gib:8.3f} GiB"),
        ("moved from storage", f"{r['bytes_from_storage'] / gib:8.3f} GiB"),
        ("transfer rate", f"{r['transfer_gbps']:.2f} GB/s while transferring ({r['transfer_busy_s']:.1f} s busy, "
                          f"{r['tasks']} tasks)"),
        ("task latency", f"p50 {r['task_p50_ms']:.2f} ms, p99 {r['task_p99_ms']:.2f} ms"),
        ("write policy", f"{policy}: {r['storage_write_blocks']} blocks newly stored"),
        ("verified blocks", f"{r['verified_blocks']} transferred and bit-exact, {r['corrupt_blocks']} corrupt"),
        ("device hits", f"{r['device_hits']} (checked; no bytes moved)"),
    ]
    if "store_cleanup_s" in r:
        rows.append(("temporary store", f"removed in {r['store_cleanup_s']:.2f} s"))
    if r.get("model"):
        rows += model_rows(r)
    if r.get("instances", 1) > 1:
        rows += replay_instances.summary_rows(r)
    if r.get("pd"):
        rows += replay_pd.summary_rows(r)
    rows += replay_events.summary_rows(r)
    rows += replay_tenants.summary_rows(r)
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 50))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 50))


def model_rows(r: dict) -> list[tuple[str, str]]:
    """Bytes per request per tier against the naive all-layers-full layout."""
    kib = 1024
    rows = []
    for tier, what in (("device_to_host", "device->host"), ("host_to_device", "host->device"),
                       ("to_storage", "to storage"), ("from_storage", "from storage"), ("pd", "P/D"), ("all", "all")):
        if tier not in r["bytes_per_request"]:
            continue
        got, naive = r["bytes_per_request"][tier], r["naive_bytes_per_request"][tier]
        share = f" ({got['total'] / naive['total']:.1%} of naive)" if naive["total"] else ""
        rows.append((f"  per request, {what}", f"median {got['median'] / kib:,.0f} KiB, mean {got['mean'] / kib:,.0f} "
                                               f"KiB; naive {naive['median'] / kib:,.0f} / {naive['mean'] / kib:,.0f} "
                                               f"KiB{share}"))
    return [("bytes moved per request", f"{r['model']} layout against every layer full and uncompressed")] + rows


def plot(r: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = r["_timeline"]
    x = np.arange(1, len(timeline) + 1)
    totals = np.array([n for n, _, _ in timeline], dtype=float)
    ceiling = np.array([c for _, c, _ in timeline], dtype=float)
    per = {t: np.array([c[t] for _, _, c in timeline], dtype=float) for t in TIERS}
    window = max(1, len(timeline) // 40)
    kernel = np.ones(window)

    def rolling(a: np.ndarray) -> np.ndarray:
        return np.convolve(a, kernel, mode="same") / np.maximum(np.convolve(totals, kernel, mode="same"), 1)

    pd_timeline = r.get("_pd_timeline")
    slowest = r.get("slowest_requests")
    rows = (3 if pd_timeline else 2) + bool(slowest)
    fig, axes = plt.subplots(rows, 1, figsize=(9, (10 if pd_timeline else 7) + (3 if slowest else 0)))
    for ax in axes[1:rows - bool(slowest)]:
        ax.sharex(axes[0])  # request index; the slowest requests' panel has its own axis (ms)
    if slowest:
        replay_records.plot_panel(axes[-1], slowest)
    ax1, ax2 = axes[:2]
    ax1.stackplot(x, [rolling(per[t]) for t in TIERS[:3]], labels=["device", "host", "storage"],
                  colors=["#2b8cbe", "#7bccc4", "#f0a04b"])
    ax1.set_ylabel(f"hit ratio (rolling, {window} requests)")
    ax1.set_ylim(0, 1)
    ax1.legend(loc="upper left")
    cum_hits = np.cumsum(totals - per["miss"]) / np.cumsum(totals)
    ax2.plot(x, cum_hits, label="cumulative hit ratio", color="#084081")
    ax2.plot(x, np.cumsum(ceiling) / np.cumsum(totals), linestyle="--", color="grey",
             label="trace's ceiling (blocks seen before)")
    ax2.set_ylabel("hit ratio")
    ax2.set_xlabel("request")
    ax2.set_ylim(0, 1)
    ax2.legend(loc="lower right")
    if r.get("_kill_index") is not None:
        for ax in (ax1, ax2):
            ax.axvline(r["_kill_index"] + 0.5, color="#c0392b", linestyle=":", label="instance killed")
        ax2.legend(loc="lower right")
    if pd_timeline:
        replay_pd.plot_panel(axes[2], pd_timeline)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict, args: argparse.Namespace, source: str) -> None:
    """The summary, the plot and the JSON line."""
    print_summary(result, args)
    if args.plot:
        plot(result, args.plot, f"{source}: {result['requests']} requests, TP={args.tp}, storage {args.storage}")
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.items()
                          if not k.startswith("_")}), flush=True)
