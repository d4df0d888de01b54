/* Release stores and acquire loads of aligned 64-bit words in shared memory (the layer board,
 * cache_manager/layer_progress.py).
 *
 * A rank copies a layer's bytes, then publishes "layer l landed" in one word; the engine reads the
 * word, then lets the model read the bytes.  A plain store and load are enough on x86 (TSO keeps
 * stores in order and loads in order), but not on the aarch64 hosts of Ascend machines: there the
 * word may become visible before the bytes, or the reader's later loads of the bytes may be served
 * before its load of the word.  A release store (every earlier write visible before the word) paired
 * with an acquire load (no later read moves before it) gives the order on every architecture.
 *
 *   store_release(buffer, index, value)    words[index] = value, release
 *   load_acquire(buffer, index) -> int     words[index], acquire
 *   load_acquire_row(buffer, start, count) -> list[int]   count acquire loads from words[start]
 *   load_after_reads(buffer, index) -> int    words[index], after every earlier load of this thread
 *   store_fenced(buffer, index, value)        words[index] = value, then a full fence
 *
 * "Read the word after the bytes" (a puller that checks a handle, a generation or a ticket word only
 * after its data loads) needs the opposite order to an acquire load: the *earlier* loads must be done
 * before the word is read.  An acquire load does not give that (on aarch64 a later load of the word
 * may be satisfied before earlier loads of the data); ``load_after_reads`` issues an acquire fence
 * (dmb ishld) first, which orders every earlier load before every later one.  ``store_fenced`` is the
 * writer's half, and the Dekker handshake of a push ticket (a writer stores "started" then reads the
 * ticket; the decode side stores the fence then reads "started"): a store followed by a full fence
 * (dmb ish / mfence), so no later load or store of this thread passes it.
 *
 * ``buffer`` is any object exposing a buffer of int64 words (the board's numpy array); the word
 * must lie inside it and be 8-byte aligned (an unaligned atomic is not one on every architecture).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int64_t *word_at(Py_buffer *view, Py_ssize_t index, Py_ssize_t count) {
    if (index < 0 || count < 0 || view->len / 8 < index || view->len / 8 - index < count) {
        PyErr_Format(PyExc_IndexError, "words [%zd, %zd) are outside a buffer of %zd words", index,
                     index + count, view->len / 8);
        return NULL;
    }
    char *p = (char *)view->buf + 8 * index;
    if (((uintptr_t)p & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "the word is not 8-byte aligned");
        return NULL;
    }
    return (int64_t *)p;
}

static PyObject *store_release(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t index;
    long long value;
    if (!PyArg_ParseTuple(args, "OnL:store_release", &obj, &index, &value))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    int64_t *w = word_at(&view, index, 1);
    if (w != NULL)
        __atomic_store_n(w, (int64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    if (w == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *load_acquire(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "On:load_acquire", &obj, &index))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t *w = word_at(&view, index, 1);
    int64_t value = w != NULL ? __atomic_load_n(w, __ATOMIC_ACQUIRE) : 0;
    PyBuffer_Release(&view);
    if (w == NULL)
        return NULL;
    return PyLong_FromLongLong(value);
}

static PyObject *load_acquire_row(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "Onn:load_acquire_row", &obj, &start, &count))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t *w = word_at(&view, start, count);
    PyObject *out = w != NULL ? PyList_New(count) : NULL;
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *item = PyLong_FromLongLong(__atomic_load_n(w + i, __ATOMIC_ACQUIRE));
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *load_after_reads(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "On:load_after_reads", &obj, &index))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t *w = word_at(&view, index, 1);
    int64_t value = 0;
    if (w != NULL) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* every earlier load (the data) is done first */
        value = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    }
    PyBuffer_Release(&view);
    if (w == NULL)
        return NULL;
    return PyLong_FromLongLong(value);
}

static PyObject *store_fenced(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t index;
    long long value;
    if (!PyArg_ParseTuple(args, "OnL:store_fenced", &obj, &index, &value))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    int64_t *w = word_at(&view, index, 1);
    if (w != NULL) {
        __atomic_store_n(w, (int64_t)value, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* no later load or store passes the word */
    }
    PyBuffer_Release(&view);
    if (w == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load_after_reads", load_after_reads, METH_VARARGS,
     "load_after_reads(buffer, index) -> int: load an int64 word after every earlier load (fenced)"},
    {"store_fenced", store_fenced, METH_VARARGS,
     "store_fenced(buffer, index, value): store an int64 word, then a full fence"},
    {"store_release", store_release, METH_VARARGS, "store_release(buffer, index, value): release store of an int64 word"},
    {"load_acquire", load_acquire, METH_VARARGS, "load_acquire(buffer, index) -> int: acquire load of an int64 word"},
    {"load_acquire_row", load_acquire_row, METH_VARARGS,
     "load_acquire_row(buffer, start, count) -> list[int]: acquire loads of count int64 words"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_shm_atomic", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__shm_atomic(void) { return PyModule_Create(&module); }
