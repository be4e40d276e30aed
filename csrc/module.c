/*
 * module.c: memscale._core, module definition and state.
 *
 * Multi-phase init: every torch object and interned name the extension uses
 * lives in the module state, and the heap types are created per module
 * object, so the module can be re-imported (and used from sub-interpreters
 * that support it) without globals.
 */
#include "state.h"

#include "adam8bit.h"
#include "dispatch_guard.h"
#include "engine.h"
#include "executor.h"
#include "fake_calls.h"
#include "hardware.h"
#include "layer_stats.h"
#include "plan.h"
#include "profiler.h"
#include "spill.h"
#include "storage_track.h"
#include "tiling.h"
#include "units.h"

#include <string.h>

ms_state *
ms_get_state(PyObject *module)
{
    void *state = PyModule_GetState(module);
    assert(state != NULL);
    return (ms_state *)state;
}

ms_state *
ms_state_from_type(PyTypeObject *tp)
{
    PyObject *module = PyType_GetModuleByDef(tp, &ms_module_def);
    if (module == NULL) {
        return NULL;
    }
    return ms_get_state(module);
}

int
ms_call_enter(ms_state *st, PyObject *ctx)
{
    PyObject *res = PyObject_CallMethodNoArgs(ctx, st->s_enter);
    if (res == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
}

/*
 * Leave a context manager.  Safe to call with an exception set: the pending
 * exception is kept and wins over any error raised by __exit__ itself (that
 * one is reported as unraisable, so it is never silently lost).
 */
int
ms_call_exit(ms_state *st, PyObject *ctx)
{
    ms_exc_state saved;
    ms_exc_save(&saved);
    int had_exc = ms_exc_pending(&saved);
    PyObject *res = PyObject_CallMethodObjArgs(ctx, st->s_exit, Py_None,
                                               Py_None, Py_None, NULL);
    if (res == NULL) {
        if (had_exc) {
            PyErr_WriteUnraisable(ctx);
            ms_exc_restore(&saved);
        }
        return -1;
    }
    Py_DECREF(res);
    if (had_exc) {
        ms_exc_restore(&saved);
    }
    return 0;
}

int
ms_is_tensor(ms_state *st, PyObject *obj)
{
    return PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type);
}

/* 1 if the tensor t is on the CPU (t.device.type == "cpu"), 0 if not, -1
   with an exception set. */
int
ms_is_on_cpu(ms_state *st, PyObject *t)
{
    PyObject *dev = PyObject_GetAttr(t, st->s_device);
    PyObject *type = dev ? PyObject_GetAttr(dev, st->s_type) : NULL;
    Py_XDECREF(dev);
    if (type == NULL) {
        return -1;
    }
    int cpu = PyUnicode_Check(type)
              && PyUnicode_CompareWithASCIIString(type, "cpu") == 0;
    Py_DECREF(type);
    return cpu;
}

/* 1 if autograd records, 0 if not, -1 with an exception set. */
int
ms_grad_enabled(ms_state *st)
{
    PyObject *res = PyObject_CallNoArgs(st->is_grad_enabled);
    if (res == NULL) {
        return -1;
    }
    int enabled = PyObject_IsTrue(res);
    Py_DECREF(res);
    return enabled;
}

/*
 * The identity and size of a tensor's storage.  Views share a storage, so
 * the storage (not the tensor) is what memory is counted by.  The key is the
 * storage implementation's address (UntypedStorage._cdata), which is also
 * defined for meta and fake tensors, where data_ptr() is not.
 */
int
ms_storage_key_and_size(ms_state *st, PyObject *tensor, PyObject **key,
                        long long *nbytes)
{
    PyObject *storage = NULL, *size = NULL;
    *key = NULL;
    storage = PyObject_CallMethodNoArgs(tensor, st->s_untyped_storage);
    if (storage == NULL) {
        goto error;
    }
    *key = PyObject_GetAttr(storage, st->s_cdata);
    if (*key == NULL) {
        goto error;
    }
    size = PyObject_CallMethodNoArgs(storage, st->s_nbytes);
    if (size == NULL) {
        goto error;
    }
    *nbytes = PyLong_AsLongLong(size);
    if (*nbytes == -1 && PyErr_Occurred()) {
        goto error;
    }
    Py_DECREF(size);
    Py_DECREF(storage);
    return 0;
error:
    Py_CLEAR(*key);
    Py_XDECREF(size);
    Py_XDECREF(storage);
    return -1;
}

/* ------------------------------------------------------------------ */

/* clang-format off */
PyDoc_STRVAR(find_units_doc,
"find_units($module, model, /)\n--\n\n"
"Return the planning units of *model* as a list of (name, module) pairs.\n\n"
"The children of a ModuleList or Sequential that repeats a class (the\n"
"blocks of a transformer) are units; without such a container, the\n"
"top-level children are, split recursively where one holds more than half\n"
"of the parameters.");
/* clang-format on */

static PyObject *
find_units(PyObject *module, PyObject *model)
{
    return ms_find_units(module, model);
}

/* clang-format off */
PyDoc_STRVAR(detect_hardware_doc,
"detect_hardware($module, /, device_type, index=0)\n--\n\n"
"Describe the device a model trains on: a dict with device, index, count,\n"
"capacity_bytes, bf16 and name.  CPU capacity is the host's RAM.");
/* clang-format on */

/* clang-format off */
PyDoc_STRVAR(build_plan_doc,
"build_plan($module, /, layers, *, mode, allowed, force, budget_bytes,\n"
"           fixed_bytes, activation_bytes, total_flops, device,\n"
"           device_count, capacity_bytes, min_offload_bytes=0,\n"
"           host_tier=False, host_cap_bytes=-1, disk_tier=True,\n"
"           peak_offset_bytes=0, plan_offset_bytes=None, solver=False,\n"
"           async_offload=False, flop_rate=0.0, offload_bandwidth=0.0,\n"
"           tile_overhead=0.0, max_segment=64, resolution=512)\n--\n\n"
"Run the decision engine and return an immutable Plan.\n\n"
"layers is a sequence of LayerStats (or plain tuples of its fields:\n"
"name, kind, param_bytes, saved_bytes, input_bytes, flops, flags).\n"
"plan_offset_bytes=None (or absent) uses peak_offset_bytes for plans too.");
/* clang-format on */

/* clang-format off */
PyDoc_STRVAR(adamw8bit_doc,
"adamw8bit_step($module, /, param, grad, exp_avg, exp_avg_scale,\n"
"               exp_avg_sq, exp_avg_sq_scale, *, lr, beta1, beta2, eps,\n"
"               weight_decay, step, block, threads)\n--\n\n"
"One AdamW update of a contiguous float32 CPU parameter, in place, with\n"
"block-wise 8-bit moments (int8 exp_avg, uint8 sqrt(exp_avg_sq), one\n"
"float32 scale per block of `block` elements).  Releases the GIL and\n"
"splits the blocks over `threads` threads.");
/* clang-format on */

/* clang-format off */
PyDoc_STRVAR(tile_call_doc,
"tile_call($module, fn, args, kwargs, dim, tiles, /)\n--\n\n"
"Call fn on `tiles` consecutive slices of its tensor arguments along\n"
"`dim` and join the outputs along `dim`: the tiled call the executor makes,\n"
"without checkpoint frames (for verifying a layer is row-independent).");
/* clang-format on */

/* clang-format off */
PyDoc_STRVAR(track_doc,
"track($module, tracker, tensor, category=None, /)\n--\n\n"
"Register the storage of *tensor* with the OOM predictor's storage\n"
"tracker (memscale.predictor._tracker.StorageTracker.track): its new\n"
"serial, or None when the storage was known (a resize in place is\n"
"recorded).");
/* clang-format on */

static PyMethodDef module_methods[] = {
    {"tile_call", (PyCFunction)(void (*)(void))ms_tile_call, METH_FASTCALL,
     tile_call_doc},
    {"find_units", (PyCFunction)find_units, METH_O, find_units_doc},
    {"track", (PyCFunction)(void (*)(void))ms_track, METH_FASTCALL, track_doc},
    {"detect_hardware", (PyCFunction)(void (*)(void))ms_detect_hardware,
     METH_VARARGS | METH_KEYWORDS, detect_hardware_doc},
    {"build_plan", (PyCFunction)(void (*)(void))ms_plan_build,
     METH_VARARGS | METH_KEYWORDS, build_plan_doc},
    {"adamw8bit_step", (PyCFunction)(void (*)(void))ms_adamw8bit_step,
     METH_VARARGS | METH_KEYWORDS, adamw8bit_doc},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------ */

/* Resolve "a.b.c" relative to owner into *slot (a new reference). */
static int
lookup(PyObject **slot, PyObject *owner, const char *dotted)
{
    PyObject *obj = Py_NewRef(owner);
    const char *p = dotted;
    while (*p) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        PyObject *name = PyUnicode_FromStringAndSize(p, (Py_ssize_t)len);
        if (name == NULL) {
            Py_DECREF(obj);
            return -1;
        }
        Py_SETREF(obj, PyObject_GetAttr(obj, name));
        Py_DECREF(name);
        if (obj == NULL) {
            return -1;
        }
        p += len;
        if (*p == '.') {
            p++;
        }
    }
    *slot = obj;
    return 0;
}

/* mod.attr into *slot; attr "" is the module itself. */
static int
import_attr(PyObject **slot, const char *mod, const char *attr)
{
    PyObject *m = PyImport_ImportModule(mod);
    if (m == NULL) {
        return -1;
    }
    int rc = lookup(slot, m, attr);
    Py_DECREF(m);
    return rc;
}

/* The module state's objects, as MS_STATE (state.h) lists them; the heap
   types are made by each file's init function below. */
static int
state_exec(ms_state *st)
{
    /* clang-format off */
#define TYPE(field)
#define IMPORT(field, mod, attr)                                             \
    if (import_attr(&st->field, mod, attr) < 0) {                           \
        return -1;                                                           \
    }
#define EXC(field, name, doc)                                                \
    st->field = PyErr_NewExceptionWithDoc(name, doc, PyExc_Exception, NULL); \
    if (st->field == NULL) {                                                 \
        return -1;                                                           \
    }
#define NAME(field, text)                                                    \
    st->field = PyUnicode_InternFromString(text);                            \
    if (st->field == NULL) {                                                 \
        return -1;                                                           \
    }
    MS_STATE(TYPE, IMPORT, EXC, NAME)
#undef TYPE
#undef IMPORT
#undef EXC
#undef NAME
    /* clang-format on */
    return 0;
}

static int
module_exec(PyObject *module)
{
    ms_state *st = ms_get_state(module);
    if (state_exec(st) < 0) {
        return -1;
    }
    if (ms_layer_stats_init_type(module, st) < 0
        || ms_plan_init_types(module, st) < 0
        || ms_executor_init_types(module, st) < 0
        || ms_profiler_init_types(module, st) < 0
        || ms_spill_init_types(module, st) < 0
        || ms_dispatch_guard_init_type(module, st) < 0
        || ms_fake_calls_init_type(module, st) < 0
        || ms_storage_track_init_type(module, st) < 0)
    {
        return -1;
    }
    if (PyModule_AddStringConstant(module, "ABI", "cpython-c-api") < 0
        || PyModule_AddIntConstant(module, "TECH_CHECKPOINT",
                                   MS_TECH_CHECKPOINT)
               < 0
        || PyModule_AddIntConstant(module, "TECH_OFFLOAD", MS_TECH_OFFLOAD) < 0
        || PyModule_AddIntConstant(module, "TECH_TILING", MS_TECH_TILING) < 0
        || PyModule_AddIntConstant(module, "TECH_SELECTIVE", MS_TECH_SELECTIVE)
               < 0
        || PyModule_AddIntConstant(module, "LAYER_TILEABLE", MS_LAYER_TILEABLE)
               < 0
        || PyModule_AddIntConstant(module, "LAYER_UNREPEATABLE",
                                   MS_LAYER_UNREPEATABLE)
               < 0
        || PyModule_AddIntConstant(module, "MAX_TILES", MS_MAX_TILES) < 0)
    {
        return -1;
    }
    return 0;
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    ms_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return 0;
    }
    /* clang-format off */
#define TYPE(field) Py_VISIT(st->field);
#define IMPORT(field, mod, attr) Py_VISIT(st->field);
#define EXC(field, name, doc) Py_VISIT(st->field);
#define NAME(field, text) Py_VISIT(st->field);
    MS_STATE(TYPE, IMPORT, EXC, NAME)
#undef TYPE
#undef IMPORT
#undef EXC
#undef NAME
    /* clang-format on */
    return 0;
}

static int
module_clear(PyObject *module)
{
    ms_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return 0;
    }
    /* clang-format off */
#define TYPE(field) Py_CLEAR(st->field);
#define IMPORT(field, mod, attr) Py_CLEAR(st->field);
#define EXC(field, name, doc) Py_CLEAR(st->field);
#define NAME(field, text) Py_CLEAR(st->field);
    MS_STATE(TYPE, IMPORT, EXC, NAME)
#undef TYPE
#undef IMPORT
#undef EXC
#undef NAME
    /* clang-format on */
    return 0;
}

static void
module_free(void *module)
{
    (void)module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_MOD_MULTI_INTERPRETERS_NOT_SUPPORTED
    /* torch itself cannot be loaded in a sub-interpreter. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTI_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

/* clang-format off */
PyDoc_STRVAR(module_doc,
"memscale._core: the profiler, decision engine, plan and executor.\n\n"
"Internal: use the memscale package.");
/* clang-format on */

PyModuleDef ms_module_def = {
    PyModuleDef_HEAD_INIT,         .m_name = "memscale._core",
    .m_doc = module_doc,           .m_size = sizeof(ms_state),
    .m_methods = module_methods,   .m_slots = module_slots,
    .m_traverse = module_traverse, .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&ms_module_def);
}
