/* The queue's check of an authenticated body (wire.check_plain), in C.
 *
 * Every task a rank receives and every result the engine receives passes this check; in Python
 * it cost a loop step per container value (about 5 us a task body on a 2-core VM, three times
 * that on a round trip's cold caches).  Same rules, same order, same messages as the docstring
 * of wire.check_plain: plain data only (None, bool, int, finite float, str, bytes, lists, maps
 * with str or bytes keys), at most max_depth levels, at most max_items items in all.  An
 * explicit stack, not recursion: hostile depth must not decide the C stack's.
 *
 * check(obj, max_depth, max_items) -> None, or a str saying why not (the caller raises BadFrame);
 * if a call of its own fails (MemoryError, RecursionError in a repr), that exception, at once.
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

/* One value inside a container: 0 if fine (*push says to descend), 1 if not (*why is the reason, a
 * new str), -1 with an exception set if a call failed (repr, the message): the caller must stop. */
static int check_value(PyObject *v, int *push, PyObject **why) {
    *push = 0;
    if (is_scalar(v))
        return 0;
    if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        if (!isfinite(d)) {
            PyObject *r = PyObject_Repr(v);
            if (r == NULL)
                return -1;
            *why = PyUnicode_FromFormat("non-finite number %U", r);
            Py_DECREF(r);
            return *why ? 1 : -1;
        }
        return 0;
    }
    if (PyList_CheckExact(v) || PyDict_CheckExact(v)) {
        *push = 1;
        return 0;
    }
    *why = PyUnicode_FromFormat("%s is not plain data", Py_TYPE(v)->tp_name);
    return *why ? 1 : -1;
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
    /* why: the reason (a new str) once one is found.  A call that fails (NULL, exception set) ends
     * the check at once: nothing may run on with an exception set, nor return a verdict over one. */
    PyObject *why = NULL;
    int failed = 0;
    while (top && !why && !failed) {
        Frame f = stack[--top];
        if (f.depth > max_depth) {
            why = PyUnicode_FromFormat("nested deeper than %ld levels", max_depth);
            failed = why == NULL;
            break;
        }
        PyObject *node = f.node;
        int is_dict = PyDict_CheckExact(node);
        if (!is_dict && !PyList_CheckExact(node)) {
            why = PyUnicode_FromFormat("%s is not plain data", Py_TYPE(node)->tp_name);
            failed = why == NULL;
            break;
        }
        Py_ssize_t n = is_dict ? PyDict_GET_SIZE(node) : PyList_GET_SIZE(node);
        items += n;
        if (items > max_items) {
            why = PyUnicode_FromFormat("more than %zd items", max_items);
            failed = why == NULL;
            break;
        }
        Py_ssize_t pos = 0;
        for (Py_ssize_t i = 0; i < n && !why && !failed; i++) {
            PyObject *value;
            if (is_dict) {
                PyObject *key;
                if (!PyDict_Next(node, &pos, &key, &value))
                    break;
                if (!PyUnicode_CheckExact(key) && !PyBytes_CheckExact(key)) {
                    why = PyUnicode_FromString("a map key is not a string");
                    failed = why == NULL;
                    break;
                }
            } else {
                value = PyList_GET_ITEM(node, i);
            }
            int push;
            int verdict = check_value(value, &push, &why);
            if (verdict < 0) {
                failed = 1;
                break;
            }
            if (push) {
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
    if (failed) {
        Py_XDECREF(why);
        return NULL;
    }
    if (why)
        return why;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS,
     "check(obj, max_depth, max_items) -> None, or why obj is not bounded plain data (str)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_check", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__wire_check(void) { return PyModule_Create(&module); }
