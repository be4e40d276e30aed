/*
 * fake_calls.c: FakeCalls, the OOM predictor's caller of operators on fake
 * tensors (memscale/_torch_compat.py, fake_calls, makes it and keeps what
 * it shares with it).
 *
 * FakeTensorMode answers a call it has seen before from its dispatch cache,
 * but computing its cache key in Python is most of what such a call costs.
 * FakeCalls keys the call by the same values more cheaply (each fake
 * tensor's dtype, shape, strides, device, offset, storage bytes and flags;
 * every other argument with its type; the global state the mode's key
 * holds), looks the key up in the memo the Python side fills on a miss
 * (key -> (the mode's key, its entry, the entry's recipe) or None), and on
 * a hit makes the output from the recipe: a meta tensor with the entry's
 * layout, wrapped as a FakeTensor with the attributes the mode gives one.
 * Everything it does not answer itself goes to a Python callable: a call
 * it cannot key or the mode does not cache to the operator, a first call
 * to `miss`, a hit without a fitting recipe to `entry_output`.
 */
#include "fake_calls.h"

#include <stddef.h> /* offsetof, for the member table */

typedef struct {
    PyObject_HEAD
    ms_state *st;
    /* The mode, its tensor class, torch.Tensor. */
    PyObject *mode, *fake_cls, *tensor_cls;
    /* key -> (mode's key, entry, recipe) or None; filled by `miss`. */
    PyObject *memo;
    /* miss(func, args, kwargs, key); entry_output(known, func, args);
       alone() -> whether a stack of one mode is the mode alone. */
    PyObject *miss, *entry_output, *alone_fn;
    /* The global state read for each call: the dispatch stack's length,
       the mode in a slot (and the fake slot), the default dtype and
       device, whether inference mode is on, the proxy mode. */
    PyObject *stack_len, *slot_mode, *fake_slot, *default_dtype;
    PyObject *default_device, *inference, *proxy_mode;
    /* Non-tensor argument types keyed by value; torch.strided; the context
       that turns off the tensor subclasses' __torch_function__. */
    PyObject *keyed_types, *strided, *no_subclass_fn;
    /* The lean build (template NULL: none): the attributes of a FakeTensor
       the mode makes, and what makes one; the recipe's three kinds of
       output and the "not answered" value. */
    PyObject *template, *empty_strided, *make_subclass, *set_conj, *set_neg;
    PyObject *guard, *exporting, *no_dispatch, *meta;
    PyObject *k_constant, *k_inplace, *k_new, *unseen;
    /* Interned names. */
    PyObject *s_cache_enabled, *s_crosscheck, *s_shape_env, *s_in_kernel;
    PyObject *s_fake_mode, *s_constant, *s_symbolic, *s_stride;
    PyObject *s_fake_device, *s_offset, *s_requires_grad, *s_is_inference;
    PyObject *s_set_, *s_fake_device_attr, *s_dispatch_device;
    PyObject *s_backend_device, *s_dict;
    int alone;            /* -1: not checked yet */
    Py_ssize_t hits;      /* calls answered from the memo */
    Py_ssize_t lean_hits; /* of those, outputs made here */
    vectorcallfunc vectorcall;
} FakeCalls;

/* The object fields, for traverse and clear (in declaration order). */
#define FC_OBJECTS(X)                                                         \
    X(mode)                                                                   \
    X(fake_cls)                                                               \
    X(tensor_cls)                                                             \
    X(memo)                                                                   \
    X(miss)                                                                   \
    X(entry_output)                                                           \
    X(alone_fn)                                                               \
    X(stack_len)                                                              \
    X(slot_mode)                                                              \
    X(fake_slot)                                                              \
    X(default_dtype)                                                          \
    X(default_device)                                                         \
    X(inference)                                                              \
    X(proxy_mode)                                                             \
    X(keyed_types)                                                            \
    X(strided)                                                                \
    X(no_subclass_fn)                                                         \
    X(template)                                                               \
    X(empty_strided)                                                          \
    X(make_subclass)                                                          \
    X(set_conj)                                                               \
    X(set_neg)                                                                \
    X(guard)                                                                  \
    X(exporting)                                                              \
    X(no_dispatch)                                                            \
    X(meta)                                                                   \
    X(k_constant)                                                             \
    X(k_inplace)                                                              \
    X(k_new)                                                                  \
    X(unseen)                                                                 \
    X(s_cache_enabled)                                                        \
    X(s_crosscheck)                                                           \
    X(s_shape_env)                                                            \
    X(s_in_kernel)                                                            \
    X(s_fake_mode)                                                            \
    X(s_constant)                                                             \
    X(s_symbolic)                                                             \
    X(s_stride)                                                               \
    X(s_fake_device)                                                          \
    X(s_offset)                                                               \
    X(s_requires_grad)                                                        \
    X(s_is_inference)                                                         \
    X(s_set_)                                                                 \
    X(s_fake_device_attr)                                                     \
    X(s_dispatch_device)                                                      \
    X(s_backend_device)                                                       \
    X(s_dict)

/* ------------------------------------------------------------------ */
/* Small helpers                                                        */

/* The truth of obj.name: 1, 0, or -1 with an exception set. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    int r = PyObject_IsTrue(value);
    Py_DECREF(value);
    return r;
}

/* Whether obj.name is `expected` (identity): 1, 0, or -1 with an
   exception set. */
static int
attr_is(PyObject *obj, PyObject *name, PyObject *expected)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    int r = value == expected;
    Py_DECREF(value);
    return r;
}

/* Append a new reference to `list` and drop it: 0, or -1 with an
   exception set (also when `item` is NULL: the error that made it). */
static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL) {
        return -1;
    }
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

/* Append fn() to `list`. */
static int
append_call(PyObject *list, PyObject *fn)
{
    return append_new(list, PyObject_CallNoArgs(fn));
}

/* func(*args, **kwargs), kwargs a dict or NULL. */
static PyObject *
call_op(PyObject *func, PyObject *args, PyObject *kwargs)
{
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) == 0) {
        kwargs = NULL;
    }
    return PyObject_Call(func, args, kwargs);
}

/* ------------------------------------------------------------------ */
/* The key                                                              */

/* Append a fake tensor's metadata to `out` (1), or find it unkeyable (0:
   another mode's, a constant, not strided, symbolic sizes), or fail
   (-1). */
static int
add_fake(FakeCalls *fc, PyObject *v, PyObject *out)
{
    int r = attr_is(v, fc->s_fake_mode, fc->mode);
    if (r <= 0) {
        return r;
    }
    r = attr_is(v, fc->s_constant, Py_None);
    if (r <= 0) {
        return r;
    }
    r = attr_is(v, fc->st->s_layout, fc->strided);
    if (r <= 0) {
        return r;
    }
    r = attr_true(v, fc->s_symbolic);
    if (r != 0) {
        return r < 0 ? -1 : 0;
    }
    PyObject *storage;
    if (append_new(out, PyObject_GetAttr(v, fc->st->s_dtype)) < 0
        || append_new(out, PyObject_GetAttr(v, fc->st->s_shape)) < 0
        || append_new(out, PyObject_CallMethodNoArgs(v, fc->s_stride)) < 0
        || append_new(out, PyObject_GetAttr(v, fc->s_fake_device)) < 0
        || append_new(out, PyObject_CallMethodNoArgs(v, fc->s_offset)) < 0)
    {
        return -1;
    }
    storage = PyObject_CallMethodNoArgs(v, fc->st->s_untyped_storage);
    if (storage == NULL) {
        return -1;
    }
    r = append_new(out, PyObject_CallMethodNoArgs(storage, fc->st->s_nbytes));
    Py_DECREF(storage);
    if (r < 0 || append_new(out, PyObject_GetAttr(v, fc->s_requires_grad)) < 0
        || append_new(out, PyObject_CallMethodNoArgs(v, fc->st->s_is_conj)) < 0
        || append_new(out, PyObject_CallMethodNoArgs(v, fc->st->s_is_neg)) < 0
        || append_new(out, PyObject_CallMethodNoArgs(v, fc->s_is_inference))
               < 0)
    {
        return -1;
    }
    return 1;
}

static int add_values(FakeCalls *fc, PyObject *seq, PyObject *out);

/* Append one value (1), or find it unkeyable (0), or fail (-1). */
static int
add_value(FakeCalls *fc, PyObject *v, PyObject *out)
{
    if ((PyObject *)Py_TYPE(v) == fc->fake_cls) {
        return add_fake(fc, v, out);
    }
    int r = PyObject_IsInstance(v, fc->tensor_cls);
    if (r != 0) {
        return r < 0 ? -1 : 0; /* a real tensor, a subclass's */
    }
    if (PyList_Check(v) || PyTuple_Check(v)) {
        if (PyList_Append(out, (PyObject *)Py_TYPE(v)) < 0
            || append_new(out, PyLong_FromSsize_t(PySequence_Fast_GET_SIZE(v)))
                   < 0)
        {
            return -1;
        }
        /* (a list that holds itself would recurse without end) */
        if (Py_EnterRecursiveCall(" in FakeCalls.key")) {
            return -1;
        }
        r = add_values(fc, v, out);
        Py_LeaveRecursiveCall();
        return r;
    }
    if (v != Py_None) {
        r = PySet_Contains(fc->keyed_types, (PyObject *)Py_TYPE(v));
        if (r <= 0) {
            return r;
        }
    }
    if (PyList_Append(out, (PyObject *)Py_TYPE(v)) < 0
        || PyList_Append(out, v) < 0)
    {
        return -1;
    }
    return 1;
}

/* The values of a list or tuple, each owned while it is read (a getter
   may run Python code that changes a list). */
static int
add_values(FakeCalls *fc, PyObject *seq, PyObject *out)
{
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_ITEMS(seq)[i]);
        int r = add_value(fc, item, out);
        Py_DECREF(item);
        if (r <= 0) {
            return r;
        }
    }
    return 1;
}

/* The memo's key of func(*args, **kwargs) (see the top of this file): a
   new tuple, or NULL without an exception when the call cannot be keyed,
   or NULL with one. */
static PyObject *
make_key(FakeCalls *fc, PyObject *func, PyObject *args, PyObject *kwargs)
{
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    PyObject *ctx = NULL, *values = NULL, *proxy = NULL;
    int r = -1;
    if (PyList_Append(out, func) < 0 || append_call(out, fc->default_dtype) < 0
        || append_call(out, fc->default_device) < 0
        || append_call(out, fc->inference) < 0)
    {
        goto done;
    }
    proxy = PyObject_CallNoArgs(fc->proxy_mode);
    if (proxy == NULL
        || PyList_Append(out, proxy != Py_None ? Py_True : Py_False) < 0
        || append_new(out, PyLong_FromSsize_t(PyTuple_GET_SIZE(args))) < 0)
    {
        goto done;
    }
    /* The tensors' metadata is read without the check for a subclass's
       __torch_function__ (FakeTensor's is torch's disabled one). */
    ctx = PyObject_CallNoArgs(fc->no_subclass_fn);
    if (ctx == NULL || ms_call_enter(fc->st, ctx) < 0) {
        goto done;
    }
    r = add_values(fc, args, out);
    if (r == 1 && kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyObject *keys = PyDict_Keys(kwargs);
        values = keys != NULL ? PyDict_Values(kwargs) : NULL;
        if (keys == NULL || values == NULL
            || append_new(out, PyLong_FromSsize_t(PyDict_GET_SIZE(kwargs)))
                   < 0)
        {
            Py_XDECREF(keys);
            r = -1;
        }
        else {
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys) && r == 1; i++) {
                r = PyList_Append(out, PyList_GET_ITEM(keys, i)) < 0 ? -1 : 1;
            }
            Py_DECREF(keys);
            if (r == 1) {
                r = add_values(fc, values, out);
            }
        }
    }
    if (ms_call_exit(fc->st, ctx) < 0) {
        r = -1;
    }
done:
    Py_XDECREF(proxy);
    Py_XDECREF(ctx);
    Py_XDECREF(values);
    if (r <= 0) {
        Py_DECREF(out);
        return NULL;
    }
    PyObject *key = PyList_AsTuple(out);
    Py_DECREF(out);
    return key;
}

/* ------------------------------------------------------------------ */
/* The lean build                                                       */

/* Set mode.in_kernel_invocation; a pending exception is kept (and wins
   over an error here, which is then reported as unraisable). */
static int
set_in_kernel(FakeCalls *fc, PyObject *value)
{
    ms_exc_state saved;
    ms_exc_save(&saved);
    int had_exc = ms_exc_pending(&saved);
    int r = PyObject_SetAttr(fc->mode, fc->s_in_kernel, value);
    if (had_exc) {
        if (r < 0) {
            PyErr_WriteUnraisable(fc->mode);
        }
        ms_exc_restore(&saved);
    }
    return r;
}

/* The meta tensor of a recipe's output, made as the mode's kernels make
   one (no dispatch mode sees the calls; the mode marked inside a
   kernel): a new reference, or NULL with an exception set. */
static PyObject *
meta_tensor(FakeCalls *fc, PyObject *out, PyObject *base)
{
    PyObject *shape = PyTuple_GET_ITEM(out, 1);
    PyObject *stride = PyTuple_GET_ITEM(out, 2);
    PyObject *kw = NULL, *empty = NULL, *pos = NULL, *res = NULL;
    PyObject *ctx = PyObject_CallNoArgs(fc->no_dispatch);
    if (ctx == NULL || ms_call_enter(fc->st, ctx) < 0) {
        Py_XDECREF(ctx);
        return NULL;
    }
    if (set_in_kernel(fc, Py_True) < 0) {
        goto exit;
    }
    kw = Py_BuildValue("{sOsOsO}", "dtype", PyTuple_GET_ITEM(out, 3), "device",
                       fc->meta, "requires_grad", PyTuple_GET_ITEM(out, 4));
    pos = PyTuple_Pack(2, shape, stride);
    if (kw == NULL || pos == NULL) {
        goto reset;
    }
    empty = PyObject_Call(fc->empty_strided, pos, kw);
    if (empty == NULL) {
        goto reset;
    }
    int conj = PyObject_IsTrue(PyTuple_GET_ITEM(out, 5));
    int neg = conj < 0 ? -1 : PyObject_IsTrue(PyTuple_GET_ITEM(out, 6));
    if (neg < 0) {
        Py_CLEAR(empty);
        goto reset;
    }
    if (conj) {
        res = PyObject_CallFunctionObjArgs(fc->set_conj, empty, Py_True, NULL);
        if (res == NULL) {
            Py_CLEAR(empty);
            goto reset;
        }
        Py_CLEAR(res);
    }
    if (neg) {
        res = PyObject_CallFunctionObjArgs(fc->set_neg, empty, Py_True, NULL);
        if (res == NULL) {
            Py_CLEAR(empty);
            goto reset;
        }
        Py_CLEAR(res);
    }
    if (base != NULL) {
        PyObject *storage =
            PyObject_CallMethodNoArgs(base, fc->st->s_untyped_storage);
        if (storage == NULL) {
            Py_CLEAR(empty);
            goto reset;
        }
        res = PyObject_CallMethodObjArgs(empty, fc->s_set_, storage,
                                         PyTuple_GET_ITEM(out, 8), shape,
                                         stride, NULL);
        Py_DECREF(storage);
        if (res == NULL) {
            Py_CLEAR(empty);
            goto reset;
        }
        Py_CLEAR(res);
    }
reset:
    if (set_in_kernel(fc, Py_False) < 0 && empty != NULL) {
        Py_CLEAR(empty);
    }
exit:
    Py_XDECREF(kw);
    Py_XDECREF(pos);
    if (ms_call_exit(fc->st, ctx) < 0) {
        Py_CLEAR(empty);
    }
    Py_DECREF(ctx);
    return empty;
}

/* The FakeTensor of a recipe's output (kind, shape, stride, dtype,
   requires_grad, conj, neg, view_idx, offset, device): a new reference,
   `unseen` (new) when the recipe does not fit the arguments, or NULL with
   an exception set. */
static PyObject *
new_output(FakeCalls *fc, PyObject *out, PyObject *args)
{
    if (!PyTuple_CheckExact(out) || PyTuple_GET_SIZE(out) != 10) {
        PyErr_SetString(PyExc_TypeError, "FakeCalls: a malformed recipe");
        return NULL;
    }
    PyObject *base = NULL;
    PyObject *view_idx = PyTuple_GET_ITEM(out, 7);
    if (view_idx != Py_None) {
        Py_ssize_t i = PyLong_AsSsize_t(view_idx);
        if (i == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (i < 0 || i >= PyTuple_GET_SIZE(args)) {
            return Py_NewRef(fc->unseen);
        }
        base = PyTuple_GET_ITEM(args, i);
        int r = PyObject_IsInstance(base, fc->fake_cls);
        if (r <= 0) {
            return r < 0 ? NULL : Py_NewRef(fc->unseen);
        }
    }
    PyObject *device = PyTuple_GET_ITEM(out, 9);
    PyObject *empty = meta_tensor(fc, out, base);
    if (empty == NULL) {
        return NULL;
    }
    PyObject *kw = Py_BuildValue("{OOOO}", fc->s_dispatch_device, Py_True,
                                 fc->s_backend_device, device);
    PyObject *pos = PyTuple_Pack(3, fc->fake_cls, empty,
                                 PyTuple_GET_ITEM(out, 4));
    Py_DECREF(empty);
    PyObject *t = NULL;
    if (kw != NULL && pos != NULL) {
        t = PyObject_Call(fc->make_subclass, pos, kw);
    }
    Py_XDECREF(kw);
    Py_XDECREF(pos);
    if (t == NULL) {
        return NULL;
    }
    PyObject *res = PyObject_CallOneArg(fc->guard, t);
    if (res == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    Py_DECREF(res);
    PyObject *d = PyObject_GetAttr(t, fc->s_dict);
    if (d != NULL && !PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError,
                     "FakeCalls: a FakeTensor's __dict__ is a %.100s, not a "
                     "dict",
                     Py_TYPE(d)->tp_name);
        Py_CLEAR(d);
    }
    if (d == NULL || PyDict_Update(d, fc->template) < 0
        || PyDict_SetItem(d, fc->s_fake_device_attr, device) < 0)
    {
        Py_XDECREF(d);
        Py_DECREF(t);
        return NULL;
    }
    Py_DECREF(d);
    return t;
}

/* The output of a call from its recipe (is a tuple, outputs): a new
   reference, `unseen` (new) when it cannot be made here, or NULL with an
   exception set. */
static PyObject *
build(FakeCalls *fc, PyObject *recipe, PyObject *args)
{
    int r = attr_true(fc->mode, fc->s_in_kernel);
    if (r == 0) {
        r = attr_is(fc->mode, fc->s_shape_env, Py_None);
        r = r < 0 ? -1 : !r;
    }
    if (r == 0) {
        PyObject *exporting = PyObject_CallNoArgs(fc->exporting);
        r = exporting == NULL ? -1 : PyObject_IsTrue(exporting);
        Py_XDECREF(exporting);
    }
    if (r != 0) {
        return r < 0 ? NULL : Py_NewRef(fc->unseen);
    }
    if (!PyTuple_CheckExact(recipe) || PyTuple_GET_SIZE(recipe) != 2
        || !PyTuple_CheckExact(PyTuple_GET_ITEM(recipe, 1)))
    {
        PyErr_SetString(PyExc_TypeError, "FakeCalls: a malformed recipe");
        return NULL;
    }
    int is_tuple = PyObject_IsTrue(PyTuple_GET_ITEM(recipe, 0));
    PyObject *outs = PyTuple_GET_ITEM(recipe, 1);
    Py_ssize_t n = PyTuple_GET_SIZE(outs);
    if (is_tuple < 0 || (!is_tuple && n != 1)) {
        if (is_tuple >= 0) {
            PyErr_SetString(PyExc_TypeError, "FakeCalls: a malformed recipe");
        }
        return NULL;
    }
    PyObject *made = PyTuple_New(n);
    if (made == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *out = PyTuple_GET_ITEM(outs, k);
        if (!PyTuple_CheckExact(out) || PyTuple_GET_SIZE(out) < 2) {
            PyErr_SetString(PyExc_TypeError, "FakeCalls: a malformed recipe");
            Py_DECREF(made);
            return NULL;
        }
        PyObject *kind = PyTuple_GET_ITEM(out, 0), *item;
        if (kind == fc->k_constant) {
            item = Py_NewRef(PyTuple_GET_ITEM(out, 1));
        }
        else if (kind == fc->k_inplace) {
            Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(out, 1));
            if (i == -1 && PyErr_Occurred()) {
                Py_DECREF(made);
                return NULL;
            }
            if (i < 0 || i >= PyTuple_GET_SIZE(args)) {
                Py_DECREF(made);
                return Py_NewRef(fc->unseen);
            }
            item = PyTuple_GET_ITEM(args, i);
            r = PyObject_IsInstance(item, fc->fake_cls);
            if (r <= 0) {
                Py_DECREF(made);
                return r < 0 ? NULL : Py_NewRef(fc->unseen);
            }
            Py_INCREF(item);
        }
        else if (kind == fc->k_new) {
            item = new_output(fc, out, args);
            if (item == NULL || item == fc->unseen) {
                Py_DECREF(made);
                return item;
            }
        }
        else {
            PyErr_SetString(PyExc_TypeError, "FakeCalls: a malformed recipe");
            Py_DECREF(made);
            return NULL;
        }
        PyTuple_SET_ITEM(made, k, item);
    }
    if (is_tuple) {
        return made;
    }
    PyObject *only = Py_NewRef(PyTuple_GET_ITEM(made, 0));
    Py_DECREF(made);
    return only;
}

/* ------------------------------------------------------------------ */
/* The call                                                             */

/* Whether the mode is the only one on the stack, in the fake slot, with
   its cache on and no shape environment: 1, 0, or -1 with an exception
   set. */
static int
usable(FakeCalls *fc)
{
    int r = attr_true(fc->mode, fc->s_cache_enabled);
    if (r <= 0) {
        return r;
    }
    r = attr_true(fc->mode, fc->s_crosscheck);
    if (r != 0) {
        return r < 0 ? -1 : 0;
    }
    r = attr_is(fc->mode, fc->s_shape_env, Py_None);
    if (r <= 0) {
        return r;
    }
    PyObject *len = PyObject_CallNoArgs(fc->stack_len);
    if (len == NULL) {
        return -1;
    }
    Py_ssize_t n = PyLong_AsSsize_t(len);
    Py_DECREF(len);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (n != 1) {
        return 0;
    }
    PyObject *in_slot = PyObject_CallOneArg(fc->slot_mode, fc->fake_slot);
    if (in_slot == NULL) {
        return -1;
    }
    r = in_slot == fc->mode;
    Py_DECREF(in_slot);
    if (!r) {
        return 0;
    }
    if (fc->alone < 0) {
        PyObject *alone = PyObject_CallNoArgs(fc->alone_fn);
        if (alone == NULL) {
            return -1;
        }
        r = PyObject_IsTrue(alone);
        Py_DECREF(alone);
        if (r < 0) {
            return -1;
        }
        fc->alone = r;
    }
    return fc->alone;
}

static PyObject *
answer(FakeCalls *fc, PyObject *func, PyObject *args, PyObject *kwargs)
{
    int r = usable(fc);
    if (r <= 0) {
        return r < 0 ? NULL : call_op(func, args, kwargs);
    }
    PyObject *key = make_key(fc, func, args, kwargs);
    if (key == NULL) {
        return PyErr_Occurred() ? NULL : call_op(func, args, kwargs);
    }
    PyObject *known = PyDict_GetItemWithError(fc->memo, key); /* borrowed */
    Py_XINCREF(known); /* the memo may change while the output is made */
    if (known == NULL) {
        PyObject *out = NULL;
        if (!PyErr_Occurred()) {
            out = PyObject_CallFunctionObjArgs(fc->miss, func, args,
                                               kwargs != NULL ? kwargs
                                                              : Py_None,
                                               key, NULL);
        }
        Py_DECREF(key);
        return out;
    }
    Py_DECREF(key);
    if (known == Py_None) { /* FakeTensorMode does not cache this call */
        Py_DECREF(known);
        return call_op(func, args, kwargs);
    }
    fc->hits++;
    PyObject *out = NULL;
    if (fc->template != NULL && PyTuple_CheckExact(known)
        && PyTuple_GET_SIZE(known) == 3
        && PyTuple_GET_ITEM(known, 2) != Py_None)
    {
        out = build(fc, PyTuple_GET_ITEM(known, 2), args);
        if (out != NULL && out != fc->unseen) {
            fc->lean_hits++;
            Py_DECREF(known);
            return out;
        }
        if (out == NULL) {
            Py_DECREF(known);
            return NULL;
        }
        Py_CLEAR(out);
    }
    out = PyObject_CallFunctionObjArgs(fc->entry_output, known, func, args,
                                       NULL);
    Py_DECREF(known);
    return out;
}

/* Check and unpack (func, args, kwargs): 0, or -1 with an exception. */
static int
unpack(PyObject *const *argv, size_t nargsf, PyObject *kwnames,
       PyObject **args, PyObject **kwargs)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_SetString(PyExc_TypeError,
                        "FakeCalls: takes (func, args, kwargs) positionally");
        return -1;
    }
    if (n != 3) {
        PyErr_Format(PyExc_TypeError,
                     "FakeCalls: takes (func, args, kwargs), got %zd "
                     "arguments",
                     n);
        return -1;
    }
    if (!PyTuple_Check(argv[1])) {
        PyErr_Format(PyExc_TypeError,
                     "FakeCalls: args must be a tuple, got %.100s",
                     Py_TYPE(argv[1])->tp_name);
        return -1;
    }
    if (argv[2] != Py_None && !PyDict_Check(argv[2])) {
        PyErr_Format(PyExc_TypeError,
                     "FakeCalls: kwargs must be a dict or None, got %.100s",
                     Py_TYPE(argv[2])->tp_name);
        return -1;
    }
    *args = argv[1];
    *kwargs = argv[2] == Py_None ? NULL : argv[2];
    return 0;
}

static PyObject *
fc_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf,
              PyObject *kwnames)
{
    PyObject *args, *kwargs;
    if (unpack(argv, nargsf, kwnames, &args, &kwargs) < 0) {
        return NULL;
    }
    return answer((FakeCalls *)self, argv[0], args, kwargs);
}

static PyObject *
fc_key(PyObject *self, PyObject *const *argv, Py_ssize_t nargs)
{
    PyObject *args, *kwargs;
    if (unpack(argv, (size_t)nargs, NULL, &args, &kwargs) < 0) {
        return NULL;
    }
    PyObject *key = make_key((FakeCalls *)self, argv[0], args, kwargs);
    if (key == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return key;
}

static PyObject *
fc_build(PyObject *self, PyObject *const *argv, Py_ssize_t nargs)
{
    FakeCalls *fc = (FakeCalls *)self;
    if (nargs != 2 || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "FakeCalls.build: takes (recipe, args), args a "
                        "tuple");
        return NULL;
    }
    if (fc->template == NULL) {
        return Py_NewRef(fc->unseen);
    }
    return build(fc, argv[0], argv[1]);
}

/* ------------------------------------------------------------------ */
/* The type                                                             */

static PyObject *
fc_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {
        "mode",           "fake_cls",     "tensor_cls",    "memo",
        "miss",           "entry_output", "alone",         "stack_len",
        "slot_mode",      "fake_slot",    "default_dtype", "default_device",
        "inference",      "proxy_mode",   "keyed_types",   "strided",
        "no_subclass_fn", "unseen",       "lean",          NULL,
    };
    PyObject *o[18] = {NULL}, *lean = Py_None;
    if (PyTuple_GET_SIZE(args) > 0) {
        PyErr_SetString(PyExc_TypeError,
                        "FakeCalls: takes keyword arguments only");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs,
                                     "|$OOOOOOOOOOOOOOOOOOO:FakeCalls", kwlist,
                                     &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                                     &o[6], &o[7], &o[8], &o[9], &o[10],
                                     &o[11], &o[12], &o[13], &o[14], &o[15],
                                     &o[16], &o[17], &lean))
    {
        return NULL;
    }
    for (size_t i = 0; i < sizeof(o) / sizeof(o[0]); i++) {
        if (o[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "FakeCalls: missing %s=", kwlist[i]);
            return NULL;
        }
    }
    if (!PyDict_CheckExact(o[3])) {
        PyErr_SetString(PyExc_TypeError, "FakeCalls: memo must be a dict");
        return NULL;
    }
    if (!PyFrozenSet_CheckExact(o[14])) {
        PyErr_SetString(PyExc_TypeError,
                        "FakeCalls: keyed_types must be a frozenset");
        return NULL;
    }
    /* lean: None, or (template, empty_strided, make_subclass, set_conj,
       set_neg, guard, exporting, no_dispatch, meta device, CONSTANT,
       INPLACE, NEW) */
    if (lean != Py_None
        && (!PyTuple_CheckExact(lean) || PyTuple_GET_SIZE(lean) != 12
            || !PyDict_CheckExact(PyTuple_GET_ITEM(lean, 0))))
    {
        PyErr_SetString(PyExc_TypeError,
                        "FakeCalls: lean must be None or a tuple of 12 "
                        "starting with a dict");
        return NULL;
    }
    ms_state *st = PyType_GetModuleState(type);
    if (st == NULL) {
        return NULL;
    }
    FakeCalls *fc = (FakeCalls *)type->tp_alloc(type, 0);
    if (fc == NULL) {
        return NULL;
    }
    fc->st = st;
    fc->alone = -1;
    fc->vectorcall = fc_vectorcall;
    PyObject **slots[] = {
        &fc->mode,      &fc->fake_cls,       &fc->tensor_cls,
        &fc->memo,      &fc->miss,           &fc->entry_output,
        &fc->alone_fn,  &fc->stack_len,      &fc->slot_mode,
        &fc->fake_slot, &fc->default_dtype,  &fc->default_device,
        &fc->inference, &fc->proxy_mode,     &fc->keyed_types,
        &fc->strided,   &fc->no_subclass_fn, &fc->unseen,
    };
    for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++) {
        *slots[i] = Py_NewRef(o[i]);
    }
    if (lean != Py_None) {
        PyObject **lslots[] = {
            &fc->template,   &fc->empty_strided, &fc->make_subclass,
            &fc->set_conj,   &fc->set_neg,       &fc->guard,
            &fc->exporting,  &fc->no_dispatch,   &fc->meta,
            &fc->k_constant, &fc->k_inplace,     &fc->k_new,
        };
        for (Py_ssize_t i = 0; i < 12; i++) {
            *lslots[i] = Py_NewRef(PyTuple_GET_ITEM(lean, i));
        }
    }
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&fc->s_cache_enabled, "cache_enabled"},
        {&fc->s_crosscheck, "cache_crosscheck_enabled"},
        {&fc->s_shape_env, "shape_env"},
        {&fc->s_in_kernel, "in_kernel_invocation"},
        {&fc->s_fake_mode, "fake_mode"},
        {&fc->s_constant, "constant"},
        {&fc->s_symbolic, "_has_symbolic_sizes_strides"},
        {&fc->s_stride, "stride"},
        {&fc->s_fake_device, "fake_device"},
        {&fc->s_offset, "storage_offset"},
        {&fc->s_requires_grad, "requires_grad"},
        {&fc->s_is_inference, "is_inference"},
        {&fc->s_set_, "set_"},
        {&fc->s_fake_device_attr, "_fake_device"},
        {&fc->s_dispatch_device, "dispatch_device"},
        {&fc->s_backend_device, "device_for_backend_keys"},
        {&fc->s_dict, "__dict__"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) {
            Py_DECREF(fc);
            return NULL;
        }
    }
    return (PyObject *)fc;
}

static int
fc_traverse(FakeCalls *fc, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(fc));
#define FC_VISIT(field) Py_VISIT(fc->field);
    FC_OBJECTS(FC_VISIT)
#undef FC_VISIT
    return 0;
}

static int
fc_clear(FakeCalls *fc)
{
#define FC_CLEAR(field) Py_CLEAR(fc->field);
    FC_OBJECTS(FC_CLEAR)
#undef FC_CLEAR
    return 0;
}

static void
fc_dealloc(FakeCalls *fc)
{
    PyTypeObject *tp = Py_TYPE(fc);
    PyObject_GC_UnTrack(fc);
    (void)fc_clear(fc);
    tp->tp_free((PyObject *)fc);
    Py_DECREF(tp);
}

static PyMethodDef fc_methods[] = {
    {"key", (PyCFunction)(void (*)(void))fc_key, METH_FASTCALL,
     "key($self, func, args, kwargs, /)\n--\n\n"
     "The memo's key of func(*args, **kwargs), or None when the call "
     "cannot be keyed."},
    {"build", (PyCFunction)(void (*)(void))fc_build, METH_FASTCALL,
     "build($self, recipe, args, /)\n--\n\n"
     "The output a recipe makes for these arguments, or the unseen value "
     "when it cannot be made here."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef fc_members[] = {
    {"mode", Py_T_OBJECT_EX, offsetof(FakeCalls, mode), Py_READONLY,
     "The FakeTensorMode whose calls it answers."},
    {"memo", Py_T_OBJECT_EX, offsetof(FakeCalls, memo), Py_READONLY,
     "key -> (the mode's key, its entry, the entry's recipe), or None "
     "where the mode does not cache the call."},
    {"hits", Py_T_PYSSIZET, offsetof(FakeCalls, hits), Py_READONLY,
     "Calls answered from the memo."},
    {"lean_hits", Py_T_PYSSIZET, offsetof(FakeCalls, lean_hits), Py_READONLY,
     "Of those, the calls whose output was made here from the recipe."},
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(FakeCalls, vectorcall),
     Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot fc_slots[] = {
    {Py_tp_doc,
     "FakeCalls(*, mode, fake_cls, tensor_cls, memo, miss, entry_output, "
     "alone, stack_len, slot_mode, fake_slot, default_dtype, "
     "default_device, inference, proxy_mode, keyed_types, strided, "
     "no_subclass_fn, unseen, lean=None)\n--\n\n"
     "Calls operators on the fake tensors of a FakeTensorMode, answering "
     "repeated calls from its dispatch cache through a cheaper key "
     "(memscale._torch_compat.fake_calls makes it)."},
    {Py_tp_new, fc_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_dealloc, fc_dealloc},
    {Py_tp_traverse, fc_traverse},
    {Py_tp_clear, fc_clear},
    {Py_tp_methods, fc_methods},
    {Py_tp_members, fc_members},
    {0, NULL},
};

static PyType_Spec fc_spec = {
    .name = "memscale._core.FakeCalls",
    .basicsize = sizeof(FakeCalls),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = fc_slots,
};

int
ms_fake_calls_init_type(PyObject *module, ms_state *st)
{
    st->fake_calls_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &fc_spec, NULL);
    if (st->fake_calls_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->fake_calls_type);
}
