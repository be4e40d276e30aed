/*
 * segment.c: checkpoint segments.
 *
 * A plan may checkpoint a run of consecutive units as one segment: only the
 * first unit's inputs are kept, and the recompute in backward replays the
 * units in turn, each on the previous one's output.  The first unit opens
 * the frame (hooks.c); at its end the frame waits as the executor's open
 * segment, and the next unit joins it if it takes that output, unchanged,
 * as its input.  Anything else ends the segment.
 */
#include "executor_internal.h"

#include "engine.h"
#include "versions.h"

/* The first tensor of a unit's output (borrowed), or NULL. */
PyObject *
ms_first_tensor(ms_state *st, PyObject *out)
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

/* Put the generators where the unit of record `rec` started, if it
   recorded that: a state is recorded only where the unit did not start
   from the one the previous unit ended with; else the previous unit's
   recompute has just left the generator there.  0, or -1 with an error. */
int
ms_segment_unit_rng(ms_state *st, PyObject *rec)
{
    PyObject *r = PyTuple_GET_ITEM(rec, 4) != Py_None
                      ? PyObject_CallOneArg(st->set_rng_state,
                                            PyTuple_GET_ITEM(rec, 4))
                      : Py_NewRef(Py_None);
    if (r != NULL && PyTuple_GET_ITEM(rec, 5) != Py_None) {
        Py_SETREF(r, PyObject_CallOneArg(st->cuda_set_rng_state_all,
                                         PyTuple_GET_ITEM(rec, 5)));
    }
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* Recompute a segment's later units, each on the previous one's output,
   under the RNG state it ran with; steals `out` (the first unit's output)
   and returns the last output, or NULL (the stop exception included). */
PyObject *
ms_segment_replay(Frame *self, PyObject *out)
{
    ms_state *st = self->ex->st;
    for (Py_ssize_t u = 0; u < PyList_GET_SIZE(self->seg.units); u++) {
        PyObject *rec = PyList_GET_ITEM(self->seg.units, u);
        PyObject *unit = PyTuple_GET_ITEM(rec, 0);
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(rec, 1));
        PyObject *args = PyTuple_GET_ITEM(rec, 2);
        PyObject *kwargs = PyTuple_GET_ITEM(rec, 3);
        PyObject *x = ms_first_tensor(st, out);
        if (x == NULL || pos < 0 || pos >= PyTuple_GET_SIZE(args)) {
            PyErr_Format(PyExc_RuntimeError,
                         "memscale: internal error: cannot chain the "
                         "recompute of checkpoint segment %R",
                         ms_ex_unit_name(self->ex, self->index));
            Py_DECREF(out);
            return NULL;
        }
        PyObject *call = PyTuple_New(PyTuple_GET_SIZE(args));
        if (call == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(args); k++) {
            PyTuple_SET_ITEM(call, k,
                             Py_NewRef(k == pos ? x
                                                : PyTuple_GET_ITEM(args, k)));
        }
        Py_DECREF(out);
        if (ms_segment_unit_rng(st, rec) < 0) {
            Py_DECREF(call);
            return NULL;
        }
        out = PyObject_Call(unit, call, kwargs);
        Py_DECREF(call);
        if (out == NULL) {
            return NULL;
        }
    }
    return out;
}

/* The bytes of RNG state `t` where they can be read in place: a plain
   contiguous CPU tensor (torch.get_rng_state and torch.cuda.get_rng_state
   make one) gives its data and size, 1.  Any other, 0 (torch.equal
   compares it).  -1 with an error. */
static int
state_bytes(ms_state *st, PyObject *t, const void **data, Py_ssize_t *size)
{
    if (!Py_IS_TYPE(t, (PyTypeObject *)st->tensor_type)) {
        return 0;
    }
    int ok = ms_is_on_cpu(st, t);
    if (ok > 0) {
        PyObject *c = PyObject_CallMethodNoArgs(t, st->s_is_contiguous);
        ok = c != NULL ? PyObject_IsTrue(c) : -1;
        Py_XDECREF(c);
    }
    if (ok <= 0) {
        return ok;
    }
    PyObject *n = PyObject_GetAttr(t, st->s_nbytes);
    Py_ssize_t bytes = n != NULL ? PyLong_AsSsize_t(n) : -1;
    Py_XDECREF(n);
    if (bytes <= 0) {
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *p = PyObject_CallMethodNoArgs(t, st->s_data_ptr);
    void *ptr = p != NULL ? PyLong_AsVoidPtr(p) : NULL;
    Py_XDECREF(p);
    if (ptr == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    *data = ptr;
    *size = bytes;
    return 1;
}

/* Whether two RNG states are the same bytes: 1, 0, or -1 with an error.
   Their bytes are compared in place where both can be read so (no
   operator dispatched: under a fake-tensor mode torch.equal would first
   make a fake twin of each, about 0.85 ms a call); else torch.equal. */
static int
rng_equal(ms_state *st, PyObject *a, PyObject *b)
{
    const void *da = NULL, *db = NULL;
    Py_ssize_t na = 0, nb = 0;
    int ra = state_bytes(st, a, &da, &na);
    int rb = ra > 0 ? state_bytes(st, b, &db, &nb) : 0;
    if (ra < 0 || rb < 0) {
        return -1;
    }
    if (ra > 0 && rb > 0) {
        return na == nb && memcmp(da, db, (size_t)na) == 0;
    }
    PyObject *eq = PyObject_CallMethodObjArgs(st->torch, st->s_equal, a, b,
                                              NULL);
    int same = eq != NULL ? PyObject_IsTrue(eq) : -1;
    Py_XDECREF(eq);
    return same;
}

/* The same for two lists of CUDA RNG states, one per device (the CUDA
   path: unverified on this project's CPU-only machines). */
static int
rng_equal_all(ms_state *st, PyObject *a, PyObject *b)
{
    PyObject *x = PySequence_Fast(a, "CUDA RNG states must be a sequence");
    PyObject *y = x ? PySequence_Fast(b, "CUDA RNG states must be a sequence")
                    : NULL;
    int same = y != NULL
                   ? PySequence_Fast_GET_SIZE(x) == PySequence_Fast_GET_SIZE(y)
                   : -1;
    for (Py_ssize_t k = 0; same > 0 && k < PySequence_Fast_GET_SIZE(x); k++) {
        same = rng_equal(st, PySequence_Fast_GET_ITEM(x, k),
                         PySequence_Fast_GET_ITEM(y, k));
    }
    Py_XDECREF(x);
    Py_XDECREF(y);
    return same;
}

/* Frame f's unit returned `x` and the segment goes on with the next unit:
   f waits as the open segment (a new reference), with x, its version and
   the RNG state the unit ended with, which the next unit's is compared
   with when it joins.  0, or -1 with an error (f not kept then). */
int
ms_segment_wait(Executor *ex, Frame *f, PyObject *x)
{
    ms_state *st = ex->st;
    if (ms_segment_finish(ex) < 0) {
        return -1;
    }
    PyObject *v = PyObject_GetAttr(x, st->s_version);
    PyObject *end = v ? PyObject_CallNoArgs(st->get_rng_state) : NULL;
    PyObject *end_cuda = (end != NULL && f->rng_cuda != NULL)
                             ? PyObject_CallNoArgs(st->cuda_get_rng_state_all)
                             : NULL;
    if (end == NULL || (f->rng_cuda != NULL && end_cuda == NULL)) {
        Py_XDECREF(v);
        Py_XDECREF(end);
        return -1;
    }
    Py_XSETREF(f->seg.out_version, v);
    Py_XSETREF(f->seg.out, Py_NewRef(x));
    Py_XSETREF(f->seg.end_rng, end);
    Py_XSETREF(f->seg.end_rng_cuda, end_cuda);
    ex->open_seg = Py_NewRef(f);
    return 0;
}

/* The RNG states unit `u` of segment f starts with, for its record: None
   where the generator is where the previous unit left it (*cpu, *cuda:
   new references).  0, or -1 with an error. */
static int
joining_rng(ms_state *st, Frame *f, PyObject **cpu, PyObject **cuda)
{
    *cpu = PyObject_CallNoArgs(st->get_rng_state);
    *cuda = NULL;
    int same = *cpu == NULL             ? -1
               : f->seg.end_rng != NULL ? rng_equal(st, *cpu, f->seg.end_rng)
                                        : 0;
    if (same > 0) {
        Py_SETREF(*cpu, Py_NewRef(Py_None));
    }
    if (same >= 0 && f->rng_cuda != NULL) {
        /* CUDA path: unverified on this project's CPU-only machines. */
        *cuda = PyObject_CallNoArgs(st->cuda_get_rng_state_all);
        same = *cuda == NULL ? -1
               : f->seg.end_rng_cuda != NULL
                   ? rng_equal_all(st, *cuda, f->seg.end_rng_cuda)
                   : 0;
        if (same > 0) {
            Py_SETREF(*cuda, Py_NewRef(Py_None));
        }
    }
    if (same < 0) {
        Py_CLEAR(*cpu);
        Py_CLEAR(*cuda);
        return -1;
    }
    if (*cuda == NULL) {
        *cuda = Py_NewRef(Py_None);
    }
    return 0;
}

/* The segment waiting for its next unit is done: its stored inputs may
   go to their offload tier now. */
int
ms_segment_finish(Executor *ex)
{
    Frame *f = (Frame *)ex->open_seg;
    ex->open_seg = NULL;
    if (f == NULL) {
        return 0;
    }
    Py_CLEAR(f->seg.out);
    Py_CLEAR(f->seg.out_version);
    Py_CLEAR(f->seg.end_rng);
    Py_CLEAR(f->seg.end_rng_cuda);
    int rc = 0;
    if (ex->masks != NULL && (ex->masks[f->index] & MS_TECH_OFFLOAD)
        && (HAS(ex->store) || HAS(ex->host)))
    {
        rc = ms_offload_inputs(ex, f);
    }
    Py_DECREF(f);
    return rc;
}

/* Whether autocast on `device` is as the segment's first unit ran it
   (enabled, and with the same dtype): 1 or 0; -1 on error. */
static int
autocast_same(ms_state *st, PyObject *device, int enabled, PyObject *dtype)
{
    PyObject *flag = PyObject_CallOneArg(st->is_autocast_enabled, device);
    int now = flag != NULL ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    if (now <= 0 || !enabled) {
        return now < 0 ? -1 : now == enabled;
    }
    PyObject *d = PyObject_CallOneArg(st->get_autocast_dtype, device);
    if (d == NULL) {
        return -1;
    }
    int eq = PyObject_RichCompareBool(d, dtype, Py_EQ);
    Py_DECREF(d);
    return eq;
}

/* Whether `unit` runs now as the replay will run it: grad enabled and
   training (as a frame opens), and under the autocast state the segment's
   first unit recorded, which the replay enters for every unit (1 or 0;
   -1 on error).  A unit run under torch.no_grad() or another autocast
   state inside the chain would be replayed differently: its saved tensors
   would not line up with the forward's. */
static int
same_mode(ms_state *st, Frame *f, PyObject *unit)
{
    int ok = ms_grad_enabled(st);
    if (ok <= 0) {
        return ok;
    }
    PyObject *training = PyObject_GetAttr(unit, st->s_training);
    ok = training != NULL ? PyObject_IsTrue(training) : -1;
    Py_XDECREF(training);
    if (ok <= 0) {
        return ok;
    }
    ok = autocast_same(st, st->s_cpu, f->cpu_autocast, f->cpu_dtype);
    if (ok <= 0 || f->cuda_dtype == NULL) {
        return ok; /* CUDA not initialized at the first unit: not replayed */
    }
    return autocast_same(st, st->s_cuda, f->cuda_autocast, f->cuda_dtype);
}

/* Unit `unit` starts: if it is the next unit of the open segment and takes
   the previous unit's output, the segment's frame takes it in (1: pushed);
   else the segment is finished (0). */
int
ms_segment_continue(Executor *ex, PyObject *unit, PyObject *args,
                    PyObject *kwargs)
{
    ms_state *st = ex->st;
    Frame *f = (Frame *)ex->open_seg;
    if (ex->recompute_depth > 0 || ex->paused > 0 || ex->active_frames > 0) {
        return 0; /* not a unit of this forward's chain */
    }
    PyObject *idx = PyDict_GetItemWithError(ex->index_of, unit);
    if (idx == NULL) {
        return PyErr_Occurred() ? -1 : ms_segment_finish(ex);
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
    if (k == f->seg.next && ex->segments != NULL
        && ex->segments[k] == f->seg.id && pos >= 0
        && PyTuple_GET_ITEM(args, pos) == f->seg.out)
    {
        /* The same tensor, not changed in place since (x.add_(...) between
           the units would be lost on replay). */
        PyObject *v = PyObject_GetAttr(f->seg.out, st->s_version);
        same = v ? PyObject_RichCompareBool(v, f->seg.out_version, Py_EQ) : -1;
        Py_XDECREF(v);
        if (same > 0) {
            same = same_mode(st, f, unit);
        }
        if (same < 0) {
            return -1;
        }
    }
    if (!same) {
        /* Something else runs between the two units (or the chain is not
           output-to-input, or the unit runs in another grad or autocast
           mode): the segment ends here. */
        return ms_segment_finish(ex) < 0 ? -1 : 0;
    }
    PyObject *held = PyTuple_New(PyTuple_GET_SIZE(args));
    PyObject *kw = (kwargs != NULL && kwargs != Py_None) ? PyDict_Copy(kwargs)
                                                         : PyDict_New();
    PyObject *rng = NULL, *rng_cuda = NULL, *rec = NULL, *pack = NULL;
    PyObject *unpack = NULL, *ctx = NULL, *where = PyLong_FromSsize_t(pos);
    PyObject *start = NULL;
    int rc = -1;
    if (held == NULL || kw == NULL || where == NULL) {
        goto done;
    }
    for (Py_ssize_t a = 0; a < PyTuple_GET_SIZE(args); a++) {
        PyTuple_SET_ITEM(held, a,
                         Py_NewRef(a == pos ? Py_None
                                            : PyTuple_GET_ITEM(args, a)));
    }
    if (joining_rng(st, f, &rng, &rng_cuda) < 0) {
        goto done;
    }
    rec = PyTuple_Pack(6, unit, where, held, kw, rng, rng_cuda);
    if (rec == NULL) {
        goto done;
    }
    if (f->seg.units == NULL && (f->seg.units = PyList_New(0)) == NULL) {
        goto done;
    }
    if (f->nest.on && f->nest.starts == NULL
        && (f->nest.starts = PyList_New(0)) == NULL)
    {
        goto done;
    }
    start = f->nest.on ? PyLong_FromSsize_t(PyList_GET_SIZE(f->shapes)) : NULL;
    if (f->nest.on && start == NULL) {
        goto done;
    }
    Py_ssize_t nv = PyList_GET_SIZE(f->versions);
    if (ms_collect_versions(st, held, f->versions) < 0
        || ms_collect_versions(st, kw, f->versions) < 0
        || PyList_Append(f->seg.units, rec) < 0)
    {
        /* Leave the frame as it was. */
        (void)PyList_SetSlice(f->versions, nv, PyList_GET_SIZE(f->versions),
                              NULL);
        goto done;
    }
    if (start != NULL && PyList_Append(f->nest.starts, start) < 0) {
        Py_ssize_t n = PyList_GET_SIZE(f->seg.units);
        (void)PyList_SetSlice(f->seg.units, n - 1, n, NULL);
        (void)PyList_SetSlice(f->versions, nv, PyList_GET_SIZE(f->versions),
                              NULL);
        goto done;
    }
    pack = PyObject_GetAttr((PyObject *)f, st->s_pack);
    unpack = PyObject_GetAttr((PyObject *)f, st->s_unpack);
    ctx = (pack && unpack)
              ? PyObject_CallFunctionObjArgs(st->saved_tensors_hooks, pack,
                                             unpack, NULL)
              : NULL;
    if (ctx == NULL || ms_call_enter(st, ctx) < 0) {
        Py_ssize_t n = PyList_GET_SIZE(f->seg.units);
        (void)PyList_SetSlice(f->seg.units, n - 1, n, NULL);
        if (start != NULL) {
            n = PyList_GET_SIZE(f->nest.starts);
            (void)PyList_SetSlice(f->nest.starts, n - 1, n, NULL);
        }
        (void)PyList_SetSlice(f->versions, nv, PyList_GET_SIZE(f->versions),
                              NULL);
        goto done;
    }
    if (ms_ex_push_entry(ex, (PyObject *)f) < 0) {
        (void)ms_call_exit(st, ctx);
        goto done;
    }
    f->ctx = Py_NewRef(ctx);
    f->cur_unit = unit;
    f->seg.next = k + 1;
    if (rng != Py_None) {
        ex->rng_states++;
    }
    Py_CLEAR(f->seg.out);
    Py_CLEAR(f->seg.out_version);
    Py_CLEAR(f->seg.end_rng);
    Py_CLEAR(f->seg.end_rng_cuda);
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
    Py_XDECREF(start);
    if (rc < 0) {
        /* Keep going without the segment rather than half in it. */
        ms_exc_state saved;
        ms_exc_save(&saved);
        if (ms_segment_finish(ex) < 0) {
            PyErr_WriteUnraisable((PyObject *)ex);
        }
        ms_exc_restore(&saved);
    }
    return rc;
}
