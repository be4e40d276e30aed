/*
 * versions.c: the versions of a call's input tensors.
 *
 * Autograd bumps a tensor's _version on every in-place change.  Recording
 * the (tensor, version) pairs of a call's inputs tells later whether one
 * was changed in place: the profiler flags such a unit, and a checkpoint
 * frame refuses to recompute from changed inputs.
 */
#include "versions.h"

static int collect_versions_impl(ms_state *st, PyObject *obj, PyObject *out);

/* Versions of the tensors among a call's args and kwargs: (tensor,
   version) pairs, to tell in-place updates of its inputs. */
int
ms_collect_versions(ms_state *st, PyObject *obj, PyObject *out)
{
    if (Py_EnterRecursiveCall(" while collecting input versions")) {
        return -1;
    }
    int rc = collect_versions_impl(st, obj, out);
    Py_LeaveRecursiveCall();
    return rc;
}

static int
collect_versions_impl(ms_state *st, PyObject *obj, PyObject *out)
{
    if (ms_is_tensor(st, obj)) {
        PyObject *v = PyObject_GetAttr(obj, st->s_version);
        if (v == NULL) {
            return -1;
        }
        PyObject *pair = PyTuple_Pack(2, obj, v);
        Py_DECREF(v);
        if (pair == NULL) {
            return -1;
        }
        int rc = PyList_Append(out, pair);
        Py_DECREF(pair);
        return rc;
    }
    if (PyTuple_Check(obj) || PyList_Check(obj)) {
        PyObject *items = PySequence_Tuple(obj); /* lists may change */
        if (items == NULL) {
            return -1;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
            if (ms_collect_versions(st, PyTuple_GET_ITEM(items, i), out) < 0) {
                Py_DECREF(items);
                return -1;
            }
        }
        Py_DECREF(items);
    }
    else if (PyDict_Check(obj)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(obj, &pos, &k, &v)) {
            Py_INCREF(v); /* the call below may run Python code */
            int rc = ms_collect_versions(st, v, out);
            Py_DECREF(v);
            if (rc < 0) {
                return -1;
            }
        }
    }
    return 0;
}

/* Whether an input recorded as (tensor, version) has changed: 1 yes, 0 no,
   -1 with an exception set.  An offloaded input is recorded through a weak
   reference: gone, nobody can have changed it since. */
static int
input_changed(ms_state *st, PyObject *pair)
{
    PyObject *t = PyTuple_GET_ITEM(pair, 0);
    if (PyWeakref_CheckRef(t)) {
        int alive = ms_weakref_get(t, &t);
        if (alive <= 0) {
            return alive; /* an error, or gone: unchanged */
        }
    }
    else {
        Py_INCREF(t);
    }
    PyObject *now = PyObject_GetAttr(t, st->s_version);
    Py_DECREF(t);
    if (now == NULL) {
        return -1;
    }
    int eq = PyObject_RichCompareBool(now, PyTuple_GET_ITEM(pair, 1), Py_EQ);
    Py_DECREF(now);
    return eq < 0 ? -1 : !eq;
}

/* 1 if every recorded input version is unchanged, 0 if not, -1 on error. */
int
ms_versions_unchanged(ms_state *st, PyObject *versions)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(versions); i++) {
        PyObject *pair = Py_NewRef(PyList_GET_ITEM(versions, i));
        int changed = input_changed(st, pair);
        Py_DECREF(pair);
        if (changed != 0) {
            return changed < 0 ? -1 : 0;
        }
    }
    return 1;
}
