"""The Mooncake backend: the real Mooncake Store client over a ``mooncake_master``."""
from transfer_factory.mooncake.config import MooncakeConfig, load_mooncake_config
from transfer_factory.mooncake.connection import MooncakeConnectionError
from transfer_factory.mooncake.store import MooncakeStore

__all__ = ["MooncakeConfig", "MooncakeConnectionError", "MooncakeStore", "load_mooncake_config"]
