/*
 * state.h: the module state of memscale._core and module.c's helpers.
 *
 * The extension uses the CPython C API only.  Torch is reached through its
 * Python objects, which module.c caches in the module state below when the
 * module is executed (multi-phase init).  Objects that need the state keep a
 * strong reference to the module object, so the state outlives them.
 */
#ifndef MEMSCALE_STATE_H
#define MEMSCALE_STATE_H

#include "compat.h"

/*
 * The module state, as one list: every field once, with how module.c
 * creates it.  The list generates the struct below and, in module.c, its
 * creation (module_exec), traverse and clear, so nothing can be added to
 * one and forgotten in another.  The entries:
 *
 *   TYPE(field)                a heap type of ours, made by the init
 *                              function of the file that owns it
 *   IMPORT(field, mod, attr)   mod.attr (attr may be dotted), looked up
 *                              once; "" for the module itself
 *   EXC(field, name, doc)      an exception class of ours
 *   NAME(field, "text")        an interned string: an attribute or method
 *                              name the C calls by
 *
 * Each macro argument is applied to every entry of its kind, in order.
 */
/* clang-format off */
#define MS_STATE(TYPE, IMPORT, EXC, NAME)                                    \
    /* Our heap types. */                                                    \
    TYPE(plan_type)                                                          \
    TYPE(layer_plan_type)                                                    \
    TYPE(layer_stats_type)                                                   \
    TYPE(executor_type)                                                      \
    TYPE(frame_type)                                                         \
    TYPE(handle_type)                                                        \
    TYPE(tiled_type)                                                         \
    TYPE(profiler_type)                                                      \
    TYPE(spilled_type)                                                       \
    TYPE(spill_store_type)                                                   \
    TYPE(dispatch_guard_type)                                                \
    TYPE(fake_calls_type)                                                    \
    TYPE(freed_type)                                                         \
    /* Torch callables and types, looked up once. */                         \
    IMPORT(torch, "torch", "")                                               \
    IMPORT(tensor_type, "torch", "Tensor")                                   \
    IMPORT(torch_module_type, "torch", "nn.Module")                          \
    IMPORT(module_list_type, "torch", "nn.ModuleList")                       \
    IMPORT(sequential_type, "torch", "nn.Sequential")                        \
    IMPORT(get_rng_state, "torch", "get_rng_state")                          \
    IMPORT(set_rng_state, "torch", "set_rng_state")                          \
    IMPORT(is_grad_enabled, "torch", "is_grad_enabled")                      \
    IMPORT(enable_grad, "torch", "enable_grad")             /* a class */    \
    IMPORT(autocast, "torch", "autocast")                   /* a class */    \
    IMPORT(is_autocast_enabled, "torch", "is_autocast_enabled")              \
    IMPORT(get_autocast_dtype, "torch", "get_autocast_dtype")                \
    /* torch.autograd.graph is not imported by "import torch" in every       \
       release: it is imported by name. */                                   \
    IMPORT(saved_tensors_hooks, "torch.autograd.graph",                      \
           "saved_tensors_hooks")                                            \
    IMPORT(cuda_is_initialized, "torch", "cuda.is_initialized")              \
    IMPORT(cuda_get_rng_state_all, "torch", "cuda.get_rng_state_all")        \
    IMPORT(cuda_set_rng_state_all, "torch", "cuda.set_rng_state_all")        \
    IMPORT(empty_strided, "torch", "empty_strided")                          \
    IMPORT(strided, "torch", "strided")                                      \
    IMPORT(cat, "torch", "cat")                                              \
    /* Raised inside a recompute once every needed tensor exists, to skip    \
       the rest of the layer (like torch.utils.checkpoint's early stop). */  \
    EXC(stop_recompute, "memscale._core._StopRecompute",                     \
        "Internal: ends a recompute early. Never escapes memscale.")         \
    /* Interned names. */                                                    \
    NAME(s_register_forward_pre_hook, "register_forward_pre_hook")           \
    NAME(s_register_forward_hook, "register_forward_hook")                   \
    NAME(s_with_kwargs, "with_kwargs")                                       \
    NAME(s_always_call, "always_call")                                       \
    NAME(s_remove, "remove")                                                 \
    NAME(s_untyped_storage, "untyped_storage")                               \
    NAME(s_cdata, "_cdata")                                                  \
    NAME(s_nbytes, "nbytes")                                                 \
    NAME(s_shape, "shape")                                                   \
    NAME(s_dtype, "dtype")                                                   \
    NAME(s_version, "_version")                                              \
    NAME(s_training, "training")                                             \
    NAME(s_enter, "__enter__")                                               \
    NAME(s_exit, "__exit__")                                                 \
    NAME(s_detach, "detach")                                                 \
    NAME(s_named_children, "named_children")                                 \
    NAME(s_parameters, "parameters")                                         \
    NAME(s_buffers, "buffers")                                               \
    NAME(s_get_total_flops, "get_total_flops")                               \
    NAME(s_cpu, "cpu")                                                       \
    NAME(s_cuda, "cuda")                                                     \
    NAME(s_pack, "_pack")                                                    \
    NAME(s_unpack, "_unpack")                                                \
    NAME(s_rpack, "_rpack")                                                  \
    NAME(s_runpack, "_runpack")                                              \
    NAME(s_dpack, "_dpack")                                                  \
    NAME(s_count, "_count")                                                  \
    NAME(s_ident, "_ident")                                                  \
    NAME(s_pre, "_pre")                                                      \
    NAME(s_post, "_post")                                                    \
    NAME(s_root_pre, "_root_pre")                                            \
    NAME(s_root_post, "_root_post")                                          \
    NAME(s_enabled, "enabled")                                               \
    NAME(s_copy_, "copy_")                                                   \
    NAME(s_clone, "clone")                                                   \
    NAME(s_equal, "equal")                                                   \
    NAME(s_narrow, "narrow")                                                 \
    NAME(s_grad_fn, "grad_fn")                                               \
    NAME(s_device, "device")                                                 \
    NAME(s_type, "type")                                                     \
    NAME(s_is_contiguous, "is_contiguous")                                   \
    NAME(s_numel, "numel")                                                   \
    NAME(s_element_size, "element_size")                                     \
    NAME(s_data_ptr, "data_ptr")                                             \
    NAME(s_stride, "stride")                                                 \
    NAME(s_requires_grad, "requires_grad")                                   \
    NAME(s_requires_grad_, "requires_grad_")                                 \
    NAME(s_get, "get")                                                       \
    NAME(s_put, "put")                                                       \
    NAME(s_layout, "layout")                                                 \
    NAME(s_is_conj, "is_conj")                                               \
    NAME(s_active, "active")                                                 \
    NAME(s_sizes, "sizes")                                                   \
    NAME(s_sizes_at_birth, "sizes_at_birth")                                 \
    NAME(s_categories, "categories")                                         \
    NAME(s_events, "events")                                                 \
    NAME(s_granule, "granule")                                               \
    NAME(s_phase, "phase")                                                   \
    NAME(s_recompute_depth, "recompute_depth")                               \
    NAME(s_known, "_known")                                                  \
    NAME(s_activations, "activations")                                       \
    NAME(s_workspace, "workspace")                                           \
    NAME(s_is_neg, "is_neg")                                                 \
    NAME(s_fake_mode, "fake_mode")                                           \
    NAME(s_in_kernel_invocation, "in_kernel_invocation")                     \
    NAME(s_fake_device, "fake_device")

#define MS_STATE_TYPE_FIELD(field) PyTypeObject *field;
#define MS_STATE_IMPORT_FIELD(field, mod, attr) PyObject *field;
#define MS_STATE_EXC_FIELD(field, name, doc) PyObject *field;
#define MS_STATE_NAME_FIELD(field, text) PyObject *field;

typedef struct {
    MS_STATE(MS_STATE_TYPE_FIELD, MS_STATE_IMPORT_FIELD, MS_STATE_EXC_FIELD,
             MS_STATE_NAME_FIELD)
} ms_state;

#undef MS_STATE_TYPE_FIELD
#undef MS_STATE_IMPORT_FIELD
#undef MS_STATE_EXC_FIELD
#undef MS_STATE_NAME_FIELD
/* clang-format on */

extern PyModuleDef ms_module_def;
ms_state *ms_get_state(PyObject *module);
ms_state *ms_state_from_type(PyTypeObject *tp);

/* Enter a context manager: 0, or -1 with an exception set. */
int ms_call_enter(ms_state *st, PyObject *ctx);
/* Leave it; a pending exception is kept (see module.c). */
int ms_call_exit(ms_state *st, PyObject *ctx);
int ms_is_tensor(ms_state *st, PyObject *obj);
/* 1 if a tensor is on the CPU, 0 if not, -1 with an exception set. */
int ms_is_on_cpu(ms_state *st, PyObject *t);
/* 1 if autograd records, 0 if not, -1 with an exception set. */
int ms_grad_enabled(ms_state *st);
/* The identity and size of a tensor's storage (see module.c). */
int ms_storage_key_and_size(ms_state *st, PyObject *tensor, PyObject **key,
                            long long *nbytes);

#endif /* MEMSCALE_STATE_H */
