/*
 * executor.c: applies a plan through module hooks and saved-tensor hooks.
 *
 * Activation checkpointing follows PyTorch's non-reentrant checkpoint.  The
 * forward pre-hook of a checkpointed layer opens a Frame: it keeps the
 * layer's inputs, records the RNG and autocast state, and pushes
 * saved-tensor hooks whose pack returns a small Handle instead of the
 * tensor.  The forward hook (always_call=True, so it also runs when the
 * forward raises) pops them.  In backward, the first Handle unpacked
 * recomputes the layer (our own hooks bypassed, everyone else's run again)
 * under the recorded RNG and autocast state, with saved-tensor hooks that
 * collect the recomputed tensors in the order they are saved; each unpack
 * hands one back and drops it.
 *
 * Every call of a planned layer pushes one entry on the executor's stack
 * (a Frame, or None when nothing is done) and its forward hook pops one, so
 * pre- and post-hooks stay paired whatever raises in between.
 */
#include "ms.h"

#include <string.h>
#include <time.h>

typedef struct Executor Executor;

typedef struct {
    PyObject_HEAD
    Executor *ex;
    Py_ssize_t index;      /* unit index, for messages */
    PyObject *unit;        /* the module */
    PyObject *args;        /* tuple */
    PyObject *kwargs;      /* dict */
    PyObject *versions;    /* list of (tensor, version) of the inputs */
    PyObject *rng_cpu;     /* ByteTensor */
    PyObject *rng_cuda;    /* list of ByteTensor, or NULL */
    PyObject *cpu_dtype;
    PyObject *cuda_dtype;  /* NULL unless CUDA was initialized */
    PyObject *ctx;         /* saved_tensors_hooks while the forward runs */
    PyObject *shapes;      /* list: shape of each packed tensor */
    PyObject *recomputed;  /* list, NULL before the first recompute */
    PyObject *offloaded;   /* list of (0, index) / (1, key): inputs whose
                              slot in args / kwargs holds an offload record,
                              or NULL */
    Py_ssize_t rpos;
    Py_ssize_t rend;       /* the recompute stops once rpos reaches this */
    /* Tiling: the forward ran in `tiles` slices along `dim`; tile j packed
       the saved tensors [tile_end[j - 1], tile_end[j]) and recomputes on
       its own, from RNG state tile_rng[j]. tile_end is NULL otherwise. */
    int tiles;
    int dim;
    Py_ssize_t extent;
    Py_ssize_t *tile_end;
    PyObject *tile_rng;      /* list of ByteTensor */
    PyObject *tile_rng_cuda; /* list of lists, or NULL */
    /* A checkpoint segment of several units, recomputed together from the
       first unit's inputs: one (unit, position, args, kwargs, rng_cpu,
       rng_cuda or None) tuple per later unit, whose args hold None at
       `position`, where the previous unit's output goes. */
    PyObject *seg_units;     /* list, or NULL for a single unit */
    PyObject *seg_out;       /* the last unit's output tensor while the
                                segment waits for its next unit */
    PyObject *cur_unit;      /* the unit running in this frame (borrowed
                                from ex->units) */
    PyObject *seg_out_version; /* seg_out._version when it was stored */
    int seg_id;              /* the plan's segment (first unit index) */
    Py_ssize_t seg_next;     /* the unit index expected next */
    int cpu_autocast;
    int cuda_autocast;
    int recomputing;
} Frame;

typedef struct {
    PyObject_HEAD
    Frame *frame;
    Py_ssize_t index;
} Handle;

struct Executor {
    PyObject_HEAD
    PyObject *module;       /* memscale._core */
    ms_state *st;
    PyObject *model_ref;    /* weakref to the root module */
    PyObject *units;        /* list of modules */
    PyObject *names;        /* list of str */
    PyObject *index_of;     /* {module: index} */
    PyObject *plan;         /* Plan or None */
    PyObject *profiler;     /* Profiler while warming up, else None */
    PyObject *on_profiled;  /* callable(profiler) -> Plan, or None */
    PyObject *pre_exc;      /* exception being handled at _root_pre, or NULL */
    PyObject *handles;      /* unit hooks */
    PyObject *root_handles; /* hooks on the root */
    PyObject *stack;        /* Frame or None per active planned call */
    PyObject *tile_verifier; /* verifier(unit, forward, args, kwargs, tiles)
                                -> dim or None, or None */
    PyObject *amp_device;   /* autocast device type (str), or None */
    PyObject *amp_dtype;    /* autocast dtype, or None */
    PyObject *amp_stack;    /* per root call: the entered autocast, or None */
    PyObject *open_seg;     /* a segment Frame between two of its units */
    int *segments;          /* per unit, from the plan: segment or -1 */
    PyObject *store;        /* SpillStore (disk tier) or None */
    PyObject *host;         /* host tier for device tensors, or None */
    unsigned *masks;
    int *tiles;             /* per unit, from the plan */
    unsigned char *buffers;  /* per unit: BUF_UNKNOWN / BUF_MUTATED / ... */
    Py_ssize_t n;
    long warmup_steps;
    long steps;             /* forward passes seen with grad, training */
    long long frames;       /* checkpoint frames opened */
    long long recomputes;   /* layer recomputations run */
    long long forwards;     /* training forwards of the root seen */
    long long recompute_ns; /* wall time spent recomputing */
    long long tiled_calls;  /* forwards run in tiles */
    int recompute_depth;
    int paused;             /* > 0: hooks do nothing (see pause()) */
    int active_frames;
    int root_in_pass;
    int attached;
};

/* Whether a unit's forward updates its buffers (BatchNorm statistics),
   learnt at its first recompute: updated buffers are restored after every
   recompute, so recomputing never counts a batch twice. */
enum { BUF_UNKNOWN = 0, BUF_MUTATED = 1, BUF_STATIC = 2 };

/* An offload tier is set (NULL once the garbage collector cleared us). */
#define HAS(obj) ((obj) != NULL && (obj) != Py_None)

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
    Py_VISIT(self->offloaded);
    Py_VISIT(self->tile_rng);
    Py_VISIT(self->tile_rng_cuda);
    Py_VISIT(self->seg_units);
    Py_VISIT(self->seg_out);
    Py_VISIT(self->seg_out_version);
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
    Py_CLEAR(self->offloaded);
    Py_CLEAR(self->tile_rng);
    Py_CLEAR(self->tile_rng_cuda);
    Py_CLEAR(self->seg_units);
    Py_CLEAR(self->seg_out);
    Py_CLEAR(self->seg_out_version);
    return 0;
}

static void
frame_dealloc(Frame *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)frame_clear(self);
    PyMem_Free(self->tile_end);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
unit_name(Executor *ex, Py_ssize_t index)
{
    if (ex->names != NULL && index >= 0 && index < PyList_GET_SIZE(ex->names))
    {
        return PyList_GET_ITEM(ex->names, index);
    }
    return Py_None;
}

/* Record what recompute must replay: RNG and autocast state, inputs. */
static Frame *
frame_new(Executor *ex, Py_ssize_t index, PyObject *unit, PyObject *args,
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
    f->ctx = f->recomputed = f->offloaded = NULL;
    f->rpos = f->rend = 0;
    f->tiles = 1;
    f->dim = -1;
    f->extent = 0;
    f->tile_end = NULL;
    f->tile_rng = f->tile_rng_cuda = NULL;
    f->seg_units = f->seg_out = f->seg_out_version = NULL;
    f->cur_unit = unit;
    f->seg_id = -1;
    f->seg_next = -1;
    f->cpu_autocast = f->cuda_autocast = 0;
    f->recomputing = 0;
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
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: recomputing checkpointed layer %R gave a "
                         "tensor of shape %R where its forward saved %R (saved "
                         "tensor #%zd). The layer does not run the same way "
                         "twice: make its forward deterministic or exclude it "
                         "from checkpointing. A wrapped model compiled with "
                         "torch.compile (other than backend='eager') does "
                         "this: train the wrapped model without "
                         "torch.compile or with backend='eager', or "
                         "memscale.detach(model) before compiling it.",
                         unit_name(self->ex, self->index), shape,
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

static PyObject *
frame_runpack(Frame *self, PyObject *Py_UNUSED(obj))
{
    PyErr_Format(PyExc_RuntimeError,
                 "memscale: internal error: a tensor saved while recomputing "
                 "layer %R was unpacked",
                 unit_name(self->ex, self->index));
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

static PyObject *
make_autocast(ms_state *st, PyObject *device, PyObject *dtype, int enabled)
{
    PyObject *kw = Py_BuildValue("{OOOO}", st->s_dtype_kw, dtype,
                                 st->s_enabled, enabled ? Py_True : Py_False);
    if (kw == NULL) {
        return NULL;
    }
    PyObject *a = PyTuple_Pack(1, device);
    PyObject *ctx = a ? PyObject_Call(st->autocast, a, kw) : NULL;
    Py_XDECREF(a);
    Py_DECREF(kw);
    return ctx;
}

static long long
monotonic_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        return 0;
    }
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
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
            PyObject *eq = PyObject_CallMethod(st->torch, "equal", "OO", buf,
                                               copy);
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

/* Whether an input recorded as (tensor, version) has changed: 1 yes, 0 no,
   -1 with an exception set.  An offloaded input is recorded through a weak
   reference: gone, nobody can have changed it since. */
static int
input_changed(ms_state *st, PyObject *pair)
{
    PyObject *t = PyTuple_GET_ITEM(pair, 0);
    if (PyWeakref_CheckRef(t)) {
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(t, &t) < 0) {
            return -1;
        }
#else
        t = PyWeakref_GetObject(t);
        if (t == NULL) {
            return -1;
        }
        t = t == Py_None ? NULL : Py_NewRef(t);
#endif
        if (t == NULL) {
            return 0;
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

/* ---- Offload of a checkpointed layer's inputs ------------------------ */

/* Offload one tensor: a record standing for it, Py_None if it stays, NULL
   with an exception set.  CPU tensors go to the disk tier; device tensors
   to the host tier (which spills on to disk itself). */
static PyObject *
offload_one(Executor *ex, PyObject *t)
{
    ms_state *st = ex->st;
    PyObject *dev = PyObject_GetAttr(t, st->s_device);
    PyObject *type = dev ? PyObject_GetAttr(dev, st->s_type) : NULL;
    Py_XDECREF(dev);
    if (type == NULL) {
        return NULL;
    }
    int cpu = PyUnicode_Check(type)
              && PyUnicode_CompareWithASCIIString(type, "cpu") == 0;
    Py_DECREF(type);
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

/* 1 if every recorded input version is unchanged, 0 if not, -1 on error. */
static int
versions_unchanged(ms_state *st, PyObject *versions)
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
static int
offload_inputs(Executor *ex, Frame *f)
{
    ms_state *st = ex->st;
    PyObject *args = NULL, *kwargs = NULL, *slots = NULL, *gone = NULL;
    PyObject *versions = NULL, *keys = NULL;
    int rc = -1;

    int same = versions_unchanged(st, f->versions);
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
    Py_XSETREF(f->offloaded, slots);
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
static int
reload_inputs(Frame *f)
{
    ms_state *st = f->ex->st;
    PyObject *slots = Py_NewRef(f->offloaded);
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
    if (f->offloaded == slots) {
        Py_CLEAR(f->offloaded);
    }
    Py_DECREF(slots);
    return 0;
error:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_DECREF(slots);
    return -1;
}

static int pop_entry(Executor *ex);

/* The first tensor of a unit's output (borrowed), or NULL. */
static PyObject *
first_tensor(ms_state *st, PyObject *out)
{
    if (ms_is_tensor(st, out)) {
        return out;
    }
    if (PyTuple_Check(out) && PyTuple_GET_SIZE(out) > 0
        && ms_is_tensor(st, PyTuple_GET_ITEM(out, 0)))
    {
        return PyTuple_GET_ITEM(out, 0);
    }
    if (PyList_Check(out) && PyList_GET_SIZE(out) > 0
        && ms_is_tensor(st, PyList_GET_ITEM(out, 0)))
    {
        return PyList_GET_ITEM(out, 0);
    }
    return NULL;
}

/* Recompute a segment's later units, each on the previous one's output,
   under the RNG state it ran with; steals `out` (the first unit's output)
   and returns the last output, or NULL (the stop exception included). */
static PyObject *
replay_segment(Frame *self, PyObject *out)
{
    ms_state *st = self->ex->st;
    for (Py_ssize_t u = 0; u < PyList_GET_SIZE(self->seg_units); u++) {
        PyObject *rec = PyList_GET_ITEM(self->seg_units, u);
        PyObject *unit = PyTuple_GET_ITEM(rec, 0);
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(rec, 1));
        PyObject *args = PyTuple_GET_ITEM(rec, 2);
        PyObject *kwargs = PyTuple_GET_ITEM(rec, 3);
        PyObject *x = first_tensor(st, out);
        if (x == NULL || pos < 0 || pos >= PyTuple_GET_SIZE(args)) {
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: internal error: cannot chain the "
                         "recompute of checkpoint segment %R",
                         unit_name(self->ex, self->index));
            Py_DECREF(out);
            return NULL;
        }
        PyObject *call = PyTuple_New(PyTuple_GET_SIZE(args));
        if (call == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(args); k++) {
            PyTuple_SET_ITEM(call, k, Py_NewRef(k == pos ? x
                                                : PyTuple_GET_ITEM(args, k)));
        }
        Py_DECREF(out);
        PyObject *r = PyObject_CallOneArg(st->set_rng_state,
                                          PyTuple_GET_ITEM(rec, 4));
        if (r != NULL && PyTuple_GET_ITEM(rec, 5) != Py_None) {
            Py_SETREF(r, PyObject_CallOneArg(st->cuda_set_rng_state_all,
                                             PyTuple_GET_ITEM(rec, 5)));
        }
        if (r == NULL) {
            Py_DECREF(call);
            return NULL;
        }
        Py_DECREF(r);
        out = PyObject_Call(unit, call, kwargs);
        Py_DECREF(call);
        if (out == NULL) {
            return NULL;
        }
    }
    return out;
}

/* Run the layer again under the state its forward ran in: all of it
   (tile < 0), or one tile of a tiled forward. */
static int
frame_recompute(Frame *self, Py_ssize_t tile)
{
    Executor *ex = self->ex;
    ms_state *st = ex->st;
    PyObject *entered = NULL, *cur_rng = NULL, *cur_cuda = NULL, *out = NULL;
    PyObject *rpack = NULL, *runpack = NULL, *snap = NULL;
    PyObject *call_args = NULL, *call_kwargs = NULL, *lead_shape = NULL;
    Py_ssize_t tile_start = 0, tile_len = 0;
    PyObject *rng = self->rng_cpu, *rng_cuda = self->rng_cuda;
    Py_ssize_t nshapes = PyList_GET_SIZE(self->shapes);
    Py_ssize_t start = 0, end = nshapes;
    int rc = -1;

    if (self->recomputing) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: layer %R needed its own saved tensors while "
                     "being recomputed",
                     unit_name(ex, self->index));
        return -1;
    }
    int same = versions_unchanged(st, self->versions);
    if (same <= 0) {
        if (same == 0) {
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: an input of checkpointed layer %R was "
                         "modified in place after the layer's forward, so it "
                         "cannot be recomputed. Avoid the in-place update "
                         "(e.g. x = x + y instead of x += y) or exclude the "
                         "layer from checkpointing.",
                         unit_name(ex, self->index));
        }
        return -1;
    }
    if (self->offloaded != NULL && reload_inputs(self) < 0) {
        return -1;
    }
    if (tile >= 0) {
        /* The tile's slice of the (reloaded) inputs, as in the forward. */
        Py_ssize_t extent;
        start = tile > 0 ? self->tile_end[tile - 1] : 0;
        end = self->tile_end[tile];
        rng = PyList_GET_ITEM(self->tile_rng, tile);
        rng_cuda = self->tile_rng_cuda != NULL
                       ? PyList_GET_ITEM(self->tile_rng_cuda, tile)
                       : NULL;
        if (ms_tile_extent(st, self->args, self->kwargs, self->dim, &extent,
                           &lead_shape) < 0)
        {
            return -1;
        }
        if (extent != self->extent) {
            Py_XDECREF(lead_shape);
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: internal error: tiled layer %R has an "
                         "input of extent %zd where its forward had %zd",
                         unit_name(ex, self->index), extent, self->extent);
            return -1;
        }
        ms_tile_range(extent, self->tiles, (int)tile, &tile_start, &tile_len);
        /* Sliced below, once grad mode is on: a slice made in backward's
           no-grad mode would not require grad, and the recompute would
           save less than the forward did. */
    }
    else {
        call_args = Py_NewRef(self->args);
        call_kwargs = Py_NewRef(self->kwargs);
    }

    entered = PyList_New(0);
    if (entered == NULL) {
        goto done;
    }
    if (tile < 0 || self->recomputed == NULL) {
        Py_XSETREF(self->recomputed, PyList_New(nshapes));
        if (self->recomputed == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < nshapes; i++) {
            PyList_SET_ITEM(self->recomputed, i, Py_NewRef(Py_None));
        }
    }
    self->rpos = start;
    self->rend = end;

    /* RNG: run under the forward's state, then put the current one back. */
    cur_rng = PyObject_CallNoArgs(st->get_rng_state);
    if (cur_rng == NULL) {
        goto done;
    }
    PyObject *r = PyObject_CallOneArg(st->set_rng_state, rng);
    if (r == NULL) {
        goto done;
    }
    Py_DECREF(r);
    if (rng_cuda != NULL) {
        cur_cuda = PyObject_CallNoArgs(st->cuda_get_rng_state_all);
        r = cur_cuda ? PyObject_CallOneArg(st->cuda_set_rng_state_all,
                                           rng_cuda)
                     : NULL;
        if (r == NULL) {
            goto restore;
        }
        Py_DECREF(r);
    }

    if (ex->buffers == NULL || ex->buffers[self->index] != BUF_STATIC
        || self->seg_units != NULL)
    {
        snap = snapshot_buffers(st, self->unit);
        if (snap == NULL) {
            goto restore;
        }
        /* A segment's later units may update buffers too. */
        for (Py_ssize_t u = 0;
             self->seg_units != NULL && u < PyList_GET_SIZE(self->seg_units);
             u++)
        {
            PyObject *more = snapshot_buffers(
                st, PyTuple_GET_ITEM(PyList_GET_ITEM(self->seg_units, u), 0));
            int rc2 = more ? PyList_SetSlice(snap, PyList_GET_SIZE(snap),
                                             PyList_GET_SIZE(snap), more)
                           : -1;
            Py_XDECREF(more);
            if (rc2 < 0) {
                goto restore;
            }
        }
    }
    rpack = PyObject_GetAttr((PyObject *)self, st->s_rpack);
    runpack = PyObject_GetAttr((PyObject *)self, st->s_runpack);
    if (rpack == NULL || runpack == NULL
        || enter_into(st, PyObject_CallNoArgs(st->enable_grad), entered) < 0
        || enter_into(st, make_autocast(st, st->s_cpu, self->cpu_dtype,
                                        self->cpu_autocast),
                      entered) < 0
        || (self->cuda_dtype != NULL
            && enter_into(st, make_autocast(st, st->s_cuda, self->cuda_dtype,
                                            self->cuda_autocast),
                          entered) < 0)
        || enter_into(st,
                      PyObject_CallFunctionObjArgs(st->saved_tensors_hooks,
                                                   rpack, runpack, NULL),
                      entered) < 0)
    {
        goto leave;
    }
    if (tile >= 0
        && ms_tile_slice(st, self->args, self->kwargs, self->dim, lead_shape,
                         tile_start, tile_len, &call_args, &call_kwargs) < 0)
    {
        goto leave;
    }
    self->recomputing = 1;
    ex->recompute_depth++;
    Py_ssize_t depth = PyList_GET_SIZE(ex->stack);
    long long t0 = monotonic_ns();
    out = PyObject_Call(self->unit, call_args, call_kwargs);
    if (out != NULL && tile < 0 && self->seg_units != NULL) {
        out = replay_segment(self, out);
    }
    ex->recompute_ns += monotonic_ns() - t0;
    ex->recompute_depth--;
    self->recomputing = 0;
    if (out != NULL) {
        rc = 0;
    }
    else if (PyErr_ExceptionMatches(st->stop_recompute)) {
        PyErr_Clear();
        rc = 0;
    }
    /* Entries the recompute pushed were popped by always_call hooks; make
       sure, should a hook have been skipped. */
    while (PyList_GET_SIZE(ex->stack) > depth) {
        if (pop_entry(ex) < 0) {
            rc = -1;
        }
    }
leave:
    for (Py_ssize_t i = PyList_GET_SIZE(entered) - 1; i >= 0; i--) {
        if (ms_call_exit(st, PyList_GET_ITEM(entered, i)) < 0) {
            rc = -1;
        }
    }
restore:
    if (snap != NULL) {
        ms_exc_state saved;
        ms_exc_save(&saved);
        int had = ms_exc_pending(&saved);
        int changed = restore_buffers(st, snap);
        if (changed < 0) {
            if (had) {
                PyErr_WriteUnraisable((PyObject *)self);
            }
            else {
                rc = -1;
            }
        }
        else if (ex->buffers != NULL && rc == 0) {
            ex->buffers[self->index] = changed ? BUF_MUTATED : BUF_STATIC;
        }
        if (had) {
            ms_exc_restore(&saved);
        }
    }
    {
        /* Put the caller's RNG back on every path. */
        ms_exc_state saved;
        ms_exc_save(&saved);
        int had = ms_exc_pending(&saved);
        PyObject *r1 = PyObject_CallOneArg(st->set_rng_state, cur_rng);
        PyObject *r2 = (r1 != NULL && cur_cuda != NULL)
                           ? PyObject_CallOneArg(st->cuda_set_rng_state_all,
                                                 cur_cuda)
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
    if (rc == 0 && self->rpos != end) {
        PyErr_Format(PyExc_RuntimeError,
                     "memscale: recomputing checkpointed layer %R saved %zd "
                     "tensors for backward where its forward saved %zd. The "
                     "layer takes a different path when run again (e.g. it "
                     "depends on global state); exclude it from "
                     "checkpointing.",
                     unit_name(ex, self->index), self->rpos - start,
                     end - start);
        rc = -1;
    }
    if (rc == 0) {
        ex->recomputes++;
    }
done:
    if (rc < 0) {
        /* Never leave a half-filled (or NULL-filled) list behind. */
        Py_CLEAR(self->recomputed);
    }
    Py_XDECREF(snap);
    Py_XDECREF(out);
    Py_XDECREF(rpack);
    Py_XDECREF(runpack);
    Py_XDECREF(cur_rng);
    Py_XDECREF(cur_cuda);
    Py_XDECREF(entered);
    Py_XDECREF(call_args);
    Py_XDECREF(call_kwargs);
    Py_XDECREF(lead_shape);
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
    if (self->recomputed == NULL
        || k >= PyList_GET_SIZE(self->recomputed)
        || PyList_GET_ITEM(self->recomputed, k) == Py_None)
    {
        /* First need in this backward (or again, with retain_graph). */
        Py_ssize_t tile = -1;
        if (self->tile_end != NULL) {
            for (Py_ssize_t j = 0; j < self->tiles; j++) {
                if (k < self->tile_end[j]) {
                    tile = j;
                    break;
                }
            }
            if (tile < 0) {
                PyErr_Format(PyExc_RuntimeError,
                             "memscale: tiled layer %R saved a tensor for "
                             "backward outside its tiles (in a hook around "
                             "its forward); exclude it from tiling",
                             unit_name(self->ex, self->index));
                return NULL;
            }
        }
        if (frame_recompute(self, tile) < 0) {
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

/* ---- Executor: hooks ---------------------------------------------- */

/* Pop the newest stack entry; leave its saved-tensor hooks if a Frame. */
static int
pop_entry(Executor *ex)
{
    Py_ssize_t n = PyList_GET_SIZE(ex->stack);
    if (n == 0) {
        return 0;
    }
    PyObject *top = Py_NewRef(PyList_GET_ITEM(ex->stack, n - 1));
    int rc = PyList_SetSlice(ex->stack, n - 1, n, NULL);
    if (PyObject_TypeCheck(top, ex->st->frame_type)) {
        Frame *f = (Frame *)top;
        ex->active_frames--;
        if (f->ctx != NULL) {
            PyObject *ctx = f->ctx;
            f->ctx = NULL;
            if (ms_call_exit(ex->st, ctx) < 0) {
                rc = -1;
            }
            Py_DECREF(ctx);
        }
    }
    Py_DECREF(top);
    return rc;
}

static int
push_entry(Executor *ex, PyObject *entry)
{
    if (PyList_Append(ex->stack, entry) < 0) {
        return -1;
    }
    if (PyObject_TypeCheck(entry, ex->st->frame_type)) {
        ex->active_frames++;
    }
    return 0;
}

/* Open a checkpoint frame for this call, or NULL-with-no-error to skip. */
static PyObject *
open_frame(Executor *ex, PyObject *unit, PyObject *args, PyObject *kwargs)
{
    ms_state *st = ex->st;
    if (ex->recompute_depth > 0 || ex->active_frames > 0 || ex->masks == NULL
        || ex->paused > 0)
    {
        return NULL; /* recomputing, or nested in a frame already */
    }
    PyObject *idx = PyDict_GetItemWithError(ex->index_of, unit);
    if (idx == NULL) {
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(idx);
    if (i < 0 || !(ex->masks[i] & MS_TECH_CHECKPOINT)) {
        return NULL;
    }
    int grad = ms_grad_enabled(st);
    if (grad <= 0) {
        return NULL;
    }
    PyObject *training = PyObject_GetAttr(unit, st->s_training);
    int train = training ? PyObject_IsTrue(training) : -1;
    Py_XDECREF(training);
    if (train <= 0) {
        return NULL;
    }
    Frame *f = frame_new(ex, i, unit, args, kwargs);
    if (f == NULL) {
        return NULL;
    }
    if ((ex->masks[i] & MS_TECH_TILING) && ex->tiles != NULL) {
        f->tiles = ex->tiles[i]; /* carried out by the layer's _Tiled */
    }
    f->seg_id = ex->segments != NULL ? ex->segments[i] : (int)i;
    f->seg_next = i + 1;
    PyObject *pack = PyObject_GetAttr((PyObject *)f, st->s_pack);
    PyObject *unpack = PyObject_GetAttr((PyObject *)f, st->s_unpack);
    PyObject *ctx = (pack && unpack)
                        ? PyObject_CallFunctionObjArgs(st->saved_tensors_hooks,
                                                       pack, unpack, NULL)
                        : NULL;
    Py_XDECREF(pack);
    Py_XDECREF(unpack);
    if (ctx == NULL || ms_call_enter(st, ctx) < 0) {
        Py_XDECREF(ctx);
        Py_DECREF(f);
        return NULL;
    }
    f->ctx = ctx;
    ex->frames++;
    return (PyObject *)f;
}

/* The segment waiting for its next unit is done: its stored inputs may
   go to their offload tier now. */
static int
finish_segment(Executor *ex)
{
    Frame *f = (Frame *)ex->open_seg;
    ex->open_seg = NULL;
    if (f == NULL) {
        return 0;
    }
    Py_CLEAR(f->seg_out);
    Py_CLEAR(f->seg_out_version);
    int rc = 0;
    if (ex->masks != NULL && (ex->masks[f->index] & MS_TECH_OFFLOAD)
        && (HAS(ex->store) || HAS(ex->host)))
    {
        rc = offload_inputs(ex, f);
    }
    Py_DECREF(f);
    return rc;
}

/* Unit `unit` starts: if it is the next unit of the open segment and takes
   the previous unit's output, the segment's frame takes it in (1: pushed);
   else the segment is finished (0). */
static int
continue_segment(Executor *ex, PyObject *unit, PyObject *args,
                 PyObject *kwargs)
{
    ms_state *st = ex->st;
    Frame *f = (Frame *)ex->open_seg;
    if (ex->recompute_depth > 0 || ex->paused > 0 || ex->active_frames > 0) {
        return 0; /* not a unit of this forward's chain */
    }
    PyObject *idx = PyDict_GetItemWithError(ex->index_of, unit);
    if (idx == NULL) {
        return PyErr_Occurred() ? -1 : finish_segment(ex);
    }
    Py_ssize_t k = PyLong_AsSsize_t(idx);
    Py_ssize_t pos = -1;
    for (Py_ssize_t a = 0; a < PyTuple_GET_SIZE(args); a++) {
        if (ms_is_tensor(st, PyTuple_GET_ITEM(args, a))) {
            pos = a;
            break;
        }
    }
    int same = 0;
    if (k == f->seg_next && ex->segments != NULL && ex->segments[k] == f->seg_id
        && pos >= 0 && PyTuple_GET_ITEM(args, pos) == f->seg_out)
    {
        /* The same tensor, not changed in place since (x.add_(...) between
           the units would be lost on replay). */
        PyObject *v = PyObject_GetAttr(f->seg_out, st->s_version);
        same = v ? PyObject_RichCompareBool(v, f->seg_out_version, Py_EQ) : -1;
        Py_XDECREF(v);
        if (same < 0) {
            return -1;
        }
    }
    if (!same) {
        /* Something else runs between the two units (or the chain is not
           output-to-input): the segment ends here. */
        return finish_segment(ex) < 0 ? -1 : 0;
    }
    PyObject *held = PyTuple_New(PyTuple_GET_SIZE(args));
    PyObject *kw = (kwargs != NULL && kwargs != Py_None) ? PyDict_Copy(kwargs)
                                                         : PyDict_New();
    PyObject *rng = PyObject_CallNoArgs(st->get_rng_state);
    PyObject *rng_cuda = NULL, *rec = NULL, *pack = NULL, *unpack = NULL;
    PyObject *ctx = NULL, *where = PyLong_FromSsize_t(pos);
    int rc = -1;
    if (held == NULL || kw == NULL || rng == NULL || where == NULL) {
        goto done;
    }
    for (Py_ssize_t a = 0; a < PyTuple_GET_SIZE(args); a++) {
        PyTuple_SET_ITEM(held, a, Py_NewRef(a == pos ? Py_None
                                                     : PyTuple_GET_ITEM(args, a)));
    }
    rng_cuda = f->rng_cuda != NULL
                   ? PyObject_CallNoArgs(st->cuda_get_rng_state_all)
                   : Py_NewRef(Py_None);
    if (rng_cuda == NULL) {
        goto done;
    }
    rec = PyTuple_Pack(6, unit, where, held, kw, rng, rng_cuda);
    if (rec == NULL) {
        goto done;
    }
    if (f->seg_units == NULL && (f->seg_units = PyList_New(0)) == NULL) {
        goto done;
    }
    Py_ssize_t nv = PyList_GET_SIZE(f->versions);
    if (ms_collect_versions(st, held, f->versions) < 0
        || ms_collect_versions(st, kw, f->versions) < 0
        || PyList_Append(f->seg_units, rec) < 0)
    {
        /* Leave the frame as it was. */
        (void)PyList_SetSlice(f->versions, nv, PyList_GET_SIZE(f->versions),
                              NULL);
        goto done;
    }
    pack = PyObject_GetAttr((PyObject *)f, st->s_pack);
    unpack = PyObject_GetAttr((PyObject *)f, st->s_unpack);
    ctx = (pack && unpack) ? PyObject_CallFunctionObjArgs(st->saved_tensors_hooks,
                                                         pack, unpack, NULL)
                           : NULL;
    if (ctx == NULL || ms_call_enter(st, ctx) < 0) {
        Py_ssize_t n = PyList_GET_SIZE(f->seg_units);
        (void)PyList_SetSlice(f->seg_units, n - 1, n, NULL);
        (void)PyList_SetSlice(f->versions, nv, PyList_GET_SIZE(f->versions),
                              NULL);
        goto done;
    }
    if (push_entry(ex, (PyObject *)f) < 0) {
        (void)ms_call_exit(st, ctx);
        goto done;
    }
    f->ctx = Py_NewRef(ctx);
    f->cur_unit = unit;
    f->seg_next = k + 1;
    Py_CLEAR(f->seg_out);
    Py_CLEAR(f->seg_out_version);
    Py_CLEAR(ex->open_seg); /* the stack holds the frame now */
    rc = 1;
done:
    Py_XDECREF(held);
    Py_XDECREF(kw);
    Py_XDECREF(rng);
    Py_XDECREF(rng_cuda);
    Py_XDECREF(rec);
    Py_XDECREF(pack);
    Py_XDECREF(unpack);
    Py_XDECREF(ctx);
    Py_XDECREF(where);
    if (rc < 0) {
        /* Keep going without the segment rather than half in it. */
        ms_exc_state saved;
        ms_exc_save(&saved);
        if (finish_segment(ex) < 0) {
            PyErr_WriteUnraisable((PyObject *)ex);
        }
        ms_exc_restore(&saved);
    }
    return rc;
}

static PyObject *
ex_pre(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_pre(module, args, kwargs)");
        return NULL;
    }
    if (!PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_pre: args must be a tuple");
        return NULL;
    }
    if (ex->open_seg != NULL) {
        int cont = continue_segment(ex, args[0], args[1], args[2]);
        if (cont > 0) {
            Py_RETURN_NONE;
        }
        if (cont < 0) {
            /* The paired forward hook pops one entry. */
            if (push_entry(ex, args[0]) < 0) {
                PyErr_WriteUnraisable((PyObject *)ex);
            }
            return NULL;
        }
    }
    PyObject *entry = open_frame(ex, args[0], args[1], args[2]);
    /* Push even on error: the paired forward hook pops one entry. */
    int failed = entry == NULL && PyErr_Occurred();
    /* The entry is the Frame, or the unit itself when nothing is done, so
       that the forward hook can tell its own entry from an outer one. */
    if (push_entry(ex, entry ? entry : args[0]) < 0) {
        if (entry != NULL) {
            Frame *f = (Frame *)entry;
            PyObject *ctx = f->ctx;
            f->ctx = NULL;
            (void)ms_call_exit(ex->st, ctx);
            Py_DECREF(ctx);
        }
        Py_XDECREF(entry);
        return NULL;
    }
    Py_XDECREF(entry);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
ex_post(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_post(module, args, output)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ex->stack);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    PyObject *top = PyList_GET_ITEM(ex->stack, n - 1);
    PyObject *owner = PyObject_TypeCheck(top, ex->st->frame_type)
                          ? ((Frame *)top)->cur_unit
                          : top;
    if (owner != args[0]) {
        /* Not ours: a hook that runs before ours raised, so our pre-hook
           never pushed.  Popping would close an outer layer's frame. */
        Py_RETURN_NONE;
    }
    PyObject *frame = top != owner ? Py_NewRef(top) : NULL;
    if (pop_entry(ex) < 0) {
        Py_XDECREF(frame);
        return NULL;
    }
    int rc = 0;
    if (frame != NULL && ((Frame *)frame)->tile_end != NULL) {
        Frame *f = (Frame *)frame;
        if (PyList_GET_SIZE(f->shapes) != f->tile_end[f->tiles - 1]) {
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: a hook around tiled layer %R saved tensors "
                         "for backward outside the layer's tiles, which "
                         "cannot be recomputed tile by tile. Remove the hook, "
                         "or turn tiling off (enable_tiling=False, or a mode "
                         "other than AGGRESSIVE)",
                         unit_name(ex, f->index));
            Py_DECREF(frame);
            return NULL;
        }
    }
    if (frame != NULL) {
        Frame *f = (Frame *)frame;
        PyObject *x = first_tensor(ex->st, args[2]);
        if (ex->segments != NULL && f->seg_next < ex->n && f->tile_end == NULL
            && ex->segments[f->seg_next] == f->seg_id && f->seg_id >= 0
            && x != NULL && ex->recompute_depth == 0)
        {
            /* The segment goes on with the next unit: keep the frame (its
               saved-tensor hooks are left, so whatever runs in between is
               not packed into it). */
            if (finish_segment(ex) < 0) {
                Py_DECREF(frame);
                return NULL;
            }
            PyObject *v = PyObject_GetAttr(x, ex->st->s_version);
            if (v == NULL) {
                Py_DECREF(frame);
                return NULL;
            }
            Py_XSETREF(f->seg_out_version, v);
            Py_XSETREF(f->seg_out, Py_NewRef(x));
            ex->open_seg = frame; /* the reference is handed over */
            Py_RETURN_NONE;
        }
        if ((ex->masks != NULL && (ex->masks[f->index] & MS_TECH_OFFLOAD))
            && (HAS(ex->store) || HAS(ex->host)))
        {
            rc = offload_inputs(ex, f);
        }
        Py_DECREF(frame);
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- Tiled forwards ----------------------------------------------- */

/* A tiled layer's `forward` while memscale is attached (an instance
   attribute, removed by detach): inside the layer's checkpoint frame it
   runs the layer's own forward tile by tile, recording where each tile's
   saved tensors start and end so that backward recomputes one tile at a
   time; anywhere else (evaluation, recompute, paused) it is the layer's
   forward unchanged.  The first tiled call asks the executor's verifier
   along which dimension the layer may be tiled, if at all. */
enum { DIM_UNVERIFIED = -1, DIM_DEMOTED = -2 };

typedef struct {
    PyObject_HEAD
    Executor *ex;
    PyObject *unit;
    PyObject *orig;   /* the forward it stands in for */
    int dim;          /* >= 0, or DIM_UNVERIFIED / DIM_DEMOTED */
    Py_ssize_t ndim;  /* dimensions of the lead tensor it was verified on */
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
    if (f->unit != self->unit || f->tiles < 2 || f->tile_end != NULL
        || f->recomputing || PyList_GET_SIZE(f->shapes) != 0)
    {
        return NULL;
    }
    return f;
}

/* Run the tiles of f; the joined output, or NULL with an exception. */
static PyObject *
run_tiles(Tiled *self, Frame *f, PyObject *args, PyObject *kwargs,
          PyObject *lead_shape, int tiles)
{
    ms_state *st = self->ex->st;
    PyObject *outs = PyList_New(0);
    f->tile_end = PyMem_Calloc((size_t)tiles, sizeof(Py_ssize_t));
    if (f->tile_end != NULL) {
        f->tiles = tiles; /* tile_end has this many entries */
    }
    f->tile_rng = PyList_New(0);
    if (f->rng_cuda != NULL) {
        f->tile_rng_cuda = PyList_New(0);
    }
    if (outs == NULL || f->tile_end == NULL || f->tile_rng == NULL
        || (f->rng_cuda != NULL && f->tile_rng_cuda == NULL))
    {
        if (f->tile_end == NULL) {
            PyErr_NoMemory();
        }
        goto error;
    }
    f->tiles = tiles;
    for (int j = 0; j < tiles; j++) {
        Py_ssize_t start, len;
        PyObject *targs, *tkwargs, *out;
        PyObject *rng = PyObject_CallNoArgs(st->get_rng_state);
        int rc = rng ? PyList_Append(f->tile_rng, rng) : -1;
        Py_XDECREF(rng);
        if (rc < 0) {
            goto error;
        }
        if (f->tile_rng_cuda != NULL) {
            rng = PyObject_CallNoArgs(st->cuda_get_rng_state_all);
            rc = rng ? PyList_Append(f->tile_rng_cuda, rng) : -1;
            Py_XDECREF(rng);
            if (rc < 0) {
                goto error;
            }
        }
        ms_tile_range(f->extent, tiles, j, &start, &len);
        if (ms_tile_slice(st, args, kwargs, f->dim, lead_shape, start, len,
                          &targs, &tkwargs) < 0)
        {
            goto error;
        }
        out = PyObject_Call(self->orig, targs, tkwargs);
        Py_DECREF(targs);
        Py_DECREF(tkwargs);
        if (out == NULL) {
            goto error;
        }
        f->tile_end[j] = PyList_GET_SIZE(f->shapes);
        rc = PyList_Append(outs, out);
        Py_DECREF(out);
        if (rc < 0) {
            goto error;
        }
    }
    PyObject *res = ms_tile_merge(st, outs, f->dim);
    Py_DECREF(outs);
    if (res != NULL) {
        self->ex->tiled_calls++;
    }
    return res;
error:
    /* The forward raises: the frame is discarded with its graph.  Leave
       it consistent anyway. */
    Py_XDECREF(outs);
    PyMem_Free(f->tile_end);
    f->tile_end = NULL;
    f->tiles = 1;
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
    PyObject *n = PyLong_FromLong(f->tiles);
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
            f->tiles = 1;
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
                              &lead_shape) < 0)
        {
            goto done;
        }
    }
    int tiles = extent < f->tiles ? (int)extent : f->tiles;
    if (self->dim < 0 || lead_shape == NULL || tiles < 2) {
        f->tiles = 1;  /* checkpointed whole, as an untiled layer */
        res = PyObject_Call(self->orig, args, kwargs);
        goto done;
    }
    f->dim = self->dim;
    f->extent = extent;
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
     "'demoted' when verification refused tiling.", NULL},
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

PyDoc_STRVAR(ex_tiled_forward_doc,
"tiled_forward($self, index, forward, /)\n--\n\n"
"A callable to install as unit *index*'s forward: it runs *forward* in\n"
"tiles when the plan tiles the layer, and unchanged otherwise.");

static PyObject *
ex_tiled_forward(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tiled_forward(index, forward)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (i < 0 || i >= ex->n || ex->units == NULL
        || i >= PyList_GET_SIZE(ex->units))
    {
        PyErr_Format(PyExc_IndexError, "no unit %zd", i);
        return NULL;
    }
    if (!PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "forward must be callable");
        return NULL;
    }
    Tiled *t = PyObject_GC_New(Tiled, ex->st->tiled_type);
    if (t == NULL) {
        return NULL;
    }
    t->ex = (Executor *)Py_NewRef(ex);
    t->unit = Py_NewRef(PyList_GET_ITEM(ex->units, i));
    t->orig = Py_NewRef(args[1]);
    t->dim = DIM_UNVERIFIED;
    t->ndim = -1;
    PyObject_GC_Track(t);
    return (PyObject *)t;
}

PyDoc_STRVAR(ex_set_tile_verifier_doc,
"set_tile_verifier($self, verifier, /)\n--\n\n"
"verifier(unit, forward, args, kwargs, tiles) -> dim or None is called at\n"
"a tiled layer's first tiled forward: the dimension to tile along, or\n"
"None to run the layer untiled (checkpointed whole).");

static PyObject *
ex_set_tile_verifier(Executor *ex, PyObject *verifier)
{
    if (verifier != Py_None && !PyCallable_Check(verifier)) {
        PyErr_SetString(PyExc_TypeError, "verifier must be callable or None");
        return NULL;
    }
    Py_XSETREF(ex->tile_verifier, Py_NewRef(verifier));
    Py_RETURN_NONE;
}

static int ex_apply_plan(Executor *ex, PyObject *plan);

/* Leave whatever an interrupted forward (KeyboardInterrupt skips the
   always_call hooks) left on the stack. */
static int
drop_stale(Executor *ex, int warn)
{
    Py_CLEAR(ex->open_seg); /* a forward that never reached its end */
    if (ex->stack == NULL || PyList_GET_SIZE(ex->stack) == 0) {
        return 0; /* (NULL: cleared by the garbage collector) */
    }
    /* Clean up first: a warning turned into an error must not leave the
       stale contexts entered (and fail every later forward). */
    int rc = 0;
    while (PyList_GET_SIZE(ex->stack) > 0) {
        if (pop_entry(ex) < 0) {
            rc = -1;
        }
    }
    ex->active_frames = 0;
    if (rc == 0 && warn
        && PyErr_WarnEx(PyExc_RuntimeWarning,
                        "memscale: a previous forward was interrupted inside "
                        "a checkpointed layer; its hooks were cleaned up",
                        1) < 0)
    {
        rc = -1;
    }
    return rc;
}

static PyObject *
root_pre_body(Executor *ex, PyObject *const *args)
{
    if (ex->recompute_depth == 0 && drop_stale(ex, 1) < 0) {
        return NULL;
    }
    if (ex->root_in_pass && ex->recompute_depth == 0) {
        /* The previous profiled forward was interrupted before its
           always_call hook (KeyboardInterrupt): drop that pass. */
        ex->root_in_pass = 0;
        PyObject *r = PyObject_CallMethod(ex->profiler, "end_pass", "(O)",
                                          Py_False);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
        if (PyErr_WarnEx(PyExc_RuntimeWarning,
                         "memscale: a previous forward was interrupted while "
                         "being profiled; its measurements were dropped",
                         1) < 0)
        {
            return NULL;
        }
    }
    if (ex->paused > 0) {
        Py_RETURN_NONE;
    }
    int grad = ms_grad_enabled(ex->st);
    if (grad < 0) {
        return NULL;
    }
    PyObject *training = PyObject_GetAttr(args[0], ex->st->s_training);
    int train = training ? PyObject_IsTrue(training) : -1;
    Py_XDECREF(training);
    if (train < 0) {
        return NULL;
    }
    if (!grad || !train) {
        Py_RETURN_NONE; /* evaluation passes are neither counted nor profiled */
    }
    ex->forwards++;
    if (HAS(ex->store) && ex->recompute_depth == 0
        && ms_spill_new_step(ex->store) < 0)
    {
        return NULL;
    }
    if (ex->profiler == Py_None || ex->root_in_pass) {
        Py_RETURN_NONE;
    }
    PyObject *r = PyObject_CallMethod(ex->profiler, "begin_pass", NULL);
    if (r == NULL) {
        return NULL;
    }
    Py_DECREF(r);
    /* The caller may itself run inside an except block: remember what was
       being handled, so that _root_post only blames a new exception. */
    Py_XSETREF(ex->pre_exc, PyErr_GetHandledException());
    if (ex->pre_exc == Py_None) {
        Py_CLEAR(ex->pre_exc);
    }
    ex->root_in_pass = 1;
    Py_RETURN_NONE;
}

static PyObject *
root_post_body(Executor *ex)
{
    if (ex->recompute_depth == 0 && ex->open_seg != NULL
        && finish_segment(ex) < 0)
    {
        return NULL;
    }
    /* End of the forward: writes still in flight finish now, so that their
       tensors are gone before backward (the step's peak) starts. */
    if (HAS(ex->store) && ex->recompute_depth == 0 && ex->paused == 0
        && ms_spill_flush(ex->store) < 0)
    {
        return NULL;
    }
    if (!ex->root_in_pass) {
        Py_RETURN_NONE;
    }
    ex->root_in_pass = 0;
    /* Called from torch's "except Exception:" when the forward raised. */
    PyObject *handled = PyErr_GetHandledException();
    if (handled == Py_None) {
        Py_CLEAR(handled);
    }
    int ok = handled == ex->pre_exc;
    Py_XDECREF(handled);
    Py_CLEAR(ex->pre_exc);
    PyObject *r = PyObject_CallMethod(ex->profiler, "end_pass", "(O)",
                                      ok ? Py_True : Py_False);
    if (r == NULL) {
        return NULL;
    }
    Py_DECREF(r);
    if (!ok) {
        Py_RETURN_NONE;
    }
    ex->steps++;
    if (ex->steps < ex->warmup_steps) {
        Py_RETURN_NONE;
    }
    /* Warm-up done: plan from what was measured, then apply. */
    PyObject *profiler = ex->profiler;
    PyObject *callback = ex->on_profiled;
    ex->profiler = Py_NewRef(Py_None);
    ex->on_profiled = Py_NewRef(Py_None);
    PyObject *plan = NULL;
    r = PyObject_CallMethod(profiler, "detach", NULL);
    if (r != NULL) {
        Py_DECREF(r);
        plan = callback != Py_None ? PyObject_CallOneArg(callback, profiler)
                                   : NULL;
        if (plan == NULL && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError,
                            "memscale: nothing to plan with after warm-up");
        }
    }
    Py_DECREF(profiler);
    Py_DECREF(callback);
    if (plan == NULL) {
        return NULL;
    }
    int rc = ex_apply_plan(ex, plan);
    Py_DECREF(plan);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Mixed precision: every forward of the root runs under the autocast the
   executor was given (set_autocast), entered last in the root's pre-hook
   and left first in its always_call post-hook.  Recomputes replay the
   autocast state their frame recorded, so they match. */
static int
amp_enter(Executor *ex)
{
    PyObject *ctx = Py_None;
    if (HAS(ex->amp_device) && ex->recompute_depth == 0) {
        ctx = make_autocast(ex->st, ex->amp_device, ex->amp_dtype, 1);
        if (ctx == NULL) {
            return -1;
        }
        if (ms_call_enter(ex->st, ctx) < 0) {
            Py_DECREF(ctx);
            return -1;
        }
    }
    else {
        Py_INCREF(ctx);
    }
    int rc = PyList_Append(ex->amp_stack, ctx);
    if (rc < 0 && ctx != Py_None) {
        (void)ms_call_exit(ex->st, ctx);
    }
    Py_DECREF(ctx);
    return rc;
}

static int
amp_leave(Executor *ex)
{
    Py_ssize_t n = ex->amp_stack ? PyList_GET_SIZE(ex->amp_stack) : 0;
    if (n == 0) {
        return 0; /* the pre-hook failed before entering */
    }
    PyObject *ctx = Py_NewRef(PyList_GET_ITEM(ex->amp_stack, n - 1));
    int rc = PyList_SetSlice(ex->amp_stack, n - 1, n, NULL);
    if (ctx != Py_None && ms_call_exit(ex->st, ctx) < 0) {
        rc = -1;
    }
    Py_DECREF(ctx);
    return rc;
}

/* Leave every autocast still entered: those of forwards interrupted by a
   BaseException (KeyboardInterrupt), whose always_call hook never ran.
   Left entered, autocast would stay on for good, and its cache of casted
   weights would never be cleared. */
static int
amp_drop_stale(Executor *ex, int warn)
{
    Py_ssize_t n = ex->amp_stack ? PyList_GET_SIZE(ex->amp_stack) : 0;
    if (n == 0) {
        return 0;
    }
    int rc = 0;
    while (PyList_GET_SIZE(ex->amp_stack) > 0) {
        if (amp_leave(ex) < 0) {
            rc = -1;
        }
    }
    if (rc == 0 && warn
        && PyErr_WarnEx(PyExc_RuntimeWarning,
                        "memscale: a previous forward was interrupted; the "
                        "mixed-precision autocast it entered was left",
                        1) < 0)
    {
        rc = -1;
    }
    return rc;
}

static PyObject *
ex_root_pre(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_root_pre(module, args, kwargs)");
        return NULL;
    }
    /* A root forward starts outside any other: what is still entered is
       stale (the same assumption as drop_stale's). */
    if (ex->recompute_depth == 0
        && (drop_stale(ex, 1) < 0 || amp_drop_stale(ex, 1) < 0))
    {
        return NULL;
    }
    PyObject *r = root_pre_body(ex, args);
    if (r == NULL || amp_enter(ex) < 0) {
        Py_XDECREF(r);
        return NULL;
    }
    return r;
}

static PyObject *
ex_root_post(Executor *ex, PyObject *const *Py_UNUSED(args), Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_root_post(module, args, output)");
        return NULL;
    }
    if (amp_leave(ex) < 0) {
        /* Still finish the pass (profiling, spill flush), then raise. */
        ms_exc_state saved;
        ms_exc_save(&saved);
        PyObject *r = root_post_body(ex);
        if (r == NULL) {
            PyErr_WriteUnraisable((PyObject *)ex);
        }
        Py_XDECREF(r);
        ms_exc_restore(&saved);
        return NULL;
    }
    return root_post_body(ex);
}

PyDoc_STRVAR(ex_set_autocast_doc,
"set_autocast($self, device_type, dtype, /)\n--\n\n"
"Run every forward of the model under torch.autocast(device_type, dtype);\n"
"set_autocast(None, None) stops it.");

static PyObject *
ex_set_autocast(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_autocast(device_type, dtype)");
        return NULL;
    }
    if ((args[0] == Py_None) != (args[1] == Py_None)
        || (args[0] != Py_None && !PyUnicode_Check(args[0])))
    {
        PyErr_SetString(PyExc_TypeError,
                        "set_autocast takes a device type (str) and a dtype, "
                        "or None and None");
        return NULL;
    }
    if (args[0] != Py_None) {
        /* Fail now, not in the next forward. */
        PyObject *probe = make_autocast(ex->st, args[0], args[1], 1);
        if (probe == NULL) {
            return NULL;
        }
        Py_DECREF(probe);
    }
    Py_XSETREF(ex->amp_device, Py_NewRef(args[0]));
    Py_XSETREF(ex->amp_dtype, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyObject *
ex_get_autocast(Executor *ex, void *Py_UNUSED(c))
{
    if (!HAS(ex->amp_device)) {
        Py_RETURN_NONE;
    }
    return PyTuple_Pack(2, ex->amp_device, ex->amp_dtype);
}

/* ---- Executor: lifecycle ------------------------------------------ */

static int
ex_apply_plan(Executor *ex, PyObject *plan)
{
    ms_state *st = ex->st;
    PyObject *chosen = NULL, *pre = NULL, *post = NULL;
    unsigned *masks = NULL;
    int *tiles = NULL, *segments = NULL;
    int rc = -1;

    if (!PyObject_TypeCheck(plan, st->plan_type)) {
        PyErr_Format(PyExc_TypeError,
                     "apply() needs a Plan, got %.200s",
                     Py_TYPE(plan)->tp_name);
        return -1;
    }
    if (!ex->attached) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: this executor was detached");
        return -1;
    }
    if (PySequence_Size(plan) != ex->n) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError,
                         "plan has %zd layers, the executor %zd",
                         PySequence_Size(plan), ex->n);
        }
        return -1;
    }
    masks = PyMem_Calloc(ex->n ? (size_t)ex->n : 1, sizeof(unsigned));
    tiles = PyMem_Calloc(ex->n ? (size_t)ex->n : 1, sizeof(int));
    segments = PyMem_Calloc(ex->n ? (size_t)ex->n : 1, sizeof(int));
    chosen = PyList_New(0);
    if (masks == NULL || tiles == NULL || segments == NULL || chosen == NULL) {
        if (masks == NULL || tiles == NULL || segments == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    for (Py_ssize_t i = 0; i < ex->n; i++) {
        if (ms_plan_layer(plan, i, &masks[i], &tiles[i], &segments[i]) < 0) {
            goto done;
        }
        if (segments[i] < -1 || segments[i] > i) {
            PyErr_Format(PyExc_ValueError, "plan layer %zd has segment %d",
                         i, segments[i]);
            goto done;
        }
        if (masks[i] != 0
            && PyList_Append(chosen, PyList_GET_ITEM(ex->units, i)) < 0)
        {
            goto done;
        }
    }
    if (PyList_GET_SIZE(ex->stack) > 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: cannot change the plan inside a "
                        "checkpointed layer's forward");
        goto done;
    }
    /* Replace the hooks of any previous plan. */
    if (ms_remove_handles(st, ex->handles) < 0) {
        goto done;
    }
    PyMem_Free(ex->masks);
    ex->masks = NULL;
    PyMem_Free(ex->tiles);
    ex->tiles = NULL;
    PyMem_Free(ex->segments);
    ex->segments = NULL;
    Py_CLEAR(ex->open_seg);
    Py_XSETREF(ex->plan, Py_NewRef(Py_None));  /* its hooks are gone */
    pre = PyUnicode_InternFromString("_pre");
    post = PyUnicode_InternFromString("_post");
    if (pre == NULL || post == NULL
        || ms_register_unit_hooks(st, (PyObject *)ex, chosen, ex->handles, pre,
                                  post) < 0)
    {
        goto done;
    }
    ex->masks = masks;
    masks = NULL;
    ex->tiles = tiles;
    tiles = NULL;
    ex->segments = segments;
    segments = NULL;
    Py_XSETREF(ex->plan, Py_NewRef(plan));
    rc = 0;
done:
    PyMem_Free(masks);
    PyMem_Free(tiles);
    PyMem_Free(segments);
    Py_XDECREF(chosen);
    Py_XDECREF(pre);
    Py_XDECREF(post);
    return rc;
}

PyDoc_STRVAR(ex_apply_doc,
"apply($self, plan, /)\n--\n\n"
"Attach the hooks that carry out *plan* (replacing a previous plan's).");

static PyObject *
ex_apply(Executor *ex, PyObject *plan)
{
    if (ex_apply_plan(ex, plan) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(ex_start_profiling_doc,
"start_profiling($self, profiler, on_profiled, /)\n--\n\n"
"Measure the next warmup_steps training forwards with *profiler*, then\n"
"call on_profiled(profiler) for a Plan and apply it.");

static PyObject *
ex_start_profiling(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "start_profiling(profiler, on_profiled)");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], ex->st->profiler_type)
        || !PyCallable_Check(args[1]))
    {
        PyErr_SetString(PyExc_TypeError,
                        "start_profiling needs a Profiler and a callable");
        return NULL;
    }
    if (!ex->attached) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: this executor was detached");
        return NULL;
    }
    if (ex->root_in_pass || PyList_GET_SIZE(ex->stack) > 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: cannot start profiling inside a forward");
        return NULL;
    }
    Py_XSETREF(ex->profiler, Py_NewRef(args[0]));
    Py_XSETREF(ex->on_profiled, Py_NewRef(args[1]));
    ex->steps = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(ex_set_offload_doc,
"set_offload($self, store, host, /)\n--\n\n"
"Where offloaded layers send their inputs: *store*, a SpillStore (the disk\n"
"tier, for CPU tensors), and *host*, an object whose put(tensor) returns a\n"
"record with get() or None (the host tier, for device tensors); either may\n"
"be None.");

static PyObject *
ex_set_offload(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_offload(store, host)");
        return NULL;
    }
    if (args[0] != Py_None
        && !PyObject_TypeCheck(args[0], ex->st->spill_store_type))
    {
        PyErr_Format(PyExc_TypeError,
                     "set_offload: store must be a SpillStore or None, got "
                     "%.200s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (ex->stack != NULL && PyList_GET_SIZE(ex->stack) > 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: cannot change offloading inside a forward");
        return NULL;
    }
    Py_XSETREF(ex->store, Py_NewRef(args[0]));
    Py_XSETREF(ex->host, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(ex_pause_doc,
"pause($self, /)\n--\n\n"
"Make every hook of this executor do nothing until resume() (nestable):\n"
"forwards run as without memscale and are not counted.  Not allowed\n"
"inside a checkpointed layer's forward or a profiled pass.");

static PyObject *
ex_pause(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ex->root_in_pass || (ex->stack && PyList_GET_SIZE(ex->stack) > 0)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: cannot pause the executor inside a forward");
        return NULL;
    }
    ex->paused++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(ex_resume_doc,
"resume($self, /)\n--\n\n"
"Undo one pause().");

static PyObject *
ex_resume(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ex->paused == 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale: resume() without a matching pause()");
        return NULL;
    }
    ex->paused--;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(
    ex_abandon_doc,
    "_abandon($self, /)\n--\n\n"
    "The root forward is being left by an exception its always_call hooks\n"
    "did not see (KeyboardInterrupt, any BaseException): leave every\n"
    "saved-tensor hook and autocast this executor entered, drop the\n"
    "half-built frames and the profiled pass.  Idempotent; nothing to do\n"
    "while a layer is recomputed.");

static PyObject *
ex_abandon(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ex->stack == NULL || ex->recompute_depth > 0) {
        Py_RETURN_NONE; /* cleared by the garbage collector, or in backward */
    }
    int rc = 0;
    if (drop_stale(ex, 0) < 0) {
        rc = -1;
    }
    if (amp_drop_stale(ex, 0) < 0) {
        rc = -1;
    }
    Py_CLEAR(ex->pre_exc);
    if (ex->root_in_pass) {
        ex->root_in_pass = 0;
        if (ex->profiler != NULL && ex->profiler != Py_None) {
            PyObject *r = PyObject_CallMethod(ex->profiler, "end_pass", "(O)",
                                              Py_False);
            if (r == NULL) {
                rc = -1;
            }
            Py_XDECREF(r);
        }
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(ex_detach_doc,
"detach($self, /)\n--\n\n"
"Remove every hook this executor attached and drop its references to the\n"
"model.  Idempotent.");

static PyObject *
ex_detach(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ex->handles == NULL || ex->root_handles == NULL || ex->units == NULL)
    {
        Py_RETURN_NONE; /* cleared by the garbage collector: nothing left */
    }
    int rc = 0;
    if (drop_stale(ex, 0) < 0) {
        rc = -1;
    }
    if (ex->profiler != NULL && ex->profiler != Py_None) {
        PyObject *r = PyObject_CallMethod(ex->profiler, "detach", NULL);
        if (r == NULL) {
            rc = -1;
        }
        Py_XDECREF(r);
    }
    if (rc < 0) {
        /* Remove the hooks anyway; the first error is what is raised. */
        ms_exc_state saved;
        ms_exc_save(&saved);
        if (ms_remove_handles(ex->st, ex->handles) < 0
            || ms_remove_handles(ex->st, ex->root_handles) < 0)
        {
            PyErr_WriteUnraisable((PyObject *)ex);
        }
        ms_exc_restore(&saved);
    }
    else if (ms_remove_handles(ex->st, ex->handles) < 0
             || ms_remove_handles(ex->st, ex->root_handles) < 0)
    {
        rc = -1;
    }
    ex->attached = 0;
    ex->root_in_pass = 0;
    PyMem_Free(ex->masks);
    ex->masks = NULL;
    PyMem_Free(ex->tiles);
    ex->tiles = NULL;
    PyMem_Free(ex->segments);
    ex->segments = NULL;
    Py_CLEAR(ex->open_seg);
    Py_XSETREF(ex->tile_verifier, Py_NewRef(Py_None));
    Py_XSETREF(ex->amp_device, Py_NewRef(Py_None));
    Py_XSETREF(ex->amp_dtype, Py_NewRef(Py_None));
    if (amp_drop_stale(ex, 0) < 0) {
        rc = -1;
    }
    Py_XSETREF(ex->profiler, Py_NewRef(Py_None));
    Py_XSETREF(ex->on_profiled, Py_NewRef(Py_None));
    Py_XSETREF(ex->store, Py_NewRef(Py_None));
    Py_XSETREF(ex->host, Py_NewRef(Py_None));
    Py_CLEAR(ex->model_ref);
    PyDict_Clear(ex->index_of);
    if (PyList_SetSlice(ex->units, 0, PyList_GET_SIZE(ex->units), NULL) < 0) {
        rc = -1;
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
ex_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"model", "units", "warmup_steps", NULL};
    PyObject *model, *units_arg, *seq = NULL;
    long warmup = 2;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$l:Executor", kwlist,
                                     &model, &units_arg, &warmup))
    {
        return NULL;
    }
    if (warmup < 1) {
        PyErr_SetString(PyExc_ValueError, "warmup_steps must be >= 1");
        return NULL;
    }
    PyObject *module = PyType_GetModuleByDef(type, &ms_module_def);
    if (module == NULL) {
        return NULL;
    }
    ms_state *st = ms_get_state(module);
    int is_mod = PyObject_IsInstance(model, st->torch_module_type);
    if (is_mod <= 0) {
        if (is_mod == 0) {
            PyErr_Format(PyExc_TypeError,
                         "Executor needs a torch.nn.Module, got %.200s",
                         Py_TYPE(model)->tp_name);
        }
        return NULL;
    }
    Executor *ex = (Executor *)type->tp_alloc(type, 0);
    if (ex == NULL) {
        return NULL;
    }
    ex->module = Py_NewRef(module);
    ex->st = st;
    ex->warmup_steps = warmup;
    ex->plan = Py_NewRef(Py_None);
    ex->profiler = Py_NewRef(Py_None);
    ex->on_profiled = Py_NewRef(Py_None);
    ex->store = Py_NewRef(Py_None);
    ex->host = Py_NewRef(Py_None);
    ex->tile_verifier = Py_NewRef(Py_None);
    ex->amp_device = Py_NewRef(Py_None);
    ex->amp_dtype = Py_NewRef(Py_None);
    ex->amp_stack = PyList_New(0);
    ex->model_ref = PyWeakref_NewRef(model, NULL);
    ex->units = PyList_New(0);
    ex->names = PyList_New(0);
    ex->index_of = PyDict_New();
    ex->handles = PyList_New(0);
    ex->root_handles = PyList_New(0);
    ex->stack = PyList_New(0);
    if (ex->model_ref == NULL || ex->amp_stack == NULL || ex->units == NULL
        || ex->names == NULL
        || ex->index_of == NULL || ex->handles == NULL
        || ex->root_handles == NULL || ex->stack == NULL)
    {
        goto error;
    }
    /* A tuple of our own: the caller's list cannot change under us while
       the loop below runs Python code (hashing the modules). */
    seq = PySequence_Fast(units_arg, "units must be a sequence of "
                                     "(name, module) pairs");
    if (seq == NULL) {
        goto error;
    }
    Py_SETREF(seq, PySequence_Tuple(seq));
    if (seq == NULL) {
        goto error;
    }
    ex->n = PyTuple_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < ex->n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i), *name, *unit;
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError,
                         "units must be (name, module) tuples, got %.200s",
                         Py_TYPE(item)->tp_name);
            goto error;
        }
        if (!PyArg_ParseTuple(item, "UO;units must be (name, module) pairs",
                              &name, &unit))
        {
            goto error;
        }
        int has = PyDict_Contains(ex->index_of, unit);
        if (has != 0) {
            if (has > 0) {
                PyErr_Format(PyExc_ValueError,
                             "unit %R appears twice among the units", name);
            }
            goto error;
        }
        PyObject *idx = PyLong_FromSsize_t(i);
        int rc = idx ? PyDict_SetItem(ex->index_of, unit, idx) : -1;
        Py_XDECREF(idx);
        if (rc < 0 || PyList_Append(ex->units, unit) < 0
            || PyList_Append(ex->names, name) < 0)
        {
            goto error;
        }
    }
    Py_CLEAR(seq);
    ex->buffers = PyMem_Calloc(ex->n ? (size_t)ex->n : 1, 1);
    if (ex->buffers == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    ex->attached = 1;
    {
        PyObject *pre = PyUnicode_InternFromString("_root_pre");
        PyObject *post = PyUnicode_InternFromString("_root_post");
        PyObject *root = PyList_New(1);
        int rc = -1;
        if (pre != NULL && post != NULL && root != NULL) {
            PyList_SET_ITEM(root, 0, Py_NewRef(model));
            rc = ms_register_unit_hooks(st, (PyObject *)ex, root,
                                        ex->root_handles, pre, post);
        }
        Py_XDECREF(pre);
        Py_XDECREF(post);
        Py_XDECREF(root);
        if (rc < 0) {
            goto error;
        }
    }
    return (PyObject *)ex;
error:
    Py_XDECREF(seq);
    Py_DECREF(ex);
    return NULL;
}

static int
ex_traverse(Executor *ex, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(ex));
    Py_VISIT(ex->module);
    Py_VISIT(ex->model_ref);
    Py_VISIT(ex->units);
    Py_VISIT(ex->names);
    Py_VISIT(ex->index_of);
    Py_VISIT(ex->plan);
    Py_VISIT(ex->profiler);
    Py_VISIT(ex->on_profiled);
    Py_VISIT(ex->pre_exc);
    Py_VISIT(ex->handles);
    Py_VISIT(ex->root_handles);
    Py_VISIT(ex->stack);
    Py_VISIT(ex->store);
    Py_VISIT(ex->host);
    Py_VISIT(ex->tile_verifier);
    Py_VISIT(ex->amp_device);
    Py_VISIT(ex->amp_dtype);
    Py_VISIT(ex->amp_stack);
    Py_VISIT(ex->open_seg);
    return 0;
}

static int
ex_clear(Executor *ex)
{
    Py_CLEAR(ex->model_ref);
    Py_CLEAR(ex->units);
    Py_CLEAR(ex->names);
    Py_CLEAR(ex->index_of);
    Py_CLEAR(ex->plan);
    Py_CLEAR(ex->profiler);
    Py_CLEAR(ex->on_profiled);
    Py_CLEAR(ex->pre_exc);
    Py_CLEAR(ex->handles);
    Py_CLEAR(ex->root_handles);
    Py_CLEAR(ex->stack);
    Py_CLEAR(ex->store);
    Py_CLEAR(ex->host);
    Py_CLEAR(ex->tile_verifier);
    Py_CLEAR(ex->amp_device);
    Py_CLEAR(ex->amp_dtype);
    Py_CLEAR(ex->amp_stack);
    Py_CLEAR(ex->open_seg);
    Py_CLEAR(ex->module);
    return 0;
}

static void
ex_dealloc(Executor *ex)
{
    PyTypeObject *tp = Py_TYPE(ex);
    PyObject_GC_UnTrack(ex);
    (void)ex_clear(ex);
    PyMem_Free(ex->masks);
    PyMem_Free(ex->tiles);
    PyMem_Free(ex->segments);
    PyMem_Free(ex->buffers);
    tp->tp_free((PyObject *)ex);
    Py_DECREF(tp);
}

static PyObject *
ex_get_plan(Executor *ex, void *Py_UNUSED(c))
{
    return Py_NewRef(ex->plan);
}

static PyObject *
ex_get_state(Executor *ex, void *Py_UNUSED(c))
{
    const char *s = !ex->attached               ? "detached"
                    : ex->profiler != Py_None   ? "profiling"
                    : ex->plan != Py_None       ? "applied"
                                                : "idle";
    return PyUnicode_FromString(s);
}

static PyObject *
ex_get_model(Executor *ex, void *Py_UNUSED(c))
{
    if (ex->model_ref == NULL) {
        Py_RETURN_NONE;
    }
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *m;
    if (PyWeakref_GetRef(ex->model_ref, &m) < 0) {
        return NULL;
    }
    return m != NULL ? m : Py_NewRef(Py_None);
#else
    return Py_NewRef(PyWeakref_GetObject(ex->model_ref));
#endif
}

static PyObject *
ex_get_stats(Executor *ex, void *Py_UNUSED(c))
{
    Py_ssize_t hooks = 0;
    if (ex->handles != NULL && ex->root_handles != NULL) {
        hooks = PyList_GET_SIZE(ex->handles) + PyList_GET_SIZE(ex->root_handles);
    }
    return Py_BuildValue("{slsLsLsLsdsisnsL}", "steps", ex->steps,
                         "checkpoint_frames", ex->frames, "recomputes",
                         ex->recomputes, "training_forwards", ex->forwards,
                         "recompute_seconds", (double)ex->recompute_ns / 1e9,
                         "active_frames", ex->active_frames, "hooks", hooks,
                         "tiled_calls", ex->tiled_calls);
}

static PyObject *
ex_get_names(Executor *ex, void *Py_UNUSED(c))
{
    return PyList_AsTuple(ex->names);
}

static PyMethodDef ex_methods[] = {
    {"apply", (PyCFunction)ex_apply, METH_O, ex_apply_doc},
    {"start_profiling", (PyCFunction)(void (*)(void))ex_start_profiling,
     METH_FASTCALL, ex_start_profiling_doc},
    {"detach", (PyCFunction)ex_detach, METH_NOARGS, ex_detach_doc},
    {"_abandon", (PyCFunction)ex_abandon, METH_NOARGS, ex_abandon_doc},
    {"pause", (PyCFunction)ex_pause, METH_NOARGS, ex_pause_doc},
    {"set_offload", (PyCFunction)(void (*)(void))ex_set_offload,
     METH_FASTCALL, ex_set_offload_doc},
    {"resume", (PyCFunction)ex_resume, METH_NOARGS, ex_resume_doc},
    {"tiled_forward", (PyCFunction)(void (*)(void))ex_tiled_forward,
     METH_FASTCALL, ex_tiled_forward_doc},
    {"set_tile_verifier", (PyCFunction)ex_set_tile_verifier, METH_O,
     ex_set_tile_verifier_doc},
    {"set_autocast", (PyCFunction)(void (*)(void))ex_set_autocast,
     METH_FASTCALL, ex_set_autocast_doc},
    {"_pre", (PyCFunction)(void (*)(void))ex_pre, METH_FASTCALL, NULL},
    {"_post", (PyCFunction)(void (*)(void))ex_post, METH_FASTCALL, NULL},
    {"_root_pre", (PyCFunction)(void (*)(void))ex_root_pre, METH_FASTCALL,
     NULL},
    {"_root_post", (PyCFunction)(void (*)(void))ex_root_post, METH_FASTCALL,
     NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ex_getset[] = {
    {"plan", (getter)ex_get_plan, NULL, "The applied Plan, or None.", NULL},
    {"state", (getter)ex_get_state, NULL,
     "'profiling', 'applied', 'idle' or 'detached'.", NULL},
    {"model", (getter)ex_get_model, NULL,
     "The wrapped model (weakly referenced), or None.", NULL},
    {"stats", (getter)ex_get_stats, NULL,
     "Counters (a new dict): steps (profiled warm-up passes),\n"
     "checkpoint_frames, recomputes, training_forwards, recompute_seconds,\n"
     "active_frames, hooks, tiled_calls.",
     NULL},
    {"layer_names", (getter)ex_get_names, NULL,
     "Names of the planning units.", NULL},
    {"autocast", (getter)ex_get_autocast, NULL,
     "(device_type, dtype) every forward runs under, or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ex_slots[] = {
    {Py_tp_doc,
     "Executor(model, units, *, warmup_steps=2)\n--\n\n"
     "Carries out a memscale plan on a model through hooks."},
    {Py_tp_new, ex_new},
    {Py_tp_dealloc, ex_dealloc},
    {Py_tp_traverse, ex_traverse},
    {Py_tp_clear, ex_clear},
    {Py_tp_methods, ex_methods},
    {Py_tp_getset, ex_getset},
    {0, NULL},
};

/* A base type: memscale.executor.Executor adds the Python-side state. */
static PyType_Spec ex_spec = {
    .name = "memscale._core.Executor",
    .basicsize = sizeof(Executor),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_BASETYPE,
    .slots = ex_slots,
};

int
ms_executor_init_types(PyObject *module, ms_state *st)
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
    st->tiled_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &tiled_spec, NULL);
    if (st->tiled_type == NULL) {
        return -1;
    }
    st->executor_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &ex_spec, NULL);
    if (st->executor_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->executor_type);
}
