/*
 * profiler.c: per-layer measurements, the Profiler type.
 *
 * A Profiler watches forward passes through module hooks and one
 * saved-tensor hook.  Every tensor autograd saves is attributed to the
 * innermost planning unit running at that moment; memory is counted by
 * storage (views share one), once per unit call, and never for parameters
 * or buffers.  Forward cost is taken from a FLOP counter, which is exact and
 * repeatable where timings are not.  The same code measures a real pass, a
 * pass on fake tensors (static profiling) and the user's first steps.
 */
#include "profiler.h"

#include "engine.h"
#include "hook_handles.h"
#include "versions.h"

#include <string.h>

typedef struct {
    long long saved;  /* bytes saved for backward, per call, summed */
    long long input;  /* input bytes (non-parameter storages) */
    long long output; /* output bytes */
    double flops;
    long calls;
    unsigned flags;
} unit_stats;

typedef struct {
    PyObject_HEAD
    PyObject *module; /* memscale._core: keeps the state alive */
    ms_state *st;
    PyObject *units;      /* list of modules */
    PyObject *index_of;   /* {module: index} (modules hash by identity) */
    PyObject *param_keys; /* set of storage keys to ignore */
    PyObject *flop_counter;
    PyObject *handles;   /* list of RemovableHandle */
    PyObject *ctx;       /* saved_tensors_hooks during a pass */
    PyObject *seen;      /* storage keys counted in this pass */
    PyObject *stack;     /* list of active unit records */
    PyObject *held;      /* storage weak references held for the pass */
    PyObject *free_weak; /* UntypedStorage._free_weak_ref, or NULL */
    Py_ssize_t n;
    unit_stats *cur;
    unit_stats *best;
    long long *param_bytes;
    long long total_cur;
    long long total_best;
    double flops_cur;
    double flops_best;
    long passes;
    int in_pass;
} Profiler;

/* ---- storage accounting ------------------------------------------- */

/* After a failure to read a tensor's storage: whether it is one a tensor
   without a storage raises (sparse, some subclasses), then cleared, so
   that the user's forward does not fail for what is only counting. */
static int
storage_less(void)
{
    if (PyErr_ExceptionMatches(PyExc_RuntimeError)
        || PyErr_ExceptionMatches(PyExc_NotImplementedError)
        || PyErr_ExceptionMatches(PyExc_AttributeError)
        || PyErr_ExceptionMatches(PyExc_TypeError))
    {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* Add tensor's storage to `keys` unless seen or a parameter; return the
   bytes added (0 if none) or -1 with an exception set. */
static long long
add_storage(Profiler *self, PyObject *tensor, PyObject *keys)
{
    PyObject *key;
    long long nbytes;
    if (ms_storage_key_and_size(self->st, tensor, &key, &nbytes) < 0) {
        /* Tensors without a storage (sparse, some subclasses): count
           nothing rather than fail the user's forward. */
        return storage_less() ? 0 : -1;
    }
    int r = PySet_Contains(self->param_keys, key);
    if (r == 0) {
        r = PySet_Contains(keys, key);
        if (r == 0) {
            r = PySet_Add(keys, key) < 0 ? -1 : 0;
            Py_DECREF(key);
            return r < 0 ? -1 : nbytes;
        }
    }
    Py_DECREF(key);
    return r < 0 ? -1 : 0;
}

/* Sum the storages of tensors in obj (a tensor, or a tuple/list/dict of
   them, one level deep is enough for module inputs and outputs). */
static long long
tensor_bytes(Profiler *self, PyObject *obj, PyObject *keys, int depth)
{
    ms_state *st = self->st;
    if (ms_is_tensor(st, obj)) {
        return add_storage(self, obj, keys);
    }
    if (depth > 2) {
        return 0;
    }
    long long total = 0;
    if (PyTuple_Check(obj) || PyList_Check(obj)) {
        /* Re-read the size and own the item: tensor methods may run Python
           code (subclasses) that changes a list. */
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(obj); i++) {
            PyObject *item = Py_NewRef(PySequence_Fast_ITEMS(obj)[i]);
            long long b = tensor_bytes(self, item, keys, depth + 1);
            Py_DECREF(item);
            if (b < 0) {
                return -1;
            }
            total += b;
        }
    }
    else if (PyDict_Check(obj)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(obj, &pos, &k, &v)) {
            Py_INCREF(v);
            long long b = tensor_bytes(self, v, keys, depth + 1);
            Py_DECREF(v);
            if (b < 0) {
                return -1;
            }
            total += b;
        }
    }
    else if (depth == 0) {
        /* Model outputs such as Hugging Face ModelOutput: a mapping. */
        PyObject *vals = NULL;
        if (PyMapping_Check(obj) && !PyUnicode_Check(obj)) {
            vals = PyMapping_Values(obj);
            if (vals == NULL) {
                PyErr_Clear();
                return 0;
            }
            total = tensor_bytes(self, vals, keys, depth + 1);
            Py_DECREF(vals);
        }
    }
    return total;
}

static int
current_flops(Profiler *self, double *out)
{
    *out = 0.0;
    if (self->flop_counter == Py_None) {
        return 0;
    }
    PyObject *v = PyObject_CallMethodNoArgs(self->flop_counter,
                                            self->st->s_get_total_flops);
    if (v == NULL) {
        return -1;
    }
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* ---- hooks -------------------------------------------------------- */

/* Active unit record: (index, seen-set, flops-at-start, versions). */

static Py_ssize_t
unit_index(Profiler *self, PyObject *module)
{
    PyObject *idx = PyDict_GetItemWithError(self->index_of, module);
    if (idx == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError,
                            "memscale profiler: hook called for a module "
                            "it does not watch");
        }
        return -1;
    }
    return PyLong_AsSsize_t(idx);
}

static PyObject *
prof_pre(Profiler *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seen = NULL, *versions = NULL, *rec = NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_pre(module, args, kwargs)");
        return NULL;
    }
    if (!self->in_pass) {
        Py_RETURN_NONE;
    }
    Py_ssize_t i = unit_index(self, args[0]);
    if (i < 0) {
        return NULL;
    }
    double flops0;
    long long in_bytes;
    seen = PySet_New(NULL);
    versions = PyList_New(0);
    if (seen == NULL || versions == NULL || current_flops(self, &flops0) < 0
        || ms_collect_versions(self->st, args[1], versions) < 0
        || ms_collect_versions(self->st, args[2], versions) < 0)
    {
        goto error;
    }
    /* Inputs are counted into the call's seen-set: a unit that saves its
       input (most do) saves nothing checkpointing would free there. */
    PyObject *in_keys = PySet_New(NULL);
    if (in_keys == NULL) {
        goto error;
    }
    long long a = tensor_bytes(self, args[1], in_keys, 0);
    long long b = a < 0 ? -1 : tensor_bytes(self, args[2], in_keys, 0);
    Py_DECREF(in_keys);
    if (a < 0 || b < 0) {
        goto error;
    }
    in_bytes = a + b;
    self->cur[i].input += in_bytes;
    self->cur[i].calls += 1;
    rec = Py_BuildValue("(nOdO)", i, seen, flops0, versions);
    if (rec == NULL || PyList_Append(self->stack, rec) < 0) {
        goto error;
    }
    Py_DECREF(rec);
    Py_DECREF(seen);
    Py_DECREF(versions);
    Py_RETURN_NONE;
error:
    Py_XDECREF(rec);
    Py_XDECREF(seen);
    Py_XDECREF(versions);
    return NULL;
}

static PyObject *
prof_post(Profiler *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_post(module, args, output)");
        return NULL;
    }
    Py_ssize_t depth = PyList_GET_SIZE(self->stack);
    if (!self->in_pass || depth == 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t i = unit_index(self, args[0]);
    if (i < 0) {
        return NULL;
    }
    PyObject *rec = PyList_GET_ITEM(self->stack, depth - 1);
    if (PyLong_AsSsize_t(PyTuple_GET_ITEM(rec, 0)) != i) {
        Py_RETURN_NONE; /* not ours: its pre-hook did not run */
    }
    Py_INCREF(rec);
    if (PyList_SetSlice(self->stack, depth - 1, depth, NULL) < 0) {
        Py_DECREF(rec);
        return NULL;
    }
    double flops1;
    int same = ms_versions_unchanged(self->st, PyTuple_GET_ITEM(rec, 3));
    if (same < 0 || current_flops(self, &flops1) < 0) {
        Py_DECREF(rec);
        return NULL;
    }
    if (!same) {
        self->cur[i].flags |= MS_LAYER_INPLACE_INPUT;
    }
    self->cur[i].flops += flops1 - PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(rec, 2));
    Py_DECREF(rec);
    if (args[2] != Py_None) {
        PyObject *keys = PySet_New(NULL);
        if (keys == NULL) {
            return NULL;
        }
        long long out = tensor_bytes(self, args[2], keys, 0);
        Py_DECREF(keys);
        if (out < 0) {
            return NULL;
        }
        self->cur[i].output += out;
    }
    Py_RETURN_NONE;
}

/* Count a tensor autograd saves: into the pass's total and the innermost
   running unit's saved bytes.  0, or -1 with an exception set. */
static int
count_saved(Profiler *self, PyObject *tensor)
{
    long long added = add_storage(self, tensor, self->seen);
    if (added < 0) {
        return -1;
    }
    self->total_cur += added;
    Py_ssize_t depth = PyList_GET_SIZE(self->stack);
    if (depth > 0) {
        PyObject *rec = PyList_GET_ITEM(self->stack, depth - 1);
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(rec, 0));
        long long b = add_storage(self, tensor, PyTuple_GET_ITEM(rec, 1));
        if (b < 0) {
            return -1;
        }
        self->cur[i].saved += b;
    }
    return 0;
}

/* Keep the storage implementation of `tensor` (not its data) from being
   freed until the pass ends, through a weak reference: its address is
   the key memory is counted by, and a tensor a checkpoint frame packs is
   dropped at once, so a later storage could take its address and be
   taken for it.  (A tensor the profiler's own hook packs is kept by
   autograd.) */
static int
hold_address(Profiler *self, PyObject *tensor)
{
    PyObject *storage = PyObject_CallMethodNoArgs(tensor,
                                                  self->st->s_untyped_storage);
    if (storage == NULL) {
        /* No storage to hold (sparse, some subclasses): nothing to keep
           from being reused, as add_storage() counts nothing for it. */
        return storage_less() ? 0 : -1;
    }
    if (self->held == NULL) {
        self->held = PyList_New(0); /* released by release_addresses() */
        if (self->held == NULL) {
            Py_DECREF(storage);
            return -1;
        }
    }
    if (self->free_weak == NULL) {
        self->free_weak = PyObject_GetAttrString((PyObject *)Py_TYPE(storage),
                                                 "_free_weak_ref");
        if (self->free_weak == NULL) {
            Py_DECREF(storage);
            return -1;
        }
    }
    PyObject *ref = PyObject_CallMethod(storage, "_weak_ref", NULL);
    Py_DECREF(storage);
    if (ref == NULL) {
        return -1;
    }
    if (PyList_Append(self->held, ref) < 0) {
        PyObject *r = PyObject_CallOneArg(self->free_weak, ref);
        if (r == NULL) {
            PyErr_WriteUnraisable((PyObject *)self);
        }
        Py_XDECREF(r);
        Py_DECREF(ref);
        return -1;
    }
    Py_DECREF(ref);
    return 0;
}

/* Let go of every weak reference hold_address() took (a failure to is
   reported as unraisable: the others are still released). */
static void
release_addresses(Profiler *self)
{
    if (self->held == NULL) {
        return;
    }
    /* Taken whole, so that nothing here allocates; hold_address() makes a
       new list when it next needs one. */
    PyObject *held = self->held;
    self->held = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(held); i++) {
        PyObject *r = self->free_weak == NULL
                          ? NULL
                          : PyObject_CallOneArg(self->free_weak,
                                                PyList_GET_ITEM(held, i));
        if (r == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError,
                                "memscale profiler: no _free_weak_ref");
            }
            PyErr_WriteUnraisable((PyObject *)self);
        }
        Py_XDECREF(r);
    }
    Py_DECREF(held);
}

static PyObject *
prof_count(Profiler *self, PyObject *tensor)
{
    /* Pack hook: count, then hand the tensor back unchanged. */
    if (count_saved(self, tensor) < 0) {
        return NULL;
    }
    /* Hand back a detached alias, as checkpointing does: the tensor itself
       would, for an output its own grad_fn saves, make a cycle through
       that grad_fn which nothing collects, keeping a forward-only pass's
       whole graph alive (the empirical profile has no backward). */
    return PyObject_CallMethodNoArgs(tensor, self->st->s_detach);
}

static PyObject *
prof_ident(Profiler *Py_UNUSED(self), PyObject *obj)
{
    return Py_NewRef(obj);
}

/* ---- passes ------------------------------------------------------- */

/* clang-format off */
PyDoc_STRVAR(prof_begin_doc,
"begin_pass($self, /)\n--\n\n"
"Start measuring one forward pass.");
/* clang-format on */

static int
begin_pass(Profiler *self)
{
    ms_state *st = self->st;
    PyObject *pack = NULL, *unpack = NULL, *ctx = NULL;
    if (self->in_pass) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale profiler: a pass is already running");
        return -1;
    }
    memset(self->cur, 0, (size_t)self->n * sizeof(unit_stats));
    self->total_cur = 0;
    self->flops_cur = 0.0;
    Py_XSETREF(self->seen, PySet_New(NULL));
    if (self->seen == NULL) {
        return -1;
    }
    if (PyList_SetSlice(self->stack, 0, PyList_GET_SIZE(self->stack), NULL)
        < 0)
    {
        return -1;
    }
    pack = PyObject_GetAttr((PyObject *)self, st->s_count);
    unpack = PyObject_GetAttr((PyObject *)self, st->s_ident);
    if (pack == NULL || unpack == NULL) {
        goto error;
    }
    ctx = PyObject_CallFunctionObjArgs(st->saved_tensors_hooks, pack, unpack,
                                       NULL);
    if (ctx == NULL) {
        goto error;
    }
    if (self->flop_counter != Py_None
        && ms_call_enter(st, self->flop_counter) < 0)
    {
        goto error;
    }
    if (ms_call_enter(st, ctx) < 0) {
        if (self->flop_counter != Py_None) {
            (void)ms_call_exit(st, self->flop_counter);
        }
        goto error;
    }
    self->ctx = ctx;
    self->in_pass = 1;
    Py_DECREF(pack);
    Py_DECREF(unpack);
    return 0;
error:
    Py_XDECREF(ctx);
    Py_XDECREF(pack);
    Py_XDECREF(unpack);
    return -1;
}

static PyObject *
prof_begin(Profiler *self, PyObject *Py_UNUSED(ignored))
{
    if (begin_pass(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(prof_end_doc,
"end_pass($self, /, ok=True)\n--\n\n"
"Finish the pass begun by begin_pass(); with ok=False (the forward\n"
"raised) its figures are dropped.");
/* clang-format on */

/* Leave the pass's contexts and fold its figures in (ok) or drop them. */
static int
end_pass(Profiler *self, int ok)
{
    ms_state *st = self->st;
    self->in_pass = 0;
    int rc = ms_call_exit(st, self->ctx);
    Py_CLEAR(self->ctx);
    if (self->flop_counter != Py_None) {
        double total = 0.0;
        if (rc == 0 && current_flops(self, &total) < 0) {
            rc = -1;
        }
        self->flops_cur = total;
        if (ms_call_exit(st, self->flop_counter) < 0) {
            rc = -1;
        }
    }
    Py_CLEAR(self->seen);
    if (PyList_SetSlice(self->stack, 0, PyList_GET_SIZE(self->stack), NULL)
        < 0)
    {
        rc = -1;
    }
    if (self->held != NULL) {
        ms_exc_state saved;
        ms_exc_save(&saved);
        release_addresses(self);
        ms_exc_restore(&saved);
    }
    if (rc < 0 || !ok) {
        return rc;
    }
    /* Keep, per unit, the largest figures seen in any pass. */
    for (Py_ssize_t i = 0; i < self->n; i++) {
        unit_stats *c = &self->cur[i], *b = &self->best[i];
        if (c->saved > b->saved) {
            b->saved = c->saved;
        }
        if (c->input > b->input) {
            b->input = c->input;
        }
        if (c->output > b->output) {
            b->output = c->output;
        }
        if (c->flops > b->flops) {
            b->flops = c->flops;
        }
        if (c->calls > b->calls) {
            b->calls = c->calls;
        }
        b->flags |= c->flags;
    }
    if (self->total_cur > self->total_best) {
        self->total_best = self->total_cur;
    }
    if (self->flops_cur > self->flops_best) {
        self->flops_best = self->flops_cur;
    }
    self->passes += 1;
    return 0;
}

/* end_pass() of the pass running, or a RuntimeError if none is. */
static int
end_running_pass(Profiler *self, int ok)
{
    if (!self->in_pass) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale profiler: no pass is running");
        return -1;
    }
    return end_pass(self, ok);
}

static PyObject *
prof_end(Profiler *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"ok", NULL};
    int ok = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p:end_pass", kwlist, &ok))
    {
        return NULL;
    }
    if (end_running_pass(self, ok) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(prof_attach_doc,
"attach($self, /)\n--\n\n"
"Register the measuring hooks on every unit (kept as handles).");
/* clang-format on */

static PyObject *
prof_attach(Profiler *self, PyObject *Py_UNUSED(ignored))
{
    if (PyList_GET_SIZE(self->handles) > 0) {
        Py_RETURN_NONE;
    }
    if (ms_register_unit_hooks(self->st, (PyObject *)self, self->units,
                               self->handles, self->st->s_pre,
                               self->st->s_post)
        < 0)
    {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(prof_detach_doc,
"detach($self, /)\n--\n\n"
"Remove the hooks attach() registered; leave any running pass.");
/* clang-format on */

static int
detach_hooks(Profiler *self)
{
    int rc = 0;
    /* An unfinished pass (its forward was interrupted) is dropped. */
    if (self->in_pass && end_pass(self, 0) < 0) {
        rc = -1;
    }
    if (rc == 0) {
        rc = ms_remove_handles(self->st, self->handles);
    }
    else {
        ms_exc_state saved;
        ms_exc_save(&saved);
        if (ms_remove_handles(self->st, self->handles) < 0) {
            PyErr_WriteUnraisable((PyObject *)self);
        }
        ms_exc_restore(&saved);
    }
    return rc;
}

static PyObject *
prof_detach(Profiler *self, PyObject *Py_UNUSED(ignored))
{
    if (detach_hooks(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* clang-format off */
PyDoc_STRVAR(prof_results_doc,
"results($self, /)\n--\n\n"
"Per-unit figures, largest over the passes measured: a list of dicts\n"
"with param_bytes, saved_bytes, input_bytes, output_bytes, flops, calls\n"
"and flags.");
/* clang-format on */

static PyObject *
prof_results(Profiler *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New(self->n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        unit_stats *b = &self->best[i];
        unsigned flags = b->flags | (b->calls == 0 ? MS_LAYER_NOT_CALLED : 0);
        PyObject *d = Py_BuildValue("{sLsLsLsLsdslsI}", "param_bytes",
                                    self->param_bytes[i], "saved_bytes",
                                    b->saved, "input_bytes", b->input,
                                    "output_bytes", b->output, "flops",
                                    b->flops, "calls", b->calls, "flags",
                                    flags);
        if (d == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, d);
    }
    return list;
}

static PyObject *
prof_get_total(Profiler *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->total_best);
}

static PyObject *
prof_get_total_flops(Profiler *self, void *Py_UNUSED(c))
{
    return PyFloat_FromDouble(self->flops_best);
}

static PyObject *
prof_get_passes(Profiler *self, void *Py_UNUSED(c))
{
    return PyLong_FromLong(self->passes);
}

static PyObject *
prof_get_in_pass(Profiler *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(self->in_pass);
}

/* ---- construction ------------------------------------------------- */

static int
storage_keys_of(Profiler *self, PyObject *tensors, PyObject *keys)
{
    PyObject *it = PyObject_GetIter(tensors);
    if (it == NULL) {
        return -1;
    }
    PyObject *t;
    while ((t = PyIter_Next(it)) != NULL) {
        if (!ms_is_tensor(self->st, t)) {
            PyErr_Format(PyExc_TypeError,
                         "param_tensors must hold tensors, got %.200s",
                         Py_TYPE(t)->tp_name);
            Py_DECREF(t);
            Py_DECREF(it);
            return -1;
        }
        PyObject *key;
        long long nbytes;
        int rc = ms_storage_key_and_size(self->st, t, &key, &nbytes);
        Py_DECREF(t);
        if (rc < 0 || PySet_Add(keys, key) < 0) {
            Py_XDECREF(key);
            Py_DECREF(it);
            return -1;
        }
        Py_DECREF(key);
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* Parameter bytes of one unit, counted by storage. */
static int
unit_param_bytes(Profiler *self, PyObject *unit, long long *out)
{
    PyObject *keys = PySet_New(NULL);
    PyObject *params = keys ? PyObject_CallMethodNoArgs(unit,
                                                        self->st->s_parameters)
                            : NULL;
    PyObject *it = params ? PyObject_GetIter(params) : NULL;
    PyObject *p;
    *out = 0;
    if (it == NULL) {
        goto error;
    }
    while ((p = PyIter_Next(it)) != NULL) {
        PyObject *key;
        long long nbytes;
        int rc = ms_storage_key_and_size(self->st, p, &key, &nbytes);
        Py_DECREF(p);
        if (rc < 0) {
            goto error;
        }
        int has = PySet_Contains(keys, key);
        if (has < 0 || (has == 0 && PySet_Add(keys, key) < 0)) {
            Py_DECREF(key);
            goto error;
        }
        Py_DECREF(key);
        if (!has) {
            *out += nbytes;
        }
    }
    if (PyErr_Occurred()) {
        goto error;
    }
    Py_DECREF(it);
    Py_DECREF(params);
    Py_DECREF(keys);
    return 0;
error:
    Py_XDECREF(it);
    Py_XDECREF(params);
    Py_XDECREF(keys);
    return -1;
}

static PyObject *
prof_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"units", "param_tensors", "flop_counter", NULL};
    PyObject *units, *params, *flop_counter = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:Profiler", kwlist,
                                     &units, &params, &flop_counter))
    {
        return NULL;
    }
    PyObject *module = PyType_GetModuleByDef(type, &ms_module_def);
    if (module == NULL) {
        return NULL;
    }
    Profiler *self = (Profiler *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->module = Py_NewRef(module);
    self->st = ms_get_state(module);
    self->flop_counter = Py_NewRef(flop_counter);
    self->units = PySequence_List(units);
    self->index_of = PyDict_New();
    self->param_keys = PySet_New(NULL);
    self->handles = PyList_New(0);
    self->stack = PyList_New(0);
    /* self->held: made by hold_address() when a pass first holds one */
    if (self->units == NULL || self->index_of == NULL
        || self->param_keys == NULL || self->handles == NULL
        || self->stack == NULL)
    {
        goto error;
    }
    self->n = PyList_GET_SIZE(self->units);
    self->cur = PyMem_Calloc(self->n ? (size_t)self->n : 1,
                             sizeof(unit_stats));
    self->best = PyMem_Calloc(self->n ? (size_t)self->n : 1,
                              sizeof(unit_stats));
    self->param_bytes = PyMem_Calloc(self->n ? (size_t)self->n : 1,
                                     sizeof(long long));
    if (self->cur == NULL || self->best == NULL || self->param_bytes == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *unit = PyList_GET_ITEM(self->units, i);
        PyObject *idx = PyLong_FromSsize_t(i);
        if (idx == NULL) {
            goto error;
        }
        int has = PyDict_Contains(self->index_of, unit);
        int rc = has ? -1 : PyDict_SetItem(self->index_of, unit, idx);
        Py_DECREF(idx);
        if (has > 0) {
            PyErr_Format(PyExc_ValueError,
                         "unit %zd appears twice among the units", i);
        }
        if (rc < 0 || unit_param_bytes(self, unit, &self->param_bytes[i]) < 0)
        {
            goto error;
        }
    }
    if (storage_keys_of(self, params, self->param_keys) < 0) {
        goto error;
    }
    return (PyObject *)self;
error:
    Py_DECREF(self);
    return NULL;
}

static int
prof_traverse(Profiler *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->units);
    Py_VISIT(self->index_of);
    Py_VISIT(self->param_keys);
    Py_VISIT(self->flop_counter);
    Py_VISIT(self->handles);
    Py_VISIT(self->ctx);
    Py_VISIT(self->seen);
    Py_VISIT(self->stack);
    Py_VISIT(self->held);
    Py_VISIT(self->free_weak);
    return 0;
}

static int
prof_clear(Profiler *self)
{
    if (self->held != NULL) {
        ms_exc_state saved;
        ms_exc_save(&saved);
        release_addresses(self);
        ms_exc_restore(&saved);
    }
    Py_CLEAR(self->free_weak);
    Py_CLEAR(self->units);
    Py_CLEAR(self->index_of);
    Py_CLEAR(self->param_keys);
    Py_CLEAR(self->flop_counter);
    Py_CLEAR(self->handles);
    Py_CLEAR(self->ctx);
    Py_CLEAR(self->seen);
    Py_CLEAR(self->stack);
    Py_CLEAR(self->module);
    return 0;
}

static void
prof_dealloc(Profiler *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)prof_clear(self);
    PyMem_Free(self->cur);
    PyMem_Free(self->best);
    PyMem_Free(self->param_bytes);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef prof_methods[] = {
    {"attach", (PyCFunction)prof_attach, METH_NOARGS, prof_attach_doc},
    {"detach", (PyCFunction)prof_detach, METH_NOARGS, prof_detach_doc},
    {"begin_pass", (PyCFunction)prof_begin, METH_NOARGS, prof_begin_doc},
    {"end_pass", (PyCFunction)(void (*)(void))prof_end,
     METH_VARARGS | METH_KEYWORDS, prof_end_doc},
    {"results", (PyCFunction)prof_results, METH_NOARGS, prof_results_doc},
    {"_pre", (PyCFunction)(void (*)(void))prof_pre, METH_FASTCALL, NULL},
    {"_post", (PyCFunction)(void (*)(void))prof_post, METH_FASTCALL, NULL},
    {"_count", (PyCFunction)prof_count, METH_O, NULL},
    {"_ident", (PyCFunction)prof_ident, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef prof_getset[] = {
    {"total_saved_bytes", (getter)prof_get_total, NULL,
     "Activation bytes saved for backward by the whole model (largest "
     "pass).",
     NULL},
    {"total_flops", (getter)prof_get_total_flops, NULL,
     "Forward FLOPs of the whole model (largest pass).", NULL},
    {"passes", (getter)prof_get_passes, NULL, "Passes measured.", NULL},
    {"in_pass", (getter)prof_get_in_pass, NULL, "A pass is running.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot prof_slots[] = {
    {Py_tp_doc, "Profiler(units, param_tensors, flop_counter=None)\n--\n\n"
                "Measures what each planning unit saves for backward."},
    {Py_tp_new, prof_new},
    {Py_tp_dealloc, prof_dealloc},
    {Py_tp_traverse, prof_traverse},
    {Py_tp_clear, prof_clear},
    {Py_tp_methods, prof_methods},
    {Py_tp_getset, prof_getset},
    {0, NULL},
};

static PyType_Spec prof_spec = {
    .name = "memscale._core.Profiler",
    .basicsize = sizeof(Profiler),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC
             | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = prof_slots,
};

/* The executor drives a Profiler through these, not through its Python
   methods: the type is ours and final (no subclass can override them).
   NULL (an executor the garbage collector cleared) is an error, as it is
   for a call through the C API. */
static Profiler *
as_profiler(PyObject *obj)
{
    if (obj == NULL) {
        PyErr_BadInternalCall();
        return NULL;
    }
    assert(Py_IS_TYPE(obj, ((Profiler *)obj)->st->profiler_type));
    return (Profiler *)obj;
}

int
ms_profiler_begin_pass(PyObject *profiler)
{
    Profiler *self = as_profiler(profiler);
    return self != NULL ? begin_pass(self) : -1;
}

int
ms_profiler_end_pass(PyObject *profiler, int ok)
{
    Profiler *self = as_profiler(profiler);
    return self != NULL ? end_running_pass(self, ok) : -1;
}

int
ms_profiler_count(PyObject *profiler, PyObject *tensor)
{
    Profiler *self = as_profiler(profiler);
    if (self == NULL) {
        return -1;
    }
    if (!self->in_pass) {
        return 0;
    }
    return hold_address(self, tensor) < 0 ? -1 : count_saved(self, tensor);
}

int
ms_profiler_detach(PyObject *profiler)
{
    Profiler *self = as_profiler(profiler);
    return self != NULL ? detach_hooks(self) : -1;
}

int
ms_profiler_init_types(PyObject *module, ms_state *st)
{
    st->profiler_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &prof_spec, NULL);
    if (st->profiler_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->profiler_type);
}
