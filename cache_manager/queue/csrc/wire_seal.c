/* The queue's frame seal and open (wire.seal, wire.open_frame), in C.
 *
 * A frame is MAGIC | version | session (16) | stream (u32) | counter (u64) | body | HMAC-SHA256,
 * big-endian (wire.py's docstring).  Every task and every result is sealed once and opened once.
 * In Python the MAC alone was six hashlib calls, and the checks around it slices, a struct and
 * a named tuple: 9-13 us a frame on a round trip's cold caches, four frames a round trip.
 * Here one call per frame, with the key's inner and outer SHA-256 states computed once
 * (RFC 2104) and the SHA-NI rounds where the CPU has them (transfer_factory/csrc/sha256.c).
 *
 * Key(secret, magic, version, max_frame_bytes, error) -- the error type is wire.BadFrame:
 *   mac(data) -> bytes                               HMAC-SHA256(secret, data)
 *   seal(body, session, stream, counter) -> bytes    the whole frame
 *   open(frame) -> Envelope(session, stream, counter, payload), or raises error with the reason;
 *     the messages are those wire.py had: oversized, short, bad magic, version, authentication.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "sha256.h"

#define MAGIC_BYTES 4
#define SESSION_BYTES 16
#define TAG_BYTES 32
#define PREFIX_BYTES (MAGIC_BYTES + 1 + SESSION_BYTES + 4 + 8)
#define HMAC_BLOCK 64

static PyTypeObject *EnvelopeType;

static PyStructSequence_Field envelope_fields[] = {
    {"session", "the connection's session (16 bytes; zeros in a hello)"},
    {"stream", "channel and direction"},
    {"counter", "the frame's place in its stream"},
    {"payload", "the msgpack body, not yet parsed"},
    {NULL, NULL},
};

static PyStructSequence_Desc envelope_desc = {
    "cache_manager.queue.wire.Envelope", "An authenticated frame's envelope and unparsed body.", envelope_fields, 4,
};

typedef struct {
    PyObject_HEAD
    uint32_t inner[8], outer[8]; /* SHA-256 states after the key XOR ipad / opad block */
    unsigned char magic[MAGIC_BYTES];
    unsigned char version;
    Py_ssize_t max_frame;
    PyObject *error; /* set by a successful __init__ only: NULL says the key was never initialised */
} KeyObject;

/* Key.__new__(Key) without __init__ has no key: its MAC would be HMAC under an all-zero state
 * and its error type NULL.  Every method refuses such an object. */
static int key_ready(const KeyObject *self)
{
    if (self->error != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "Key is not initialised: call Key(secret, magic, version, "
                                         "max_frame_bytes, error)");
    return 0;
}

static void hmac(const KeyObject *k, const unsigned char *data, size_t len, unsigned char out[TAG_BYTES])
{
    uint32_t st[8];
    unsigned char inner[32];
    memcpy(st, k->inner, sizeof st);
    sha256_finish(sha256_blocks, st, HMAC_BLOCK, data, len, inner);
    memcpy(st, k->outer, sizeof st);
    sha256_finish(sha256_blocks, st, HMAC_BLOCK, inner, sizeof inner, out);
}

static int Key_init(KeyObject *self, PyObject *args, PyObject *kwds)
{
    Py_buffer secret, magic;
    int version;
    Py_ssize_t max_frame;
    PyObject *error;
    if (!PyArg_ParseTuple(args, "y*y*inO:Key", &secret, &magic, &version, &max_frame, &error))
        return -1;
    int bad = magic.len != MAGIC_BYTES || version < 0 || version > 255 || max_frame < PREFIX_BYTES + TAG_BYTES + 1;
    unsigned char key[HMAC_BLOCK] = {0}, magic_bytes[MAGIC_BYTES];
    if (!bad) {
        memcpy(magic_bytes, magic.buf, MAGIC_BYTES);
        if (secret.len > HMAC_BLOCK)
            sha256_with(sha256_blocks, secret.buf, (size_t)secret.len, key);
        else
            memcpy(key, secret.buf, (size_t)secret.len);
    }
    PyBuffer_Release(&secret);
    PyBuffer_Release(&magic);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "Key: magic must be %d bytes, version 0-255, max_frame_bytes at least %d",
                     MAGIC_BYTES, PREFIX_BYTES + TAG_BYTES + 1);
        return -1;
    }
    if (!PyType_Check(error) || !PyType_IsSubtype((PyTypeObject *)error, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "Key: error must be an exception type");
        return -1;
    }
    /* Nothing of self changes before every argument passed: a failed re-init leaves the key as it was. */
    unsigned char pad[HMAC_BLOCK];
    for (int i = 0; i < HMAC_BLOCK; i++)
        pad[i] = key[i] ^ 0x36;
    sha256_init(self->inner);
    sha256_blocks(self->inner, pad, 1);
    for (int i = 0; i < HMAC_BLOCK; i++)
        pad[i] = key[i] ^ 0x5c;
    sha256_init(self->outer);
    sha256_blocks(self->outer, pad, 1);
    memcpy(self->magic, magic_bytes, MAGIC_BYTES);
    self->version = (unsigned char)version;
    self->max_frame = max_frame;
    Py_INCREF(error);
    Py_XSETREF(self->error, error);
    return 0;
}

static void Key_dealloc(KeyObject *self)
{
    Py_XDECREF(self->error);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Key_mac(KeyObject *self, PyObject *data)
{
    if (!key_ready(self))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    unsigned char out[TAG_BYTES];
    hmac(self, buf.buf, (size_t)buf.len, out);
    PyBuffer_Release(&buf);
    return PyBytes_FromStringAndSize((const char *)out, TAG_BYTES);
}

static void put_be(unsigned char *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

static uint64_t get_be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static PyObject *Key_seal(KeyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!key_ready(self))
        return NULL;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "seal(body, session, stream, counter) takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *body = args[0], *session = args[1];
    if (!PyBytes_Check(body) || !PyBytes_Check(session) || PyBytes_GET_SIZE(session) != SESSION_BYTES) {
        PyErr_Format(PyExc_ValueError, "seal: body must be bytes and session %d bytes", SESSION_BYTES);
        return NULL;
    }
    unsigned long stream = PyLong_AsUnsignedLong(args[2]);
    if (stream == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long long counter = PyLong_AsUnsignedLongLong(args[3]);
    if (counter == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (stream > 0xffffffffUL) {
        PyErr_Format(PyExc_OverflowError, "stream %lu does not fit 32 bits", stream);
        return NULL;
    }
    Py_ssize_t blen = PyBytes_GET_SIZE(body), framed = PREFIX_BYTES + blen;
    if (framed > self->max_frame - TAG_BYTES) {
        PyErr_Format(PyExc_ValueError, "message of %zd bytes exceeds the %zd-byte frame limit", framed, self->max_frame);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, framed + TAG_BYTES);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    memcpy(p, self->magic, MAGIC_BYTES);
    p[MAGIC_BYTES] = self->version;
    memcpy(p + MAGIC_BYTES + 1, PyBytes_AS_STRING(session), SESSION_BYTES);
    put_be(p + MAGIC_BYTES + 1 + SESSION_BYTES, stream, 4);
    put_be(p + MAGIC_BYTES + 1 + SESSION_BYTES + 4, counter, 8);
    memcpy(p + PREFIX_BYTES, PyBytes_AS_STRING(body), (size_t)blen);
    hmac(self, p, (size_t)framed, p + framed);
    return out;
}

static PyObject *bad_frame(KeyObject *self, const char *fmt, ...)
{
    va_list va;
    va_start(va, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (msg != NULL) {
        PyErr_SetObject(self->error, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

static PyObject *open_buffer(KeyObject *self, const unsigned char *p, Py_ssize_t len)
{
    if (len > self->max_frame)
        return bad_frame(self, "oversized frame (%zd bytes)", len);
    if (len < PREFIX_BYTES + TAG_BYTES + 1)
        return bad_frame(self, "short frame (%zd bytes)", len);
    if (memcmp(p, self->magic, MAGIC_BYTES) != 0)
        return bad_frame(self, "bad magic");
    if (p[MAGIC_BYTES] != self->version)
        return bad_frame(self, "protocol version %d, expected %d", (int)p[MAGIC_BYTES], (int)self->version);
    Py_ssize_t framed = len - TAG_BYTES;
    unsigned char tag[TAG_BYTES], diff = 0;
    hmac(self, p, (size_t)framed, tag);
    for (int i = 0; i < TAG_BYTES; i++) /* every byte, whatever the first mismatch: constant time */
        diff |= tag[i] ^ p[framed + i];
    if (diff)
        return bad_frame(self, "authentication failed");
    PyObject *env = PyStructSequence_New(EnvelopeType);
    if (env == NULL)
        return NULL;
    const unsigned char *q = p + MAGIC_BYTES + 1;
    PyObject *items[4] = {
        PyBytes_FromStringAndSize((const char *)q, SESSION_BYTES),
        PyLong_FromUnsignedLongLong(get_be(q + SESSION_BYTES, 4)),
        PyLong_FromUnsignedLongLong(get_be(q + SESSION_BYTES + 4, 8)),
        PyBytes_FromStringAndSize((const char *)p + PREFIX_BYTES, framed - PREFIX_BYTES),
    };
    int failed = 0;
    for (int i = 0; i < 4; i++) {
        if (items[i] == NULL)
            failed = 1;
        PyStructSequence_SET_ITEM(env, i, items[i] ? items[i] : Py_NewRef(Py_None));
    }
    if (failed) {
        Py_DECREF(env);
        return NULL;
    }
    return env;
}

static PyObject *Key_open(KeyObject *self, PyObject *frame)
{
    if (!key_ready(self))
        return NULL;
    if (PyBytes_Check(frame))
        return open_buffer(self, (const unsigned char *)PyBytes_AS_STRING(frame), PyBytes_GET_SIZE(frame));
    Py_buffer buf;
    if (PyObject_GetBuffer(frame, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *env = open_buffer(self, buf.buf, buf.len);
    PyBuffer_Release(&buf);
    return env;
}

static PyMethodDef Key_methods[] = {
    {"mac", (PyCFunction)Key_mac, METH_O, "mac(data) -> HMAC-SHA256 of data under the key"},
    {"seal", (PyCFunction)(void (*)(void))Key_seal, METH_FASTCALL,
     "seal(body, session, stream, counter) -> the frame: header, envelope, body and MAC"},
    {"open", (PyCFunction)Key_open, METH_O,
     "open(frame) -> Envelope(session, stream, counter, payload); raises the key's error type"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cache_manager.queue._wire_seal.Key",
    .tp_basicsize = sizeof(KeyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Key(secret, magic, version, max_frame_bytes, error): seals and opens the queue's frames",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Key_init,
    .tp_dealloc = (destructor)Key_dealloc,
    .tp_methods = Key_methods,
};

static PyObject *rounds(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(sha256_blocks == sha256_blocks_portable ? "portable" : "sha-ni");
}

static PyMethodDef module_methods[] = {
    {"rounds", rounds, METH_NOARGS, "rounds() -> 'sha-ni' or 'portable': the SHA-256 rounds in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_wire_seal",
    .m_doc = "The queue's frame seal and open in C (see wire_seal.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__wire_seal(void)
{
    sha256_setup();
    if (PyType_Ready(&KeyType) < 0)
        return NULL;
    EnvelopeType = PyStructSequence_NewType(&envelope_desc);
    if (EnvelopeType == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Key", (PyObject *)&KeyType) < 0 ||
        PyModule_AddObjectRef(m, "Envelope", (PyObject *)EnvelopeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
