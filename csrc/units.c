/*
 * units.c: the planning units of a model (find_units).
 *
 * The children of a ModuleList or Sequential that repeats a class (the
 * blocks of a transformer) are the units, wherever such a container sits
 * below the model.  Without one, the model's top-level children are, and
 * a child holding over half of the parameters is split into its own
 * children, recursively.  A module reached twice is one unit.
 */
#include "units.h"

static PyObject *
named_children(ms_state *st, PyObject *mod)
{
    PyObject *it = PyObject_CallMethodNoArgs(mod, st->s_named_children);
    if (it == NULL) {
        return NULL;
    }
    PyObject *list = PySequence_List(it);
    Py_DECREF(it);
    return list;
}

/* 1 if mod is a ModuleList/Sequential with two children of one class. */
static int
is_repeating(ms_state *st, PyObject *mod)
{
    int r = PyObject_IsInstance(mod, st->module_list_type);
    if (r == 0) {
        r = PyObject_IsInstance(mod, st->sequential_type);
    }
    if (r <= 0) {
        return r;
    }
    PyObject *kids = named_children(st, mod);
    if (kids == NULL) {
        return -1;
    }
    PyObject *types = PySet_New(NULL);
    int found = types ? 0 : -1;
    for (Py_ssize_t i = 0; found == 0 && i < PyList_GET_SIZE(kids); i++) {
        PyObject *tp = (PyObject *)Py_TYPE(
            PyTuple_GET_ITEM(PyList_GET_ITEM(kids, i), 1));
        int has = PySet_Contains(types, tp);
        if (has != 0) {
            found = has;
        }
        else if (PySet_Add(types, tp) < 0) {
            found = -1;
        }
    }
    Py_XDECREF(types);
    Py_DECREF(kids);
    return found;
}

static int
add_unit(PyObject *out, PyObject *seen, PyObject *name, PyObject *mod)
{
    int has = PySet_Contains(seen, mod);
    if (has != 0) {
        return has < 0 ? -1 : 0; /* a shared module is one unit */
    }
    PyObject *pair = PyTuple_Pack(2, name, mod);
    if (pair == NULL) {
        return -1;
    }
    int rc = (PySet_Add(seen, mod) < 0 || PyList_Append(out, pair) < 0) ? -1
                                                                        : 0;
    Py_DECREF(pair);
    return rc;
}

static PyObject *
join_name(PyObject *prefix, PyObject *name)
{
    if (PyUnicode_GET_LENGTH(prefix) == 0) {
        return Py_NewRef(name);
    }
    return PyUnicode_FromFormat("%U.%U", prefix, name);
}

/* Children of repeating containers anywhere below mod. */
static int
walk_repeating(ms_state *st, PyObject *mod, PyObject *prefix, PyObject *out,
               PyObject *seen)
{
    PyObject *kids = named_children(st, mod);
    if (kids == NULL) {
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(kids); i++) {
        PyObject *pair = PyList_GET_ITEM(kids, i);
        PyObject *full = join_name(prefix, PyTuple_GET_ITEM(pair, 0));
        if (full == NULL) {
            rc = -1;
            break;
        }
        PyObject *child = PyTuple_GET_ITEM(pair, 1);
        int rep = is_repeating(st, child);
        if (rep < 0) {
            rc = -1;
        }
        else if (rep) {
            PyObject *blocks = named_children(st, child);
            if (blocks == NULL) {
                rc = -1;
            }
            for (Py_ssize_t j = 0; rc == 0 && j < PyList_GET_SIZE(blocks); j++)
            {
                PyObject *bp = PyList_GET_ITEM(blocks, j);
                PyObject *bname = join_name(full, PyTuple_GET_ITEM(bp, 0));
                rc = bname
                         ? add_unit(out, seen, bname, PyTuple_GET_ITEM(bp, 1))
                         : -1;
                Py_XDECREF(bname);
            }
            Py_XDECREF(blocks);
        }
        else {
            rc = walk_repeating(st, child, full, out, seen);
        }
        Py_DECREF(full);
    }
    Py_DECREF(kids);
    return rc;
}

static int
param_count(ms_state *st, PyObject *mod, long long *out)
{
    PyObject *params = PyObject_CallMethodNoArgs(mod, st->s_parameters);
    PyObject *it = params ? PyObject_GetIter(params) : NULL;
    PyObject *p;
    *out = 0;
    Py_XDECREF(params);
    if (it == NULL) {
        return -1;
    }
    while ((p = PyIter_Next(it)) != NULL) {
        PyObject *n = PyObject_CallMethodNoArgs(p, st->s_numel);
        Py_DECREF(p);
        long long v = n ? PyLong_AsLongLong(n) : -1;
        Py_XDECREF(n);
        if (v < 0) {
            Py_DECREF(it);
            return -1;
        }
        *out += v;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* Top-level children; one holding over half the parameters is split. */
static int
walk_fallback(ms_state *st, PyObject *mod, PyObject *prefix, long long total,
              PyObject *out, PyObject *seen)
{
    PyObject *kids = named_children(st, mod);
    if (kids == NULL) {
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(kids); i++) {
        PyObject *pair = PyList_GET_ITEM(kids, i);
        PyObject *child = PyTuple_GET_ITEM(pair, 1);
        PyObject *full = join_name(prefix, PyTuple_GET_ITEM(pair, 0));
        long long count;
        if (full == NULL || param_count(st, child, &count) < 0) {
            Py_XDECREF(full);
            rc = -1;
            break;
        }
        PyObject *grand = named_children(st, child);
        if (grand == NULL) {
            rc = -1;
        }
        else if (total > 0 && 2 * count > total && PyList_GET_SIZE(grand) > 0)
        {
            rc = walk_fallback(st, child, full, total, out, seen);
        }
        else {
            rc = add_unit(out, seen, full, child);
        }
        Py_XDECREF(grand);
        Py_DECREF(full);
    }
    Py_DECREF(kids);
    return rc;
}

PyObject *
ms_find_units(PyObject *module, PyObject *model)
{
    ms_state *st = ms_get_state(module);
    PyObject *out = PyList_New(0), *seen = PySet_New(NULL);
    PyObject *empty = PyUnicode_FromString("");
    int rc = -1;
    if (out == NULL || seen == NULL || empty == NULL) {
        goto done;
    }
    int r = PyObject_IsInstance(model, st->torch_module_type);
    if (r <= 0) {
        if (r == 0) {
            PyErr_Format(PyExc_TypeError,
                         "find_units() needs a torch.nn.Module, got %.200s",
                         Py_TYPE(model)->tp_name);
        }
        goto done;
    }
    int rep = is_repeating(st, model);
    if (rep < 0) {
        goto done;
    }
    if (rep) {
        /* The model itself is the repeating container. */
        PyObject *kids = named_children(st, model);
        if (kids == NULL) {
            goto done;
        }
        rc = 0;
        for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(kids); i++) {
            PyObject *pair = PyList_GET_ITEM(kids, i);
            rc = add_unit(out, seen, PyTuple_GET_ITEM(pair, 0),
                          PyTuple_GET_ITEM(pair, 1));
        }
        Py_DECREF(kids);
        if (rc < 0) {
            goto done;
        }
    }
    else if (walk_repeating(st, model, empty, out, seen) < 0) {
        goto done;
    }
    if (PyList_GET_SIZE(out) == 0) {
        long long total;
        if (param_count(st, model, &total) < 0
            || walk_fallback(st, model, empty, total, out, seen) < 0)
        {
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(seen);
    Py_XDECREF(empty);
    if (rc < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}
