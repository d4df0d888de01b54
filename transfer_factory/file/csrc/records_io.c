/*
 * Payload checksums and vectored record I/O for transfer_factory.file._records (records.c has
 * the overview).
 */
#include "records.h"

#include <dlfcn.h>
#include <errno.h>
#include <string.h>

/* XXH3 straight from the xxhash package's own extension, when it exports the function (it does:
 * the wheel's _xxhash module is linked with default visibility): no Python call per object and
 * the GIL let go while hashing.  Set by bind_xxh3(); NULL means "call fn from Python". */
xxh3_fn fr_xxh3_direct = NULL;

/* The first n values as a new list of Python ints (the checksums both calls hand back). */
static PyObject *u64_list(const uint64_t *values, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *c = PyLong_FromUnsignedLongLong(values[i]);
        if (c == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, c);
    }
    return out;
}

PyObject *fr_bind_xxh3(PyObject *self, PyObject *arg)
{
    if (arg == Py_None) {                             /* unbind: checksums call fn from Python again */
        fr_xxh3_direct = NULL;
        Py_RETURN_FALSE;
    }
    PyObject *path = PyUnicode_EncodeFSDefault(arg);
    if (path == NULL)
        return NULL;
    /* RTLD_NOLOAD: only a library Python already loaded (importing xxhash did). */
    void *lib = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path);
    /* The _dispatch variant picks AVX2 or AVX-512 at run time (50 GB/s here); the plain one is
     * the SSE2 baseline the wheel is compiled for (26 GB/s).  Same results, so the first found. */
    static const char *const names[] = {"XXH3_64bits_withSeed_dispatch", "XXH3_64bits_withSeed"};
    fr_xxh3_direct = NULL;
    for (size_t i = 0; lib && fr_xxh3_direct == NULL && i < sizeof names / sizeof names[0]; i++) {
        fr_xxh3_direct = (xxh3_fn)dlsym(lib, names[i]);
        if (fr_xxh3_direct != NULL)
            /* The handle stays open: the library stays loaded as long as this module uses it. */
            return PyUnicode_FromString(names[i]);
    }
    Py_RETURN_FALSE;
}

PyObject *fr_checksums(PyObject *self, PyObject *args)
{
    PyObject *fn, *ptrs_obj, *sizes_obj;
    int via_python = 0;
    if (!PyArg_ParseTuple(args, "OOO|p:checksums", &fn, &ptrs_obj, &sizes_obj, &via_python))
        return NULL;
    uint64_t *ptrs = NULL, *sizes = NULL;
    Py_ssize_t n, ns;
    PyObject *out = NULL;
    if (fr_as_u64s(ptrs_obj, "ptrs", &ptrs, &n) < 0 || fr_as_u64s(sizes_obj, "sizes", &sizes, &ns) < 0)
        goto done;
    if (n != ns) {
        PyErr_SetString(PyExc_ValueError, "ptrs and sizes differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > (uint64_t)PY_SSIZE_T_MAX || (ptrs[i] == 0 && sizes[i])) {
            PyErr_Format(PyExc_ValueError, "record %zd: bad pointer or size", i);
            goto done;
        }
    }
    xxh3_fn direct = via_python ? NULL : fr_xxh3_direct;
    if (direct != NULL) {
        /* sizes[] is reused for the results: hashed with the GIL let go, then boxed. */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            sizes[i] = direct((const void *)(uintptr_t)ptrs[i], (size_t)sizes[i], 0) & 0xFFFFFFFFu;
        Py_END_ALLOW_THREADS
        out = u64_list(sizes, n);
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* A view of the caller's memory, no copy: the same thing the Python path hashes. */
        PyObject *view = PyMemoryView_FromMemory((char *)(uintptr_t)ptrs[i], (Py_ssize_t)sizes[i], PyBUF_READ);
        if (view == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyObject *r = PyObject_CallOneArg(fn, view);
        Py_DECREF(view);
        if (r == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        unsigned long long v = PyLong_AsUnsignedLongLongMask(r);
        Py_DECREF(r);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        PyObject *c = PyLong_FromUnsignedLong((unsigned long)(v & 0xFFFFFFFFu));
        if (c == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, c);
    }
done:
    PyMem_Free(ptrs);
    PyMem_Free(sizes);
    return out;
}

/* The iovecs of a run: header i, then record i's non-empty buffers.  NULL with an exception. */
static struct iovec *run_iovecs(Py_buffer *headers, PyObject *ptrs_obj, PyObject *sizes_obj, PyObject *counts_obj,
                                int *niov, size_t *total)
{
    uint64_t *ptrs = NULL, *sizes = NULL, *counts = NULL;
    Py_ssize_t n, ns, nrec;
    struct iovec *iov = NULL;
    if (fr_as_u64s(ptrs_obj, "ptrs", &ptrs, &n) < 0 || fr_as_u64s(sizes_obj, "sizes", &sizes, &ns) < 0)
        goto done;
    if (counts_obj != Py_None && fr_as_u64s(counts_obj, "counts", &counts, &nrec) < 0)
        goto done;
    if (counts == NULL)
        nrec = n;
    if (ns != n || nrec > headers->len / HEADER_SIZE || nrec > INT_MAX / 4 || n > INT_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "ptrs, sizes, counts and headers do not describe one run");
        goto done;
    }
    iov = PyMem_Malloc((size_t)(nrec + n + 1) * sizeof(struct iovec));
    if (iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int k = 0;
    size_t sum = 0;
    Py_ssize_t b = 0;
    char *h = headers->buf;
    for (Py_ssize_t i = 0; i < nrec; i++, h += HEADER_SIZE) {
        iov[k].iov_base = h;
        iov[k++].iov_len = HEADER_SIZE;
        sum += HEADER_SIZE;
        uint64_t c = counts ? counts[i] : 1;
        if (c > (uint64_t)(n - b)) {
            PyErr_SetString(PyExc_ValueError, "counts name more buffers than ptrs holds");
            PyMem_Free(iov);
            iov = NULL;
            goto done;
        }
        for (uint64_t j = 0; j < c; j++, b++) {
            if (sizes[b] == 0)
                continue;
            if (ptrs[b] == 0 || sizes[b] > (uint64_t)PY_SSIZE_T_MAX) {
                PyErr_Format(PyExc_ValueError, "buffer %zd: bad pointer or size", b);
                PyMem_Free(iov);
                iov = NULL;
                goto done;
            }
            iov[k].iov_base = (void *)(uintptr_t)ptrs[b];
            iov[k++].iov_len = sizes[b];
            sum += sizes[b];
        }
    }
    if (b != n) {
        PyErr_SetString(PyExc_ValueError, "counts name fewer buffers than ptrs holds");
        PyMem_Free(iov);
        iov = NULL;
        goto done;
    }
    *niov = k;
    *total = sum;
done:
    PyMem_Free(ptrs);
    PyMem_Free(sizes);
    PyMem_Free(counts);
    return iov;
}

/* Moves every iovec with as few calls as IOV_LIMIT allows, resuming after short transfers (the
 * iovecs are trimmed in place).  Returns bytes moved; a read stops early at the end of the file,
 * a write that accepts no byte fails with ENOSPC (a full regular file; retrying would spin). */
int64_t fr_move_all(int fd, struct iovec *iov, int niov, int64_t offset, int writing)
{
    int64_t done = 0;
    int i = 0;
    while (i < niov) {
        int cnt = niov - i < IOV_LIMIT ? niov - i : IOV_LIMIT;
        ssize_t got = writing ? pwritev(fd, iov + i, cnt, offset + done) : preadv(fd, iov + i, cnt, offset + done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0) {
            if (writing) {
                errno = ENOSPC;
                return -1;
            }
            break;
        }
        done += got;
        size_t left = (size_t)got;
        while (i < niov && left >= iov[i].iov_len)
            left -= iov[i++].iov_len;
        if (left) {
            iov[i].iov_base = (char *)iov[i].iov_base + left;
            iov[i].iov_len -= left;
        }
    }
    return done;
}

static PyObject *move_records(PyObject *args, int writing)
{
    int fd;
    long long offset;
    Py_buffer headers;
    PyObject *ptrs, *sizes, *counts;
    if (!PyArg_ParseTuple(args, writing ? "iLy*OOO:write_records" : "iLw*OOO:read_records", &fd, &offset, &headers,
                          &ptrs, &sizes, &counts))
        return NULL;
    int niov = 0;
    size_t total = 0;
    struct iovec *iov = offset < 0 ? NULL : run_iovecs(&headers, ptrs, sizes, counts, &niov, &total);
    if (offset < 0)
        PyErr_SetString(PyExc_ValueError, "offset must not be negative");
    if (iov == NULL) {
        PyBuffer_Release(&headers);
        return NULL;
    }
    int64_t done;
    int err;
    Py_BEGIN_ALLOW_THREADS
    done = fr_move_all(fd, iov, niov, offset, writing);
    err = errno;
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    PyBuffer_Release(&headers);
    if (done < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(done);
}

PyObject *fr_write_records(PyObject *self, PyObject *args) { return move_records(args, 1); }

PyObject *fr_read_records(PyObject *self, PyObject *args) { return move_records(args, 0); }

/* read_records for single-buffer records, each record's payload checksummed right after its
 * sub-piece (about ``sub_bytes``) is read, while it is still in the core's cache, all with the GIL
 * let go.  Returns (bytes read, checksums of the records read whole: a prefix).  Needs XXH3 bound
 * (bind_xxh3); RuntimeError otherwise. */
PyObject *fr_read_and_sum(PyObject *self, PyObject *args)
{
    int fd;
    long long offset, sub_bytes;
    Py_buffer headers;
    PyObject *ptrs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "iLw*OOL:read_and_sum", &fd, &offset, &headers, &ptrs_obj, &sizes_obj, &sub_bytes))
        return NULL;
    xxh3_fn xxh3 = fr_xxh3_direct;
    uint64_t *ptrs = NULL, *sizes = NULL;
    Py_ssize_t n = 0, ns;
    struct iovec *iov = NULL;
    PyObject *ret = NULL;
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound (bind_xxh3)");
        goto done;
    }
    if (fr_as_u64s(ptrs_obj, "ptrs", &ptrs, &n) < 0 || fr_as_u64s(sizes_obj, "sizes", &sizes, &ns) < 0)
        goto done;
    if (ns != n || n > headers.len / HEADER_SIZE || offset < 0 || n > INT_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "ptrs, sizes and headers do not describe one run");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ptrs[i] == 0 || sizes[i] == 0 || sizes[i] > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "record %zd: bad pointer or size", i);
            goto done;
        }
    }
    iov = PyMem_Malloc((size_t)(2 * n + 1) * sizeof(struct iovec));
    if (iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t done_bytes = 0;
    Py_ssize_t whole = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    char *h = headers.buf;
    while (i < n) {
        /* A sub-piece: records [i, j), at least one, about sub_bytes, at most IOV_LIMIT iovecs. */
        Py_ssize_t j = i;
        int k = 0;
        uint64_t bytes = 0;
        while (j < n && k + 2 <= IOV_LIMIT && (j == i || bytes < (uint64_t)sub_bytes)) {
            iov[k].iov_base = h + HEADER_SIZE * j;
            iov[k++].iov_len = HEADER_SIZE;
            iov[k].iov_base = (void *)(uintptr_t)ptrs[j];
            iov[k++].iov_len = sizes[j];
            bytes += HEADER_SIZE + sizes[j];
            j++;
        }
        int64_t got = fr_move_all(fd, iov, k, offset + done_bytes, 0);
        if (got < 0) {
            err = errno;
            done_bytes = -1;
            break;
        }
        /* The records read whole are checksummed now; sizes[] becomes their checksums. */
        uint64_t left = (uint64_t)got;
        for (; i < j && left >= HEADER_SIZE + sizes[i]; i++) {
            left -= HEADER_SIZE + sizes[i];
            sizes[i] = xxh3((const void *)(uintptr_t)ptrs[i], (size_t)sizes[i], 0) & 0xFFFFFFFFu;
            whole++;
        }
        done_bytes += got;
        if ((uint64_t)got < bytes)
            break;                                  /* the end of the file */
    }
    Py_END_ALLOW_THREADS
    if (done_bytes < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    PyObject *sums = u64_list(sizes, whole);
    if (sums == NULL)
        goto done;
    ret = Py_BuildValue("(LN)", (long long)done_bytes, sums);
done:
    PyMem_Free(iov);
    PyMem_Free(ptrs);
    PyMem_Free(sizes);
    PyBuffer_Release(&headers);
    return ret;
}
