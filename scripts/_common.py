"""Shared bits of the scripts: make the repo importable when run as `python scripts/x.py`, logging."""
import logging
import os
import sys
import threading
from typing import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def quiet_paddle() -> None:
    """Paddle warns about its CPU build at import; the scripts' output is the figures."""
    import warnings

    warnings.filterwarnings("ignore", module="paddle")


def per_rank(fn: Callable[[int], object], count: int) -> None:
    """``fn(rank)`` for every rank, in parallel threads when there are several (as the ranks run);
    the first exception is raised once all have ended."""
    if count == 1:
        fn(0)
        return
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def rounded(value: object) -> object:
    """``value`` with every float rounded to 4 places, inside dicts and lists too (a JSON line)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(x) for k, x in value.items()}
    if isinstance(value, list):
        return [rounded(x) for x in value]
    return value


def add_pd_size_arguments(p, mib: int, reps: int) -> None:
    """The P/D benchmarks' shape of a transfer: block sizes, layers, TP, bytes per transfer, repeats."""
    p.add_argument("--block-kib", default="16,512", help="comma-separated K block sizes of one layer on one rank, KiB")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mib", type=int, default=mib, help="at least this many MiB per rank per transfer (K+V, all layers)")
    p.add_argument("--reps", type=int, default=reps)
