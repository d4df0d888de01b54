"""Utilities of the AttentionStore SDK contract stand-in (tests only): the error type in ``err``."""
