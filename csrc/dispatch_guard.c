/*
 * dispatch_guard.c: DispatchGuard(fast, safe), a method that calls `fast`
 * while the interpreter evaluates frames its own way and `safe` otherwise.
 *
 * torch wraps the __torch_dispatch__ of every TorchDispatchMode so that
 * dynamo never traces it: dynamo sees a frame only through the frame
 * evaluator it installs (PEP 523) while a compiled function runs, and the
 * wrapper clears dynamo's callback around the call, at the cost of a dozen
 * Python calls per operator.  While the interpreter's frame evaluator is
 * CPython's own, no frame can be seen by dynamo (nor by anything else), so
 * the guard calls the raw method; under any other evaluator it calls
 * torch's wrapped one.  The guard is a descriptor: read off an instance it
 * is bound to it, as a function is.
 *
 * Given `devices` (prim.device, the FakeTensor class, torch.device), it
 * also answers a fake tensor's prim.device query itself, as the modes of
 * the OOM predictor do in Python (memscale/_torch_compat.py,
 * fake_device_reader): torch's C++ code (the autograd engine above all)
 * asks a fake tensor for its device through that operator, which reaches
 * the modes, about twice per operator call of a simulated step.  The
 * answer is the tensor's fake_device, outside a fake kernel; any other
 * query goes to the method.
 */
#include "dispatch_guard.h"

#include <stddef.h> /* offsetof, for the member table */

typedef struct {
    PyObject_HEAD
    PyObject *fast;
    PyObject *safe;
    /* prim.device, the FakeTensor class, torch.device; all NULL: none */
    PyObject *device_op, *fake_cls, *device_type;
    vectorcallfunc vectorcall;
} DispatchGuard;

/* obj.name, or NULL without an exception when it has none (getattr with a
   default of None swallows only AttributeError): 1 and a new reference in
   *out, 0 and NULL, or -1 and NULL with an exception set. */
static int
optional_attr(PyObject *obj, PyObject *name, PyObject **out)
{
    *out = PyObject_GetAttr(obj, name);
    if (*out != NULL) {
        return 1;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return -1;
    }
    PyErr_Clear();
    return 0;
}

/* The device a fake tensor `t` reports, read as fake_device_reader reads
   it: 1 and a new reference in *out; 0 and NULL when `t` is not a fake
   tensor outside a fake kernel with a torch.device (the method answers);
   -1 and NULL with an exception set. */
static int
fake_device(DispatchGuard *g, PyObject *t, PyObject **out)
{
    *out = NULL;
    int r = PyObject_IsInstance(t, g->fake_cls);
    if (r <= 0) {
        return r;
    }
    ms_state *st = PyType_GetModuleState(Py_TYPE(g));
    if (st == NULL) {
        return -1;
    }
    PyObject *mode, *in_kernel, *device;
    r = optional_attr(t, st->s_fake_mode, &mode);
    if (r <= 0) {
        return r;
    }
    if (mode == Py_None) {
        Py_DECREF(mode);
        return 0;
    }
    r = optional_attr(mode, st->s_in_kernel_invocation, &in_kernel);
    Py_DECREF(mode);
    if (r <= 0) {
        return r; /* none: taken as inside a kernel */
    }
    r = PyObject_IsTrue(in_kernel);
    Py_DECREF(in_kernel);
    if (r != 0) {
        return r < 0 ? -1 : 0;
    }
    r = optional_attr(t, st->s_fake_device, &device);
    if (r <= 0) {
        return r;
    }
    r = PyObject_IsInstance(device, g->device_type);
    if (r <= 0) {
        Py_DECREF(device);
        return r;
    }
    *out = device;
    return 1;
}

static PyObject *
guard_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                 PyObject *kwnames)
{
    DispatchGuard *g = (DispatchGuard *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    /* (self, func, types, args, kwargs), bound: prim.device of one
       tensor */
    if (g->device_op != NULL && nargs >= 4 && args[1] == g->device_op
        && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)
        && PyTuple_Check(args[3]) && PyTuple_GET_SIZE(args[3]) == 1)
    {
        PyObject *device;
        int r = fake_device(g, PyTuple_GET_ITEM(args[3], 0), &device);
        if (r != 0) {
            return device;
        }
    }
    PyInterpreterState *interp = PyInterpreterState_Get();
    PyObject *target = _PyInterpreterState_GetEvalFrameFunc(interp)
                               == _PyEval_EvalFrameDefault
                           ? g->fast
                           : g->safe;
    return PyObject_Vectorcall(target, args, nargsf, kwnames);
}

static PyObject *
guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *fast, *safe, *devices = Py_None;
    static char *kwlist[] = {"fast", "safe", "devices", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:DispatchGuard",
                                     kwlist, &fast, &safe, &devices))
    {
        return NULL;
    }
    if (!PyCallable_Check(fast) || !PyCallable_Check(safe)) {
        PyErr_SetString(PyExc_TypeError,
                        "DispatchGuard: fast and safe must be callable");
        return NULL;
    }
    if (devices != Py_None
        && (!PyTuple_Check(devices) || PyTuple_GET_SIZE(devices) != 3
            || !PyType_Check(PyTuple_GET_ITEM(devices, 1))
            || !PyType_Check(PyTuple_GET_ITEM(devices, 2))))
    {
        PyErr_SetString(PyExc_TypeError,
                        "DispatchGuard: devices must be None or (the "
                        "prim.device operator, the fake tensor class, "
                        "torch.device)");
        return NULL;
    }
    DispatchGuard *g = (DispatchGuard *)type->tp_alloc(type, 0);
    if (g == NULL) {
        return NULL;
    }
    g->fast = Py_NewRef(fast);
    g->safe = Py_NewRef(safe);
    if (devices != Py_None) {
        g->device_op = Py_NewRef(PyTuple_GET_ITEM(devices, 0));
        g->fake_cls = Py_NewRef(PyTuple_GET_ITEM(devices, 1));
        g->device_type = Py_NewRef(PyTuple_GET_ITEM(devices, 2));
    }
    g->vectorcall = guard_vectorcall;
    return (PyObject *)g;
}

static PyObject *
guard_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    (void)type;
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static int
guard_traverse(DispatchGuard *g, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(g));
    Py_VISIT(g->fast);
    Py_VISIT(g->safe);
    Py_VISIT(g->device_op);
    Py_VISIT(g->fake_cls);
    Py_VISIT(g->device_type);
    return 0;
}

static int
guard_clear(DispatchGuard *g)
{
    Py_CLEAR(g->fast);
    Py_CLEAR(g->safe);
    Py_CLEAR(g->device_op);
    Py_CLEAR(g->fake_cls);
    Py_CLEAR(g->device_type);
    return 0;
}

static void
guard_dealloc(DispatchGuard *g)
{
    PyTypeObject *tp = Py_TYPE(g);
    PyObject_GC_UnTrack(g);
    (void)guard_clear(g);
    tp->tp_free((PyObject *)g);
    Py_DECREF(tp);
}

static PyObject *
guard_is_fast(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    PyInterpreterState *interp = PyInterpreterState_Get();
    return PyBool_FromLong(_PyInterpreterState_GetEvalFrameFunc(interp)
                           == _PyEval_EvalFrameDefault);
}

static PyObject *
guard_get_fake_cls(PyObject *self, void *Py_UNUSED(closure))
{
    DispatchGuard *g = (DispatchGuard *)self;
    return Py_NewRef(g->fake_cls != NULL ? g->fake_cls : Py_None);
}

static PyGetSetDef guard_getset[] = {
    {"fake_cls", guard_get_fake_cls, NULL,
     "The fake tensors whose prim.device it answers (None: none).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef guard_methods[] = {
    {"is_fast", (PyCFunction)guard_is_fast, METH_NOARGS,
     "is_fast($self, /)\n--\n\n"
     "Whether a call now goes to fast (the interpreter's frame evaluator "
     "is its own)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef guard_members[] = {
    {"fast", Py_T_OBJECT_EX, offsetof(DispatchGuard, fast), Py_READONLY,
     "Called while the interpreter evaluates frames its own way."},
    {"safe", Py_T_OBJECT_EX, offsetof(DispatchGuard, safe), Py_READONLY,
     "Called under any other frame evaluator."},
    {"__vectorcalloffset__", Py_T_PYSSIZET,
     offsetof(DispatchGuard, vectorcall), Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot guard_slots[] = {
    {Py_tp_doc,
     "DispatchGuard(fast, safe, devices=None)\n--\n\n"
     "A method that calls fast while the interpreter's frame evaluator is "
     "its own (no frame can be traced by dynamo) and safe otherwise.  "
     "With devices, (prim.device, the fake tensor class, torch.device), "
     "it answers prim.device of a fake tensor outside a fake kernel "
     "itself, with the tensor's fake_device."},
    {Py_tp_new, guard_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, guard_descr_get},
    {Py_tp_dealloc, guard_dealloc},
    {Py_tp_traverse, guard_traverse},
    {Py_tp_clear, guard_clear},
    {Py_tp_methods, guard_methods},
    {Py_tp_members, guard_members},
    {Py_tp_getset, guard_getset},
    {0, NULL},
};

static PyType_Spec guard_spec = {
    .name = "memscale._core.DispatchGuard",
    .basicsize = sizeof(DispatchGuard),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = guard_slots,
};

int
ms_dispatch_guard_init_type(PyObject *module, ms_state *st)
{
    st->dispatch_guard_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &guard_spec, NULL);
    if (st->dispatch_guard_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->dispatch_guard_type);
}
