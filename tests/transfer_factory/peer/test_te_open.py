"""Opening a rank's Transfer Engine: Mooncake draws its TCP data port at random, and two ranks
starting in the same millisecond once drew the same one ("Address already in use"), failing the
describe and the link.  A fresh engine draws again, a bounded number of times."""
import logging

import pytest

mooncake_engine = pytest.importorskip("mooncake.engine")

from transfer_factory.peer.te import OPEN_ATTEMPTS, PeerTransferError, TransferEngineEndpoint  # noqa: E402


class FlakyEngine:
    """Stands for ``TransferEngine``: the first ``fails`` initializations fail, as a port taken would."""

    fails = 0
    made = 0

    def __init__(self):
        type(self).made += 1

    def initialize(self, *args):
        if type(self).made <= type(self).fails:
            return -1
        return 0

    def get_rpc_port(self):
        return 12345


@pytest.mark.parametrize("fails, opens", [(1, True), (OPEN_ATTEMPTS - 1, True), (OPEN_ATTEMPTS, False)])
def test_a_transfer_engine_that_fails_to_start_is_tried_again_a_bounded_number_of_times(monkeypatch, fails, opens):
    FlakyEngine.fails, FlakyEngine.made = fails, 0
    monkeypatch.setattr(mooncake_engine, "TransferEngine", FlakyEngine)
    endpoint = TransferEngineEndpoint("127.0.0.1", "tcp", logging.getLogger("test_te_open"))
    if opens:
        assert endpoint.open() == "127.0.0.1:12345" and FlakyEngine.made == fails + 1
    else:
        with pytest.raises(PeerTransferError, match=f"{OPEN_ATTEMPTS} times"):
            endpoint.open()
        assert FlakyEngine.made == OPEN_ATTEMPTS and not endpoint.is_open
