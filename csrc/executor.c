/*
 * executor.c: the Executor type, its methods and its lifecycle.
 *
 * An Executor applies a plan to a model through module hooks and
 * saved-tensor hooks: new() registers the root module's hooks (root.c),
 * apply() the hooks of the planned units (hooks.c), detach() removes them
 * all.  The work is done by the files listed in executor_internal.h.
 */
#include "executor_internal.h"

#include "hook_handles.h"
#include "plan.h"
#include "profiler.h"

/* ---- Executor: what the other files ask ---------------------------- */

PyObject *
ms_ex_unit_name(Executor *ex, Py_ssize_t index)
{
    if (ex->names != NULL && index >= 0 && index < PyList_GET_SIZE(ex->names))
    {
        return PyList_GET_ITEM(ex->names, index);
    }
    return Py_None;
}

/* ---- Executor: the features' settings ------------------------------ */

/* clang-format off */
PyDoc_STRVAR(ex_tiled_forward_doc,
"tiled_forward($self, index, forward, /)\n--\n\n"
"A callable to install as unit *index*'s forward: it runs *forward* in\n"
"tiles when the plan tiles the layer, and unchanged otherwise.");
/* clang-format on */

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
    return ms_tiled_new(ex, PyList_GET_ITEM(ex->units, i), args[1]);
}

/* clang-format off */
PyDoc_STRVAR(ex_set_tile_verifier_doc,
"set_tile_verifier($self, verifier, /)\n--\n\n"
"verifier(unit, forward, args, kwargs, tiles) -> dim or None is called at\n"
"a tiled layer's first tiled forward: the dimension to tile along, or\n"
"None to run the layer untiled (checkpointed whole).");
/* clang-format on */

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

/* clang-format off */
PyDoc_STRVAR(ex_set_autocast_doc,
"set_autocast($self, device_type, dtype, /)\n--\n\n"
"Run every forward of the model under torch.autocast(device_type, dtype);\n"
"set_autocast(None, None) stops it.");
/* clang-format on */

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
        PyObject *probe = ms_make_autocast(ex->st, args[0], args[1], 1);
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

int
ms_ex_apply_plan(Executor *ex, PyObject *plan)
{
    ms_state *st = ex->st;
    PyObject *chosen = NULL;
    unsigned *masks = NULL;
    int *tiles = NULL, *segments = NULL;
    int rc = -1;

    if (!PyObject_TypeCheck(plan, st->plan_type)) {
        PyErr_Format(PyExc_TypeError, "apply() needs a Plan, got %.200s",
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
        int nested = 0;
        if (ms_plan_layer(plan, i, &masks[i], &tiles[i], &segments[i], &nested)
            < 0)
        {
            goto done;
        }
        if (nested && masks[i] != 0) {
            masks[i] |= MS_EX_NESTED;
        }
        if (segments[i] < -1 || segments[i] > i) {
            PyErr_Format(PyExc_ValueError, "plan layer %zd has segment %d", i,
                         segments[i]);
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
    Py_XSETREF(ex->plan, Py_NewRef(Py_None)); /* its hooks are gone */
    if (ms_register_unit_hooks(st, (PyObject *)ex, chosen, ex->handles,
                               st->s_pre, st->s_post)
        < 0)
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
    return rc;
}

/* clang-format off */
PyDoc_STRVAR(ex_apply_doc,
"apply($self, plan, /)\n--\n\n"
"Attach the hooks that carry out *plan* (replacing a previous plan's).");
/* clang-format on */

static PyObject *
ex_apply(Executor *ex, PyObject *plan)
{
    if (ms_ex_apply_plan(ex, plan) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(ex_start_profiling_doc,
"start_profiling($self, profiler, on_profiled, /)\n--\n\n"
"Measure the next warmup_steps training forwards with *profiler*, then\n"
"call on_profiled(profiler) for a Plan and apply it.");
/* clang-format on */

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

/* clang-format off */
PyDoc_STRVAR(ex_set_offload_doc,
"set_offload($self, store, host, /)\n--\n\n"
"Where offloaded layers send their inputs: *store*, a SpillStore (the disk\n"
"tier, for CPU tensors), and *host*, an object whose put(tensor) returns a\n"
"record with get() or None (the host tier, for device tensors); either may\n"
"be None.");
/* clang-format on */

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

/* clang-format off */
PyDoc_STRVAR(ex_pause_doc,
"pause($self, /)\n--\n\n"
"Make every hook of this executor do nothing until resume() (nestable):\n"
"forwards run as without memscale and are not counted.  Not allowed\n"
"inside a checkpointed layer's forward or a profiled pass.");
/* clang-format on */

static PyObject *
ex_pause(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ex->root_in_pass || (ex->stack && PyList_GET_SIZE(ex->stack) > 0)) {
        PyErr_SetString(
            PyExc_RuntimeError,
            "memscale: cannot pause the executor inside a forward");
        return NULL;
    }
    ex->paused++;
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(ex_resume_doc,
"resume($self, /)\n--\n\n"
"Undo one pause().");
/* clang-format on */

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

/* clang-format off */
PyDoc_STRVAR(ex_abandon_doc,
"_abandon($self, /)\n--\n\n"
"The root forward is being left by an exception its always_call hooks\n"
"did not see (KeyboardInterrupt, any BaseException): leave every\n"
"saved-tensor hook and autocast this executor entered, drop the\n"
"half-built frames and the profiled pass.  Idempotent; nothing to do\n"
"while a layer is recomputed.");
/* clang-format on */

static PyObject *
ex_abandon(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ms_ex_abandon(ex) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(ex_detach_doc,
"detach($self, /)\n--\n\n"
"Remove every hook this executor attached and drop its references to the\n"
"model.  Idempotent.");
/* clang-format on */

static PyObject *
ex_detach(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    if (ex->handles == NULL || ex->root_handles == NULL || ex->units == NULL) {
        Py_RETURN_NONE; /* cleared by the garbage collector: nothing left */
    }
    int rc = 0;
    if (ms_ex_drop_stale(ex, 0) < 0) {
        rc = -1;
    }
    if (ex->profiler != NULL && ex->profiler != Py_None) {
        if (ms_profiler_detach(ex->profiler) < 0) {
            rc = -1;
        }
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
    if (ms_amp_drop_stale(ex, 0) < 0) {
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
        || ex->names == NULL || ex->index_of == NULL || ex->handles == NULL
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
        PyObject *root = PyList_New(1);
        int rc = -1;
        if (root != NULL) {
            PyList_SET_ITEM(root, 0, Py_NewRef(model));
            rc = ms_register_unit_hooks(st, (PyObject *)ex, root,
                                        ex->root_handles, st->s_root_pre,
                                        st->s_root_post);
        }
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
    const char *s = !ex->attached             ? "detached"
                    : ex->profiler != Py_None ? "profiling"
                    : ex->plan != Py_None     ? "applied"
                                              : "idle";
    return PyUnicode_FromString(s);
}

static PyObject *
ex_get_model(Executor *ex, void *Py_UNUSED(c))
{
    if (ex->model_ref == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *m;
    if (ms_weakref_get(ex->model_ref, &m) < 0) {
        return NULL;
    }
    return m != NULL ? m : Py_NewRef(Py_None);
}

static PyObject *
ex_get_stats(Executor *ex, void *Py_UNUSED(c))
{
    Py_ssize_t hooks = 0;
    if (ex->handles != NULL && ex->root_handles != NULL) {
        hooks = PyList_GET_SIZE(ex->handles)
                + PyList_GET_SIZE(ex->root_handles);
    }
    return Py_BuildValue("{slsLsLsLsLsdsisnsL}", "steps", ex->steps,
                         "checkpoint_frames", ex->frames, "rng_states",
                         ex->rng_states, "recomputes", ex->recomputes,
                         "training_forwards", ex->forwards,
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
    {"set_offload", (PyCFunction)(void (*)(void))ex_set_offload, METH_FASTCALL,
     ex_set_offload_doc},
    {"resume", (PyCFunction)ex_resume, METH_NOARGS, ex_resume_doc},
    {"tiled_forward", (PyCFunction)(void (*)(void))ex_tiled_forward,
     METH_FASTCALL, ex_tiled_forward_doc},
    {"set_tile_verifier", (PyCFunction)ex_set_tile_verifier, METH_O,
     ex_set_tile_verifier_doc},
    {"set_autocast", (PyCFunction)(void (*)(void))ex_set_autocast,
     METH_FASTCALL, ex_set_autocast_doc},
    {"_pre", (PyCFunction)(void (*)(void))ms_ex_pre, METH_FASTCALL, NULL},
    {"_post", (PyCFunction)(void (*)(void))ms_ex_post, METH_FASTCALL, NULL},
    {"_root_pre", (PyCFunction)(void (*)(void))ms_ex_root_pre, METH_FASTCALL,
     NULL},
    {"_root_post", (PyCFunction)(void (*)(void))ms_ex_root_post, METH_FASTCALL,
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
     "checkpoint_frames, rng_states (CPU RNG states the checkpoints\n"
     "recorded: one per frame, and one per unit that joined a segment\n"
     "after the generator moved), recomputes, training_forwards,\n"
     "recompute_seconds, active_frames, hooks, tiled_calls.",
     NULL},
    {"layer_names", (getter)ex_get_names, NULL, "Names of the planning units.",
     NULL},
    {"autocast", (getter)ex_get_autocast, NULL,
     "(device_type, dtype) every forward runs under, or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ex_slots[] = {
    {Py_tp_doc, "Executor(model, units, *, warmup_steps=2)\n--\n\n"
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
    if (ms_frame_init_types(module, st) < 0
        || ms_tiled_init_types(module, st) < 0)
    {
        return -1;
    }
    st->executor_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &ex_spec, NULL);
    if (st->executor_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->executor_type);
}
