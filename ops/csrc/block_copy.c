/*
 * Block-copy kernel for the CPU platform.
 *
 * Every copy between a paged KV cache and host memory is described the same
 * way: per layer, a base address, a block stride and a capacity on each side,
 * plus parallel arrays of source and destination block ids.  The per-layer
 * layout (swap_cache_all_layers) has stride == block_bytes; the block-major
 * staging layout (swap_cache_layout) has stride == num_layers * block_bytes
 * and a per-layer base offset.
 *
 * Contract (checked in copy_checks.c): every id, length and size is checked before the first byte
 * moves; any violation raises ValueError naming the value and nothing is
 * written.  Runs of consecutive ids on both sides are merged into one
 * memcpy.  The GIL is released while bytes move, and a large copy is split
 * by bytes between the caller and persistent worker threads (copy_pool.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "copy_checks.h"
#include "copy_digest.h"
#include "copy_pool.h"
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAMING_STORES 1
#endif

/* Below this many bytes per extra thread, waking a helper costs more than it buys. */
#define MIN_BYTES_PER_THREAD (512 * 1024)
#define MAX_THREADS 64
#define CHUNKS_PER_THREAD 4
#define MIN_CHUNK_BYTES (256 * 1024)

typedef struct {
    char *dst;
    const char *src;
    size_t len;
} segment_t;

typedef struct {
    const segment_t *segs;
    size_t nsegs;
    const size_t *prefix; /* prefix[i] = bytes before segment i */
    size_t total;         /* bytes of the concatenated segments */
    size_t chunk;         /* bytes per pool item, a multiple of 64 */
    int streaming;        /* copy with non-temporal stores */
} work_t;

/* A copy far larger than the caches gains nothing from leaving the destination in them, and a
 * normal store first reads every destination line (read-for-ownership).  glibc's memcpy
 * switches to non-temporal stores for such sizes, but it only sees one block at a time, so
 * scattered 4 KiB blocks never get them; this decides on the whole call instead. */
#define STREAMING_MIN_TOTAL (4u << 20)

#ifdef HAVE_STREAMING_STORES
/* One 64-byte line from src to a 16-byte aligned dst, past the caches. */
static inline void stream_line(char *dst, const char *src)
{
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}
#endif

static void copy_bytes(char *dst, const char *src, size_t n, int streaming)
{
#ifdef HAVE_STREAMING_STORES
    if (streaming && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64)
            stream_line(dst + i, src + i);
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    (void)streaming;
    memcpy(dst, src, n);
}

#ifdef HAVE_STREAMING_STORES
/* Blocks of a scattered copy up to this size are copied INTERLEAVE at a time, a line of each in
 * turn: one block's source lines come from a page of their own, so a single stream waits on the
 * memory latency block after block; four streams keep four misses in flight (random 4 KiB
 * blocks on one thread: 5.3-6.8 -> 8.5-10.1 GB/s, 16 KiB: 7.5-8.8 -> 10.4-13.0 GB/s). */
#define INTERLEAVE 4
#define INTERLEAVE_MAX_BYTES (64u << 10)

/* Whether segs[0..INTERLEAVE) can be streamed together: one length, a whole number of lines of
 * at most INTERLEAVE_MAX_BYTES, and every destination 16-byte aligned. */
static int interleavable(const segment_t *segs, size_t len)
{
    if (len < 64 || len > INTERLEAVE_MAX_BYTES || len % 64)
        return 0;
    for (int k = 0; k < INTERLEAVE; k++)
        if (segs[k].len != len || ((uintptr_t)segs[k].dst & 15))
            return 0;
    return 1;
}

static void stream_interleaved(const segment_t *segs, size_t len)
{
    for (size_t i = 0; i < len; i += 64)
        for (int k = 0; k < INTERLEAVE; k++)
            stream_line(segs[k].dst + i, segs[k].src + i);
}
#endif

static size_t find_segment(const size_t *prefix, size_t nsegs, size_t offset)
{
    size_t lo = 0, hi = nsegs; /* last i with prefix[i] <= offset */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (prefix[mid] <= offset)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* One pool item: bytes [item * chunk, (item + 1) * chunk) of the concatenated segments. */
static void run_chunk(void *arg, size_t item)
{
    const work_t *w = (const work_t *)arg;
    size_t begin = item * w->chunk;
    size_t end = w->total - begin > w->chunk ? begin + w->chunk : w->total;
    size_t i = find_segment(w->prefix, w->nsegs, begin);
    size_t pos = begin;
    while (pos < end && i < w->nsegs) {
        size_t seg_start = w->prefix[i];
        size_t off = pos - seg_start;
        size_t avail = w->segs[i].len - off;
        size_t want = end - pos;
        size_t n = avail < want ? avail : want;
#ifdef HAVE_STREAMING_STORES
        if (w->streaming && off == 0 && i + INTERLEAVE <= w->nsegs && INTERLEAVE * avail <= want
                && interleavable(&w->segs[i], avail)) {
            stream_interleaved(&w->segs[i], avail);
            pos += INTERLEAVE * avail;
            i += INTERLEAVE;
            continue;
        }
#endif
        if (w->streaming && i + 1 < w->nsegs) {
            /* Scattered blocks defeat the hardware prefetcher at every block boundary: ask for
             * the start of the next block's source while this one is copied. */
            const char *next = w->segs[i + 1].src;
            for (int line = 0; line < 8; line++)
                __builtin_prefetch(next + 64 * line, 0, 0);
        }
        copy_bytes(w->segs[i].dst + off, w->segs[i].src + off, n, w->streaming);
        pos += n;
        i++;
    }
#ifdef HAVE_STREAMING_STORES
    if (w->streaming)
        _mm_sfence(); /* streamed stores are visible before the pool counts this item done */
#endif
}

enum streaming { STREAM_NEVER, STREAM_IF_LARGE, STREAM_ALWAYS };

/* Runs the segments on the caller and up to num_threads - 1 pool workers; call without the GIL. */
static int run_segments(const segment_t *segs, size_t nsegs, int num_threads, enum streaming streaming)
{
    if (nsegs == 0)
        return 0;
    size_t *prefix = malloc(sizeof(size_t) * (nsegs + 1));
    if (!prefix)
        return -1;
    size_t total = 0;
    for (size_t i = 0; i < nsegs; i++) {
        prefix[i] = total;
        total += segs[i].len;
    }
    prefix[nsegs] = total;
    if (total == 0) {
        free(prefix);
        return 0;
    }

    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    size_t useful = total / MIN_BYTES_PER_THREAD;
    if ((size_t)threads > useful)
        threads = useful < 1 ? 1 : (int)useful;

    /* Several items per thread, claimed as threads come free: a thread that starts late or
     * loses its core on a shared machine leaves its items to the others.  Cuts on 64-byte
     * boundaries keep threads off each other's cache lines. */
    size_t chunk = total;
    if (threads > 1) {
        chunk = (total / ((size_t)threads * CHUNKS_PER_THREAD) + 63) & ~(size_t)63;
        if (chunk < MIN_CHUNK_BYTES)
            chunk = MIN_CHUNK_BYTES;
    }
    work_t work = {segs, nsegs, prefix, total, chunk,
                   streaming == STREAM_ALWAYS || (streaming == STREAM_IF_LARGE && total >= STREAMING_MIN_TOTAL)};
    copy_pool_run(run_chunk, &work, (total + chunk - 1) / chunk, threads - 1);
    free(prefix);
    return 0;
}

PyDoc_STRVAR(copy_blocks_doc,
"copy_blocks(src_bases, src_caps, src_stride, src_ids, src_name,\n"
"            dst_bases, dst_caps, dst_stride, dst_ids, dst_name,\n"
"            block_bytes, num_threads, bulk=0) -> int\n\n"
"Copy block src_ids[i] to dst_ids[i] in every layer; returns the number of\n"
"memcpy segments after merging consecutive runs.  bases/caps/ids are int64\n"
"buffers (ids may also be lists of ints); a block of layer l starts at\n"
"bases[l] + id * stride.  bulk: this call is one piece of a transfer far\n"
"larger than the caches, so its stores stream past them whatever the piece's\n"
"own size.");

static PyObject *py_copy_blocks(PyObject *self, PyObject *args)
{
    PyObject *src_bases, *src_caps, *src_ids, *dst_bases, *dst_caps, *dst_ids;
    long long src_stride, dst_stride, block_bytes;
    const char *src_name, *dst_name;
    int num_threads, bulk = 0;
    if (!PyArg_ParseTuple(args, "OOLOsOOLOsLi|p", &src_bases, &src_caps, &src_stride, &src_ids,
                          &src_name, &dst_bases, &dst_caps, &dst_stride, &dst_ids, &dst_name,
                          &block_bytes, &num_threads, &bulk))
        return NULL;

    side_bufs_t src = {0}, dst = {0};
    PyObject *result = NULL;
    segment_t *segs = NULL;
    if (load_side(src_bases, src_caps, src_ids, &src, src_name) < 0 ||
        load_side(dst_bases, dst_caps, dst_ids, &dst, dst_name) < 0)
        goto done;

    Py_ssize_t layers, n;
    if (check_copy(&src, src_name, src_stride, &dst, dst_name, dst_stride, block_bytes, &layers, &n) < 0)
        goto done;
    const int64_t *sb = src.bases.buf, *db = dst.bases.buf, *si = src.ids.buf, *di = dst.ids.buf;

    /* Plan: one segment per maximal run of consecutive ids on both sides. */
    int src_dense = src_stride == block_bytes, dst_dense = dst_stride == block_bytes;
    size_t cap_segs = (size_t)layers * (size_t)(n ? n : 1);
    segs = malloc(sizeof(segment_t) * cap_segs);
    if (!segs) {
        PyErr_NoMemory();
        goto done;
    }
    size_t nsegs = 0;
    for (Py_ssize_t l = 0; l < layers; l++) {
        Py_ssize_t i = 0;
        while (i < n) {
            Py_ssize_t j = i + 1;
            if (src_dense && dst_dense)
                while (j < n && si[j] == si[j - 1] + 1 && di[j] == di[j - 1] + 1)
                    j++;
            segs[nsegs].src = (const char *)(intptr_t)sb[l] + si[i] * src_stride;
            segs[nsegs].dst = (char *)(intptr_t)db[l] + di[i] * dst_stride;
            segs[nsegs].len = (size_t)block_bytes * (size_t)(j - i);
            nsegs++;
            i = j;
        }
    }

    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run_segments(segs, nsegs, num_threads, bulk ? STREAM_ALWAYS : STREAM_IF_LARGE);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromSize_t(nsegs);
done:
    free(segs);
    release_side(&src);
    release_side(&dst);
    return result;
}

PyDoc_STRVAR(copy_contiguous_doc,
"copy_contiguous(dst_ptr, src_ptr, nbytes, num_threads) -> None\n\n"
"One contiguous memcpy split across threads the same way as copy_blocks;\n"
"the reference the benchmarks measure the kernel against.");

static PyObject *py_copy_contiguous(PyObject *self, PyObject *args)
{
    unsigned long long dst, src, nbytes;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKi", &dst, &src, &nbytes, &num_threads))
        return NULL;
    segment_t seg = {(char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)nbytes};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run_segments(&seg, 1, num_threads, STREAM_NEVER); /* the floor of the benchmarks: plain memcpy */
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(host_alloc_doc,
"host_alloc(nbytes) -> int\n\nPage-aligned, pre-faulted anonymous host memory; returns its address.");

static PyObject *py_host_alloc(PyObject *self, PyObject *args)
{
    long long nbytes;
    if (!PyArg_ParseTuple(args, "L", &nbytes))
        return NULL;
    if (nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "host_alloc size %lld must be positive", nbytes);
        return NULL;
    }
    /* MAP_POPULATE commits the pages now, as pinned allocation does on a GPU: a
     * swap must not pay first-touch page faults on its hot path. */
    void *p = mmap(NULL, (size_t)nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_MemoryError);
    return PyLong_FromVoidPtr(p);
}

PyDoc_STRVAR(host_free_doc, "host_free(ptr, nbytes) -> None\n\nRelease memory from host_alloc.");

static PyObject *py_host_free(PyObject *self, PyObject *args)
{
    unsigned long long ptr, nbytes;
    if (!PyArg_ParseTuple(args, "KK", &ptr, &nbytes))
        return NULL;
    if (munmap((void *)(uintptr_t)ptr, (size_t)nbytes) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pool_workers_doc,
"pool_workers() -> int\n\nCopy-pool worker threads alive in this process; a forked child starts with 0.");

static PyObject *py_pool_workers(PyObject *self, PyObject *args) { return PyLong_FromLong(copy_pool_workers()); }

static PyMethodDef methods[] = {
    {"copy_blocks", py_copy_blocks, METH_VARARGS, copy_blocks_doc},
    {"copy_blocks_digest", py_copy_blocks_digest, METH_VARARGS, COPY_BLOCKS_DIGEST_DOC},
    {"copy_contiguous", py_copy_contiguous, METH_VARARGS, copy_contiguous_doc},
    {"host_alloc", py_host_alloc, METH_VARARGS, host_alloc_doc},
    {"host_free", py_host_free, METH_VARARGS, host_free_doc},
    {"pool_workers", py_pool_workers, METH_NOARGS, pool_workers_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ops._block_copy", "CPU block-copy kernel (see block_copy.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block_copy(void) { return PyModule_Create(&module); }
