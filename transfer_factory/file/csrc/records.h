/*
 * Shared by the files of transfer_factory.file._records (records.c has the overview).
 */
#ifndef FILE_RECORDS_H
#define FILE_RECORDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/uio.h>

/* The record header: the one definition of its layout.  segments.py takes these from the module
 * (HEADER_SIZE, FORMAT_VERSION, LIVE, DEAD, HEADER_LAYOUT) and refuses to load if its struct
 * disagrees; tests/test_file_formats.py holds both to fixed bytes.  All integers little-endian. */
#define HEADER_SIZE 56
#define FORMAT_VERSION 2
#define MAGIC_LIVE "CTKR"           /* a live record */
#define MAGIC_DEAD "CTKD"           /* a dead one (deleted, or found corrupt) */
#define MAGIC_SIZE 4
#define OFF_MAGIC 0
#define OFF_VERSION 4               /* 2 bytes */
#define OFF_FLAGS 6                 /* 2 bytes, always 0 */
#define OFF_PAYLOAD_LEN 8           /* 8 bytes */
#define OFF_PAYLOAD_SUM 16          /* 4 bytes: low 32 bits of XXH3-64 of the payload */
#define OFF_KEY_SHA256 20           /* 32 bytes */
#define OFF_HEADER_CRC 52           /* 4 bytes: CRC-32 of bytes [OFF_VERSION, OFF_HEADER_CRC) */
#define IOV_LIMIT 1024 /* Linux's IOV_MAX */

/* The items of a list or tuple as unsigned 64-bit integers (PyMem_Malloc'ed); -1 with an exception. */
int fr_as_u64s(PyObject *seq, const char *what, uint64_t **out, Py_ssize_t *n);

/* Moves every iovec, resuming short transfers: bytes moved, or -1 with errno (records_io.c). */
int64_t fr_move_all(int fd, struct iovec *iov, int niov, int64_t offset, int writing);

/* XXH3_64bits_withSeed(_dispatch) of the xxhash package's extension, once bind_xxh3 found it; else NULL. */
typedef uint64_t (*xxh3_fn)(const void *data, size_t len, uint64_t seed);
extern xxh3_fn fr_xxh3_direct;

/* The index's value type (records_index.c). */
typedef struct {
    PyObject_HEAD
    PyObject *seg;
    long long offset;
    long long length;
    unsigned int crc;
    unsigned int hcrc;
} EntryObject;
extern PyTypeObject fr_EntryType;

PyObject *fr_pack_headers(PyObject *self, PyObject *args);
PyObject *fr_parse_headers(PyObject *self, PyObject *args);
PyObject *fr_payload_bytes(PyObject *self, PyObject *args);
PyObject *fr_bind_xxh3(PyObject *self, PyObject *arg);
PyObject *fr_checksums(PyObject *self, PyObject *args);
PyObject *fr_block_digests(PyObject *self, PyObject *args);
PyObject *fr_xxh3_address(PyObject *self, PyObject *unused);
PyObject *fr_write_records(PyObject *self, PyObject *args);
PyObject *fr_read_records(PyObject *self, PyObject *args);
PyObject *fr_read_and_sum(PyObject *self, PyObject *args);
PyObject *fr_key_digests(PyObject *self, PyObject *keys);
PyObject *fr_sha256_bytes(PyObject *self, PyObject *args);
PyObject *fr_key_groups(PyObject *self, PyObject *args);
PyObject *fr_note_blocks(PyObject *self, PyObject *args);
PyObject *fr_new_entries(PyObject *self, PyObject *args);
PyObject *fr_select_all(PyObject *self, PyObject *args);

#endif
