"""Installs the four packages of cache-transfer-manager and builds its C extensions."""
from setuptools import Extension, find_packages, setup

block_copy = Extension(
    "ops._block_copy",
    sources=["ops/csrc/block_copy.c", "ops/csrc/copy_checks.c", "ops/csrc/copy_pool.c", "ops/csrc/copy_digest.c"],
    extra_compile_args=["-O3", "-pthread", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

# The FileStore's batch-wide record work (key digests, headers, checksums, vectored I/O, index
# entries) and the P/D block digests (records_digest.c): see the .c files.  dl: it binds XXH3 from the
# xxhash package's own extension.
file_records = Extension(
    "transfer_factory.file._records",
    sources=[f"transfer_factory/file/csrc/records{part}.c" for part in ("", "_io", "_sha", "_index", "_digest")]
    + ["transfer_factory/csrc/sha256.c"],
    depends=["transfer_factory/file/csrc/records.h", "transfer_factory/csrc/sha256.h"],
    include_dirs=["transfer_factory/csrc"],
    extra_compile_args=["-O3", "-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    libraries=["dl"],
)

# The queue's check of every authenticated body (``cache_manager.queue.wire.check_plain``).
wire_check = Extension(
    "cache_manager.queue._wire_check",
    sources=["cache_manager/queue/csrc/wire_check.c"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

# The queue's frame MAC, seal and open (``cache_manager.queue.wire``), with the FileStore's SHA-256.
wire_seal = Extension(
    "cache_manager.queue._wire_seal",
    sources=["cache_manager/queue/csrc/wire_seal.c", "transfer_factory/csrc/sha256.c"],
    depends=["transfer_factory/csrc/sha256.h"],
    include_dirs=["transfer_factory/csrc"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

# Release stores and acquire loads of words in shared memory (the layer board, the exposure board).
shm_atomic = Extension(
    "ops._shm_atomic",
    sources=["ops/csrc/shm_atomic.c"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

setup(
    name="cache-transfer-manager",
    version="0.1.0",
    description="KV-cache transfer subsystem: device <-> host swap space <-> storage",
    # Every subpackage of the four (a listed set missed transfer_factory.peer, which the CTM imports).
    packages=find_packages(include=["cache_manager*", "ops*", "transfer_factory*", "engine_hooks*"]),
    ext_modules=[block_copy, file_records, wire_check, wire_seal, shm_atomic],
    python_requires=">=3.10",
    install_requires=["numpy", "pyzmq", "msgpack"],
    extras_require={
        # The CPU build is the embedded default; Ascend hosts install paddle-custom-npu instead.
        "cpu": ["paddlepaddle>=3.0"],
        "test": ["pytest", "hypothesis"],
    },
)
