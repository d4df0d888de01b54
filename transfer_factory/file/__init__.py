"""The file backend: a log-structured store of KV objects in segment files under a private root."""
from transfer_factory.file.store import FileStore

__all__ = ["FileStore"]
