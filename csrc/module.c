/*
 * module.c: memscale._core, module definition and state.
 *
 * Multi-phase init: every torch object and interned name the extension uses
 * lives in the module state, and the heap types are created per module
 * object, so the module can be re-imported (and used from sub-interpreters
 * that support it) without globals.
 */
#include "ms.h"

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

PyDoc_STRVAR(find_units_doc,
"find_units($module, model, /)\n--\n\n"
"Return the planning units of *model* as a list of (name, module) pairs.\n\n"
"The children of a ModuleList or Sequential that repeats a class (the\n"
"blocks of a transformer) are units; without such a container, the\n"
"top-level children are, split recursively where one holds more than half\n"
"of the parameters.");

static PyObject *
find_units(PyObject *module, PyObject *model)
{
    return ms_find_units(module, model);
}

PyDoc_STRVAR(detect_hardware_doc,
"detect_hardware($module, /, device_type, index=0)\n--\n\n"
"Describe the device a model trains on: a dict with device, index, count,\n"
"capacity_bytes, bf16 and name.  CPU capacity is the host's RAM.");

PyDoc_STRVAR(build_plan_doc,
"build_plan($module, /, layers, *, mode, allowed, force, budget_bytes,\n"
"           fixed_bytes, activation_bytes, total_flops, device,\n"
"           device_count, capacity_bytes, min_offload_bytes=0,\n"
"           host_tier=False, host_cap_bytes=-1, disk_tier=True,\n"
"           peak_offset_bytes=0, plan_offset_bytes=None, solver=False,\n"
"           async_offload=False, flop_rate=0.0, offload_bandwidth=0.0,\n"
"           tile_overhead=0.0, max_segment=64, resolution=512)\n--\n\n"
"Run the decision engine and return an immutable Plan.\n\n"
"layers is a sequence of (name, kind, param_bytes, saved_bytes,\n"
"input_bytes, flops, flags) tuples as the profiler reports them.\n"
"plan_offset_bytes=None (or absent) uses peak_offset_bytes for plans too.");

PyDoc_STRVAR(adamw8bit_doc,
"adamw8bit_step($module, /, param, grad, exp_avg, exp_avg_scale,\n"
"               exp_avg_sq, exp_avg_sq_scale, *, lr, beta1, beta2, eps,\n"
"               weight_decay, step, block, threads)\n--\n\n"
"One AdamW update of a contiguous float32 CPU parameter, in place, with\n"
"block-wise 8-bit moments (int8 exp_avg, uint8 sqrt(exp_avg_sq), one\n"
"float32 scale per block of `block` elements).  Releases the GIL and\n"
"splits the blocks over `threads` threads.");

PyDoc_STRVAR(tile_call_doc,
"tile_call($module, fn, args, kwargs, dim, tiles, /)\n--\n\n"
"Call fn on `tiles` consecutive slices of its tensor arguments along\n"
"`dim` and join the outputs along `dim`: the tiled call the executor makes,\n"
"without checkpoint frames (for verifying a layer is row-independent).");

static PyMethodDef module_methods[] = {
    {"tile_call", (PyCFunction)(void (*)(void))ms_tile_call, METH_FASTCALL,
     tile_call_doc},
    {"find_units", (PyCFunction)find_units, METH_O, find_units_doc},
    {"detect_hardware", (PyCFunction)(void (*)(void))ms_detect_hardware,
     METH_VARARGS | METH_KEYWORDS, detect_hardware_doc},
    {"build_plan", (PyCFunction)(void (*)(void))ms_plan_build,
     METH_VARARGS | METH_KEYWORDS, build_plan_doc},
    {"adamw8bit_step", (PyCFunction)(void (*)(void))ms_adamw8bit_step,
     METH_VARARGS | METH_KEYWORDS, adamw8bit_doc},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------ */

static int
intern(PyObject **slot, const char *name)
{
    *slot = PyUnicode_InternFromString(name);
    return *slot == NULL ? -1 : 0;
}

static int
lookup(PyObject **slot, PyObject *owner, const char *dotted)
{
    /* Resolve "a.b.c" relative to owner. */
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

static int
module_exec(PyObject *module)
{
    ms_state *st = ms_get_state(module);
    PyObject *time_mod = NULL;

    st->torch = PyImport_ImportModule("torch");
    if (st->torch == NULL) {
        return -1;
    }
    /* torch.autograd.graph is not imported by "import torch" in every
       release; import it explicitly. */
    PyObject *graph = PyImport_ImportModule("torch.autograd.graph");
    if (graph == NULL) {
        return -1;
    }
    int rc = lookup(&st->saved_tensors_hooks, graph, "saved_tensors_hooks");
    Py_DECREF(graph);
    if (rc < 0) {
        return -1;
    }
    time_mod = PyImport_ImportModule("time");
    if (time_mod == NULL) {
        return -1;
    }
    rc = lookup(&st->perf_counter_ns, time_mod, "perf_counter_ns");
    Py_DECREF(time_mod);
    if (rc < 0) {
        return -1;
    }
    if (lookup(&st->tensor_type, st->torch, "Tensor") < 0
        || lookup(&st->torch_module_type, st->torch, "nn.Module") < 0
        || lookup(&st->module_list_type, st->torch, "nn.ModuleList") < 0
        || lookup(&st->sequential_type, st->torch, "nn.Sequential") < 0
        || lookup(&st->get_rng_state, st->torch, "get_rng_state") < 0
        || lookup(&st->set_rng_state, st->torch, "set_rng_state") < 0
        || lookup(&st->is_grad_enabled, st->torch, "is_grad_enabled") < 0
        || lookup(&st->enable_grad, st->torch, "enable_grad") < 0
        || lookup(&st->autocast, st->torch, "autocast") < 0
        || lookup(&st->is_autocast_enabled, st->torch,
                  "is_autocast_enabled") < 0
        || lookup(&st->get_autocast_dtype, st->torch,
                  "get_autocast_dtype") < 0
        || lookup(&st->cuda_is_initialized, st->torch,
                  "cuda.is_initialized") < 0
        || lookup(&st->cuda_get_rng_state_all, st->torch,
                  "cuda.get_rng_state_all") < 0
        || lookup(&st->cuda_set_rng_state_all, st->torch,
                  "cuda.set_rng_state_all") < 0
        || lookup(&st->empty_strided, st->torch, "empty_strided") < 0
        || lookup(&st->strided, st->torch, "strided") < 0
        || lookup(&st->cat, st->torch, "cat") < 0)
    {
        return -1;
    }

    if (intern(&st->s_register_forward_pre_hook,
               "register_forward_pre_hook") < 0
        || intern(&st->s_register_forward_hook, "register_forward_hook") < 0
        || intern(&st->s_with_kwargs, "with_kwargs") < 0
        || intern(&st->s_always_call, "always_call") < 0
        || intern(&st->s_remove, "remove") < 0
        || intern(&st->s_untyped_storage, "untyped_storage") < 0
        || intern(&st->s_cdata, "_cdata") < 0
        || intern(&st->s_nbytes, "nbytes") < 0
        || intern(&st->s_shape, "shape") < 0
        || intern(&st->s_dtype, "dtype") < 0
        || intern(&st->s_version, "_version") < 0
        || intern(&st->s_training, "training") < 0
        || intern(&st->s_enter, "__enter__") < 0
        || intern(&st->s_exit, "__exit__") < 0
        || intern(&st->s_detach, "detach") < 0
        || intern(&st->s_named_children, "named_children") < 0
        || intern(&st->s_parameters, "parameters") < 0
        || intern(&st->s_buffers, "buffers") < 0
        || intern(&st->s_get_total_flops, "get_total_flops") < 0
        || intern(&st->s_cpu, "cpu") < 0
        || intern(&st->s_cuda, "cuda") < 0
        || intern(&st->s_pack, "_pack") < 0
        || intern(&st->s_unpack, "_unpack") < 0
        || intern(&st->s_rpack, "_rpack") < 0
        || intern(&st->s_runpack, "_runpack") < 0
        || intern(&st->s_count, "_count") < 0
        || intern(&st->s_ident, "_ident") < 0
        || intern(&st->s_device_type, "device_type") < 0
        || intern(&st->s_dtype_kw, "dtype") < 0
        || intern(&st->s_enabled, "enabled") < 0
        || intern(&st->s_copy_, "copy_") < 0
        || intern(&st->s_clone, "clone") < 0
        || intern(&st->s_grad_fn, "grad_fn") < 0
        || intern(&st->s_device, "device") < 0
        || intern(&st->s_type, "type") < 0
        || intern(&st->s_is_contiguous, "is_contiguous") < 0
        || intern(&st->s_numel, "numel") < 0
        || intern(&st->s_element_size, "element_size") < 0
        || intern(&st->s_data_ptr, "data_ptr") < 0
        || intern(&st->s_stride, "stride") < 0
        || intern(&st->s_requires_grad, "requires_grad") < 0
        || intern(&st->s_requires_grad_, "requires_grad_") < 0
        || intern(&st->s_get, "get") < 0
        || intern(&st->s_put, "put") < 0
        || intern(&st->s_layout, "layout") < 0
        || intern(&st->s_is_conj, "is_conj") < 0
        || intern(&st->s_is_neg, "is_neg") < 0)
    {
        return -1;
    }

    /* Raised inside a recompute once every needed tensor exists, to skip
       the rest of the layer (like torch.utils.checkpoint's early stop). */
    st->stop_recompute = PyErr_NewExceptionWithDoc(
        "memscale._core._StopRecompute",
        "Internal: ends a recompute early. Never escapes memscale.",
        PyExc_Exception, NULL);
    if (st->stop_recompute == NULL) {
        return -1;
    }
    if (ms_plan_init_types(module, st) < 0
        || ms_executor_init_types(module, st) < 0
        || ms_profiler_init_types(module, st) < 0
        || ms_spill_init_types(module, st) < 0)
    {
        return -1;
    }
    if (PyModule_AddStringConstant(module, "ABI", "cpython-c-api") < 0
        || PyModule_AddIntConstant(module, "TECH_CHECKPOINT",
                                   MS_TECH_CHECKPOINT) < 0
        || PyModule_AddIntConstant(module, "TECH_OFFLOAD", MS_TECH_OFFLOAD) < 0
        || PyModule_AddIntConstant(module, "TECH_TILING", MS_TECH_TILING) < 0
        || PyModule_AddIntConstant(module, "LAYER_TILEABLE",
                                   MS_LAYER_TILEABLE) < 0
        || PyModule_AddIntConstant(module, "LAYER_UNREPEATABLE",
                                   MS_LAYER_UNREPEATABLE) < 0
        || PyModule_AddIntConstant(module, "MAX_TILES", MS_MAX_TILES) < 0)
    {
        return -1;
    }
    return 0;
}

#define MS_VISIT_ALL(op)                                                      \
    op(plan_type) op(layer_plan_type) op(executor_type) op(frame_type)       \
    op(handle_type) op(tiled_type) op(profiler_type) op(torch)                \
    op(tensor_type) op(torch_module_type) op(module_list_type) op(sequential_type)                 \
    op(get_rng_state) op(set_rng_state) op(is_grad_enabled) op(enable_grad)  \
    op(autocast) op(is_autocast_enabled) op(get_autocast_dtype)              \
    op(saved_tensors_hooks) op(cuda_is_initialized)                          \
    op(cuda_get_rng_state_all) op(cuda_set_rng_state_all)                    \
    op(perf_counter_ns) op(stop_recompute) op(s_register_forward_pre_hook)                      \
    op(s_register_forward_hook) op(s_with_kwargs) op(s_always_call)          \
    op(s_remove) op(s_untyped_storage) op(s_cdata) op(s_nbytes) op(s_shape)  \
    op(s_dtype) op(s_version) op(s_training) op(s_enter) op(s_exit)          \
    op(s_detach) op(s_named_children) op(s_parameters) op(s_buffers)         \
    op(s_get_total_flops) op(s_cpu) op(s_cuda) op(s_pack) op(s_unpack)       \
    op(s_rpack) op(s_runpack) op(s_count) op(s_ident) op(s_device_type)      \
    op(s_dtype_kw) op(s_enabled) op(s_copy_) op(s_clone)                    \
    op(spilled_type) op(spill_store_type) op(empty_strided) op(s_grad_fn)    \
    op(s_device) op(s_type) op(s_is_contiguous) op(s_numel)                  \
    op(s_element_size) op(s_data_ptr) op(s_stride) op(s_requires_grad)      \
    op(s_requires_grad_) op(s_get) op(s_put) op(strided) op(s_layout)        \
    op(s_is_conj) op(s_is_neg) op(cat)

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    ms_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return 0;
    }
#define VISIT(name) Py_VISIT(st->name);
    MS_VISIT_ALL(VISIT)
#undef VISIT
    return 0;
}

static int
module_clear(PyObject *module)
{
    ms_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return 0;
    }
#define CLEAR(name) Py_CLEAR(st->name);
    MS_VISIT_ALL(CLEAR)
#undef CLEAR
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

PyDoc_STRVAR(module_doc,
"memscale._core: the profiler, decision engine, plan and executor.\n\n"
"Internal: use the memscale package.");

PyModuleDef ms_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "memscale._core",
    .m_doc = module_doc,
    .m_size = sizeof(ms_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&ms_module_def);
}
