/*
 * hooks.c: the module hooks of the planned units.
 *
 * Every call of a planned layer pushes one entry on the executor's stack
 * (a Frame, or the unit itself when nothing is done) in its forward
 * pre-hook, and its forward hook (always_call=True) pops one, so pre- and
 * post-hooks stay paired whatever raises in between.
 */
#include "executor_internal.h"

#include "engine.h"

/* Pop the newest stack entry; leave its saved-tensor hooks if a Frame. */
int
ms_ex_pop_entry(Executor *ex)
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

int
ms_ex_push_entry(Executor *ex, PyObject *entry)
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
    Frame *f = ms_frame_new(ex, i, unit, args, kwargs);
    if (f == NULL) {
        return NULL;
    }
    if ((ex->masks[i] & MS_TECH_TILING) && ex->tiles != NULL) {
        f->tile.n = ex->tiles[i]; /* carried out by the layer's _Tiled */
    }
    f->seg.id = ex->segments != NULL ? ex->segments[i] : (int)i;
    f->seg.next = i + 1;
    f->nest.on = (ex->masks[i] & MS_EX_NESTED) != 0;
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
    ex->rng_states++;
    return (PyObject *)f;
}

PyObject *
ms_ex_pre(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
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
        int cont = ms_segment_continue(ex, args[0], args[1], args[2]);
        if (cont > 0) {
            Py_RETURN_NONE;
        }
        if (cont < 0) {
            /* The paired forward hook pops one entry. */
            if (ms_ex_push_entry(ex, args[0]) < 0) {
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
    if (ms_ex_push_entry(ex, entry ? entry : args[0]) < 0) {
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

PyObject *
ms_ex_post(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
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
    if (ms_ex_pop_entry(ex) < 0) {
        Py_XDECREF(frame);
        return NULL;
    }
    int rc = 0;
    if (frame != NULL && ((Frame *)frame)->tile.end != NULL) {
        Frame *f = (Frame *)frame;
        if (PyList_GET_SIZE(f->shapes) != f->tile.end[f->tile.n - 1]) {
            PyErr_Format(
                PyExc_RuntimeError,
                "memscale: a hook around tiled layer %R saved tensors "
                "for backward outside the layer's tiles, which "
                "cannot be recomputed tile by tile. Remove the hook, "
                "or turn tiling off (enable_tiling=False, or a mode "
                "other than AGGRESSIVE)",
                ms_ex_unit_name(ex, f->index));
            Py_DECREF(frame);
            return NULL;
        }
    }
    if (frame != NULL) {
        Frame *f = (Frame *)frame;
        PyObject *x = ms_first_tensor(ex->st, args[2]);
        if (ex->segments != NULL && f->seg.next < ex->n && f->tile.end == NULL
            && ex->segments[f->seg.next] == f->seg.id && f->seg.id >= 0
            && x != NULL && ex->recompute_depth == 0)
        {
            /* The segment goes on with the next unit: keep the frame (its
               saved-tensor hooks are left, so whatever runs in between is
               not packed into it). */
            rc = ms_segment_wait(ex, f, x);
            Py_DECREF(frame);
            if (rc < 0) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
        if ((ex->masks != NULL && (ex->masks[f->index] & MS_TECH_OFFLOAD))
            && (HAS(ex->store) || HAS(ex->host)))
        {
            rc = ms_offload_inputs(ex, f);
        }
        Py_DECREF(frame);
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}
