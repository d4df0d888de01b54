"""Generated-API package of the AttentionStore SDK contract stand-in (tests only)."""
