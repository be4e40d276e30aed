/*
 * root.c: the root module's hooks, the lifecycle of a pass.
 *
 * The root's forward pre-hook (_root_pre) starts a training pass: it
 * cleans up what an interrupted forward left entered, counts the pass,
 * starts a new spill step and, while warming up, a profiled pass; last, it
 * enters the autocast the executor was given.  Its always-called forward
 * hook (_root_post) leaves that autocast, ends a segment still open,
 * flushes the spill writes in flight and ends the profiled pass; after the
 * last warm-up pass it plans from what was measured and applies the plan.
 */
#include "executor_internal.h"

#include "profiler.h"
#include "spill.h"

/* torch.autocast(device, dtype=dtype, enabled=enabled), not entered. */
PyObject *
ms_make_autocast(ms_state *st, PyObject *device, PyObject *dtype, int enabled)
{
    PyObject *kw = Py_BuildValue("{OOOO}", st->s_dtype, dtype, st->s_enabled,
                                 enabled ? Py_True : Py_False);
    if (kw == NULL) {
        return NULL;
    }
    PyObject *a = PyTuple_Pack(1, device);
    PyObject *ctx = a ? PyObject_Call(st->autocast, a, kw) : NULL;
    Py_XDECREF(a);
    Py_DECREF(kw);
    return ctx;
}

/* Leave whatever an interrupted forward (KeyboardInterrupt skips the
   always_call hooks) left on the stack. */
int
ms_ex_drop_stale(Executor *ex, int warn)
{
    Py_CLEAR(ex->open_seg); /* a forward that never reached its end */
    if (ex->stack == NULL || PyList_GET_SIZE(ex->stack) == 0) {
        return 0; /* (NULL: cleared by the garbage collector) */
    }
    /* Clean up first: a warning turned into an error must not leave the
       stale contexts entered (and fail every later forward). */
    int rc = 0;
    while (PyList_GET_SIZE(ex->stack) > 0) {
        if (ms_ex_pop_entry(ex) < 0) {
            rc = -1;
        }
    }
    ex->active_frames = 0;
    if (rc == 0 && warn
        && PyErr_WarnEx(PyExc_RuntimeWarning,
                        "memscale: a previous forward was interrupted inside "
                        "a checkpointed layer; its hooks were cleaned up",
                        1)
               < 0)
    {
        rc = -1;
    }
    return rc;
}

/* A clean-up step of ms_ex_abandon failed: keep the first error to raise,
   report a later one as unraisable, so that every step runs with no
   exception pending. */
static void
abandon_failed(ms_exc_state *first)
{
    if (ms_exc_pending(first)) {
        PyErr_WriteUnraisable(NULL);
    }
    else {
        ms_exc_save(first);
    }
}

/* The root forward is being left by an exception its always_call hooks
   did not see: leave what this executor entered, drop the half-built
   frames and the profiled pass.  Nothing to do while a layer is
   recomputed.  Every step runs even when one fails; the first error is
   the one raised. */
int
ms_ex_abandon(Executor *ex)
{
    if (ex->stack == NULL || ex->recompute_depth > 0) {
        return 0; /* cleared by the garbage collector, or in backward */
    }
    ms_exc_state first = {0};
    if (ms_ex_drop_stale(ex, 0) < 0) {
        abandon_failed(&first);
    }
    if (ms_amp_drop_stale(ex, 0) < 0) {
        abandon_failed(&first);
    }
    Py_CLEAR(ex->pre_exc);
    if (ex->root_in_pass) {
        ex->root_in_pass = 0;
        if (ex->profiler != NULL && ex->profiler != Py_None
            && ms_profiler_end_pass(ex->profiler, 0) < 0)
        {
            abandon_failed(&first);
        }
    }
    if (ms_exc_pending(&first)) {
        ms_exc_restore(&first);
        return -1;
    }
    return 0;
}

static PyObject *
root_pre_body(Executor *ex, PyObject *const *args)
{
    if (ex->recompute_depth == 0 && ms_ex_drop_stale(ex, 1) < 0) {
        return NULL;
    }
    if (ex->root_in_pass && ex->recompute_depth == 0) {
        /* The previous profiled forward was interrupted before its
           always_call hook (KeyboardInterrupt): drop that pass. */
        ex->root_in_pass = 0;
        if (ms_profiler_end_pass(ex->profiler, 0) < 0) {
            return NULL;
        }
        if (PyErr_WarnEx(PyExc_RuntimeWarning,
                         "memscale: a previous forward was interrupted while "
                         "being profiled; its measurements were dropped",
                         1)
            < 0)
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
        /* Evaluation passes are neither counted nor profiled. */
        Py_RETURN_NONE;
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
    if (ms_profiler_begin_pass(ex->profiler) < 0) {
        return NULL;
    }
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
        && ms_segment_finish(ex) < 0)
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
    if (ms_profiler_end_pass(ex->profiler, ok) < 0) {
        return NULL;
    }
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
    if (ms_profiler_detach(profiler) == 0) {
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
    int rc = ms_ex_apply_plan(ex, plan);
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
        ctx = ms_make_autocast(ex->st, ex->amp_device, ex->amp_dtype, 1);
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
int
ms_amp_drop_stale(Executor *ex, int warn)
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
                        1)
               < 0)
    {
        rc = -1;
    }
    return rc;
}

PyObject *
ms_ex_root_pre(Executor *ex, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_root_pre(module, args, kwargs)");
        return NULL;
    }
    /* A root forward starts outside any other: what is still entered is
       stale (the same assumption as ms_ex_drop_stale's). */
    if (ex->recompute_depth == 0
        && (ms_ex_drop_stale(ex, 1) < 0 || ms_amp_drop_stale(ex, 1) < 0))
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

PyObject *
ms_ex_root_post(Executor *ex, PyObject *const *Py_UNUSED(args),
                Py_ssize_t nargs)
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
