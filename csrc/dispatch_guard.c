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
 */
#include "dispatch_guard.h"

#include <stddef.h> /* offsetof, for the member table */

typedef struct {
    PyObject_HEAD
    PyObject *fast;
    PyObject *safe;
    vectorcallfunc vectorcall;
} DispatchGuard;

static PyObject *
guard_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                 PyObject *kwnames)
{
    DispatchGuard *g = (DispatchGuard *)self;
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
    PyObject *fast, *safe;
    static char *kwlist[] = {"fast", "safe", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:DispatchGuard", kwlist,
                                     &fast, &safe))
    {
        return NULL;
    }
    if (!PyCallable_Check(fast) || !PyCallable_Check(safe)) {
        PyErr_SetString(PyExc_TypeError,
                        "DispatchGuard: fast and safe must be callable");
        return NULL;
    }
    DispatchGuard *g = (DispatchGuard *)type->tp_alloc(type, 0);
    if (g == NULL) {
        return NULL;
    }
    g->fast = Py_NewRef(fast);
    g->safe = Py_NewRef(safe);
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
    return 0;
}

static int
guard_clear(DispatchGuard *g)
{
    Py_CLEAR(g->fast);
    Py_CLEAR(g->safe);
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
     "DispatchGuard(fast, safe)\n--\n\n"
     "A method that calls fast while the interpreter's frame evaluator is "
     "its own (no frame can be traced by dynamo) and safe otherwise."},
    {Py_tp_new, guard_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, guard_descr_get},
    {Py_tp_dealloc, guard_dealloc},
    {Py_tp_traverse, guard_traverse},
    {Py_tp_clear, guard_clear},
    {Py_tp_methods, guard_methods},
    {Py_tp_members, guard_members},
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
