/*
 * exec_tiling.c: the tiled forward, _TiledForward.
 *
 * A tiled layer's `forward` while memscale is attached (an instance
 * attribute, removed by detach): inside the layer's checkpoint frame it
 * runs the layer's own forward tile by tile, recording where each tile's
 * saved tensors start and end so that backward recomputes one tile at a
 * time (frame.c); anywhere else (evaluation, recompute, paused) it is the
 * layer's forward unchanged.  The first tiled call asks the executor's
 * verifier along which dimension the layer may be tiled, if at all.  The
 * slicing and joining are tiling.c's.
 */
#include "executor_internal.h"

#include "tiling.h"

/* Tiled.dim before the first tiled call, and once refused. */
enum { DIM_UNVERIFIED = -1, DIM_DEMOTED = -2 };

typedef struct {
    PyObject_HEAD
    Executor *ex;
    PyObject *unit;
    PyObject *orig;  /* the forward it stands in for */
    int dim;         /* >= 0, or DIM_UNVERIFIED / DIM_DEMOTED */
    Py_ssize_t ndim; /* dimensions of the lead tensor it was verified on */
} Tiled;

static int
tiled_traverse(Tiled *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->ex);
    Py_VISIT(self->unit);
    Py_VISIT(self->orig);
    return 0;
}

static int
tiled_clear(Tiled *self)
{
    Py_CLEAR(self->ex);
    Py_CLEAR(self->unit);
    Py_CLEAR(self->orig);
    return 0;
}

static void
tiled_dealloc(Tiled *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)tiled_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* The frame this call tiles (borrowed), or NULL to run untiled. */
static Frame *
tiled_frame(Tiled *self)
{
    Executor *ex = self->ex;
    if (ex == NULL || ex->stack == NULL || ex->recompute_depth > 0
        || self->dim == DIM_DEMOTED)
    {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ex->stack);
    if (n == 0) {
        return NULL;
    }
    PyObject *top = PyList_GET_ITEM(ex->stack, n - 1);
    if (!PyObject_TypeCheck(top, ex->st->frame_type)) {
        return NULL;
    }
    Frame *f = (Frame *)top;
    /* Only a fresh frame of this layer: nothing saved before the tiles. */
    if (f->unit != self->unit || f->tile.n < 2 || f->tile.end != NULL
        || f->recomputing || PyList_GET_SIZE(f->shapes) != 0)
    {
        return NULL;
    }
    return f;
}

/* Append the CPU RNG state to f->tile.rng.  A tileable layer draws no
   random numbers, so every tile usually starts from the state the frame
   recorded: then that same object is appended, and a tiled frame holds no
   more RNG state than an untiled one. */
static int
append_rng(ms_state *st, Frame *f)
{
    PyObject *rng = PyObject_CallNoArgs(st->get_rng_state);
    if (rng == NULL) {
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(f->tile.rng);
    PyObject *prev = n > 0 ? PyList_GET_ITEM(f->tile.rng, n - 1) : f->rng_cpu;
    if (prev != NULL) {
        PyObject *eq = PyObject_CallMethodObjArgs(st->torch, st->s_equal, prev,
                                                  rng, NULL);
        int same = eq != NULL ? PyObject_IsTrue(eq) : -1;
        Py_XDECREF(eq);
        if (same < 0) {
            Py_DECREF(rng);
            return -1;
        }
        if (same) {
            Py_SETREF(rng, Py_NewRef(prev));
        }
    }
    int rc = PyList_Append(f->tile.rng, rng);
    Py_DECREF(rng);
    return rc;
}

/* Run the tiles of f; the joined output, or NULL with an exception. */
static PyObject *
run_tiles(Tiled *self, Frame *f, PyObject *args, PyObject *kwargs,
          PyObject *lead_shape, int tiles)
{
    ms_state *st = self->ex->st;
    PyObject *outs = PyList_New(0);
    f->tile.end = PyMem_Calloc((size_t)tiles, sizeof(Py_ssize_t));
    if (f->tile.end != NULL) {
        f->tile.n = tiles; /* tile_end has this many entries */
    }
    f->tile.rng = PyList_New(0);
    if (f->rng_cuda != NULL) {
        f->tile.rng_cuda = PyList_New(0);
    }
    if (outs == NULL || f->tile.end == NULL || f->tile.rng == NULL
        || (f->rng_cuda != NULL && f->tile.rng_cuda == NULL))
    {
        if (f->tile.end == NULL) {
            PyErr_NoMemory();
        }
        goto error;
    }
    f->tile.n = tiles;
    for (int j = 0; j < tiles; j++) {
        Py_ssize_t start, len;
        PyObject *targs, *tkwargs, *out;
        int rc = append_rng(st, f);
        if (rc < 0) {
            goto error;
        }
        if (f->tile.rng_cuda != NULL) {
            PyObject *rng = PyObject_CallNoArgs(st->cuda_get_rng_state_all);
            rc = rng ? PyList_Append(f->tile.rng_cuda, rng) : -1;
            Py_XDECREF(rng);
            if (rc < 0) {
                goto error;
            }
        }
        ms_tile_range(f->tile.extent, tiles, j, &start, &len);
        if (ms_tile_slice(st, args, kwargs, f->tile.dim, lead_shape, start,
                          len, &targs, &tkwargs)
            < 0)
        {
            goto error;
        }
        out = PyObject_Call(self->orig, targs, tkwargs);
        Py_DECREF(targs);
        Py_DECREF(tkwargs);
        if (out == NULL) {
            goto error;
        }
        f->tile.end[j] = PyList_GET_SIZE(f->shapes);
        rc = PyList_Append(outs, out);
        Py_DECREF(out);
        if (rc < 0) {
            goto error;
        }
    }
    PyObject *res = ms_tile_merge(st, outs, f->tile.dim);
    Py_DECREF(outs);
    if (res != NULL) {
        self->ex->tiled_calls++;
    }
    return res;
error:
    /* The forward raises: the frame is discarded with its graph.  Leave
       it consistent anyway. */
    Py_XDECREF(outs);
    PyMem_Free(f->tile.end);
    f->tile.end = NULL;
    f->tile.n = 1;
    return NULL;
}

/* Dimensions of the lead tensor of a call (0 without one), or -1. */
static Py_ssize_t
lead_ndim(ms_state *st, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t extent;
    PyObject *shape;
    if (ms_tile_extent(st, args, kwargs, 0, &extent, &shape) < 0) {
        return -1;
    }
    Py_ssize_t n = shape != NULL ? PyTuple_GET_SIZE(shape) : 0;
    Py_XDECREF(shape);
    return n;
}

/* Ask the verifier: 0 with self->dim set (or left unverified, when it
   cannot tell on this input), -1 with an exception. */
static int
verify_tiling(Tiled *self, Frame *f, PyObject *args, PyObject *kwargs)
{
    Executor *ex = self->ex;
    PyObject *verifier = Py_XNewRef(ex->tile_verifier);
    if (verifier == NULL || verifier == Py_None) {
        Py_XDECREF(verifier);
        self->dim = DIM_DEMOTED;
        return 0;
    }
    PyObject *kw = kwargs != NULL ? Py_NewRef(kwargs) : PyDict_New();
    PyObject *n = PyLong_FromLong(f->tile.n);
    PyObject *r = (kw != NULL && n != NULL)
                      ? PyObject_CallFunctionObjArgs(verifier, self->unit,
                                                     self->orig, args, kw, n,
                                                     NULL)
                      : NULL;
    Py_XDECREF(kw);
    Py_XDECREF(n);
    Py_DECREF(verifier);
    if (r == NULL) {
        return -1;
    }
    if (r == Py_None) {
        Py_DECREF(r);
        self->dim = DIM_DEMOTED;
        return 0;
    }
    long d = PyLong_AsLong(r);
    Py_DECREF(r);
    if (d == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (d < -1 || d > 64) {
        PyErr_Format(PyExc_ValueError,
                     "memscale: the tiling verifier returned dim %ld", d);
        return -1;
    }
    if (d >= 0) {
        Py_ssize_t nd = lead_ndim(ex->st, args, kwargs);
        if (nd < 0) {
            return -1;
        }
        self->dim = (int)d;
        self->ndim = nd;
    }
    /* d == -1: undecided on this input; ask again next time. */
    return 0;
}

static PyObject *
tiled_call(Tiled *self, PyObject *args, PyObject *kwargs)
{
    Frame *f = tiled_frame(self);
    if (f == NULL) {
        return PyObject_Call(self->orig, args, kwargs);
    }
    Executor *ex = self->ex;
    Py_INCREF(f);
    PyObject *res = NULL, *lead_shape = NULL;
    if (self->dim == DIM_UNVERIFIED) {
        if (verify_tiling(self, f, args, kwargs) < 0) {
            goto done;
        }
        if (tiled_frame(self) != f) {
            /* The verifier changed what the frame holds (it saved tensors
               into it): not tiled this time. */
            f->tile.n = 1;
            res = PyObject_Call(self->orig, args, kwargs);
            goto done;
        }
    }
    Py_ssize_t extent = 0;
    if (self->dim >= 0) {
        Py_ssize_t nd = lead_ndim(ex->st, args, kwargs);
        if (nd < 0) {
            goto done;
        }
        /* Verified on inputs of another rank: the dimension means
           something else here, so this call runs whole. */
        if (nd == self->ndim
            && ms_tile_extent(ex->st, args, kwargs, self->dim, &extent,
                              &lead_shape)
                   < 0)
        {
            goto done;
        }
    }
    int tiles = extent < f->tile.n ? (int)extent : f->tile.n;
    if (self->dim < 0 || lead_shape == NULL || tiles < 2) {
        f->tile.n = 1; /* checkpointed whole, as an untiled layer */
        res = PyObject_Call(self->orig, args, kwargs);
        goto done;
    }
    f->tile.dim = self->dim;
    f->tile.extent = extent;
    res = run_tiles(self, f, args, kwargs, lead_shape, tiles);
done:
    Py_XDECREF(lead_shape);
    Py_DECREF(f);
    return res;
}

static PyObject *
tiled_get_wrapped(Tiled *self, void *Py_UNUSED(c))
{
    return Py_NewRef(self->orig ? self->orig : Py_None);
}

static PyObject *
tiled_get_dim(Tiled *self, void *Py_UNUSED(c))
{
    if (self->dim >= 0) {
        return PyLong_FromLong(self->dim);
    }
    return PyUnicode_FromString(self->dim == DIM_DEMOTED ? "demoted"
                                                         : "unverified");
}

static PyGetSetDef tiled_getset[] = {
    {"__wrapped__", (getter)tiled_get_wrapped, NULL,
     "The layer's own forward.", NULL},
    {"dim", (getter)tiled_get_dim, NULL,
     "The tiled dimension, 'unverified' before the first tiled call, or\n"
     "'demoted' when verification refused tiling.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot tiled_slots[] = {
    {Py_tp_doc, "A tiled layer's forward while memscale is attached."},
    {Py_tp_dealloc, tiled_dealloc},
    {Py_tp_traverse, tiled_traverse},
    {Py_tp_clear, tiled_clear},
    {Py_tp_call, tiled_call},
    {Py_tp_getset, tiled_getset},
    {0, NULL},
};

static PyType_Spec tiled_spec = {
    .name = "memscale._core._TiledForward",
    .basicsize = sizeof(Tiled),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tiled_slots,
};

PyObject *
ms_tiled_new(Executor *ex, PyObject *unit, PyObject *forward)
{
    Tiled *t = PyObject_GC_New(Tiled, ex->st->tiled_type);
    if (t == NULL) {
        return NULL;
    }
    t->ex = (Executor *)Py_NewRef(ex);
    t->unit = Py_NewRef(unit);
    t->orig = Py_NewRef(forward);
    t->dim = DIM_UNVERIFIED;
    t->ndim = -1;
    PyObject_GC_Track(t);
    return (PyObject *)t;
}

int
ms_tiled_init_types(PyObject *module, ms_state *st)
{
    st->tiled_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &tiled_spec, NULL);
    return st->tiled_type == NULL ? -1 : 0;
}
