/*
 * Input checks of the block-copy kernel (block_copy.c): loading each side's bases, capacities
 * and ids, and refusing, with a ValueError naming the value, anything that would let a copy
 * touch memory outside the blocks it describes.  Every check is the kernel's own contract, not
 * a repeat of the Python layer's: none of them may pass vacuously (zero layers, a capacity whose
 * addresses wrap), and none may itself read or write out of bounds whatever the ids.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "copy_checks.h"


void release_side(side_bufs_t *s)
{
    if (s->have_bases)
        PyBuffer_Release(&s->bases);
    if (s->have_caps)
        PyBuffer_Release(&s->caps);
    if (s->have_ids)
        PyBuffer_Release(&s->ids);
    PyMem_Free(s->listed_ids);
}

/* Block ids as a list of ints, as a rank's tasks bring them: a numpy array per side per copy cost
 * more than the copy of a small task.  Each item must be an int (not a bool) within int64. */
static int load_listed_ids(PyObject *list, side_bufs_t *s, const char *name)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    s->listed_ids = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (s->listed_ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(item)) {
            PyErr_Format(PyExc_ValueError, "%s block id %R at position %zd is not an integer", name, item, i);
            return -1;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) {
            PyErr_Format(PyExc_ValueError, "%s block id %R at position %zd is out of range", name, item, i);
            return -1;
        }
        s->listed_ids[i] = v;
    }
    s->ids.buf = s->listed_ids;
    s->ids.len = n * (Py_ssize_t)sizeof(int64_t);
    return 0;
}

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || !view->format ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0 &&
         strcmp(view->format, "=q") != 0)) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous int64 buffer (got format '%s')",
                     what, view->format ? view->format : "?");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

int load_side(PyObject *bases, PyObject *caps, PyObject *ids, side_bufs_t *s, const char *name)
{
    char what[96];
    snprintf(what, sizeof what, "%s layer bases", name);
    if (get_int64_buffer(bases, &s->bases, what) < 0)
        return -1;
    s->have_bases = 1;
    snprintf(what, sizeof what, "%s layer capacities", name);
    if (get_int64_buffer(caps, &s->caps, what) < 0)
        return -1;
    s->have_caps = 1;
    if (PyList_CheckExact(ids))
        return load_listed_ids(ids, s, name);
    snprintf(what, sizeof what, "%s block ids", name);
    if (get_int64_buffer(ids, &s->ids, what) < 0)
        return -1;
    s->have_ids = 1;
    return 0;
}

/* Checks every id of one side against every layer's capacity.  A capacity whose last block
 * would lie past INT64_MAX bytes is refused: id * stride could wrap and address anything. */
static int check_ids(const int64_t *ids, Py_ssize_t n, const int64_t *caps, Py_ssize_t layers,
                     int64_t stride, const char *name)
{
    int64_t min_cap = INT64_MAX;
    Py_ssize_t min_layer = 0;
    for (Py_ssize_t l = 0; l < layers; l++) {
        if (caps[l] < 0) {
            PyErr_Format(PyExc_ValueError, "%s capacity %lld of layer %zd is negative", name,
                         (long long)caps[l], l);
            return -1;
        }
        if (caps[l] > INT64_MAX / stride) {
            PyErr_Format(PyExc_ValueError, "%s capacity %lld of layer %zd times stride %lld overflows",
                         name, (long long)caps[l], l, (long long)stride);
            return -1;
        }
        if (caps[l] < min_cap) {
            min_cap = caps[l];
            min_layer = l;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= min_cap) {
            PyErr_Format(PyExc_ValueError,
                         "%s block id %lld at position %zd is out of range [0, %lld) (layer %zd)",
                         name, (long long)ids[i], i, (long long)min_cap, min_layer);
            return -1;
        }
    }
    return 0;
}

static int refuse_repeat(const char *name, int64_t id, Py_ssize_t pos)
{
    PyErr_Format(PyExc_ValueError, "%s block id %lld appears more than once (again at position %zd)",
                 name, (long long)id, pos);
    return -1;
}

typedef struct {
    int64_t id;
    Py_ssize_t pos;
} id_pos_t;

static int cmp_id_pos(const void *a, const void *b)
{
    const id_pos_t *x = a, *y = b;
    if (x->id != y->id)
        return x->id < y->id ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Duplicates by sorting (id, position) pairs: for a cache far larger than the task, where a
 * bitmap over every block would cost more than the ids (or fail to allocate).  Reports the
 * earliest repeat, as the bitmap does. */
static int check_unique_sorted(const int64_t *ids, Py_ssize_t n, const char *name)
{
    id_pos_t *pairs = malloc(sizeof(id_pos_t) * (size_t)n);
    if (!pairs) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        pairs[i] = (id_pos_t){ids[i], i};
    qsort(pairs, (size_t)n, sizeof(id_pos_t), cmp_id_pos);
    Py_ssize_t first = -1;
    for (Py_ssize_t k = 1; k < n; k++) /* within a run of one id, pairs[k].pos is a repeat */
        if (pairs[k].id == pairs[k - 1].id && (first < 0 || pairs[k].pos < pairs[first].pos))
            first = k;
    int rc = first < 0 ? 0 : refuse_repeat(name, pairs[first].id, pairs[first].pos);
    free(pairs);
    return rc;
}

/* Two sources into one destination block would race; refuse them.  Safe whatever it is given:
 * an id outside [0, cap) is refused here rather than trusted to an earlier check, and a bitmap
 * is only allocated while it is small or small next to the ids. */
#define UNIQUE_BITMAP_MAX_BYTES ((size_t)1 << 20)
static int check_unique(const int64_t *ids, Py_ssize_t n, int64_t cap, const char *name)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= cap) {
            PyErr_Format(PyExc_ValueError, "%s block id %lld at position %zd is out of range [0, %lld)",
                         name, (long long)ids[i], i, (long long)cap);
            return -1;
        }
    if (n < 2)
        return 0;
    if (n <= 32) { /* small tasks: a bitmap over the whole cache costs more */
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (ids[i] == ids[j])
                    return refuse_repeat(name, ids[i], i);
        return 0;
    }
    size_t nbytes = (size_t)cap / 8 + 1;
    if (nbytes > UNIQUE_BITMAP_MAX_BYTES && nbytes / 16 > (size_t)n)
        return check_unique_sorted(ids, n, name);
    unsigned char *seen = calloc(nbytes, 1);
    if (!seen) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        unsigned char bit = (unsigned char)(1u << (id & 7));
        if (seen[id >> 3] & bit) {
            free(seen);
            return refuse_repeat(name, id, i);
        }
        seen[id >> 3] |= bit;
    }
    free(seen);
    return 0;
}

int check_copy(const side_bufs_t *src, const char *src_name, long long src_stride, const side_bufs_t *dst,
               const char *dst_name, long long dst_stride, long long block_bytes, Py_ssize_t *layers_out,
               Py_ssize_t *n_out)
{
    Py_ssize_t layers = src->bases.len / 8;
    Py_ssize_t n = src->ids.len / 8;
    if (dst->bases.len / 8 != layers || src->caps.len / 8 != layers || dst->caps.len / 8 != layers) {
        PyErr_Format(PyExc_ValueError, "layer count mismatch: %s has %zd layers, %s has %zd", src_name,
                     layers, dst_name, dst->bases.len / 8);
        return -1;
    }
    if (layers < 1) { /* no layer: check_ids would pass every id against no capacity */
        PyErr_Format(PyExc_ValueError, "copy_blocks needs at least one layer (%s and %s have 0)",
                     src_name, dst_name);
        return -1;
    }
    if (dst->ids.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%s block ids (%zd) and %s block ids (%zd) differ in length",
                     src_name, n, dst_name, dst->ids.len / 8);
        return -1;
    }
    if (block_bytes <= 0 || block_bytes > src_stride || block_bytes > dst_stride) {
        PyErr_Format(PyExc_ValueError, "block_bytes %lld must be in (0, min(stride %lld, %lld)]",
                     block_bytes, src_stride, dst_stride);
        return -1;
    }
    const int64_t *sc = src->caps.buf, *dc = dst->caps.buf, *si = src->ids.buf, *di = dst->ids.buf;
    if (check_ids(si, n, sc, layers, src_stride, src_name) < 0 ||
        check_ids(di, n, dc, layers, dst_stride, dst_name) < 0)
        return -1;
    int64_t dst_max_cap = 0;
    for (Py_ssize_t l = 0; l < layers; l++)
        if (dc[l] > dst_max_cap)
            dst_max_cap = dc[l];
    if (check_unique(di, n, dst_max_cap, dst_name) < 0)
        return -1;
    *layers_out = layers;
    *n_out = n;
    return 0;
}
