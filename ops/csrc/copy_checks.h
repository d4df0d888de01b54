/* Input checks of the block-copy kernel; see copy_checks.c. */
#ifndef CTM_COPY_CHECKS_H
#define CTM_COPY_CHECKS_H

#include <Python.h>
#include <stdint.h>

/* One side of a copy: int64 layer bases and capacities, and block ids (a buffer, or a list of
 * ints copied into listed_ids). */
typedef struct {
    Py_buffer bases, caps, ids;
    int have_bases, have_caps, have_ids;
    int64_t *listed_ids; /* ids given as a list of ints, copied here (ids.buf points at it) */
} side_bufs_t;

/* Loads bases, capacities and ids; on failure a ValueError is set.  Release either way. */
int load_side(PyObject *bases, PyObject *caps, PyObject *ids, side_bufs_t *s, const char *name);
void release_side(side_bufs_t *s);

/* Every check of copy_blocks before a byte moves: layer counts (at least one, equal on both
 * sides), id counts, block_bytes against the strides, every id against every layer's capacity,
 * no repeated destination.  0 with *layers_out and *n_out set, or -1 with a ValueError set. */
int check_copy(const side_bufs_t *src, const char *src_name, long long src_stride, const side_bufs_t *dst,
               const char *dst_name, long long dst_stride, long long block_bytes, Py_ssize_t *layers_out,
               Py_ssize_t *n_out);

#endif
