/*
 * frame.c: checkpoint frames and the recompute.
 *
 * Activation checkpointing follows PyTorch's non-reentrant checkpoint.  The
 * forward pre-hook of a checkpointed layer (hooks.c) opens a Frame: it
 * keeps the layer's inputs, records the RNG and autocast state, and pushes
 * saved-tensor hooks whose pack returns a small Handle instead of the
 * tensor.  The forward hook (always_call=True, so it also runs when the
 * forward raises) pops them.  In backward, the first Handle unpacked
 * recomputes the layer (our own hooks bypassed, everyone else's run again)
 * under the recorded RNG and autocast state, with saved-tensor hooks that
 * collect the recomputed tensors in the order they are saved; each unpack
 * hands one back and drops it.
 */
#include "executor_internal.h"

#include "clock.h"
#include "profiler.h"
#include "tiling.h"
#include "versions.h"

typedef struct {
    PyObject_HEAD
    Frame *frame;
    Py_ssize_t index;
} Handle;

/* ---- Handle ------------------------------------------------------- */

static int
handle_traverse(Handle *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->frame);
    return 0;
}

static int
handle_clear(Handle *self)
{
    Py_CLEAR(self->frame);
    return 0;
}

static void
handle_dealloc(Handle *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)handle_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyType_Slot handle_slots[] = {
    {Py_tp_doc, "Stands for a tensor a checkpointed layer saved."},
    {Py_tp_dealloc, handle_dealloc},
    {Py_tp_traverse, handle_traverse},
    {Py_tp_clear, handle_clear},
    {0, NULL},
};

static PyType_Spec handle_spec = {
    .name = "memscale._core._Handle",
    .basicsize = sizeof(Handle),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = handle_slots,
};

/* ---- Frame -------------------------------------------------------- */

static int
frame_traverse(Frame *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->ex);
    Py_VISIT(self->unit);
    Py_VISIT(self->args);
    Py_VISIT(self->kwargs);
    Py_VISIT(self->versions);
    Py_VISIT(self->rng_cpu);
    Py_VISIT(self->rng_cuda);
    Py_VISIT(self->cpu_dtype);
    Py_VISIT(self->cuda_dtype);
    Py_VISIT(self->ctx);
    Py_VISIT(self->shapes);
    Py_VISIT(self->recomputed);
    Py_VISIT(self->off.slots);
    Py_VISIT(self->tile.rng);
    Py_VISIT(self->tile.rng_cuda);
    Py_VISIT(self->seg.units);
    Py_VISIT(self->seg.out);
    Py_VISIT(self->seg.out_version);
    Py_VISIT(self->seg.end_rng);
    Py_VISIT(self->seg.end_rng_cuda);
    Py_VISIT(self->nest.starts);
    Py_VISIT(self->nest.inputs);
    return 0;
}

static int
frame_clear(Frame *self)
{
    Py_CLEAR(self->ex);
    Py_CLEAR(self->unit);
    Py_CLEAR(self->args);
    Py_CLEAR(self->kwargs);
    Py_CLEAR(self->versions);
    Py_CLEAR(self->rng_cpu);
    Py_CLEAR(self->rng_cuda);
    Py_CLEAR(self->cpu_dtype);
    Py_CLEAR(self->cuda_dtype);
    Py_CLEAR(self->ctx);
    Py_CLEAR(self->shapes);
    Py_CLEAR(self->recomputed);
    Py_CLEAR(self->off.slots);
    Py_CLEAR(self->tile.rng);
    Py_CLEAR(self->tile.rng_cuda);
    Py_CLEAR(self->seg.units);
    Py_CLEAR(self->seg.out);
    Py_CLEAR(self->seg.out_version);
    Py_CLEAR(self->seg.end_rng);
    Py_CLEAR(self->seg.end_rng_cuda);
    Py_CLEAR(self->nest.starts);
    Py_CLEAR(self->nest.inputs);
    return 0;
}

static void
frame_dealloc(Frame *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)frame_clear(self);
    PyMem_Free(self->tile.end);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Record what recompute must replay: RNG and autocast state, inputs. */
Frame *
ms_frame_new(Executor *ex, Py_ssize_t index, PyObject *unit, PyObject *args,
             PyObject *kwargs)
{
    ms_state *st = ex->st;
    PyObject *flag = NULL;
    Frame *f = PyObject_GC_New(Frame, st->frame_type);
    if (f == NULL) {
        return NULL;
    }
    f->ex = (Executor *)Py_NewRef(ex);
    f->index = index;
    f->unit = Py_NewRef(unit);
    f->args = Py_NewRef(args);
    f->kwargs = (kwargs != NULL && kwargs != Py_None) ? PyDict_Copy(kwargs)
                                                      : PyDict_New();
    f->versions = PyList_New(0);
    f->shapes = PyList_New(0);
    f->rng_cpu = f->rng_cuda = f->cpu_dtype = f->cuda_dtype = NULL;
    f->ctx = f->recomputed = f->off.slots = NULL;
    f->rpos = f->rend = 0;
    f->cur_unit = unit;
    f->cpu_autocast = f->cuda_autocast = 0;
    f->recomputing = 0;
    f->tile = (FrameTiles){.n = 1, .dim = -1};
    f->seg = (FrameSegment){.id = -1, .next = -1};
    f->nest = (FrameNest){.on = 0};
    f->off = (FrameOffload){.slots = NULL};
    PyObject_GC_Track(f);
    if (f->kwargs == NULL || f->versions == NULL || f->shapes == NULL) {
        goto error;
    }
    /* Versions of the tensor inputs, nested ones included (a tuple of
       tensors is a common argument): recompute needs them unchanged. */
    if (ms_collect_versions(st, f->args, f->versions) < 0
        || ms_collect_versions(st, f->kwargs, f->versions) < 0)
    {
        goto error;
    }
    f->rng_cpu = PyObject_CallNoArgs(st->get_rng_state);
    if (f->rng_cpu == NULL) {
        goto error;
    }
    flag = PyObject_CallOneArg(st->is_autocast_enabled, st->s_cpu);
    if (flag == NULL || (f->cpu_autocast = PyObject_IsTrue(flag)) < 0) {
        goto error;
    }
    Py_CLEAR(flag);
    f->cpu_dtype = PyObject_CallOneArg(st->get_autocast_dtype, st->s_cpu);
    if (f->cpu_dtype == NULL) {
        goto error;
    }
    flag = PyObject_CallNoArgs(st->cuda_is_initialized);
    int cuda = flag ? PyObject_IsTrue(flag) : -1;
    Py_CLEAR(flag);
    if (cuda < 0) {
        goto error;
    }
    if (cuda) {
        /* CUDA path: unverified on this project's CPU-only machines. */
        f->rng_cuda = PyObject_CallNoArgs(st->cuda_get_rng_state_all);
        if (f->rng_cuda == NULL) {
            goto error;
        }
        flag = PyObject_CallOneArg(st->is_autocast_enabled, st->s_cuda);
        if (flag == NULL || (f->cuda_autocast = PyObject_IsTrue(flag)) < 0) {
            goto error;
        }
        Py_CLEAR(flag);
        f->cuda_dtype = PyObject_CallOneArg(st->get_autocast_dtype,
                                            st->s_cuda);
        if (f->cuda_dtype == NULL) {
            goto error;
        }
    }
    return f;
error:
    Py_XDECREF(flag);
    Py_DECREF(f);
    return NULL;
}

static PyObject *
frame_pack(Frame *self, PyObject *tensor)
{
    ms_state *st = self->ex->st;
    /* A pass measured under the plan: the profiler counts what the layer
       saves as its own hook would without the frame (the frame's hook is
       the one autograd calls). */
    if (HAS(self->ex->profiler)
        && ms_profiler_count(self->ex->profiler, tensor) < 0)
    {
        return NULL;
    }
    PyObject *shape = PyObject_GetAttr(tensor, st->s_shape);
    if (shape == NULL) {
        return NULL;
    }
    int rc = PyList_Append(self->shapes, shape);
    Py_DECREF(shape);
    if (rc < 0) {
        return NULL;
    }
    Handle *h = PyObject_GC_New(Handle, st->handle_type);
    if (h == NULL) {
        return NULL;
    }
    h->frame = (Frame *)Py_NewRef(self);
    h->index = PyList_GET_SIZE(self->shapes) - 1;
    PyObject_GC_Track(h);
    return (PyObject *)h;
}

static PyObject *
frame_rpack(Frame *self, PyObject *tensor)
{
    ms_state *st = self->ex->st;
    Py_ssize_t k = self->rpos++;
    if (self->recomputed == NULL || k >= self->rend
        || k >= PyList_GET_SIZE(self->recomputed))
    {
        Py_RETURN_NONE; /* counted; reported after the recompute */
    }
    PyObject *shape = PyObject_GetAttr(tensor, st->s_shape);
    if (shape == NULL) {
        return NULL;
    }
    int eq = PyObject_RichCompareBool(shape, PyList_GET_ITEM(self->shapes, k),
                                      Py_EQ);
    if (eq <= 0) {
        if (eq == 0) {
            PyErr_Format(
                PyExc_RuntimeError,
                "memscale: recomputing checkpointed layer %R gave a "
                "tensor of shape %R where its forward saved %R (saved "
                "tensor #%zd). The layer does not run the same way "
                "twice (its first step's recompute check, on by "
                "default, catches this and plans without the layer; "
                "see docs/checkpointing.md): make its forward "
                "deterministic, or train without checkpointing it.",
                ms_ex_unit_name(self->ex, self->index), shape,
                PyList_GET_ITEM(self->shapes, k), k);
        }
        Py_DECREF(shape);
        return NULL;
    }
    Py_DECREF(shape);
    PyObject *d = PyObject_CallMethodNoArgs(tensor, st->s_detach);
    if (d == NULL) {
        return NULL;
    }
    if (PyList_SetItem(self->recomputed, k, d) < 0) {
        return NULL;
    }
    if (k + 1 == self->rend) {
        /* Everything backward needs exists: stop the layer here. */
        PyErr_SetNone(st->stop_recompute);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The first pass of a nested segment's recompute keeps nothing: the
   tensors its units save are dropped (each unit's own recompute saves them
   again). */
static PyObject *
frame_dpack(Frame *Py_UNUSED(self), PyObject *Py_UNUSED(tensor))
{
    Py_RETURN_NONE;
}

static PyObject *
frame_runpack(Frame *self, PyObject *Py_UNUSED(obj))
{
    PyErr_Format(PyExc_RuntimeError,
                 "memscale: internal error: a tensor saved while recomputing "
                 "layer %R was unpacked",
                 ms_ex_unit_name(self->ex, self->index));
    return NULL;
}

/* Enter ctx and append it to `entered` (for leaving in reverse). */
static int
enter_into(ms_state *st, PyObject *ctx, PyObject *entered)
{
    if (ctx == NULL) {
        return -1;
    }
    int rc = ms_call_enter(st, ctx);
    if (rc == 0) {
        rc = PyList_Append(entered, ctx);
        if (rc < 0) {
            (void)ms_call_exit(st, ctx);
        }
    }
    Py_DECREF(ctx);
    return rc;
}

/* Snapshot the unit's buffers: a list of (buffer, copy, version). */
static PyObject *
snapshot_buffers(ms_state *st, PyObject *unit)
{
    PyObject *snap = PyList_New(0);
    PyObject *bufs = snap ? PyObject_CallMethodNoArgs(unit, st->s_buffers)
                          : NULL;
    PyObject *it = bufs ? PyObject_GetIter(bufs) : NULL;
    PyObject *b;
    Py_XDECREF(bufs);
    if (it == NULL) {
        Py_XDECREF(snap);
        return NULL;
    }
    while ((b = PyIter_Next(it)) != NULL) {
        PyObject *copy = PyObject_CallMethodNoArgs(b, st->s_clone);
        PyObject *ver = copy ? PyObject_GetAttr(b, st->s_version) : NULL;
        PyObject *entry = ver ? PyTuple_Pack(3, b, copy, ver) : NULL;
        Py_DECREF(b);
        Py_XDECREF(copy);
        Py_XDECREF(ver);
        if (entry == NULL || PyList_Append(snap, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(it);
            Py_DECREF(snap);
            return NULL;
        }
        Py_DECREF(entry);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        Py_DECREF(snap);
        return NULL;
    }
    return snap;
}

/*
 * Put back buffers the recompute changed; 1 if any was, 0 if none.  Kernels
 * such as batch_norm update running statistics without bumping the
 * version counter, so values are compared as well.
 */
static int
restore_buffers(ms_state *st, PyObject *snap)
{
    int changed = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(snap); i++) {
        PyObject *e = PyList_GET_ITEM(snap, i);
        PyObject *buf = PyTuple_GET_ITEM(e, 0), *copy = PyTuple_GET_ITEM(e, 1);
        PyObject *ver = PyObject_GetAttr(buf, st->s_version);
        int same = ver ? PyObject_RichCompareBool(ver, PyTuple_GET_ITEM(e, 2),
                                                  Py_EQ)
                       : -1;
        Py_XDECREF(ver);
        if (same > 0) {
            PyObject *eq = PyObject_CallMethodObjArgs(st->torch, st->s_equal,
                                                      buf, copy, NULL);
            same = eq ? PyObject_IsTrue(eq) : -1;
            Py_XDECREF(eq);
        }
        if (same < 0) {
            return -1;
        }
        if (!same) {
            PyObject *r = PyObject_CallMethodOneArg(buf, st->s_copy_, copy);
            if (r == NULL) {
                return -1;
            }
            Py_DECREF(r);
            changed = 1;
        }
    }
    return changed;
}

/* One recompute of a frame: what it runs and what it must undo. */
typedef struct {
    Py_ssize_t tile;          /* -1: the whole layer (or segment) */
    Py_ssize_t unit;          /* a nested segment's unit recomputed alone;
                                 -1: the whole segment */
    Py_ssize_t pass_to;       /* >= 0: the nested first pass, from `unit`
                                 up to this unit (its input kept) */
    PyObject *callee;         /* the module called (borrowed) */
    Py_ssize_t start, end;    /* the saved tensors it fills */
    PyObject *rng, *rng_cuda; /* the forward's RNG state (borrowed) */
    PyObject *lead_shape;     /* a tile: its lead tensor's shape */
    Py_ssize_t tile_start, tile_len;
    PyObject *call_args, *call_kwargs;
    PyObject *cur_rng, *cur_cuda; /* the caller's RNG state, to put back */
    PyObject *out;                /* what the layer returned */
    PyObject *snap;               /* buffers to put back, or NULL */
    int snap_first;               /* whether snap has the first unit's */
    PyObject *entered;            /* contexts to leave, or NULL */
} Recompute;

/* ---- nested segments (FrameNest) ---------------------------------- */

/* Where unit u (> 0) of nested frame `self` starts: the index of its
   first saved tensor, or -1 with an error. */
static Py_ssize_t
nest_start(Frame *self, Py_ssize_t u)
{
    return PyLong_AsSsize_t(PyList_GET_ITEM(self->nest.starts, u - 1));
}

/* The unit of nested frame `self` that saved tensor k: 0 for the first,
   u for seg.units[u - 1]; -1 with an error. */
static Py_ssize_t
nest_unit_of(Frame *self, Py_ssize_t k)
{
    Py_ssize_t u = 0;
    for (Py_ssize_t j = 1; j <= PyList_GET_SIZE(self->nest.starts); j++) {
        Py_ssize_t start = nest_start(self, j);
        if (start < 0) {
            return -1;
        }
        if (k >= start) {
            u = j;
        }
    }
    return u;
}

/* The kept input of unit u (x, rng_cpu, rng_cuda or None), borrowed, or
   NULL when there is none (no error set). */
static PyObject *
nest_input_of(Frame *self, Py_ssize_t u)
{
    if (u <= 0 || self->nest.inputs == NULL
        || u >= PyList_GET_SIZE(self->nest.inputs))
    {
        return NULL;
    }
    PyObject *in = PyList_GET_ITEM(self->nest.inputs, u);
    return in != Py_None ? in : NULL;
}

/* The same, or NULL with an error when there is none. */
static PyObject *
nest_kept(Frame *self, Py_ssize_t u)
{
    PyObject *in = nest_input_of(self, u);
    if (in == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: internal error: no input kept for unit %zd "
                     "of nested checkpoint segment %R",
                     u, ms_ex_unit_name(self->ex, self->index));
    }
    return in;
}

/* The arguments of unit u (u > 0) called on x: its record's, with x where
   the previous unit's output went (a new tuple); *unit and *kwargs are
   borrowed from the record. */
static PyObject *
nest_args(Frame *self, Py_ssize_t u, PyObject *x, PyObject **unit,
          PyObject **kwargs)
{
    PyObject *rec = PyList_GET_ITEM(self->seg.units, u - 1);
    PyObject *held = PyTuple_GET_ITEM(rec, 2);
    Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(rec, 1));
    if (pos < 0 || pos >= PyTuple_GET_SIZE(held)) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: internal error: cannot chain the "
                         "recompute of checkpoint segment %R",
                         ms_ex_unit_name(self->ex, self->index));
        }
        return NULL;
    }
    PyObject *call = PyTuple_New(PyTuple_GET_SIZE(held));
    if (call == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(held); k++) {
        PyTuple_SET_ITEM(call, k,
                         Py_NewRef(k == pos ? x : PyTuple_GET_ITEM(held, k)));
    }
    *unit = PyTuple_GET_ITEM(rec, 0);
    *kwargs = PyTuple_GET_ITEM(rec, 3);
    return call;
}

/* What unit u's own recompute covers: its saved tensors, from its kept
   input and RNG state (unit 0: the frame's). */
static int
nest_range(Frame *self, Recompute *r)
{
    Py_ssize_t u = r->unit, m = PyList_GET_SIZE(self->nest.starts);
    r->start = u > 0 ? nest_start(self, u) : 0;
    r->end = u < m ? nest_start(self, u + 1) : PyList_GET_SIZE(self->shapes);
    if (r->start < 0 || r->end < 0) {
        return -1;
    }
    if (u == 0) {
        r->call_args = Py_NewRef(self->args);
        r->call_kwargs = Py_NewRef(self->kwargs);
        return 0;
    }
    PyObject *in = nest_kept(self, u);
    if (in == NULL) {
        return -1;
    }
    r->rng = PyTuple_GET_ITEM(in, 1);
    r->rng_cuda = PyTuple_GET_ITEM(in, 2) != Py_None ? PyTuple_GET_ITEM(in, 2)
                                                     : NULL;
    PyObject *kwargs = NULL;
    r->call_args = nest_args(self, u, PyTuple_GET_ITEM(in, 0), &r->callee,
                             &kwargs);
    if (r->call_args == NULL) {
        return -1;
    }
    r->call_kwargs = Py_NewRef(kwargs);
    return 0;
}

/* Keep the input of unit u (> 0) of the first pass: the previous unit's
   output `out` detached (requiring grad as it did), with the RNG state
   the unit starts from: its record's where the forward recorded one, else
   where the previous unit left the generator.  0, or -1 with an error. */
static int
nest_keep(Frame *self, Py_ssize_t u, PyObject *out)
{
    ms_state *st = self->ex->st;
    PyObject *x = ms_first_tensor(st, out);
    if (x == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: internal error: cannot chain the recompute "
                     "of checkpoint segment %R",
                     ms_ex_unit_name(self->ex, self->index));
        return -1;
    }
    if (ms_segment_unit_rng(st, PyList_GET_ITEM(self->seg.units, u - 1)) < 0) {
        return -1;
    }
    PyObject *d = PyObject_CallMethodNoArgs(x, st->s_detach);
    PyObject *grad = d ? PyObject_GetAttr(x, st->s_requires_grad) : NULL;
    int g = grad ? PyObject_IsTrue(grad) : -1;
    Py_XDECREF(grad);
    if (g > 0) {
        PyObject *res = PyObject_CallMethodOneArg(d, st->s_requires_grad_,
                                                  Py_True);
        g = res != NULL ? 0 : -1;
        Py_XDECREF(res);
    }
    PyObject *rng = g >= 0 ? PyObject_CallNoArgs(st->get_rng_state) : NULL;
    PyObject *cuda = (rng != NULL && self->rng_cuda != NULL)
                         ? PyObject_CallNoArgs(st->cuda_get_rng_state_all)
                         : (rng != NULL ? Py_NewRef(Py_None) : NULL);
    PyObject *in = cuda ? PyTuple_Pack(3, d, rng, cuda) : NULL;
    int rc = in != NULL ? PyList_SetItem(self->nest.inputs, u, in) : -1;
    Py_XDECREF(d);
    Py_XDECREF(rng);
    Py_XDECREF(cuda);
    return rc;
}

/* The first pass, inside the recompute's state: run units from..to-1 on
   each other's outputs, keeping the input of each unit after `from` up to
   `to`.  A new reference to None, or NULL with an error. */
static PyObject *
nest_pass(Frame *self, Py_ssize_t from, Py_ssize_t to)
{
    for (Py_ssize_t w = from; w < to; w++) {
        PyObject *unit = self->unit, *kwargs = self->kwargs, *args;
        if (w == 0) {
            args = Py_NewRef(self->args);
        }
        else {
            PyObject *in = nest_kept(self, w);
            if (in == NULL) {
                return NULL;
            }
            args = nest_args(self, w, PyTuple_GET_ITEM(in, 0), &unit, &kwargs);
        }
        if (args == NULL) {
            return NULL;
        }
        PyObject *out = PyObject_Call(unit, args, kwargs);
        Py_DECREF(args);
        int rc = out != NULL ? nest_keep(self, w + 1, out) : -1;
        Py_XDECREF(out);
        if (rc < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* Whether the frame can be recomputed at all: 0, or -1 with an error. */
static int
recompute_check(Frame *self)
{
    if (self->recomputing) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: layer %R needed its own saved tensors while "
                     "being recomputed",
                     ms_ex_unit_name(self->ex, self->index));
        return -1;
    }
    int same = ms_versions_unchanged(self->ex->st, self->versions);
    if (same == 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: an input of checkpointed layer %R was "
                     "modified in place after the layer's forward, so it "
                     "cannot be recomputed. Avoid the in-place update "
                     "(e.g. x = x + y instead of x += y) or exclude the "
                     "layer from checkpointing.",
                     ms_ex_unit_name(self->ex, self->index));
    }
    return same > 0 ? 0 : -1;
}

/* What this recompute covers: the whole layer, or the slice of one tile
   of its (reloaded) inputs, as in the forward.  The tile's arguments are
   sliced in recompute_call, once grad mode is on: a slice made in
   backward's no-grad mode would not require grad, and the recompute would
   save less than the forward did. */
static int
recompute_range(Frame *self, Recompute *r)
{
    ms_state *st = self->ex->st;
    Py_ssize_t extent;
    r->start = 0;
    r->end = PyList_GET_SIZE(self->shapes);
    r->rng = self->rng_cpu;
    r->rng_cuda = self->rng_cuda;
    r->callee = self->unit;
    if (r->unit >= 0) {
        return nest_range(self, r);
    }
    if (r->tile < 0) {
        r->call_args = Py_NewRef(self->args);
        r->call_kwargs = Py_NewRef(self->kwargs);
        return 0;
    }
    r->start = r->tile > 0 ? self->tile.end[r->tile - 1] : 0;
    r->end = self->tile.end[r->tile];
    r->rng = PyList_GET_ITEM(self->tile.rng, r->tile);
    r->rng_cuda = self->tile.rng_cuda != NULL
                      ? PyList_GET_ITEM(self->tile.rng_cuda, r->tile)
                      : NULL;
    if (ms_tile_extent(st, self->args, self->kwargs, self->tile.dim, &extent,
                       &r->lead_shape)
        < 0)
    {
        return -1;
    }
    if (extent != self->tile.extent) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: internal error: tiled layer %R has an "
                     "input of extent %zd where its forward had %zd",
                     ms_ex_unit_name(self->ex, self->index), extent,
                     self->tile.extent);
        return -1;
    }
    ms_tile_range(extent, self->tile.n, (int)r->tile, &r->tile_start,
                  &r->tile_len);
    return 0;
}

/* The list the recompute fills (kept across the tiles of one backward),
   and where it starts and stops. */
static int
recompute_results(Frame *self, Recompute *r)
{
    Py_ssize_t n = PyList_GET_SIZE(self->shapes);
    if ((r->tile < 0 && r->unit < 0) || self->recomputed == NULL) {
        Py_XSETREF(self->recomputed, PyList_New(n));
        if (self->recomputed == NULL) {
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyList_SET_ITEM(self->recomputed, i, Py_NewRef(Py_None));
        }
    }
    self->rpos = r->start;
    self->rend = r->end;
    return 0;
}

/* Run under the forward's RNG state; r->cur_rng (and r->cur_cuda) are set
   once there is a state to put back. */
static int
recompute_rng(ms_state *st, Recompute *r)
{
    PyObject *cur = PyObject_CallNoArgs(st->get_rng_state);
    if (cur == NULL) {
        return -1;
    }
    PyObject *res = PyObject_CallOneArg(st->set_rng_state, r->rng);
    if (res == NULL) {
        Py_DECREF(cur);
        return -1;
    }
    Py_DECREF(res);
    r->cur_rng = cur;
    if (r->rng_cuda != NULL) {
        r->cur_cuda = PyObject_CallNoArgs(st->cuda_get_rng_state_all);
        res = r->cur_cuda ? PyObject_CallOneArg(st->cuda_set_rng_state_all,
                                                r->rng_cuda)
                          : NULL;
        if (res == NULL) {
            return -1;
        }
        Py_DECREF(res);
    }
    return 0;
}

/* Snapshot the buffers the recompute may update (BatchNorm statistics):
   those of the units it runs (unless the frame's one unit is known not to
   update any).  A nested segment's recompute runs one unit, or its first
   pass a few: only theirs, not every unit of the segment each time. */
static int
recompute_snapshot(Frame *self, Recompute *r)
{
    Executor *ex = self->ex;
    if (ex->buffers != NULL && ex->buffers[self->index] == BUF_STATIC
        && self->seg.units == NULL)
    {
        return 0;
    }
    Py_ssize_t n = 1
                   + (self->seg.units ? PyList_GET_SIZE(self->seg.units) : 0);
    Py_ssize_t lo = r->unit < 0 ? 0 : r->unit;
    Py_ssize_t hi = r->unit < 0 ? n
                                : (r->pass_to >= 0 ? r->pass_to : r->unit + 1);
    r->snap = PyList_New(0);
    if (r->snap == NULL) {
        return -1;
    }
    r->snap_first = lo == 0;
    for (Py_ssize_t u = lo; u < hi && u < n; u++) {
        PyObject *unit =
            u == 0
                ? self->unit
                : PyTuple_GET_ITEM(PyList_GET_ITEM(self->seg.units, u - 1), 0);
        PyObject *more = snapshot_buffers(ex->st, unit);
        int rc = more ? PyList_SetSlice(r->snap, PyList_GET_SIZE(r->snap),
                                        PyList_GET_SIZE(r->snap), more)
                      : -1;
        Py_XDECREF(more);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Enter grad mode, the forward's autocast state and the saved-tensor hooks
   that collect the recomputed tensors. */
static int
recompute_enter(Frame *self, Recompute *r)
{
    ms_state *st = self->ex->st;
    r->entered = PyList_New(0);
    if (r->entered == NULL) {
        return -1;
    }
    PyObject *rpack = PyObject_GetAttr((PyObject *)self, r->pass_to >= 0
                                                             ? st->s_dpack
                                                             : st->s_rpack);
    PyObject *runpack = PyObject_GetAttr((PyObject *)self, st->s_runpack);
    int rc = -1;
    if (rpack != NULL && runpack != NULL
        && enter_into(st, PyObject_CallNoArgs(st->enable_grad), r->entered)
               == 0
        && enter_into(st,
                      ms_make_autocast(st, st->s_cpu, self->cpu_dtype,
                                       self->cpu_autocast),
                      r->entered)
               == 0
        && (self->cuda_dtype == NULL
            || enter_into(st,
                          ms_make_autocast(st, st->s_cuda, self->cuda_dtype,
                                           self->cuda_autocast),
                          r->entered)
                   == 0)
        && enter_into(st,
                      PyObject_CallFunctionObjArgs(st->saved_tensors_hooks,
                                                   rpack, runpack, NULL),
                      r->entered)
               == 0)
    {
        rc = 0;
    }
    Py_XDECREF(rpack);
    Py_XDECREF(runpack);
    return rc;
}

/* Run the layer (a tile of it, or its whole segment).  The early stop
   (_StopRecompute, raised once every needed tensor exists) is success. */
static int
recompute_call(Frame *self, Recompute *r)
{
    Executor *ex = self->ex;
    ms_state *st = ex->st;
    if (r->tile >= 0
        && ms_tile_slice(st, self->args, self->kwargs, self->tile.dim,
                         r->lead_shape, r->tile_start, r->tile_len,
                         &r->call_args, &r->call_kwargs)
               < 0)
    {
        return -1;
    }
    int rc = -1;
    self->recomputing = 1;
    ex->recompute_depth++;
    Py_ssize_t depth = PyList_GET_SIZE(ex->stack);
    long long t0 = ms_monotonic_ns();
    if (r->pass_to >= 0) {
        r->out = nest_pass(self, r->unit, r->pass_to);
    }
    else {
        r->out = PyObject_Call(r->callee, r->call_args, r->call_kwargs);
    }
    if (r->out != NULL && r->tile < 0 && r->unit < 0
        && self->seg.units != NULL)
    {
        r->out = ms_segment_replay(self, r->out);
    }
    ex->recompute_ns += ms_monotonic_ns() - t0;
    ex->recompute_depth--;
    self->recomputing = 0;
    if (r->out != NULL) {
        rc = 0;
    }
    else if (PyErr_ExceptionMatches(st->stop_recompute)) {
        PyErr_Clear();
        rc = 0;
    }
    /* Entries the recompute pushed were popped by always_call hooks; make
       sure, should a hook have been skipped. */
    while (PyList_GET_SIZE(ex->stack) > depth) {
        if (ms_ex_pop_entry(ex) < 0) {
            rc = -1;
        }
    }
    return rc;
}

/* Undo what the recompute entered and changed, on every path: leave its
   contexts, put back the buffers it updated and the caller's RNG state.
   Returns rc, or -1 if undoing failed; an error already set wins (the new
   one is reported as unraisable). */
static int
recompute_leave(Frame *self, Recompute *r, int rc)
{
    Executor *ex = self->ex;
    ms_state *st = ex->st;
    for (Py_ssize_t i = r->entered ? PyList_GET_SIZE(r->entered) - 1 : -1;
         i >= 0; i--)
    {
        if (ms_call_exit(st, PyList_GET_ITEM(r->entered, i)) < 0) {
            rc = -1;
        }
    }
    if (r->snap != NULL) {
        ms_exc_state saved;
        ms_exc_save(&saved);
        int had = ms_exc_pending(&saved);
        int changed = restore_buffers(st, r->snap);
        if (changed < 0) {
            if (had) {
                PyErr_WriteUnraisable((PyObject *)self);
            }
            else {
                rc = -1;
            }
        }
        else if (ex->buffers != NULL && rc == 0 && r->snap_first) {
            ex->buffers[self->index] = changed ? BUF_MUTATED : BUF_STATIC;
        }
        if (had) {
            ms_exc_restore(&saved);
        }
    }
    if (r->cur_rng != NULL) {
        ms_exc_state saved;
        ms_exc_save(&saved);
        int had = ms_exc_pending(&saved);
        PyObject *r1 = PyObject_CallOneArg(st->set_rng_state, r->cur_rng);
        PyObject *r2 = (r1 != NULL && r->cur_cuda != NULL)
                           ? PyObject_CallOneArg(st->cuda_set_rng_state_all,
                                                 r->cur_cuda)
                           : Py_NewRef(Py_None);
        if (r1 == NULL || r2 == NULL) {
            if (had) {
                PyErr_WriteUnraisable((PyObject *)self);
                ms_exc_restore(&saved);
            }
            rc = -1; /* else: the new error stays set */
        }
        else if (had) {
            ms_exc_restore(&saved);
        }
        Py_XDECREF(r1);
        Py_XDECREF(r2);
    }
    return rc;
}

static void
recompute_clear(Recompute *r)
{
    Py_CLEAR(r->lead_shape);
    Py_CLEAR(r->call_args);
    Py_CLEAR(r->call_kwargs);
    Py_CLEAR(r->cur_rng);
    Py_CLEAR(r->cur_cuda);
    Py_CLEAR(r->snap);
    Py_CLEAR(r->out);
    Py_CLEAR(r->entered);
}

/* Run the layer again under the state its forward ran in: all of it
   (tile < 0), or one tile of a tiled forward.  As checkpoint.py's
   recompute: reload the offloaded inputs, take the slice to run, enter
   the forward's state, call, and restore the caller's. */
static int
frame_recompute(Frame *self, Py_ssize_t tile, Py_ssize_t unit)
{
    Executor *ex = self->ex;
    Recompute r = {.tile = tile, .unit = unit, .pass_to = -1};
    if (recompute_check(self) < 0
        || (self->off.slots != NULL && ms_reload_inputs(self) < 0))
    {
        return -1;
    }
    if (recompute_range(self, &r) < 0) {
        /* Nothing changed yet. */
        recompute_clear(&r);
        return -1;
    }
    int rc = -1;
    if (recompute_results(self, &r) == 0 && recompute_rng(ex->st, &r) == 0
        && recompute_snapshot(self, &r) == 0 && recompute_enter(self, &r) == 0)
    {
        rc = recompute_call(self, &r);
    }
    rc = recompute_leave(self, &r, rc);
    if (rc == 0 && self->rpos != r.end) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: recomputing checkpointed layer %R saved %zd "
                     "tensors for backward where its forward saved %zd. The "
                     "layer takes a different path when run again (e.g. it "
                     "depends on global state); exclude it from "
                     "checkpointing.",
                     ms_ex_unit_name(ex, self->index), self->rpos - r.start,
                     r.end - r.start);
        rc = -1;
    }
    if (rc == 0) {
        ex->recomputes++;
        if (unit == 0) {
            /* The segment's first unit: nothing kept is needed any more. */
            Py_CLEAR(self->nest.inputs);
        }
        else if (unit > 0 && self->nest.inputs != NULL) {
            /* Its saved tensors hold what backward needs of its input, and
               backward is done with every unit after it (their gradients
               came first; a unit that saved nothing is never recomputed,
               and its kept input would otherwise stay while the graph
               lives). */
            Py_ssize_t n = PyList_GET_SIZE(self->nest.inputs);
            for (Py_ssize_t w = unit; w < n && rc == 0; w++) {
                rc = PyList_SetItem(self->nest.inputs, w, Py_NewRef(Py_None));
            }
        }
    }
    else {
        /* Never leave a half-filled (or NULL-filled) list behind, nor
           inputs kept for a recompute that failed. */
        Py_CLEAR(self->recomputed);
        if (unit >= 0) {
            Py_CLEAR(self->nest.inputs);
        }
    }
    recompute_clear(&r);
    return rc;
}

/* A nested segment's first pass, for unit u (> 0) whose input is not
   kept: from the nearest unit before it whose input is (or the first),
   under that unit's RNG state, as a recompute of its own.  0, or -1 with
   an error. */
static int
nest_first_pass(Frame *self, Py_ssize_t u)
{
    Executor *ex = self->ex;
    ms_state *st = ex->st;
    Py_ssize_t m = PyList_GET_SIZE(self->nest.starts);
    if (self->nest.inputs == NULL) {
        self->nest.inputs = PyList_New(m + 1);
        if (self->nest.inputs == NULL) {
            return -1;
        }
        for (Py_ssize_t k = 0; k <= m; k++) {
            PyList_SET_ITEM(self->nest.inputs, k, Py_NewRef(Py_None));
        }
    }
    Py_ssize_t v = u - 1;
    while (v > 0 && nest_input_of(self, v) == NULL) {
        v--;
    }
    Recompute r = {.tile = -1, .unit = v, .pass_to = u};
    PyObject *in = nest_input_of(self, v);
    r.rng = in != NULL ? PyTuple_GET_ITEM(in, 1) : self->rng_cpu;
    r.rng_cuda = in == NULL                           ? self->rng_cuda
                 : PyTuple_GET_ITEM(in, 2) != Py_None ? PyTuple_GET_ITEM(in, 2)
                                                      : NULL;
    if (recompute_check(self) < 0
        || (self->off.slots != NULL && ms_reload_inputs(self) < 0))
    {
        return -1;
    }
    int rc = -1;
    if (recompute_rng(st, &r) == 0 && recompute_snapshot(self, &r) == 0
        && recompute_enter(self, &r) == 0)
    {
        rc = recompute_call(self, &r);
    }
    rc = recompute_leave(self, &r, rc);
    if (rc < 0) {
        Py_CLEAR(self->nest.inputs);
    }
    recompute_clear(&r);
    return rc;
}

static PyObject *
frame_unpack(Frame *self, PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, self->ex->st->handle_type)
        || ((Handle *)obj)->frame != self)
    {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: internal error: unpack got %R", obj);
        return NULL;
    }
    Py_ssize_t k = ((Handle *)obj)->index;
    if (self->recomputed == NULL || k >= PyList_GET_SIZE(self->recomputed)
        || PyList_GET_ITEM(self->recomputed, k) == Py_None)
    {
        /* First need in this backward (or again, with retain_graph). */
        Py_ssize_t tile = -1;
        if (self->tile.end != NULL) {
            for (Py_ssize_t j = 0; j < self->tile.n; j++) {
                if (k < self->tile.end[j]) {
                    tile = j;
                    break;
                }
            }
            if (tile < 0) {
                PyErr_Format(PyExc_RuntimeError,
                             "memscale: tiled layer %R saved a tensor for "
                             "backward outside its tiles (in a hook around "
                             "its forward); exclude it from tiling",
                             ms_ex_unit_name(self->ex, self->index));
                return NULL;
            }
        }
        Py_ssize_t unit = -1;
        if (self->nest.on && self->nest.starts != NULL) {
            unit = nest_unit_of(self, k);
            if (unit < 0
                || (unit > 0 && nest_input_of(self, unit) == NULL
                    && nest_first_pass(self, unit) < 0))
            {
                return NULL;
            }
        }
        if (frame_recompute(self, tile, unit) < 0) {
            return NULL;
        }
    }
    PyObject *t = Py_NewRef(PyList_GET_ITEM(self->recomputed, k));
    /* Hand it over and drop ours: memory goes as backward consumes it. */
    if (PyList_SetItem(self->recomputed, k, Py_NewRef(Py_None)) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

static PyMethodDef frame_methods[] = {
    {"_pack", (PyCFunction)frame_pack, METH_O, NULL},
    {"_unpack", (PyCFunction)frame_unpack, METH_O, NULL},
    {"_rpack", (PyCFunction)frame_rpack, METH_O, NULL},
    {"_runpack", (PyCFunction)frame_runpack, METH_O, NULL},
    {"_dpack", (PyCFunction)frame_dpack, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot frame_slots[] = {
    {Py_tp_doc, "One checkpointed call of a layer."},
    {Py_tp_dealloc, frame_dealloc},
    {Py_tp_traverse, frame_traverse},
    {Py_tp_clear, frame_clear},
    {Py_tp_methods, frame_methods},
    {0, NULL},
};

static PyType_Spec frame_spec = {
    .name = "memscale._core._Frame",
    .basicsize = sizeof(Frame),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = frame_slots,
};

int
ms_frame_init_types(PyObject *module, ms_state *st)
{
    st->handle_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &handle_spec, NULL);
    if (st->handle_type == NULL) {
        return -1;
    }
    st->frame_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &frame_spec, NULL);
    if (st->frame_type == NULL) {
        return -1;
    }
    return 0;
}
