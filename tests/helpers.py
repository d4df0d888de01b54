"""Small helpers shared by the tests: raw byte views of caches."""
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
