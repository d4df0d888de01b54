"""Peer transports for prefill/decode disaggregation (DESIGN §3.11).

A rank of one engine instance moves a request's blocks to or from a rank of another instance.
This package holds what both sides agree on before a byte moves:

- ``descriptor``: what a rank publishes about itself (instance, rank, TP, cache layout, the
  transports it offers) and the check that two layouts can exchange blocks, which names the
  first field that differs.
"""
from transfer_factory.peer.descriptor import (LayoutMismatch, PeerDescriptor, choose_transport, compatible_layouts,
                                              usable_transports)

__all__ = ["LayoutMismatch", "PeerDescriptor", "choose_transport", "compatible_layouts", "usable_transports"]
