/*
 * Batch-wide record work for the FileStore (transfer_factory/file/segments.py has the format).
 *
 * At 16 KiB objects the store's Python cost per record (a header packed, a checksum call, an
 * iovec entry, a header checked) was several times the cost of copying the record's bytes.  These
 * functions do that work for a whole batch or run of records in one call:
 *
 *   pack_headers(digests, lengths, crcs) -> bytes       n live headers back to back (56 bytes each)
 *   parse_headers(buf, n) -> bytes                      per header: 0 invalid, 1 live, 2 dead
 *   checksums(fn, ptrs, sizes) -> list[int]             fn(view) & 0xFFFFFFFF for raw memory views
 *                                                       (XXH3 from xxhash's own library once bind_xxh3 found it)
 *   write_records(fd, offset, headers, ptrs, sizes, counts) -> int    pwritev of header+payload runs
 *   read_records(fd, offset, headers, ptrs, sizes, counts) -> int     preadv of the same shape
 *   read_and_sum(fd, offset, headers, ptrs, sizes, sub) -> (int, list) the same, checksummed as it goes
 *   key_digests(keys) -> list[bytes | None]             SHA-256 of every key (None: not a key)
 *   payload_bytes(ptrs, sizes) -> int                   sum(sizes) if every buffer is valid, else -1
 *   key_groups(keys, kinds), note_blocks(...)           the object groups of a batch, and their blocks
 *   Entry, new_entries(index, seg, ...)                 the index's values, made in bulk
 *   select_all(index, digests, ptrs, sizes)             a read batch's entries, looked up in bulk
 *
 * Files: records.c (this: headers, the module), records_io.c (checksums, vectored I/O),
 * records_sha.c (key digests), records_index.c (index entries, object groups).
 *
 * A run of n records is header i, then the buffers of record i (``counts[i]`` of them, or one each
 * when counts is None), for i in order.  Pointers are trusted: the Python side checked them.
 * The GIL is released around every system call; an error raises OSError with the errno.  The
 * header CRC is zlib's CRC-32 (same polynomial and conditioning), computed here so that no zlib
 * headers are needed at build time.
 */
#include "records.h"
#include "sha256.h"

#include <string.h>

/* zlib's CRC-32, eight bytes a step (slicing-by-8): a header's 48 bytes in 6 steps, not 48. */
static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32_of(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF]
            ^ crc_table[4][lo >> 24] ^ crc_table[3][p[4]] ^ crc_table[2][p[5]] ^ crc_table[1][p[6]]
            ^ crc_table[0][p[7]];
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static void put_le(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes)
{
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}


int fr_as_u64s(PyObject *seq, const char *what, uint64_t **out, Py_ssize_t *n)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    uint64_t *vals = PyMem_Malloc((size_t)(len ? len : 1) * sizeof(uint64_t));
    if (vals == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < len; i++) {
        vals[i] = PyLong_AsUnsignedLongLong(items[i]);
        if (vals[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is not a non-negative integer", what, i);
            PyMem_Free(vals);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = vals;
    *n = len;
    return 0;
}

PyObject *fr_pack_headers(PyObject *self, PyObject *args)
{
    PyObject *digests, *lengths_obj, *crcs_obj;
    if (!PyArg_ParseTuple(args, "OOO:pack_headers", &digests, &lengths_obj, &crcs_obj))
        return NULL;
    uint64_t *lengths = NULL, *crcs = NULL;
    Py_ssize_t n, nl, nc;
    PyObject *fast = NULL, *out = NULL;
    if (fr_as_u64s(lengths_obj, "lengths", &lengths, &nl) < 0 || fr_as_u64s(crcs_obj, "crcs", &crcs, &nc) < 0)
        goto done;
    fast = PySequence_Fast(digests, "digests must be a sequence");
    if (fast == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(fast);
    if (nl != n || nc != n) {
        PyErr_SetString(PyExc_ValueError, "digests, lengths and crcs differ in length");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * HEADER_SIZE);
    if (out == NULL)
        goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++, p += HEADER_SIZE) {
        if (!PyBytes_Check(items[i]) || PyBytes_GET_SIZE(items[i]) != 32 || crcs[i] > 0xFFFFFFFFu) {
            PyErr_Format(PyExc_ValueError, "record %zd: a digest must be 32 bytes and a crc 32 bits", i);
            Py_CLEAR(out);
            goto done;
        }
        memcpy(p + OFF_MAGIC, MAGIC_LIVE, MAGIC_SIZE);
        put_le(p + OFF_VERSION, FORMAT_VERSION, 2);
        put_le(p + OFF_FLAGS, 0, 2);
        put_le(p + OFF_PAYLOAD_LEN, lengths[i], 8);
        put_le(p + OFF_PAYLOAD_SUM, crcs[i], 4);
        memcpy(p + OFF_KEY_SHA256, PyBytes_AS_STRING(items[i]), 32);
        put_le(p + OFF_HEADER_CRC, crc32_of(p + OFF_VERSION, OFF_HEADER_CRC - OFF_VERSION), 4);
    }
done:
    Py_XDECREF(fast);
    PyMem_Free(lengths);
    PyMem_Free(crcs);
    return out;
}

PyObject *fr_parse_headers(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*n:parse_headers", &buf, &n))
        return NULL;
    if (n < 0 || n > buf.len / HEADER_SIZE) {
        PyBuffer_Release(&buf);
        return PyErr_Format(PyExc_ValueError, "%zd headers do not fit in %zd bytes", n, buf.len);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL) {
        char *st = PyBytes_AS_STRING(out);
        const unsigned char *p = buf.buf;
        for (Py_ssize_t i = 0; i < n; i++, p += HEADER_SIZE) {
            int live = memcmp(p + OFF_MAGIC, MAGIC_LIVE, MAGIC_SIZE) == 0;
            int dead = memcmp(p + OFF_MAGIC, MAGIC_DEAD, MAGIC_SIZE) == 0;
            /* An empty payload is never written (segments.py): such a header is damage. */
            int ok = (live || dead) && get_le(p + OFF_VERSION, 2) == FORMAT_VERSION && get_le(p + OFF_FLAGS, 2) == 0
                     && get_le(p + OFF_PAYLOAD_LEN, 8) != 0
                     && crc32_of(p + OFF_VERSION, OFF_HEADER_CRC - OFF_VERSION)
                            == (uint32_t)get_le(p + OFF_HEADER_CRC, 4);
            st[i] = (char)(ok ? (live ? 1 : 2) : 0);
        }
    }
    PyBuffer_Release(&buf);
    return out;
}


/* The payload bytes of a batch of single-buffer objects: the sum of ``sizes`` when every pointer
 * and size is an exact int, every pointer > 0 and every size > 0 (what the per-object check
 * accepts); -1 otherwise, and the caller checks object by object. */
PyObject *fr_payload_bytes(PyObject *self, PyObject *args)
{
    PyObject *ptrs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "OO:payload_bytes", &ptrs_obj, &sizes_obj))
        return NULL;
    PyObject *ptrs = PySequence_Fast(ptrs_obj, "ptrs must be a sequence");
    if (ptrs == NULL)
        return NULL;
    PyObject *sizes = PySequence_Fast(sizes_obj, "sizes must be a sequence");
    if (sizes == NULL) {
        Py_DECREF(ptrs);
        return NULL;
    }
    long long total = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ptrs);
    if (n == PySequence_Fast_GET_SIZE(sizes)) {
        PyObject **p = PySequence_Fast_ITEMS(ptrs), **z = PySequence_Fast_ITEMS(sizes);
        total = 0;
        for (Py_ssize_t i = 0; i < n && total >= 0; i++) {
            int o1, o2;
            if (!PyLong_CheckExact(p[i]) || !PyLong_CheckExact(z[i])) {
                total = -1;
                break;
            }
            long long a = PyLong_AsLongLongAndOverflow(p[i], &o1), b = PyLong_AsLongLongAndOverflow(z[i], &o2);
            if (o2 || b <= 0 || (!o1 && a <= 0) || o1 < 0 || total > LLONG_MAX - b)
                total = -1;
            else
                total += b;
        }
    }
    Py_DECREF(ptrs);
    Py_DECREF(sizes);
    return PyLong_FromLongLong(total);
}



static PyMethodDef methods[] = {
    {"pack_headers", fr_pack_headers, METH_VARARGS,
     "pack_headers(digests, lengths, crcs) -> bytes: the live record headers, 56 bytes each."},
    {"parse_headers", fr_parse_headers, METH_VARARGS,
     "parse_headers(buf, n) -> bytes: per header 0 (invalid), 1 (valid, live) or 2 (valid, dead)."},
    {"checksums", fr_checksums, METH_VARARGS,
     "checksums(fn, ptrs, sizes, via_python=False) -> list[int]: fn(view of each buffer) & 0xFFFFFFFF (XXH3 "
     "called directly when bind_xxh3 found it, unless via_python)."},
    {"block_digests", fr_block_digests, METH_VARARGS,
     "block_digests(bases, capacities, stride, ids, offset, nbytes, out): out[r * n + i] = XXH3-64 of nbytes at "
     "bases[r] + ids[i] * stride + offset (records_digest.c; needs bind_xxh3)."},
    {"xxh3_address", fr_xxh3_address, METH_NOARGS,
     "xxh3_address() -> int: the address of the XXH3 function bind_xxh3 bound, 0 when none."},
    {"bind_xxh3", fr_bind_xxh3, METH_O,
     "bind_xxh3(path) -> str | False: use XXH3_64bits_withSeed_dispatch (else XXH3_64bits_withSeed) of the "
     "loaded library at path for checksums; returns the name bound (None: stop, False)."},
    {"write_records", fr_write_records, METH_VARARGS,
     "write_records(fd, offset, headers, ptrs, sizes, counts) -> bytes written (all, or OSError)."},
    {"read_records", fr_read_records, METH_VARARGS,
     "read_records(fd, offset, headers, ptrs, sizes, counts) -> bytes read (short only at end of file)."},
    {"read_and_sum", fr_read_and_sum, METH_VARARGS,
     "read_and_sum(fd, offset, headers, ptrs, sizes, sub_bytes) -> (bytes read, checksums of the records read "
     "whole): read_records of single-buffer records, each checksummed while still in cache."},
    {"select_all", fr_select_all, METH_VARARGS,
     "select_all(index, digests, ptrs, sizes, siblings) -> (segs, offsets, lengths, crcs, all in siblings) when "
     "every object is stored, one valid buffer big enough; else None."},
    {"new_entries", fr_new_entries, METH_VARARGS,
     "new_entries(index, seg, digests, offsets, lengths, crcs, headers): index[d] = Entry(seg, ...) for each."},
    {"key_groups", fr_key_groups, METH_VARARGS,
     "key_groups(keys, kinds) -> list: each key's object group ('{ns}/{hash}/{rank}'), or None."},
    {"note_blocks", fr_note_blocks, METH_VARARGS,
     "note_blocks(groups, digests, done, index, siblings): siblings of the blocks whose members all succeeded."},
    {"payload_bytes", fr_payload_bytes, METH_VARARGS,
     "payload_bytes(ptrs, sizes) -> int: sum(sizes) when all are exact ints, ptrs > 0, sizes > 0; else -1."},
    {"key_digests", fr_key_digests, METH_O,
     "key_digests(keys) -> list: SHA-256 of each key's UTF-8 (lone surrogates passed through); None for a "
     "key that is not a non-empty str."},
    {"sha256", fr_sha256_bytes, METH_VARARGS,
     "sha256(buffer, portable=False) -> bytes: the SHA-256 digest (for tests; portable: without SHA-NI)."},
    {NULL, NULL, 0, NULL},
};

/* HEADER_LAYOUT: {field: (offset, size)} of records.h, in header order. */
static PyObject *header_layout(void)
{
    return Py_BuildValue("{s(ii)s(ii)s(ii)s(ii)s(ii)s(ii)s(ii)}", "magic", OFF_MAGIC, MAGIC_SIZE, "version",
                         OFF_VERSION, 2, "flags", OFF_FLAGS, 2, "payload_len", OFF_PAYLOAD_LEN, 8, "payload_sum",
                         OFF_PAYLOAD_SUM, 4, "key_sha256", OFF_KEY_SHA256, 32, "header_crc", OFF_HEADER_CRC, 4);
}

/* PyModule_AddObjectRef of a new reference (or NULL with an exception), which it then drops. */
static int add_new(PyObject *m, const char *name, PyObject *value)
{
    int r = value == NULL ? -1 : PyModule_AddObjectRef(m, name, value);
    Py_XDECREF(value);
    return r;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transfer_factory.file._records",
    "Batch-wide record headers, checksums and vectored I/O for the FileStore (see records.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};
PyMODINIT_FUNC PyInit__records(void)
{
    crc_init();
    int sha_ni = sha256_setup();
    if (PyType_Ready(&fr_EntryType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "SHA_NI", sha_ni) < 0
                      || PyModule_AddObjectRef(m, "Entry", (PyObject *)&fr_EntryType) < 0
                      || PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0
                      || PyModule_AddIntConstant(m, "FORMAT_VERSION", FORMAT_VERSION) < 0
                      || add_new(m, "LIVE", PyBytes_FromStringAndSize(MAGIC_LIVE, MAGIC_SIZE)) < 0
                      || add_new(m, "DEAD", PyBytes_FromStringAndSize(MAGIC_DEAD, MAGIC_SIZE)) < 0
                      || add_new(m, "HEADER_LAYOUT", header_layout()) < 0))
        Py_CLEAR(m);
    return m;
}
