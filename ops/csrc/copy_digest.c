/*
 * The block copy with a digest of every block it wrote, taken while the block is still in the
 * caches (a P/D pull with digests on: transfer_factory.peer.digests).
 *
 * copy_blocks_digest(<the arguments of copy_blocks but bulk>, xxh3, out): copies block src_ids[i]
 * to dst_ids[i] of every layer as copy_blocks does (every id checked first, by the same checks),
 * but one block at a time with ordinary stores, and right after each block hashes the bytes it
 * just stored: out[l * n + i] = XXH3-64 (seed 0) of destination block dst_ids[i] of layer l.  So
 * the digest is of what landed, read back from the caches instead of from memory.  xxh3 is the
 * address of XXH3_64bits_withSeed(_dispatch) as transfer_factory.file._records bound it
 * (xxh3_address()).  The work is split over the copy pool's threads, a few blocks per item.
 */
#include "copy_digest.h"

#include <stdint.h>
#include <string.h>

#include "copy_checks.h"
#include "copy_pool.h"

typedef uint64_t (*xxh3_fn)(const void *data, size_t len, uint64_t seed);

#define ITEM_MIN_BYTES (256 * 1024) /* a pool item copies at least this (or one block) */
#define MAX_THREADS 64

typedef struct {
    const int64_t *sb, *db, *si, *di;
    long long src_stride, dst_stride;
    size_t block_bytes;
    Py_ssize_t n;           /* blocks per layer */
    size_t per_item;        /* (layer, block) pairs per pool item */
    size_t pairs;           /* layers * n */
    xxh3_fn xxh3;
    uint64_t *out;
} digest_work_t;

static void run_item(void *arg, size_t item)
{
    const digest_work_t *w = (const digest_work_t *)arg;
    size_t end = (item + 1) * w->per_item < w->pairs ? (item + 1) * w->per_item : w->pairs;
    for (size_t k = item * w->per_item; k < end; k++) {
        size_t l = k / (size_t)w->n, i = k % (size_t)w->n;
        char *dst = (char *)(intptr_t)w->db[l] + w->di[i] * w->dst_stride;
        const char *src = (const char *)(intptr_t)w->sb[l] + w->si[i] * w->src_stride;
        memcpy(dst, src, w->block_bytes);
        w->out[k] = w->xxh3(dst, w->block_bytes, 0);
    }
}

PyObject *py_copy_blocks_digest(PyObject *self, PyObject *args)
{
    PyObject *src_bases, *src_caps, *src_ids, *dst_bases, *dst_caps, *dst_ids, *out_obj;
    long long src_stride, dst_stride, block_bytes;
    unsigned long long xxh3;
    const char *src_name, *dst_name;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOLOsOOLOsLiKO:copy_blocks_digest", &src_bases, &src_caps, &src_stride, &src_ids,
                          &src_name, &dst_bases, &dst_caps, &dst_stride, &dst_ids, &dst_name, &block_bytes,
                          &num_threads, &xxh3, &out_obj))
        return NULL;
    if (xxh3 == 0) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks_digest: no XXH3 bound (xxh3 address 0)");
        return NULL;
    }
    side_bufs_t src = {0}, dst = {0};
    Py_buffer out = {0};
    int have_out = 0;
    PyObject *result = NULL;
    Py_ssize_t layers, n;
    if (load_side(src_bases, src_caps, src_ids, &src, src_name) < 0 ||
        load_side(dst_bases, dst_caps, dst_ids, &dst, dst_name) < 0)
        goto done;
    if (check_copy(&src, src_name, src_stride, &dst, dst_name, dst_stride, block_bytes, &layers, &n) < 0)
        goto done;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_out = 1;
    if (out.len != (Py_ssize_t)(8 * layers * n)) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, want 8 x layers x blocks = %zd", out.len,
                     (Py_ssize_t)(8 * layers * n));
        goto done;
    }
    if (layers * n == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    digest_work_t w = {src.bases.buf, dst.bases.buf, src.ids.buf, dst.ids.buf, src_stride, dst_stride,
                       (size_t)block_bytes, n, 1, (size_t)(layers * n), (xxh3_fn)(uintptr_t)xxh3, out.buf};
    if ((size_t)block_bytes < ITEM_MIN_BYTES)
        w.per_item = ITEM_MIN_BYTES / (size_t)block_bytes;
    size_t items = (w.pairs + w.per_item - 1) / w.per_item;
    int threads = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
    if ((size_t)threads > items)
        threads = (int)items;
    Py_BEGIN_ALLOW_THREADS
    copy_pool_run(run_item, &w, items, threads - 1);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (have_out)
        PyBuffer_Release(&out);
    release_side(&src);
    release_side(&dst);
    return result;
}
