"""A rank's side of prefill/decode disaggregation (DESIGN §3.11): its links to the ranks of other
engine instances (``links``), the transfers over them (``transfers``), and one channel per peer
transport under one interface (``channel``: ``ipc``, ``te`` for the Mooncake Transfer Engine,
``datadist`` for LLM-DataDist)."""
