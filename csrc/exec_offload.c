/*
 * exec_offload.c: the executor side of activation offload.
 *
 * When a checkpointed layer's forward is done (or its checkpoint segment
 * is), the tensors among its stored inputs go to an offload tier: CPU
 * tensors to the disk tier (a SpillStore, spill.c), device tensors to the
 * host tier (memscale.offload).  The frame then holds records in their
 * slots, and its recompute in backward puts the tensors back first.
 */
#include "executor_internal.h"

#include "spill.h"
#include "versions.h"

/* Offload one tensor: a record standing for it, Py_None if it stays, NULL
   with an exception set.  CPU tensors go to the disk tier; device tensors
   to the host tier (which spills on to disk itself). */
static PyObject *
offload_one(Executor *ex, PyObject *t)
{
    ms_state *st = ex->st;
    int cpu = ms_is_on_cpu(st, t);
    if (cpu < 0) {
        return NULL;
    }
    if (cpu && HAS(ex->store)) {
        return ms_spill_put(ex->store, t);
    }
    /* The host tier: memscale.offload.HostTier for CUDA tensors (a path
       unverified on this project's CPU-only machines), or the predictor's
       stand-in for fake tensors. */
    if (!HAS(ex->host)) {
        Py_RETURN_NONE;
    }
    return PyObject_CallMethodOneArg(ex->host, st->s_put, t);
}

/* Record an offloaded slot: `where` 0 = args index, 1 = kwargs key. */
static int
note_slot(PyObject *slots, int where, PyObject *key)
{
    PyObject *item = Py_BuildValue("(iO)", where, key);
    if (item == NULL) {
        return -1;
    }
    int rc = PyList_Append(slots, item);
    Py_DECREF(item);
    return rc;
}

/*
 * After a checkpointed layer's forward: move its top-level tensor inputs
 * off the device.  The frame then holds records instead of the tensors,
 * and their version entries through weak references (an input changed in
 * place later still makes the recompute refuse, as without offload), so
 * the tensors' memory goes once the caller lets go of them.  Nothing of
 * the frame changes unless everything succeeds.
 */
int
ms_offload_inputs(Executor *ex, Frame *f)
{
    ms_state *st = ex->st;
    PyObject *args = NULL, *kwargs = NULL, *slots = NULL, *gone = NULL;
    PyObject *versions = NULL, *keys = NULL;
    int rc = -1;

    int same = ms_versions_unchanged(st, f->versions);
    if (same <= 0) {
        /* Changed during the layer: recompute reports it; nothing to do. */
        return same;
    }
    args = PySequence_List(f->args);
    kwargs = PyDict_Copy(f->kwargs);
    keys = kwargs ? PyDict_Keys(kwargs) : NULL;
    slots = PyList_New(0);
    gone = PyList_New(0);
    if (args == NULL || keys == NULL || slots == NULL || gone == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args); i++) {
        PyObject *a = Py_NewRef(PyList_GET_ITEM(args, i));
        PyObject *rec = ms_is_tensor(st, a) ? offload_one(ex, a)
                                            : Py_NewRef(Py_None);
        int bad = rec == NULL;
        if (!bad && rec != Py_None) {
            PyObject *idx = PyLong_FromSsize_t(i);
            bad = idx == NULL || note_slot(slots, 0, idx) < 0
                  || PyList_Append(gone, a) < 0
                  || PyList_SetItem(args, i, Py_NewRef(rec)) < 0;
            Py_XDECREF(idx);
        }
        Py_XDECREF(rec);
        Py_DECREF(a);
        if (bad) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *value = PyDict_GetItemWithError(kwargs, key);
        if (value == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            continue;
        }
        Py_INCREF(value);
        PyObject *rec = ms_is_tensor(st, value) ? offload_one(ex, value)
                                                : Py_NewRef(Py_None);
        int bad = rec == NULL;
        if (!bad && rec != Py_None) {
            bad = note_slot(slots, 1, key) < 0
                  || PyList_Append(gone, value) < 0
                  || PyDict_SetItem(kwargs, key, rec) < 0;
        }
        Py_XDECREF(rec);
        Py_DECREF(value);
        if (bad) {
            goto done;
        }
    }
    if (PyList_GET_SIZE(slots) == 0) {
        rc = 0;
        goto done;
    }
    /* Version entries of offloaded tensors: through weak references. */
    versions = PyList_New(0);
    if (versions == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(f->versions); i++) {
        PyObject *pair = PyList_GET_ITEM(f->versions, i);
        PyObject *t = PyTuple_GET_ITEM(pair, 0);
        int offloaded = 0;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(gone); j++) {
            if (PyList_GET_ITEM(gone, j) == t) {
                offloaded = 1;
                break;
            }
        }
        PyObject *entry;
        if (offloaded) {
            PyObject *ref = PyWeakref_NewRef(t, NULL);
            entry = ref ? PyTuple_Pack(2, ref, PyTuple_GET_ITEM(pair, 1))
                        : NULL;
            Py_XDECREF(ref);
        }
        else {
            entry = Py_NewRef(pair);
        }
        int bad = entry == NULL || PyList_Append(versions, entry) < 0;
        Py_XDECREF(entry);
        if (bad) {
            goto done;
        }
    }
    PyObject *tuple = PyList_AsTuple(args);
    if (tuple == NULL) {
        goto done;
    }
    /* Commit. */
    Py_SETREF(f->args, tuple);
    Py_SETREF(f->kwargs, kwargs);
    kwargs = NULL;
    Py_SETREF(f->versions, versions);
    versions = NULL;
    Py_XSETREF(f->off.slots, slots);
    slots = NULL;
    rc = 0;
done:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(keys);
    Py_XDECREF(slots);
    Py_XDECREF(gone);
    Py_XDECREF(versions);
    return rc;
}

static PyObject *
reload_one(ms_state *st, PyObject *rec)
{
    if (ms_is_spilled(st, rec)) {
        return ms_spill_get(rec);
    }
    return PyObject_CallMethodNoArgs(rec, st->s_get);
}

/* Before a recompute: put the offloaded inputs back.  Works on copies and
   commits at the end, so that a failure (or a concurrent recompute of the
   frame) leaves the frame as it was. */
int
ms_reload_inputs(Frame *f)
{
    ms_state *st = f->ex->st;
    PyObject *slots = Py_NewRef(f->off.slots);
    PyObject *args = PySequence_List(f->args);
    PyObject *kwargs = PyDict_Copy(f->kwargs);
    if (args == NULL || kwargs == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
        PyObject *slot = PyList_GET_ITEM(slots, i);
        long where = PyLong_AsLong(PyTuple_GET_ITEM(slot, 0));
        PyObject *key = PyTuple_GET_ITEM(slot, 1);
        PyObject *rec;
        if (where == 0) {
            Py_ssize_t k = PyLong_AsSsize_t(key);
            rec = (k >= 0 && k < PyList_GET_SIZE(args))
                      ? PyList_GET_ITEM(args, k)
                      : NULL;
        }
        else {
            rec = PyDict_GetItemWithError(kwargs, key);
        }
        if (rec == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError,
                                "memscale: internal error: bad offload slot");
            }
            goto error;
        }
        Py_INCREF(rec);
        PyObject *t = reload_one(st, rec);
        Py_DECREF(rec);
        if (t == NULL) {
            goto error;
        }
        int bad = where == 0
                      ? PyList_SetItem(args, PyLong_AsSsize_t(key), t) < 0
                      : PyDict_SetItem(kwargs, key, t) < 0;
        if (where != 0) {
            Py_DECREF(t); /* PyDict_SetItem does not steal */
        }
        if (bad) {
            goto error;
        }
    }
    PyObject *tuple = PyList_AsTuple(args);
    if (tuple == NULL) {
        goto error;
    }
    Py_DECREF(args);
    Py_SETREF(f->args, tuple);
    Py_SETREF(f->kwargs, kwargs);
    if (f->off.slots == slots) {
        Py_CLEAR(f->off.slots);
    }
    Py_DECREF(slots);
    return 0;
error:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_DECREF(slots);
    return -1;
}
