"""Prefill/decode disaggregation on top of the service (DESIGN §3.11): the engine's side (``side``), the
decode side of a push (``push``) and the prefill side's lease reaper (``leases``)."""
from .side import DEFAULT_OFFER, TRANSPORT_CHOICES, PrefillDecode, offer_for

__all__ = ["DEFAULT_OFFER", "TRANSPORT_CHOICES", "PrefillDecode", "offer_for"]
