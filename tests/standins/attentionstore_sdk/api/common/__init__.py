"""Common protobuf definitions of the AttentionStore SDK contract stand-in (tests only)."""
