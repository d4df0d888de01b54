/*
 * Batch-wide record work for the FileStore (transfer_factory/file_segments.py has the format).
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
 * A run of n records is header i, then the buffers of record i (``counts[i]`` of them, or one each
 * when counts is None), for i in order.  Pointers are trusted: the Python side checked them.
 * The GIL is released around every system call; an error raises OSError with the errno.  The
 * header CRC is zlib's CRC-32 (same polynomial and conditioning), computed here so that no zlib
 * headers are needed at build time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <dlfcn.h>
#include <sys/uio.h>

#define HEADER_SIZE 56
#define FORMAT_VERSION 2
#define IOV_LIMIT 1024 /* Linux's IOV_MAX */

static uint32_t crc_table[256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_of(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
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

/* The items of a list or tuple as unsigned 64-bit integers; -1 with an exception set. */
static int as_u64s(PyObject *seq, const char *what, uint64_t **out, Py_ssize_t *n)
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

static PyObject *pack_headers(PyObject *self, PyObject *args)
{
    PyObject *digests, *lengths_obj, *crcs_obj;
    if (!PyArg_ParseTuple(args, "OOO:pack_headers", &digests, &lengths_obj, &crcs_obj))
        return NULL;
    uint64_t *lengths = NULL, *crcs = NULL;
    Py_ssize_t n, nl, nc;
    PyObject *fast = NULL, *out = NULL;
    if (as_u64s(lengths_obj, "lengths", &lengths, &nl) < 0 || as_u64s(crcs_obj, "crcs", &crcs, &nc) < 0)
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
        memcpy(p, "CTKR", 4);
        put_le(p + 4, FORMAT_VERSION, 2);
        put_le(p + 6, 0, 2);
        put_le(p + 8, lengths[i], 8);
        put_le(p + 16, crcs[i], 4);
        memcpy(p + 20, PyBytes_AS_STRING(items[i]), 32);
        put_le(p + 52, crc32_of(p + 4, HEADER_SIZE - 8), 4);
    }
done:
    Py_XDECREF(fast);
    PyMem_Free(lengths);
    PyMem_Free(crcs);
    return out;
}

static PyObject *parse_headers(PyObject *self, PyObject *args)
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
            int live = memcmp(p, "CTKR", 4) == 0, dead = memcmp(p, "CTKD", 4) == 0;
            int ok = (live || dead) && get_le(p + 4, 2) == FORMAT_VERSION && get_le(p + 6, 2) == 0
                     && crc32_of(p + 4, HEADER_SIZE - 8) == (uint32_t)get_le(p + 52, 4);
            st[i] = (char)(ok ? (live ? 1 : 2) : 0);
        }
    }
    PyBuffer_Release(&buf);
    return out;
}

/* XXH3 straight from the xxhash package's own extension, when it exports the function (it does:
 * the wheel's _xxhash module is linked with default visibility): no Python call per object and
 * the GIL let go while hashing.  Set by bind_xxh3(); NULL means "call fn from Python". */
typedef uint64_t (*xxh3_fn)(const void *data, size_t len, uint64_t seed);
static xxh3_fn xxh3_direct = NULL;

static PyObject *bind_xxh3(PyObject *self, PyObject *arg)
{
    PyObject *path = PyUnicode_EncodeFSDefault(arg);
    if (path == NULL)
        return NULL;
    /* RTLD_NOLOAD: only a library Python already loaded (importing xxhash did). */
    void *lib = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path);
    xxh3_direct = lib ? (xxh3_fn)dlsym(lib, "XXH3_64bits_withSeed") : NULL;
    /* The handle stays open: the library stays loaded as long as this module uses it. */
    return PyBool_FromLong(xxh3_direct != NULL);
}

static PyObject *checksums(PyObject *self, PyObject *args)
{
    PyObject *fn, *ptrs_obj, *sizes_obj;
    int via_python = 0;
    if (!PyArg_ParseTuple(args, "OOO|p:checksums", &fn, &ptrs_obj, &sizes_obj, &via_python))
        return NULL;
    uint64_t *ptrs = NULL, *sizes = NULL;
    Py_ssize_t n, ns;
    PyObject *out = NULL;
    if (as_u64s(ptrs_obj, "ptrs", &ptrs, &n) < 0 || as_u64s(sizes_obj, "sizes", &sizes, &ns) < 0)
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
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    xxh3_fn direct = via_python ? NULL : xxh3_direct;
    if (direct != NULL) {
        /* sizes[] is reused for the results: hashed with the GIL let go, then boxed. */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            sizes[i] = direct((const void *)(uintptr_t)ptrs[i], (size_t)sizes[i], 0) & 0xFFFFFFFFu;
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *c = PyLong_FromUnsignedLongLong(sizes[i]);
            if (c == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyList_SET_ITEM(out, i, c);
        }
        goto done;
    }
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
    if (as_u64s(ptrs_obj, "ptrs", &ptrs, &n) < 0 || as_u64s(sizes_obj, "sizes", &sizes, &ns) < 0)
        goto done;
    if (counts_obj != Py_None && as_u64s(counts_obj, "counts", &counts, &nrec) < 0)
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
static int64_t move_all(int fd, struct iovec *iov, int niov, int64_t offset, int writing)
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
    done = move_all(fd, iov, niov, offset, writing);
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

static PyObject *write_records(PyObject *self, PyObject *args) { return move_records(args, 1); }

static PyObject *read_records(PyObject *self, PyObject *args) { return move_records(args, 0); }


/* ------------------------------------------------------------------------------- key digests */
/* SHA-256 of every key of a batch.  hashlib costs ~0.8 us a key from Python (object, encode,
 * call, digest); one call for the batch with the SHA extensions where the CPU has them (a few
 * tens of ns a short key), else the portable rounds below. */
static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_blocks_c(uint32_t st[8], const unsigned char *p, size_t nblocks)
{
    for (; nblocks--; p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR32(w[t - 15], 7) ^ ROR32(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR32(w[t - 2], 17) ^ ROR32(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR32(e, 6) ^ ROR32(e, 11) ^ ROR32(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ROR32(a, 2) ^ ROR32(a, 13) ^ ROR32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        st[0] += a, st[1] += b, st[2] += c, st[3] += d, st[4] += e, st[5] += f, st[6] += g, st[7] += h;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI_PATH 1

__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_ni(uint32_t st[8], const unsigned char *p, size_t nblocks)
{
    const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&st[0]);
    __m128i s1 = _mm_loadu_si128((const __m128i *)&st[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);              /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);                /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);        /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);             /* CDGH */
    for (; nblocks--; p += 64) {
        __m128i abef = s0, cdgh = s1, w[16];
        for (int j = 0; j < 4; j++)
            w[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), mask);
        for (int j = 4; j < 16; j++) {
            __m128i x = _mm_sha256msg1_epu32(w[j - 4], w[j - 3]);
            x = _mm_add_epi32(x, _mm_alignr_epi8(w[j - 1], w[j - 2], 4));
            w[j] = _mm_sha256msg2_epu32(x, w[j - 1]);
        }
        for (int j = 0; j < 16; j++) {
            __m128i m = _mm_add_epi32(w[j], _mm_loadu_si128((const __m128i *)&K256[4 * j]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, m);
            m = _mm_shuffle_epi32(m, 0x0E);
            s0 = _mm_sha256rnds2_epu32(s0, s1, m);
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);               /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);             /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);                /* HGFE */
    _mm_storeu_si128((__m128i *)&st[0], s0);
    _mm_storeu_si128((__m128i *)&st[4], s1);
}

static int cpu_has_sha_ni(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19)) || !(c & (1u << 9)))   /* SSE4.1, SSSE3 */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b >> 29) & 1;                                                          /* SHA */
}
#endif


typedef void (*blocks_fn)(uint32_t st[8], const unsigned char *p, size_t nblocks);

static blocks_fn sha256_blocks = sha256_blocks_c;  /* sha256_blocks_ni where the CPU has SHA-NI */

static void sha256_with(blocks_fn blocks, const unsigned char *msg, size_t len, unsigned char out[32])
{
    uint32_t st[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t full = len / 64;
    blocks(st, msg, full);
    unsigned char tail[128];
    size_t rest = len - full * 64;
    memcpy(tail, msg + full * 64, rest);
    tail[rest] = 0x80;
    size_t tlen = rest + 1 + 8 <= 64 ? 64 : 128;
    memset(tail + rest + 1, 0, tlen - rest - 1);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++)
        tail[tlen - 1 - i] = (unsigned char)(bits >> (8 * i));
    blocks(st, tail, tlen / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(st[i] >> 24);
        out[4 * i + 1] = (unsigned char)(st[i] >> 16);
        out[4 * i + 2] = (unsigned char)(st[i] >> 8);
        out[4 * i + 3] = (unsigned char)st[i];
    }
}

static void sha256(const unsigned char *msg, size_t len, unsigned char out[32])
{
    sha256_with(sha256_blocks, msg, len, out);
}

static PyObject *sha256_bytes(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*|p:sha256", &buf, &portable))
        return NULL;
    unsigned char out[32];
    sha256_with(portable ? sha256_blocks_c : sha256_blocks, buf.buf, (size_t)buf.len, out);
    PyBuffer_Release(&buf);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static PyObject *key_digests(PyObject *self, PyObject *keys)
{
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i], *d;
        if (!PyUnicode_Check(k) || PyUnicode_GET_LENGTH(k) == 0) {
            d = Py_NewRef(Py_None);                   /* not a key: the caller reports INVALID */
        } else {
            Py_ssize_t len;
            const char *utf8 = PyUnicode_AsUTF8AndSize(k, &len);
            PyObject *enc = NULL;
            if (utf8 == NULL) {                       /* lone surrogates: passed through, as the store always did */
                PyErr_Clear();
                enc = PyUnicode_AsEncodedString(k, "utf-8", "surrogatepass");
                if (enc == NULL) {
                    Py_CLEAR(out);
                    goto done;
                }
                utf8 = PyBytes_AS_STRING(enc);
                len = PyBytes_GET_SIZE(enc);
            }
            unsigned char md[32];
            sha256((const unsigned char *)utf8, (size_t)len, md);
            Py_XDECREF(enc);
            d = PyBytes_FromStringAndSize((const char *)md, 32);
            if (d == NULL) {
                Py_CLEAR(out);
                goto done;
            }
        }
        PyList_SET_ITEM(out, i, d);
    }
done:
    Py_DECREF(fast);
    return out;
}


/* The payload bytes of a batch of single-buffer objects: the sum of ``sizes`` when every pointer
 * and size is an exact int, every pointer > 0 and every size > 0 (what the per-object check
 * accepts); -1 otherwise, and the caller checks object by object. */
static PyObject *payload_bytes(PyObject *self, PyObject *args)
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


/* ------------------------------------------------------------------------------- object groups */
/* file_space.group_of for every key: ``{namespace}/{hash}/{rank}`` when the key ends in
 * ``/{kind}`` with kind one of ``kinds``, else None. */
static PyObject *key_groups(PyObject *self, PyObject *args)
{
    PyObject *keys_obj, *kinds;
    if (!PyArg_ParseTuple(args, "OO!:key_groups", &keys_obj, &PyTuple_Type, &kinds))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_obj, "keys must be a sequence");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *k = items[i], *g = NULL;
        if (PyUnicode_Check(k)) {
            Py_ssize_t len = PyUnicode_GET_LENGTH(k);
            Py_ssize_t slash = len ? PyUnicode_FindChar(k, '/', 0, len, -1) : -1;
            if (slash == -2) {
                Py_CLEAR(out);
                break;
            }
            if (slash > 0) {
                PyObject *kind = PyUnicode_Substring(k, slash + 1, len);
                int known = kind == NULL ? -1 : PySequence_Contains(kinds, kind);
                Py_XDECREF(kind);
                if (known < 0) {
                    Py_CLEAR(out);
                    break;
                }
                if (known && (g = PyUnicode_Substring(k, 0, slash)) == NULL) {
                    Py_CLEAR(out);
                    break;
                }
            }
        }
        PyList_SET_ITEM(out, i, g != NULL ? g : Py_NewRef(Py_None));
    }
    Py_DECREF(keys);
    return out;
}

/* FileStore._note_blocks after its early exit: for every group whose members (in ``groups`` /
 * ``digests``, None skipped) all succeeded (``done``) and are more than one, the tuple of their
 * digests becomes ``siblings[d]`` of each member ``d`` still in ``index``. */
static PyObject *note_blocks(PyObject *self, PyObject *args)
{
    PyObject *groups_obj, *digests_obj, *done_obj, *index, *siblings;
    if (!PyArg_ParseTuple(args, "OOOO!O!:note_blocks", &groups_obj, &digests_obj, &done_obj, &PyDict_Type, &index,
                          &PyDict_Type, &siblings))
        return NULL;
    PyObject *groups = NULL, *digests = NULL, *done = NULL, *blocks = NULL, *failed = NULL, *ret = NULL;
    if ((groups = PySequence_Fast(groups_obj, "groups")) == NULL
        || (digests = PySequence_Fast(digests_obj, "digests")) == NULL
        || (done = PySequence_Fast(done_obj, "done")) == NULL
        || (blocks = PyDict_New()) == NULL || (failed = PySet_New(NULL)) == NULL)
        goto out;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(groups);
    if (PySequence_Fast_GET_SIZE(digests) != n || PySequence_Fast_GET_SIZE(done) != n) {
        PyErr_SetString(PyExc_ValueError, "groups, digests and done differ in length");
        goto out;
    }
    PyObject **g = PySequence_Fast_ITEMS(groups), **d = PySequence_Fast_ITEMS(digests);
    PyObject **ok = PySequence_Fast_ITEMS(done);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (g[i] == Py_None || d[i] == Py_None)
            continue;
        PyObject *members = PyDict_GetItemWithError(blocks, g[i]);
        if (members == NULL) {
            if (PyErr_Occurred() || (members = PyList_New(0)) == NULL)
                goto out;
            int r = PyDict_SetItem(blocks, g[i], members);
            Py_DECREF(members);                      /* the dict holds it */
            if (r < 0)
                goto out;
        }
        if (PyList_Append(members, d[i]) < 0)
            goto out;
        int truth = PyObject_IsTrue(ok[i]);
        if (truth < 0 || (!truth && PySet_Add(failed, g[i]) < 0))
            goto out;
    }
    Py_ssize_t pos = 0;
    PyObject *group, *members;
    while (PyDict_Next(blocks, &pos, &group, &members)) {
        Py_ssize_t m = PyList_GET_SIZE(members);
        int bad = PySet_Contains(failed, group);
        if (bad < 0)
            goto out;
        if (bad || m < 2)
            continue;
        PyObject *t = PyList_AsTuple(members);
        if (t == NULL)
            goto out;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *dj = PyTuple_GET_ITEM(t, j);
            int in = PyDict_Contains(index, dj);
            if (in < 0 || (in && PyDict_SetItem(siblings, dj, t) < 0)) {
                Py_DECREF(t);
                goto out;
            }
        }
        Py_DECREF(t);
    }
    ret = Py_NewRef(Py_None);
out:
    Py_XDECREF(groups);
    Py_XDECREF(digests);
    Py_XDECREF(done);
    Py_XDECREF(blocks);
    Py_XDECREF(failed);
    return ret;
}


/* ------------------------------------------------------------------------------- index entries */
/* file_segments.Entry: where one object's live record is, and its header's fields (the index's
 * value).  In C because a batch creates one per record: a Python __init__ cost more than the
 * record's copy at 16 KiB.  Not tracked by the cyclic GC: an Entry refers only to its Segment,
 * which never refers back to entries, so it cannot be part of a cycle, and thousands of them per
 * batch would otherwise make every collection walk the whole index. */
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *seg;
    long long offset;
    long long length;
    unsigned int crc;
    unsigned int hcrc;
} EntryObject;

static PyTypeObject EntryType;

static int entry_init(EntryObject *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"seg", "offset", "length", "crc", "hcrc", NULL};
    PyObject *seg;
    long long offset, length;
    unsigned long long crc, hcrc;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLLKK:Entry", names, &seg, &offset, &length, &crc, &hcrc))
        return -1;
    if (crc > 0xFFFFFFFFull || hcrc > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "crc and hcrc are 32-bit");
        return -1;
    }
    Py_INCREF(seg);
    Py_XSETREF(self->seg, seg);
    self->offset = offset, self->length = length;
    self->crc = (unsigned int)crc, self->hcrc = (unsigned int)hcrc;
    return 0;
}

static void entry_dealloc(EntryObject *self)
{
    Py_XDECREF(self->seg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *entry_size(EntryObject *self, void *closure)
{
    return PyLong_FromLongLong(HEADER_SIZE + self->length);
}

static PyObject *entry_fields(EntryObject *self, PyObject *digest)
{
    /* The live header's fields as file_segments.unpack_header returns them: equal means byte
     * for byte the header this record was written (or found valid) with. */
    return Py_BuildValue("(y#iiLIOI)", "CTKR", (Py_ssize_t)4, FORMAT_VERSION, 0, self->length, self->crc, digest,
                         self->hcrc);
}

static PyObject *entry_repr(EntryObject *self)
{
    return PyUnicode_FromFormat("Entry(%R, offset=%lld, length=%lld, crc=%u, hcrc=%u)", self->seg ? self->seg : Py_None,
                                self->offset, self->length, self->crc, self->hcrc);
}

static PyMemberDef entry_members[] = {
    {"seg", T_OBJECT_EX, offsetof(EntryObject, seg), 0, "the Segment the record is in"},
    {"offset", T_LONGLONG, offsetof(EntryObject, offset), 0, "the record's offset in its segment"},
    {"length", T_LONGLONG, offsetof(EntryObject, length), 0, "payload bytes"},
    {"crc", T_UINT, offsetof(EntryObject, crc), 0, "the payload checksum"},
    {"hcrc", T_UINT, offsetof(EntryObject, hcrc), 0, "the header CRC"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef entry_getset[] = {
    {"size", (getter)entry_size, NULL, "header + payload bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef entry_methods[] = {
    {"fields", (PyCFunction)entry_fields, METH_O,
     "fields(digest) -> the live header's fields as unpack_header returns them."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "transfer_factory._file_records.Entry",
    .tp_doc = "Entry(seg, offset, length, crc, hcrc): where one object's live record is (the index's value).",
    .tp_basicsize = sizeof(EntryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)entry_init,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_repr = (reprfunc)entry_repr,
    .tp_members = entry_members,
    .tp_getset = entry_getset,
    .tp_methods = entry_methods,
};

/* FileStore._add_entries_locked's common case: ``index[d] = Entry(seg, ...)`` for records none of
 * which is in the index yet (the caller checked), in order. */
static PyObject *new_entries(PyObject *self, PyObject *args)
{
    PyObject *index, *seg, *digests_obj, *offs_obj, *lens_obj, *crcs_obj, *hcrcs_obj;
    if (!PyArg_ParseTuple(args, "OOOOOOO:new_entries", &index, &seg, &digests_obj, &offs_obj, &lens_obj, &crcs_obj,
                          &hcrcs_obj))
        return NULL;
    uint64_t *offs = NULL, *lens = NULL, *crcs = NULL, *hcrcs = NULL;
    Py_ssize_t n, n1, n2, n3;
    PyObject *digests = NULL, *ret = NULL;
    if (as_u64s(offs_obj, "offsets", &offs, &n) < 0 || as_u64s(lens_obj, "lengths", &lens, &n1) < 0
        || as_u64s(crcs_obj, "crcs", &crcs, &n2) < 0 || as_u64s(hcrcs_obj, "hcrcs", &hcrcs, &n3) < 0)
        goto done;
    if ((digests = PySequence_Fast(digests_obj, "digests")) == NULL)
        goto done;
    if (n1 != n || n2 != n || n3 != n || PySequence_Fast_GET_SIZE(digests) != n) {
        PyErr_SetString(PyExc_ValueError, "digests, offsets, lengths, crcs and hcrcs differ in length");
        goto done;
    }
    PyObject **d = PySequence_Fast_ITEMS(digests);
    for (Py_ssize_t i = 0; i < n; i++) {
        EntryObject *e = PyObject_New(EntryObject, &EntryType);
        if (e == NULL)
            goto done;
        e->seg = Py_NewRef(seg);
        e->offset = (long long)offs[i], e->length = (long long)lens[i];
        e->crc = (unsigned int)crcs[i], e->hcrc = (unsigned int)hcrcs[i];
        int r = PyObject_SetItem(index, d[i], (PyObject *)e);
        Py_DECREF(e);
        if (r < 0)
            goto done;
    }
    ret = Py_NewRef(Py_None);
done:
    Py_XDECREF(digests);
    PyMem_Free(offs);
    PyMem_Free(lens);
    PyMem_Free(crcs);
    PyMem_Free(hcrcs);
    return ret;
}

/* FileStore._select_all: the common read batch looked up in one pass.  Every digest must be in
 * ``index`` (a dict) and every object one valid buffer (exact int pointer > 0, exact int size at
 * least the record's length); then (segments, offsets, lengths, checksums) of the entries, else
 * None and the caller looks object by object. */
static PyObject *select_all(PyObject *self, PyObject *args)
{
    PyObject *index, *digests_obj, *ptrs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "O!OOO:select_all", &PyDict_Type, &index, &digests_obj, &ptrs_obj, &sizes_obj))
        return NULL;
    PyObject *digests = NULL, *ptrs = NULL, *sizes = NULL, *lists[4] = {NULL, NULL, NULL, NULL}, *ret = NULL;
    if ((digests = PySequence_Fast(digests_obj, "digests")) == NULL || (ptrs = PySequence_Fast(ptrs_obj, "ptrs")) == NULL
        || (sizes = PySequence_Fast(sizes_obj, "sizes")) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(digests);
    if (PySequence_Fast_GET_SIZE(ptrs) != n || PySequence_Fast_GET_SIZE(sizes) != n) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    for (int j = 0; j < 4; j++)
        if ((lists[j] = PyList_New(n)) == NULL)
            goto done;
    PyObject **d = PySequence_Fast_ITEMS(digests), **p = PySequence_Fast_ITEMS(ptrs), **z = PySequence_Fast_ITEMS(sizes);
    for (Py_ssize_t i = 0; i < n; i++) {
        int o1, o2;
        if (d[i] == Py_None || !PyLong_CheckExact(p[i]) || !PyLong_CheckExact(z[i])) {
            ret = Py_NewRef(Py_None);
            goto done;
        }
        long long ptr = PyLong_AsLongLongAndOverflow(p[i], &o1), room = PyLong_AsLongLongAndOverflow(z[i], &o2);
        PyObject *e = PyDict_GetItemWithError(index, d[i]);        /* borrowed */
        if (e == NULL && PyErr_Occurred())
            goto done;
        if (e == NULL || Py_TYPE(e) != &EntryType || o1 < 0 || (!o1 && ptr <= 0) || o2 < 0
            || (!o2 && room < ((EntryObject *)e)->length)) {
            ret = Py_NewRef(Py_None);
            goto done;
        }
        EntryObject *en = (EntryObject *)e;
        PyObject *v[4] = {Py_NewRef(en->seg), PyLong_FromLongLong(en->offset), PyLong_FromLongLong(en->length),
                          PyLong_FromUnsignedLong(en->crc)};
        for (int j = 0; j < 4; j++) {
            if (v[j] == NULL) {
                for (int k = 0; k < 4; k++)
                    Py_XDECREF(v[k]);
                goto done;
            }
        }
        for (int j = 0; j < 4; j++)
            PyList_SET_ITEM(lists[j], i, v[j]);
    }
    ret = PyTuple_Pack(4, lists[0], lists[1], lists[2], lists[3]);
done:
    Py_XDECREF(digests);
    Py_XDECREF(ptrs);
    Py_XDECREF(sizes);
    for (int j = 0; j < 4; j++)
        Py_XDECREF(lists[j]);
    return ret;
}

/* read_records for single-buffer records, each record's payload checksummed right after its
 * sub-piece (about ``sub_bytes``) is read, while it is still in the core's cache, all with the GIL
 * let go.  Returns (bytes read, checksums of the records read whole: a prefix).  Needs XXH3 bound
 * (bind_xxh3); RuntimeError otherwise. */
static PyObject *read_and_sum(PyObject *self, PyObject *args)
{
    int fd;
    long long offset, sub_bytes;
    Py_buffer headers;
    PyObject *ptrs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "iLw*OOL:read_and_sum", &fd, &offset, &headers, &ptrs_obj, &sizes_obj, &sub_bytes))
        return NULL;
    xxh3_fn xxh3 = xxh3_direct;
    uint64_t *ptrs = NULL, *sizes = NULL;
    Py_ssize_t n = 0, ns;
    struct iovec *iov = NULL;
    PyObject *ret = NULL;
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound (bind_xxh3)");
        goto done;
    }
    if (as_u64s(ptrs_obj, "ptrs", &ptrs, &n) < 0 || as_u64s(sizes_obj, "sizes", &sizes, &ns) < 0)
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
        int64_t got = move_all(fd, iov, k, offset + done_bytes, 0);
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
    PyObject *sums = PyList_New(whole);
    if (sums == NULL)
        goto done;
    for (Py_ssize_t m = 0; m < whole; m++) {
        PyObject *c = PyLong_FromUnsignedLongLong(sizes[m]);
        if (c == NULL) {
            Py_DECREF(sums);
            goto done;
        }
        PyList_SET_ITEM(sums, m, c);
    }
    ret = Py_BuildValue("(LN)", (long long)done_bytes, sums);
done:
    PyMem_Free(iov);
    PyMem_Free(ptrs);
    PyMem_Free(sizes);
    PyBuffer_Release(&headers);
    return ret;
}

static PyMethodDef methods[] = {
    {"pack_headers", pack_headers, METH_VARARGS,
     "pack_headers(digests, lengths, crcs) -> bytes: the live record headers, 56 bytes each."},
    {"parse_headers", parse_headers, METH_VARARGS,
     "parse_headers(buf, n) -> bytes: per header 0 (invalid), 1 (valid, live) or 2 (valid, dead)."},
    {"checksums", checksums, METH_VARARGS,
     "checksums(fn, ptrs, sizes, via_python=False) -> list[int]: fn(view of each buffer) & 0xFFFFFFFF (XXH3 "
     "called directly when bind_xxh3 found it, unless via_python)."},
    {"bind_xxh3", bind_xxh3, METH_O,
     "bind_xxh3(path) -> bool: use XXH3_64bits_withSeed of the loaded library at path for checksums."},
    {"write_records", write_records, METH_VARARGS,
     "write_records(fd, offset, headers, ptrs, sizes, counts) -> bytes written (all, or OSError)."},
    {"read_records", read_records, METH_VARARGS,
     "read_records(fd, offset, headers, ptrs, sizes, counts) -> bytes read (short only at end of file)."},
    {"read_and_sum", read_and_sum, METH_VARARGS,
     "read_and_sum(fd, offset, headers, ptrs, sizes, sub_bytes) -> (bytes read, checksums of the records read "
     "whole): read_records of single-buffer records, each checksummed while still in cache."},
    {"select_all", select_all, METH_VARARGS,
     "select_all(index, digests, ptrs, sizes) -> (segs, offsets, lengths, crcs) when every object is stored, one "
     "valid buffer big enough; else None."},
    {"new_entries", new_entries, METH_VARARGS,
     "new_entries(index, seg, digests, offsets, lengths, crcs, hcrcs): index[d] = Entry(seg, ...) for each."},
    {"key_groups", key_groups, METH_VARARGS,
     "key_groups(keys, kinds) -> list: each key's object group ('{ns}/{hash}/{rank}'), or None."},
    {"note_blocks", note_blocks, METH_VARARGS,
     "note_blocks(groups, digests, done, index, siblings): siblings of the blocks whose members all succeeded."},
    {"payload_bytes", payload_bytes, METH_VARARGS,
     "payload_bytes(ptrs, sizes) -> int: sum(sizes) when all are exact ints, ptrs > 0, sizes > 0; else -1."},
    {"key_digests", key_digests, METH_O,
     "key_digests(keys) -> list: SHA-256 of each key's UTF-8 (lone surrogates passed through); None for a "
     "key that is not a non-empty str."},
    {"sha256", sha256_bytes, METH_VARARGS,
     "sha256(buffer, portable=False) -> bytes: the SHA-256 digest (for tests; portable: without SHA-NI)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transfer_factory._file_records",
    "Batch-wide record headers, checksums and vectored I/O for the FileStore (see file_records.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__file_records(void)
{
    crc_init();
#ifdef HAVE_SHA_NI_PATH
    if (cpu_has_sha_ni())
        sha256_blocks = sha256_blocks_ni;
#endif
    if (PyType_Ready(&EntryType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "SHA_NI", sha256_blocks != sha256_blocks_c) < 0
                      || PyModule_AddObjectRef(m, "Entry", (PyObject *)&EntryType) < 0))
        Py_CLEAR(m);
    return m;
}
