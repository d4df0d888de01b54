/*
 * Key digests for transfer_factory.file._records (records.c has the overview), with the
 * SHA-256 of sha256.c; checked against hashlib by tests.
 */
#include "records.h"
#include "sha256.h"

#include <string.h>


/* ------------------------------------------------------------------------------- key digests */
/* SHA-256 of every key of a batch.  hashlib costs ~0.8 us a key from Python (object, encode,
 * call, digest); one call for the batch with the SHA extensions where the CPU has them (a few
 * tens of ns a short key), else portable rounds (sha256.c). */
static void sha256(const unsigned char *msg, size_t len, unsigned char out[32])
{
    sha256_with(sha256_blocks, msg, len, out);
}

PyObject *fr_sha256_bytes(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*|p:sha256", &buf, &portable))
        return NULL;
    unsigned char out[32];
    sha256_with(portable ? sha256_blocks_portable : sha256_blocks, buf.buf, (size_t)buf.len, out);
    PyBuffer_Release(&buf);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

PyObject *fr_key_digests(PyObject *self, PyObject *keys)
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
