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

typedef struct {
    /* Our heap types. */
    PyTypeObject *plan_type;
    PyTypeObject *layer_plan_type;
    PyTypeObject *executor_type;
    PyTypeObject *frame_type;
    PyTypeObject *handle_type;
    PyTypeObject *tiled_type;
    PyTypeObject *profiler_type;
    PyTypeObject *spilled_type;
    PyTypeObject *spill_store_type;

    /* Torch callables and types, looked up once. */
    PyObject *torch;
    PyObject *tensor_type;       /* torch.Tensor */
    PyObject *torch_module_type; /* torch.nn.Module */
    PyObject *module_list_type;  /* torch.nn.ModuleList */
    PyObject *sequential_type;   /* torch.nn.Sequential */
    PyObject *get_rng_state;
    PyObject *set_rng_state;
    PyObject *is_grad_enabled;
    PyObject *enable_grad;         /* class: a context manager */
    PyObject *autocast;            /* class: a context manager */
    PyObject *is_autocast_enabled; /* (device_type) -> bool */
    PyObject *get_autocast_dtype;  /* (device_type) -> dtype */
    PyObject *saved_tensors_hooks; /* class: a context manager */
    PyObject *cuda_is_initialized;
    PyObject *cuda_get_rng_state_all;
    PyObject *cuda_set_rng_state_all;
    PyObject *perf_counter_ns; /* time.perf_counter_ns */
    PyObject *stop_recompute;  /* our exception: recompute is done */
    PyObject *empty_strided;   /* torch.empty_strided */
    PyObject *strided;         /* torch.strided */
    PyObject *cat;             /* torch.cat */

    /* Interned names. */
    PyObject *s_register_forward_pre_hook;
    PyObject *s_register_forward_hook;
    PyObject *s_with_kwargs;
    PyObject *s_always_call;
    PyObject *s_remove;
    PyObject *s_untyped_storage;
    PyObject *s_cdata;
    PyObject *s_nbytes;
    PyObject *s_shape;
    PyObject *s_dtype;
    PyObject *s_version;
    PyObject *s_training;
    PyObject *s_enter;
    PyObject *s_exit;
    PyObject *s_detach;
    PyObject *s_named_children;
    PyObject *s_parameters;
    PyObject *s_buffers;
    PyObject *s_get_total_flops;
    PyObject *s_cpu;
    PyObject *s_cuda;
    PyObject *s_pack;
    PyObject *s_unpack;
    PyObject *s_rpack;
    PyObject *s_runpack;
    PyObject *s_count;
    PyObject *s_ident;
    PyObject *s_device_type;
    PyObject *s_dtype_kw;
    PyObject *s_enabled;
    PyObject *s_copy_;
    PyObject *s_clone;
    PyObject *s_grad_fn;
    PyObject *s_device;
    PyObject *s_type;
    PyObject *s_is_contiguous;
    PyObject *s_numel;
    PyObject *s_element_size;
    PyObject *s_data_ptr;
    PyObject *s_stride;
    PyObject *s_requires_grad;
    PyObject *s_requires_grad_;
    PyObject *s_get;
    PyObject *s_put;
    PyObject *s_layout;
    PyObject *s_is_conj;
    PyObject *s_is_neg;
} ms_state;

extern PyModuleDef ms_module_def;
ms_state *ms_get_state(PyObject *module);
ms_state *ms_state_from_type(PyTypeObject *tp);

/* Enter a context manager: 0, or -1 with an exception set. */
int ms_call_enter(ms_state *st, PyObject *ctx);
/* Leave it; a pending exception is kept (see module.c). */
int ms_call_exit(ms_state *st, PyObject *ctx);
int ms_is_tensor(ms_state *st, PyObject *obj);
/* 1 if autograd records, 0 if not, -1 with an exception set. */
int ms_grad_enabled(ms_state *st);
/* The identity and size of a tensor's storage (see module.c). */
int ms_storage_key_and_size(ms_state *st, PyObject *tensor, PyObject **key,
                            long long *nbytes);

#endif /* MEMSCALE_STATE_H */
