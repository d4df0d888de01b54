"""What the record tests share (tests/transfer_factory/file/: test_file_store_records.py,
test_file_store_bulk.py): the namespace, keys of one kind of one block, and a store opened without fsync."""
from transfer_factory.file.store import FileStore

NS = "model-tp2-0123456789abcdef"


def key(i, kind="k"):
    return f"{NS}/{i:064x}/0/{kind}"


def open_store(root, **options):
    options.setdefault("fsync", False)
    return FileStore(namespace=NS, rank=0, options={"root": str(root), **options})
