"""Installs the four packages of cache-transfer-manager and builds its C extensions."""
from setuptools import Extension, setup

block_copy = Extension(
    "ops._block_copy",
    sources=["ops/csrc/block_copy.c", "ops/csrc/copy_pool.c"],
    extra_compile_args=["-O3", "-pthread", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

# The FileStore's batch-wide record work (key digests, headers, checksums, vectored I/O, index
# entries): see the .c file.  dl: it binds XXH3 from the xxhash package's own extension.
file_records = Extension(
    "transfer_factory._file_records",
    sources=[f"transfer_factory/csrc/file_records{part}.c" for part in ("", "_io", "_sha", "_index")]
    + ["transfer_factory/csrc/sha256.c"],
    depends=["transfer_factory/csrc/file_records.h", "transfer_factory/csrc/sha256.h"],
    extra_compile_args=["-O3", "-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    libraries=["dl"],
)

# The queue's check of every authenticated body (``cache_manager.wire.check_plain``).
wire_check = Extension(
    "cache_manager._wire_check",
    sources=["cache_manager/csrc/wire_check.c"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

# The queue's frame MAC, seal and open (``cache_manager.wire``), with the FileStore's SHA-256.
wire_seal = Extension(
    "cache_manager._wire_seal",
    sources=["cache_manager/csrc/wire_seal.c", "transfer_factory/csrc/sha256.c"],
    depends=["transfer_factory/csrc/sha256.h"],
    include_dirs=["transfer_factory/csrc"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

setup(
    name="cache-transfer-manager",
    version="0.1.0",
    description="KV-cache transfer subsystem: device <-> host swap space <-> storage",
    packages=["cache_manager", "ops", "transfer_factory", "engine_hooks"],
    ext_modules=[block_copy, file_records, wire_check, wire_seal],
    python_requires=">=3.10",
    install_requires=["numpy", "pyzmq", "msgpack"],
    extras_require={
        # The CPU build is the embedded default; Ascend hosts install paddle-custom-npu instead.
        "cpu": ["paddlepaddle>=3.0"],
        "test": ["pytest", "hypothesis"],
    },
)
