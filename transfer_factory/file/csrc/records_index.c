/*
 * Index entries and object groups for transfer_factory.file._records (records.c has the
 * overview).
 */
#include "records.h"

#include <structmember.h>

/* ------------------------------------------------------------------------------- object groups */
/* space.group_of for every key: ``{namespace}/{hash}/{rank}`` when the key ends in
 * ``/{kind}`` with kind one of ``kinds``, else None. */
PyObject *fr_key_groups(PyObject *self, PyObject *args)
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

/* note_blocks for the common batch, where each block's objects are next to each other: one tuple
 * per block and nothing else.  1 when done, 0 when the batch is not like that (a group met again
 * further on, or a member without a digest) and the general path must run, -1 on error. */
static int adjacent_blocks(PyObject **g, PyObject **d, PyObject **ok, Py_ssize_t n, PyObject *index,
                           PyObject *siblings)
{
    Py_ssize_t *ends = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));   /* ends[i]: the end of i's run */
    PyObject *seen = PySet_New(NULL);
    int result = -1;
    if (ends == NULL || seen == NULL) {
        if (ends == NULL)
            PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = i + 1;
        if (g[i] != Py_None) {
            for (; j < n && g[j] != Py_None; j++) {
                int eq = PyObject_RichCompareBool(g[j], g[i], Py_EQ);
                if (eq < 0)
                    goto out;
                if (!eq)
                    break;
            }
            int had = PySet_Contains(seen, g[i]);
            if (had < 0 || PySet_Add(seen, g[i]) < 0)
                goto out;
            if (had) {
                result = 0;
                goto out;
            }
            for (Py_ssize_t k = i; k < j; k++) {
                if (d[k] == Py_None) {
                    result = 0;
                    goto out;
                }
            }
        }
        ends[i] = j;
        i = j;
    }
    for (Py_ssize_t i = 0; i < n; i = ends[i]) {
        Py_ssize_t j = ends[i];
        if (g[i] == Py_None || j - i < 2)
            continue;
        int all_ok = 1;
        for (Py_ssize_t k = i; k < j && all_ok; k++) {
            all_ok = PyObject_IsTrue(ok[k]);
            if (all_ok < 0)
                goto out;
        }
        if (!all_ok)
            continue;
        PyObject *t = PyTuple_New(j - i);
        if (t == NULL)
            goto out;
        for (Py_ssize_t k = i; k < j; k++)
            PyTuple_SET_ITEM(t, k - i, Py_NewRef(d[k]));
        for (Py_ssize_t k = i; k < j; k++) {
            int in = PyDict_Contains(index, d[k]);
            if (in < 0 || (in && PyDict_SetItem(siblings, d[k], t) < 0)) {
                Py_DECREF(t);
                goto out;
            }
        }
        Py_DECREF(t);
    }
    result = 1;
out:
    PyMem_Free(ends);
    Py_XDECREF(seen);
    return result;
}

/* Index.note_blocks after its early exit: for every group whose members (in ``groups`` /
 * ``digests``, None skipped) all succeeded (``done``) and are more than one, the tuple of their
 * digests becomes ``siblings[d]`` of each member ``d`` still in ``index``. */
PyObject *fr_note_blocks(PyObject *self, PyObject *args)
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
    int adjacent = adjacent_blocks(g, d, ok, n, index, siblings);
    if (adjacent < 0)
        goto out;
    if (adjacent) {
        ret = Py_NewRef(Py_None);
        goto out;
    }
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
/* segments.Entry: where one object's live record is, and its header's fields (the index's
 * value).  In C because a batch creates one per record: a Python __init__ cost more than the
 * record's copy at 16 KiB.  Not tracked by the cyclic GC: an Entry refers only to its Segment,
 * which never refers back to entries, so it cannot be part of a cycle, and thousands of them per
 * batch would otherwise make every collection walk the whole index. */


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
    /* The live header's fields as segments.unpack_header returns them: equal means byte
     * for byte the header this record was written (or found valid) with. */
    return Py_BuildValue("(y#iiLIOI)", MAGIC_LIVE, (Py_ssize_t)MAGIC_SIZE, FORMAT_VERSION, 0, self->length, self->crc, digest,
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

PyTypeObject fr_EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "transfer_factory.file._records.Entry",
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

/* Index.add_run's common case: ``index[d] = Entry(seg, ...)`` for records none of
 * which is in the index yet (the caller checked), in order; each header CRC is read from the
 * record's header in ``headers`` (the run's headers back to back). */
PyObject *fr_new_entries(PyObject *self, PyObject *args)
{
    PyObject *index, *seg, *digests_obj, *offs_obj, *lens_obj, *crcs_obj;
    Py_buffer headers;
    if (!PyArg_ParseTuple(args, "OOOOOOy*:new_entries", &index, &seg, &digests_obj, &offs_obj, &lens_obj, &crcs_obj,
                          &headers))
        return NULL;
    uint64_t *offs = NULL, *lens = NULL, *crcs = NULL;
    Py_ssize_t n, n1, n2;
    PyObject *digests = NULL, *ret = NULL;
    if (fr_as_u64s(offs_obj, "offsets", &offs, &n) < 0 || fr_as_u64s(lens_obj, "lengths", &lens, &n1) < 0
        || fr_as_u64s(crcs_obj, "crcs", &crcs, &n2) < 0)
        goto done;
    if ((digests = PySequence_Fast(digests_obj, "digests")) == NULL)
        goto done;
    if (n1 != n || n2 != n || PySequence_Fast_GET_SIZE(digests) != n || headers.len != n * HEADER_SIZE) {
        PyErr_SetString(PyExc_ValueError, "digests, offsets, lengths, crcs and headers differ in length");
        goto done;
    }
    PyObject **d = PySequence_Fast_ITEMS(digests);
    const unsigned char *h = headers.buf;
    for (Py_ssize_t i = 0; i < n; i++, h += HEADER_SIZE) {
        EntryObject *e = PyObject_New(EntryObject, &fr_EntryType);
        if (e == NULL)
            goto done;
        e->seg = Py_NewRef(seg);
        e->offset = (long long)offs[i], e->length = (long long)lens[i];
        e->crc = (unsigned int)crcs[i];
        const unsigned char *c = h + OFF_HEADER_CRC;
        e->hcrc = (unsigned int)c[0] | (unsigned int)c[1] << 8 | (unsigned int)c[2] << 16 | (unsigned int)c[3] << 24;
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
    PyBuffer_Release(&headers);
    return ret;
}

/* Index.select_all: the common read batch looked up in one pass.  Every digest must be in
 * ``index`` (a dict) and every object one valid buffer (exact int pointer > 0, exact int size at
 * least the record's length); then (segments, offsets, lengths, checksums, known) of the entries,
 * known telling whether every digest is a key of ``siblings`` too (its block is known), else None
 * and the caller looks object by object. */
PyObject *fr_select_all(PyObject *self, PyObject *args)
{
    PyObject *index, *digests_obj, *ptrs_obj, *sizes_obj, *siblings;
    if (!PyArg_ParseTuple(args, "O!OOOO!:select_all", &PyDict_Type, &index, &digests_obj, &ptrs_obj, &sizes_obj,
                          &PyDict_Type, &siblings))
        return NULL;
    int known = 1;
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
        if (e == NULL || Py_TYPE(e) != &fr_EntryType || o1 < 0 || (!o1 && ptr <= 0) || o2 < 0
            || (!o2 && room < ((EntryObject *)e)->length)) {
            ret = Py_NewRef(Py_None);
            goto done;
        }
        if (known) {
            known = PyDict_Contains(siblings, d[i]);
            if (known < 0)
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
    ret = Py_BuildValue("(OOOON)", lists[0], lists[1], lists[2], lists[3], PyBool_FromLong(known));
done:
    Py_XDECREF(digests);
    Py_XDECREF(ptrs);
    Py_XDECREF(sizes);
    for (int j = 0; j < 4; j++)
        Py_XDECREF(lists[j]);
    return ret;
}

