/*
 * Digests of cache blocks for prefill/decode transfers (transfer_factory.peer.digests): XXH3-64
 * of a byte range of each listed block of each layer tensor, with the XXH3 that bind_xxh3 bound
 * from the xxhash package's own extension (records_io.c), the GIL let go.
 *
 * block_digests(bases, capacities, stride, ids, offset, nbytes, out):
 *   bases, capacities: int64 buffers, one per tensor (row); ids: int64 buffer of n block ids;
 *   out: a writable uint64 buffer of rows * n words, row-major: out[r * n + i] = XXH3-64 of the
 *   nbytes at bases[r] + ids[i] * stride + offset.  Every id is checked against its row's
 *   capacity and the range against the stride before any byte is read (ValueError naming it).
 */
#include "records.h"

static int as_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyObject *fr_block_digests(PyObject *self, PyObject *args)
{
    PyObject *bases_obj, *caps_obj, *ids_obj, *out_obj;
    long long stride, offset, nbytes;
    if (!PyArg_ParseTuple(args, "OOLOLLO:block_digests", &bases_obj, &caps_obj, &stride, &ids_obj, &offset, &nbytes,
                          &out_obj))
        return NULL;
    xxh3_fn xxh3 = fr_xxh3_direct;
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound (bind_xxh3)");
        return NULL;
    }
    Py_buffer bases = {0}, caps = {0}, ids = {0}, out = {0};
    PyObject *result = NULL;
    if (as_buffer(bases_obj, &bases, 0, 8, "bases") < 0)
        return NULL;
    if (as_buffer(caps_obj, &caps, 0, 8, "capacities") < 0)
        goto release_bases;
    if (as_buffer(ids_obj, &ids, 0, 8, "ids") < 0)
        goto release_caps;
    if (as_buffer(out_obj, &out, 1, 8, "out") < 0)
        goto release_ids;
    Py_ssize_t rows = bases.len / 8, n = ids.len / 8;
    const int64_t *b = bases.buf, *c = caps.buf, *id = ids.buf;
    uint64_t *o = out.buf;
    if (caps.len != bases.len) {
        PyErr_SetString(PyExc_ValueError, "bases and capacities differ in length");
        goto done;
    }
    if (out.len / 8 != rows * n) {
        PyErr_Format(PyExc_ValueError, "out holds %zd words, want rows x ids = %zd", out.len / 8, rows * n);
        goto done;
    }
    if (stride <= 0 || offset < 0 || nbytes <= 0 || offset + nbytes > stride) {
        PyErr_Format(PyExc_ValueError, "bytes [%lld, %lld) do not fit a block of stride %lld", offset, offset + nbytes,
                     stride);
        goto done;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (b[r] <= 0) {
            PyErr_Format(PyExc_ValueError, "row %zd: base %lld is not an address", r, (long long)b[r]);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (id[i] < 0 || id[i] >= c[r]) {
                PyErr_Format(PyExc_ValueError, "block id %lld outside [0, %lld) of row %zd", (long long)id[i],
                             (long long)c[r], r);
                goto done;
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        const char *base = (const char *)(uintptr_t)b[r] + offset;
        for (Py_ssize_t i = 0; i < n; i++)
            o[r * n + i] = xxh3(base + id[i] * stride, (size_t)nbytes, 0);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
release_ids:
    PyBuffer_Release(&ids);
release_caps:
    PyBuffer_Release(&caps);
release_bases:
    PyBuffer_Release(&bases);
    return result;
}

/* xxh3_address() -> int: the address of the XXH3 bind_xxh3 bound (0: none), for a kernel of another
 * extension that hashes what it copies (ops/csrc/copy_digest.c) without binding it again. */
PyObject *fr_xxh3_address(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)fr_xxh3_direct);
}
