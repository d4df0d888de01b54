"""Small helpers shared by the tests: raw byte views of caches, a CPU K/V swap rig."""
import contextlib

import numpy as np
import paddle


def cache_bytes(tensor) -> np.ndarray:
    """A uint8 [num_blocks, block_bytes] view of a paddle cache tensor (no copy for uint8/f16; bf16 via int16)."""
    if tensor.dtype == paddle.bfloat16:
        arr = tensor.view(paddle.int16).numpy()
    else:
        arr = tensor.numpy()
    return arr.view(np.uint8).reshape(tensor.shape[0], -1)


def fill_random(platform, tensor, rng: np.random.Generator) -> None:
    """Overwrite a cache tensor allocated by the CPU platform with random bytes, in place."""
    view = platform.raw_view(tensor)
    view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)


@contextlib.contextmanager
def kv_swap_rig(instance: str, seed: int, layers: int = 3, device_blocks: int = 8, host_blocks: int = 4,
                block_bytes: int = 64):
    """A CPU platform with K and V caches of random bytes and host swap space for each, and the
    two kinds' swap plans: ``(platform, kinds)`` with ``kinds`` = ``[(caches, host_ptrs, plan), ...]``.
    Everything is freed on exit."""
    from ops.cpu import CpuPlatform

    platform = CpuPlatform(instance=instance)
    caches = [[platform.empty([device_blocks, block_bytes], "uint8") for _ in range(layers)] for _ in range(2)]
    hosts = [[platform.host_alloc(host_blocks * block_bytes) for _ in range(layers)] for _ in range(2)]
    try:
        rng = np.random.default_rng(seed)
        for t in caches[0] + caches[1]:
            fill_random(platform, t, rng)
        yield platform, [(c, h, platform.plan_all_layers(c, h, host_blocks)) for c, h in zip(caches, hosts)]
    finally:
        for t in caches[0] + caches[1]:
            platform.free(t)
        for ptr in hosts[0] + hosts[1]:
            platform.host_free(ptr)


def host_blocks_match(platform, kinds, host_slots, device_ids, host_blocks: int = 4, block_bytes: int = 64) -> bool:
    """Whether host slots ``host_slots`` of every kind and layer hold device blocks ``device_ids``."""
    return all(np.array_equal(platform.host_buffer(ptr, host_blocks * block_bytes).reshape(host_blocks, block_bytes)
                              [list(host_slots)], platform.raw_view(t)[list(device_ids)])
               for caches, ptrs, _ in kinds for t, ptr in zip(caches, ptrs))
