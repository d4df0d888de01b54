/* The block copy that digests every block it wrote; see copy_digest.c. */
#ifndef CTM_COPY_DIGEST_H
#define CTM_COPY_DIGEST_H

#include <Python.h>

PyObject *py_copy_blocks_digest(PyObject *self, PyObject *args);

#define COPY_BLOCKS_DIGEST_DOC                                                                            \
    "copy_blocks_digest(<copy_blocks' arguments but bulk>, xxh3, out) -> None\n\n"                          \
    "copy_blocks one block at a time, each hashed right after it was stored: out[l * n + i] = XXH3-64 of\n" \
    "destination block dst_ids[i] of layer l (out: uint64 buffer of layers x n; xxh3: the address of\n"    \
    "XXH3_64bits_withSeed, transfer_factory.file._records.xxh3_address())."

#endif
