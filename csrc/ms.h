/*
 * ms.h: what the files of memscale._core share.
 *
 * The extension uses the CPython C API only.  Torch is reached through its
 * Python objects, which module.c caches in the module state below when the
 * module is executed (multi-phase init).  Objects that need the state keep a
 * strong reference to the module object, so the state outlives them.
 */
#ifndef MEMSCALE_MS_H
#define MEMSCALE_MS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "engine.h"

/* Member-definition names of 3.12+, on 3.11 too. */
#if PY_VERSION_HEX < 0x030C0000
#include "structmember.h"
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_T_LONGLONG T_LONGLONG
#define Py_T_DOUBLE T_DOUBLE
#define Py_T_BOOL T_BOOL
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_INT T_INT
#define Py_READONLY READONLY
#endif

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
    PyObject *tensor_type;          /* torch.Tensor */
    PyObject *torch_module_type;    /* torch.nn.Module */
    PyObject *module_list_type;     /* torch.nn.ModuleList */
    PyObject *sequential_type;      /* torch.nn.Sequential */
    PyObject *get_rng_state;
    PyObject *set_rng_state;
    PyObject *is_grad_enabled;
    PyObject *enable_grad;          /* class: a context manager */
    PyObject *autocast;             /* class: a context manager */
    PyObject *is_autocast_enabled;  /* (device_type) -> bool */
    PyObject *get_autocast_dtype;   /* (device_type) -> dtype */
    PyObject *saved_tensors_hooks;  /* class: a context manager */
    PyObject *cuda_is_initialized;
    PyObject *cuda_get_rng_state_all;
    PyObject *cuda_set_rng_state_all;
    PyObject *perf_counter_ns;      /* time.perf_counter_ns */
    PyObject *stop_recompute;       /* our exception: recompute is done */
    PyObject *empty_strided;        /* torch.empty_strided */
    PyObject *strided;              /* torch.strided */
    PyObject *cat;                  /* torch.cat */

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

/*
 * Saving and restoring a pending exception around clean-up calls, on every
 * supported Python (PyErr_GetRaisedException only exists from 3.12 on).
 */
#if PY_VERSION_HEX >= 0x030C0000
typedef struct {
    PyObject *exc;
} ms_exc_state;

static inline void
ms_exc_save(ms_exc_state *s)
{
    s->exc = PyErr_GetRaisedException();
}

static inline void
ms_exc_restore(ms_exc_state *s)
{
    PyErr_SetRaisedException(s->exc);
    s->exc = NULL;
}

static inline int
ms_exc_pending(const ms_exc_state *s)
{
    return s->exc != NULL;
}
#else
typedef struct {
    PyObject *type, *value, *tb;
} ms_exc_state;

static inline void
ms_exc_save(ms_exc_state *s)
{
    PyErr_Fetch(&s->type, &s->value, &s->tb);
}

static inline void
ms_exc_restore(ms_exc_state *s)
{
    PyErr_Restore(s->type, s->value, s->tb);
    s->type = s->value = s->tb = NULL;
}

static inline int
ms_exc_pending(const ms_exc_state *s)
{
    return s->type != NULL;
}
#endif

/* module.c */
extern PyModuleDef ms_module_def;
ms_state *ms_get_state(PyObject *module);
ms_state *ms_state_from_type(PyTypeObject *tp);

/* Small helpers (module.c). */
int ms_call_enter(ms_state *st, PyObject *ctx);
int ms_call_exit(ms_state *st, PyObject *ctx);
int ms_is_tensor(ms_state *st, PyObject *obj);
int ms_grad_enabled(ms_state *st);
int ms_storage_key_and_size(ms_state *st, PyObject *tensor, PyObject **key,
                            long long *nbytes);

/* Type registration: each file adds its types to the module state. */
int ms_plan_init_types(PyObject *module, ms_state *st);
int ms_executor_init_types(PyObject *module, ms_state *st);
int ms_profiler_init_types(PyObject *module, ms_state *st);
int ms_spill_init_types(PyObject *module, ms_state *st);

/* spill.c: the disk tier of offload. */
/* A record standing for the spilled tensor, Py_None when the tensor stays
   in memory, NULL with an exception set. */
PyObject *ms_spill_put(PyObject *store, PyObject *tensor);
/* The tensor back (new reference). */
PyObject *ms_spill_get(PyObject *record);
/* Wait for every write in flight. */
int ms_spill_flush(PyObject *store);
/* A new training step: forget the last one's prefetch order. */
int ms_spill_new_step(PyObject *store);
int ms_is_spilled(ms_state *st, PyObject *obj);

/* tiling.c: slicing a layer's inputs into tiles, joining the outputs. */
/* The lead tensor's extent along dim and its shape (new reference), or
   *extent = 0 and *lead_shape = NULL when there is nothing to tile. */
int ms_tile_extent(ms_state *st, PyObject *args, PyObject *kwargs, int dim,
                   Py_ssize_t *extent, PyObject **lead_shape);
/* Start and length of tile j of `tiles` over `extent`. */
void ms_tile_range(Py_ssize_t extent, int tiles, int j, Py_ssize_t *start,
                   Py_ssize_t *len);
/* The arguments of one tile (new references). */
int ms_tile_slice(ms_state *st, PyObject *args, PyObject *kwargs, int dim,
                  PyObject *lead_shape, Py_ssize_t start, Py_ssize_t len,
                  PyObject **targs, PyObject **tkwargs);
/* The tiles' outputs (a non-empty list) joined along dim. */
PyObject *ms_tile_merge(ms_state *st, PyObject *outs, int dim);
/* Module function tile_call(fn, args, kwargs, dim, tiles). */
PyObject *ms_tile_call(PyObject *module, PyObject *const *args,
                       Py_ssize_t nargs);

/* adam8bit.c: the 8-bit AdamW update (module function). */
PyObject *ms_adamw8bit_step(PyObject *module, PyObject *args,
                            PyObject *kwargs);

/* plan.c: the Plan and LayerPlan types. */
PyObject *ms_plan_build(PyObject *module, PyObject *args, PyObject *kwargs);
/* Layer i of a plan: its technique mask, tile count (1: not tiled) and
   checkpoint segment (first layer's index, or -1); -1 with an exception
   set. */
int ms_plan_layer(PyObject *plan, Py_ssize_t i, unsigned *mask, int *tiles,
                  int *segment);

/* profiler.c: module-level functions and hook helpers. */
int ms_register_unit_hooks(ms_state *st, PyObject *owner, PyObject *units,
                           PyObject *handles, PyObject *pre_name,
                           PyObject *post_name);
int ms_remove_handles(ms_state *st, PyObject *handles);
PyObject *ms_find_units(PyObject *module, PyObject *model);
/* Append (tensor, tensor._version) for every tensor in obj (nested in
   tuples, lists and dict values) to the list out. */
int ms_collect_versions(ms_state *st, PyObject *obj, PyObject *out);
PyObject *ms_detect_hardware(PyObject *module, PyObject *args,
                             PyObject *kwargs);

#endif /* MEMSCALE_MS_H */
