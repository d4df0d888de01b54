/* The queue's check of an authenticated body (wire.check_plain), in C.
 *
 * Every task a rank receives and every result the engine receives passes this check; in Python
 * it cost a loop step per container value (about 5 us a task body on a 2-core VM, three times
 * that on a round trip's cold caches).  Same rules, same order, same messages as the docstring
 * of wire.check_plain: plain data only (None, bool, int, finite float, str, bytes, lists, maps
 * with str or bytes keys), at most max_depth levels, at most max_items items in all.  An
 * explicit stack, not recursion: hostile depth must not decide the C stack's.
 *
 * check(obj, max_depth, max_items) -> None, or a str saying why not (the caller raises BadFrame).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

typedef struct {
    PyObject *node;
    long depth;
} Frame;

static int is_scalar(PyObject *v) {
    return v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyUnicode_CheckExact(v) ||
           PyBytes_CheckExact(v);
}

/* One value inside a container: NULL if fine, else the reason (a new str). *push says to descend. */
static PyObject *check_value(PyObject *v, int *push) {
    *push = 0;
    if (is_scalar(v))
        return NULL;
    if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        if (!isfinite(d)) {
            PyObject *r = PyObject_Repr(v);
            PyObject *msg = r ? PyUnicode_FromFormat("non-finite number %U", r) : NULL;
            Py_XDECREF(r);
            return msg;
        }
        return NULL;
    }
    if (PyList_CheckExact(v) || PyDict_CheckExact(v)) {
        *push = 1;
        return NULL;
    }
    return PyUnicode_FromFormat("%s is not plain data", Py_TYPE(v)->tp_name);
}

static PyObject *check(PyObject *self, PyObject *args) {
    PyObject *root;
    long max_depth;
    Py_ssize_t max_items;
    if (!PyArg_ParseTuple(args, "Oln", &root, &max_depth, &max_items))
        return NULL;
    Py_ssize_t cap = 16, top = 0, items = 0;
    Frame *stack = PyMem_Malloc(cap * sizeof(Frame));
    if (!stack)
        return PyErr_NoMemory();
    /* Containers are borrowed: the caller holds the root, and nothing here mutates it. */
    stack[top++] = (Frame){root, 1};
    PyObject *why = NULL;
    while (top && !why) {
        Frame f = stack[--top];
        if (f.depth > max_depth) {
            why = PyUnicode_FromFormat("nested deeper than %ld levels", max_depth);
            break;
        }
        PyObject *node = f.node;
        int is_dict = PyDict_CheckExact(node);
        if (!is_dict && !PyList_CheckExact(node)) {
            why = PyUnicode_FromFormat("%s is not plain data", Py_TYPE(node)->tp_name);
            break;
        }
        Py_ssize_t n = is_dict ? PyDict_GET_SIZE(node) : PyList_GET_SIZE(node);
        items += n;
        if (items > max_items) {
            why = PyUnicode_FromFormat("more than %zd items", max_items);
            break;
        }
        Py_ssize_t pos = 0;
        for (Py_ssize_t i = 0; i < n && !why; i++) {
            PyObject *value;
            if (is_dict) {
                PyObject *key;
                if (!PyDict_Next(node, &pos, &key, &value))
                    break;
                if (!PyUnicode_CheckExact(key) && !PyBytes_CheckExact(key)) {
                    why = PyUnicode_FromString("a map key is not a string");
                    break;
                }
            } else {
                value = PyList_GET_ITEM(node, i);
            }
            int push;
            why = check_value(value, &push);
            if (push && !why) {
                if (top == cap) {
                    Frame *grown = PyMem_Realloc(stack, 2 * cap * sizeof(Frame));
                    if (!grown) {
                        PyMem_Free(stack);
                        return PyErr_NoMemory();
                    }
                    stack = grown;
                    cap *= 2;
                }
                stack[top++] = (Frame){value, f.depth + 1};
            }
        }
    }
    PyMem_Free(stack);
    if (why)
        return why;
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS,
     "check(obj, max_depth, max_items) -> None, or why obj is not bounded plain data (str)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_check", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__wire_check(void) { return PyModule_Create(&module); }
