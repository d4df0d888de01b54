"""Cache dtypes: their sizes and how a raw buffer becomes a paddle tensor without a copy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheDtype:
    name: str
    itemsize: int
    numpy_storage: type  # numpy type with the same bytes; paddle views it as `name`


_DTYPES = {
    d.name: d
    for d in (
        CacheDtype("bfloat16", 2, np.int16),  # numpy has no bfloat16: int16 storage, viewed as bf16
        CacheDtype("float16", 2, np.float16),
        CacheDtype("uint8", 1, np.uint8),
        CacheDtype("float32", 4, np.float32),
    )
}

SUPPORTED_DTYPES = tuple(_DTYPES)


def cache_dtype(name: object) -> CacheDtype:
    """Look up a dtype by name ('bfloat16', paddle.bfloat16, 'paddle.float16', np.uint8 ...)."""
    if isinstance(name, type) and issubclass(name, np.generic):
        key = np.dtype(name).name
    elif isinstance(name, np.dtype):
        key = name.name
    else:
        key = str(name).removeprefix("paddle.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return _DTYPES[key]
