"""Shared bits of the scripts: make the repo importable when run as `python scripts/x.py`, logging."""
import logging
import os
import sys

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
