/*
 * tiling.c: running a layer on slices of its input.
 *
 * A tiled layer sees its input in `tiles` consecutive slices along one
 * dimension (the batch or the sequence), one call per slice, and its
 * outputs are concatenated along the same dimension.  Which tensors are
 * sliced: the lead tensor (the first tensor argument) and every other
 * tensor argument, at the top level or one tuple/list deep, whose shape
 * agrees with the lead's up to and including the tiled dimension (so an
 * attention mask of shape (batch, 1, seq, seq) is sliced along the batch,
 * never along the sequence).  Everything else is passed whole.
 *
 * These helpers are shared by the executor (tiles inside a checkpoint
 * frame, each recomputed on its own in backward) and by tile_call(), which
 * the profile-time verification uses to compare tiled with untiled.
 */
#include "tiling.h"

#include "engine.h"

/* Nested tuples/lists deeper than this are passed whole. */
#define MAX_DEPTH 2

/* The shape of a tensor as a tuple (new reference). */
static PyObject *
shape_of(ms_state *st, PyObject *t)
{
    PyObject *shape = PyObject_GetAttr(t, st->s_shape);
    if (shape == NULL) {
        return NULL;
    }
    if (!PyTuple_Check(shape)) {
        PyErr_Format(PyExc_TypeError, "tensor.shape is a %.200s",
                     Py_TYPE(shape)->tp_name);
        Py_DECREF(shape);
        return NULL;
    }
    return shape;
}

static PyObject *
lead_tensor(ms_state *st, PyObject *args, PyObject *kwargs)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        if (ms_is_tensor(st, PyTuple_GET_ITEM(args, i))) {
            return PyTuple_GET_ITEM(args, i);
        }
    }
    if (kwargs != NULL && kwargs != Py_None) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            if (ms_is_tensor(st, v)) {
                return v;
            }
        }
    }
    return NULL;
}

int
ms_tile_extent(ms_state *st, PyObject *args, PyObject *kwargs, int dim,
               Py_ssize_t *extent, PyObject **lead_shape)
{
    *extent = 0;
    *lead_shape = NULL;
    if (dim < 0 || !PyTuple_Check(args)) {
        return 0;
    }
    PyObject *lead = lead_tensor(st, args, kwargs);
    if (lead == NULL) {
        return 0;
    }
    PyObject *shape = shape_of(st, lead);
    if (shape == NULL) {
        return -1;
    }
    if (PyTuple_GET_SIZE(shape) <= dim) {
        Py_DECREF(shape);
        return 0;
    }
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, dim));
    if (n < 0) {
        Py_DECREF(shape);
        return PyErr_Occurred() ? -1 : 0;
    }
    *extent = n;
    *lead_shape = shape;
    return 0;
}

void
ms_tile_range(Py_ssize_t extent, int tiles, int j, Py_ssize_t *start,
              Py_ssize_t *len)
{
    Py_ssize_t base = extent / tiles, rem = extent % tiles;
    *start = (Py_ssize_t)j * base + (j < rem ? j : rem);
    *len = base + (j < rem ? 1 : 0);
}

/* 1 if t is sliced with the lead tensor, 0 if passed whole, -1 on error. */
static int
follows_lead(ms_state *st, PyObject *t, int dim, PyObject *lead_shape)
{
    PyObject *shape = shape_of(st, t);
    if (shape == NULL) {
        return -1;
    }
    int same = PyTuple_GET_SIZE(shape) > dim;
    for (int d = 0; same > 0 && d <= dim; d++) {
        same = PyObject_RichCompareBool(PyTuple_GET_ITEM(shape, d),
                                        PyTuple_GET_ITEM(lead_shape, d),
                                        Py_EQ);
    }
    Py_DECREF(shape);
    return same; /* -1 with an exception, 0 or 1 */
}

/* tensor.narrow(dim, start, len) */
static PyObject *
narrow(ms_state *st, PyObject *tensor, int dim, Py_ssize_t start,
       Py_ssize_t len)
{
    PyObject *d = PyLong_FromLong(dim);
    PyObject *s = d ? PyLong_FromSsize_t(start) : NULL;
    PyObject *n = s ? PyLong_FromSsize_t(len) : NULL;
    PyObject *res = n ? PyObject_CallMethodObjArgs(tensor, st->s_narrow, d, s,
                                                   n, NULL)
                      : NULL;
    Py_XDECREF(d);
    Py_XDECREF(s);
    Py_XDECREF(n);
    return res;
}

static PyObject *
slice_obj(ms_state *st, PyObject *obj, int dim, PyObject *lead_shape,
          Py_ssize_t start, Py_ssize_t len, int depth)
{
    if (ms_is_tensor(st, obj)) {
        int follow = follows_lead(st, obj, dim, lead_shape);
        if (follow < 0) {
            return NULL;
        }
        if (!follow) {
            return Py_NewRef(obj);
        }
        return narrow(st, obj, dim, start, len);
    }
    int is_tuple = PyTuple_CheckExact(obj), is_list = PyList_CheckExact(obj);
    if (depth >= MAX_DEPTH || !(is_tuple || is_list)) {
        return Py_NewRef(obj);
    }
    PyObject *items = PySequence_Tuple(obj); /* a list may change */
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *out = is_tuple ? PyTuple_New(n) : PyList_New(n);
    if (out == NULL) {
        Py_DECREF(items);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = slice_obj(st, PyTuple_GET_ITEM(items, i), dim,
                                lead_shape, start, len, depth + 1);
        if (v == NULL) {
            Py_DECREF(items);
            Py_DECREF(out);
            return NULL;
        }
        if (is_tuple) {
            PyTuple_SET_ITEM(out, i, v);
        }
        else {
            PyList_SET_ITEM(out, i, v);
        }
    }
    Py_DECREF(items);
    return out;
}

int
ms_tile_slice(ms_state *st, PyObject *args, PyObject *kwargs, int dim,
              PyObject *lead_shape, Py_ssize_t start, Py_ssize_t len,
              PyObject **targs, PyObject **tkwargs)
{
    *targs = slice_obj(st, args, dim, lead_shape, start, len, 0);
    *tkwargs = PyDict_New();
    if (*targs == NULL || *tkwargs == NULL) {
        goto error;
    }
    if (kwargs != NULL && kwargs != Py_None) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            PyObject *s = slice_obj(st, v, dim, lead_shape, start, len, 1);
            if (s == NULL) {
                goto error;
            }
            int rc = PyDict_SetItem(*tkwargs, k, s);
            Py_DECREF(s);
            if (rc < 0) {
                goto error;
            }
        }
    }
    return 0;
error:
    Py_CLEAR(*targs);
    Py_CLEAR(*tkwargs);
    return -1;
}

/* Merge item `i` of each tile's output (outs: a list, one per tile). */
static PyObject *
merge(ms_state *st, PyObject *outs, int dim, int depth)
{
    Py_ssize_t n = PyList_GET_SIZE(outs);
    PyObject *first = PyList_GET_ITEM(outs, 0);
    if (ms_is_tensor(st, first)) {
        for (Py_ssize_t j = 1; j < n; j++) {
            if (!ms_is_tensor(st, PyList_GET_ITEM(outs, j))) {
                goto mismatch;
            }
        }
        PyObject *d = PyLong_FromLong(dim);
        PyObject *res = d ? PyObject_CallFunctionObjArgs(st->cat, outs, d,
                                                         NULL)
                          : NULL;
        Py_XDECREF(d);
        return res;
    }
    int is_tuple = PyTuple_CheckExact(first),
        is_list = PyList_CheckExact(first);
    if ((is_tuple || is_list) && depth < MAX_DEPTH) {
        Py_ssize_t m = PySequence_Size(first);
        for (Py_ssize_t j = 1; j < n; j++) {
            PyObject *o = PyList_GET_ITEM(outs, j);
            if (Py_TYPE(o) != Py_TYPE(first) || PySequence_Size(o) != m) {
                goto mismatch;
            }
        }
        /* Tuples of our own: a list could change under the calls below. */
        PyObject *frozen = PyList_New(n);
        if (frozen == NULL) {
            return NULL;
        }
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *t = PySequence_Tuple(PyList_GET_ITEM(outs, j));
            if (t == NULL) {
                Py_DECREF(frozen);
                return NULL;
            }
            PyList_SET_ITEM(frozen, j, t);
        }
        PyObject *res = is_tuple ? PyTuple_New(m) : PyList_New(m);
        PyObject *column = PyList_New(n);
        if (res == NULL || column == NULL) {
            Py_XDECREF(res);
            Py_XDECREF(column);
            Py_DECREF(frozen);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            for (Py_ssize_t j = 0; j < n; j++) {
                PyObject *o = PyList_GET_ITEM(frozen, j);
                PyObject *item = PyTuple_GET_ITEM(o, i);
                if (PyList_SetItem(column, j, Py_NewRef(item)) < 0) {
                    Py_DECREF(res);
                    Py_DECREF(column);
                    Py_DECREF(frozen);
                    return NULL;
                }
            }
            PyObject *v = merge(st, column, dim, depth + 1);
            if (v == NULL) {
                Py_DECREF(res);
                Py_DECREF(column);
                Py_DECREF(frozen);
                return NULL;
            }
            if (is_tuple) {
                PyTuple_SET_ITEM(res, i, v);
            }
            else {
                PyList_SET_ITEM(res, i, v);
            }
        }
        Py_DECREF(column);
        Py_DECREF(frozen);
        return res;
    }
    /* Anything else (None, a flag) must be the same object in every tile. */
    for (Py_ssize_t j = 1; j < n; j++) {
        if (PyList_GET_ITEM(outs, j) != first) {
            goto mismatch;
        }
    }
    return Py_NewRef(first);
mismatch:
    PyErr_Format(
        PyExc_TypeError,
        "memscale: the tiles of a tiled layer returned outputs that "
        "cannot be joined (a %.200s in the first tile); only tensors, "
        "and tuples or lists of them, are concatenated",
        Py_TYPE(first)->tp_name);
    return NULL;
}

PyObject *
ms_tile_merge(ms_state *st, PyObject *outs, int dim)
{
    if (!PyList_Check(outs) || PyList_GET_SIZE(outs) == 0) {
        PyErr_SetString(PyExc_SystemError, "ms_tile_merge: no tiles");
        return NULL;
    }
    return merge(st, outs, dim, 0);
}

PyObject *
ms_tile_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    ms_state *st = ms_get_state(module);
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "tile_call(fn, args, kwargs, dim, tiles)");
        return NULL;
    }
    PyObject *fn = args[0], *fargs = args[1], *fkwargs = args[2];
    if (!PyTuple_Check(fargs)
        || !(fkwargs == Py_None || PyDict_Check(fkwargs)))
    {
        PyErr_SetString(
            PyExc_TypeError,
            "tile_call: args must be a tuple, kwargs a dict or None");
        return NULL;
    }
    long ldim = PyLong_AsLong(args[3]);
    long ltiles = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (ldim < 0 || ldim > 64 || ltiles < 1 || ltiles > MS_MAX_TILES) {
        PyErr_Format(PyExc_ValueError,
                     "tile_call: dim must be in [0, 64] and tiles in [1, %d], "
                     "got %ld and %ld",
                     MS_MAX_TILES, ldim, ltiles);
        return NULL;
    }
    int dim = (int)ldim, tiles = (int)ltiles;
    Py_ssize_t extent;
    PyObject *lead_shape;
    if (ms_tile_extent(st, fargs, fkwargs, dim, &extent, &lead_shape) < 0) {
        return NULL;
    }
    if (lead_shape == NULL || extent < tiles) {
        Py_XDECREF(lead_shape);
        PyErr_Format(
            PyExc_ValueError,
            "tile_call: the first tensor argument has no dimension %d "
            "of at least %d elements",
            dim, tiles);
        return NULL;
    }
    PyObject *outs = PyList_New(0), *res = NULL;
    if (outs == NULL) {
        goto done;
    }
    for (int j = 0; j < tiles; j++) {
        Py_ssize_t start, len;
        PyObject *targs, *tkwargs;
        ms_tile_range(extent, tiles, j, &start, &len);
        if (ms_tile_slice(st, fargs, fkwargs, dim, lead_shape, start, len,
                          &targs, &tkwargs)
            < 0)
        {
            goto done;
        }
        PyObject *out = PyObject_Call(fn, targs, tkwargs);
        Py_DECREF(targs);
        Py_DECREF(tkwargs);
        if (out == NULL) {
            goto done;
        }
        int rc = PyList_Append(outs, out);
        Py_DECREF(out);
        if (rc < 0) {
            goto done;
        }
    }
    res = ms_tile_merge(st, outs, dim);
done:
    Py_XDECREF(outs);
    Py_DECREF(lead_shape);
    return res;
}
