/*
 * executor_internal.h: what the files of the executor share.
 *
 * The executor is one type (executor.c) whose work is split by job:
 *
 *   frame.c          checkpoint frames: the saved-tensor hooks of a
 *                    checkpointed call and its recompute in backward
 *   hooks.c          the module hooks of the planned units (_pre, _post)
 *   segment.c        checkpoint segments: several units, one frame
 *   exec_offload.c   a checkpointed layer's inputs moved to an offload tier
 *                    and back
 *   exec_tiling.c    the tiled forward (_TiledForward)
 *   root.c           the root module's hooks: passes, profiling, autocast
 *   executor.c       the Executor type, its methods and its lifecycle
 *
 * Nothing here is part of the module's API (executor.h is).
 */
#ifndef MEMSCALE_EXECUTOR_INTERNAL_H
#define MEMSCALE_EXECUTOR_INTERNAL_H

#include "executor.h"

typedef struct Executor Executor;

/* Tiling: the forward ran in `n` slices along `dim`; tile j packed the
   saved tensors [end[j - 1], end[j]) and recomputes on its own, from RNG
   state rng[j].  `end` is NULL when the call was not tiled (n is then the
   plan's tile count until the tiled forward runs, or 1). */
typedef struct {
    int n;
    int dim;
    Py_ssize_t extent;
    Py_ssize_t *end;
    PyObject *rng;      /* list of ByteTensor */
    PyObject *rng_cuda; /* list of lists, or NULL */
} FrameTiles;

/* A checkpoint segment of several units, recomputed together from the
   first unit's inputs: one (unit, position, args, kwargs, rng_cpu,
   rng_cuda) tuple per later unit, whose args hold None at `position`,
   where the previous unit's output goes.  A unit's RNG state is recorded
   only when it differs from the one the previous unit ended with (None
   otherwise: replaying the previous unit leaves the generator there), so a
   segment whose parent draws nothing between its units keeps one state,
   the first unit's (rng_cuda is also None without CUDA). */
typedef struct {
    PyObject *units;        /* list, or NULL for a single unit */
    PyObject *out;          /* the last unit's output tensor while the
                               segment waits for its next unit */
    PyObject *out_version;  /* out._version when it was stored */
    PyObject *end_rng;      /* the CPU RNG state the last unit ended with,
                               while the segment waits; else NULL */
    PyObject *end_rng_cuda; /* the same for CUDA (list), or NULL */
    int id;                 /* the plan's segment (first unit index) */
    Py_ssize_t next;        /* the unit index expected next */
} FrameSegment;

/* A nested segment (the plan's LayerPlan.nested): each unit is recomputed
   alone, from its own input, when backward reaches it; a first pass over
   the units before it (their saved tensors dropped) recomputes those
   inputs.  `inputs` holds them between the first pass and each unit's own
   recompute. */
typedef struct {
    int on;
    PyObject *starts; /* list of int: the first saved tensor of each later
                         unit (one per seg.units entry), or NULL */
    PyObject *inputs; /* list: None, or per unit (x, rng_cpu, rng_cuda or
                         None), unit 0's never set; NULL before backward */
} FrameNest;

/* Offload: the inputs whose slot in args / kwargs holds an offload record
   instead of the tensor. */
typedef struct {
    PyObject *slots; /* list of (0, index) / (1, key), or NULL */
} FrameOffload;

/* One checkpointed call: what its recompute replays, and the state of each
   feature that may take part in it. */
typedef struct {
    PyObject_HEAD
    Executor *ex;
    Py_ssize_t index;   /* unit index, for messages */
    PyObject *unit;     /* the module */
    PyObject *cur_unit; /* the unit running in this frame (borrowed from
                           ex->units): `unit`, or a later unit of its
                           segment */
    PyObject *args;     /* tuple */
    PyObject *kwargs;   /* dict */
    PyObject *versions; /* list of (tensor, version) of the inputs */
    PyObject *rng_cpu;  /* ByteTensor */
    PyObject *rng_cuda; /* list of ByteTensor, or NULL */
    PyObject *cpu_dtype;
    PyObject *cuda_dtype; /* NULL unless CUDA was initialized */
    int cpu_autocast;
    int cuda_autocast;
    PyObject *ctx;        /* saved_tensors_hooks while the forward runs */
    PyObject *shapes;     /* list: shape of each packed tensor */
    PyObject *recomputed; /* list, NULL before the first recompute */
    Py_ssize_t rpos;
    Py_ssize_t rend; /* the recompute stops once rpos reaches this */
    int recomputing;
    FrameTiles tile;
    FrameSegment seg;
    FrameNest nest;
    FrameOffload off;
} Frame;

struct Executor {
    PyObject_HEAD
    PyObject *module; /* memscale._core */
    ms_state *st;
    PyObject *model_ref;    /* weakref to the root module */
    PyObject *units;        /* list of modules */
    PyObject *names;        /* list of str */
    PyObject *index_of;     /* {module: index} */
    PyObject *plan;         /* Plan or None */
    PyObject *profiler;     /* Profiler while warming up, else None */
    PyObject *on_profiled;  /* callable(profiler) -> Plan, or None */
    PyObject *pre_exc;      /* exception being handled at _root_pre, or NULL */
    PyObject *handles;      /* unit hooks */
    PyObject *root_handles; /* hooks on the root */
    PyObject *stack;        /* Frame or None per active planned call */
    PyObject *tile_verifier; /* verifier(unit, forward, args, kwargs, tiles)
                                -> dim or None, or None */
    PyObject *amp_device;    /* autocast device type (str), or None */
    PyObject *amp_dtype;     /* autocast dtype, or None */
    PyObject *amp_stack;     /* per root call: the entered autocast, or None */
    PyObject *open_seg;      /* a segment Frame between two of its units */
    int *segments;           /* per unit, from the plan: segment or -1 */
    PyObject *store;         /* SpillStore (disk tier) or None */
    PyObject *host;          /* host tier for device tensors, or None */
    unsigned *masks;
    int *tiles;             /* per unit, from the plan */
    unsigned char *buffers; /* per unit: BUF_UNKNOWN / BUF_MUTATED / ... */
    Py_ssize_t n;
    long warmup_steps;
    long steps;             /* forward passes seen with grad, training */
    long long frames;       /* checkpoint frames opened */
    long long rng_states;   /* CPU RNG states checkpoints recorded: one
                               per frame, one per unit that joined a
                               segment after the generator moved */
    long long recomputes;   /* layer recomputations run */
    long long forwards;     /* training forwards of the root seen */
    long long recompute_ns; /* wall time spent recomputing */
    long long tiled_calls;  /* forwards run in tiles */
    int recompute_depth;
    int paused; /* > 0: hooks do nothing (see pause()) */
    int active_frames;
    int root_in_pass;
    int attached;
};

/* Whether a unit's forward updates its buffers (BatchNorm statistics),
   learnt at its first recompute: updated buffers are restored after every
   recompute, so recomputing never counts a batch twice. */
enum { BUF_UNKNOWN = 0, BUF_MUTATED = 1, BUF_STATIC = 2 };

/* An offload tier is set (NULL once the garbage collector cleared us). */
#define HAS(obj) ((obj) != NULL && (obj) != Py_None)

/* In Executor.masks beside the MS_TECH_* bits: the unit's checkpoint
   segment is nested (FrameNest). */
#define MS_EX_NESTED (1u << 16)

/* ---- executor.c ---------------------------------------------------- */

/* The name of unit `index` (borrowed), or None. */
PyObject *ms_ex_unit_name(Executor *ex, Py_ssize_t index);
/* Replace the hooks of the current plan by those carrying out `plan`. */
int ms_ex_apply_plan(Executor *ex, PyObject *plan);

/* ---- frame.c ------------------------------------------------------- */

int ms_frame_init_types(PyObject *module, ms_state *st);
/* A frame recording what recompute must replay (RNG and autocast state,
   the inputs), or NULL with an exception set. */
Frame *ms_frame_new(Executor *ex, Py_ssize_t index, PyObject *unit,
                    PyObject *args, PyObject *kwargs);

/* ---- hooks.c ------------------------------------------------------- */

/* Push one entry on the executor's stack / pop the newest (leaving its
   saved-tensor hooks if a Frame). */
int ms_ex_push_entry(Executor *ex, PyObject *entry);
int ms_ex_pop_entry(Executor *ex);
/* The forward pre-hook and always-called forward hook of planned units. */
PyObject *ms_ex_pre(Executor *ex, PyObject *const *args, Py_ssize_t nargs);
PyObject *ms_ex_post(Executor *ex, PyObject *const *args, Py_ssize_t nargs);

/* ---- segment.c ----------------------------------------------------- */

/* The first tensor of a unit's output (borrowed), or NULL. */
PyObject *ms_first_tensor(ms_state *st, PyObject *out);
/* Set the RNG state a unit's record holds, if any (0, or -1). */
int ms_segment_unit_rng(ms_state *st, PyObject *rec);
/* Recompute a segment's later units; steals `out`. */
PyObject *ms_segment_replay(Frame *self, PyObject *out);
/* Frame f's unit returned x and its segment goes on: f waits as the open
   segment (with the RNG state the unit ended with). */
int ms_segment_wait(Executor *ex, Frame *f, PyObject *x);
/* The open segment is done (its inputs may be offloaded now). */
int ms_segment_finish(Executor *ex);
/* Unit `unit` starts while a segment is open: 1 taken into the segment,
   0 the segment finished, -1 with an exception set. */
int ms_segment_continue(Executor *ex, PyObject *unit, PyObject *args,
                        PyObject *kwargs);

/* ---- exec_offload.c ------------------------------------------------ */

/* After a checkpointed layer's forward: its inputs to the offload tiers. */
int ms_offload_inputs(Executor *ex, Frame *f);
/* Before its recompute: the offloaded inputs back. */
int ms_reload_inputs(Frame *f);

/* ---- exec_tiling.c ------------------------------------------------- */

int ms_tiled_init_types(PyObject *module, ms_state *st);
/* The _TiledForward standing for `forward`, unit `unit`'s own forward. */
PyObject *ms_tiled_new(Executor *ex, PyObject *unit, PyObject *forward);

/* ---- root.c -------------------------------------------------------- */

/* torch.autocast(device, dtype=dtype, enabled=enabled), not entered. */
PyObject *ms_make_autocast(ms_state *st, PyObject *device, PyObject *dtype,
                           int enabled);
/* The root module's forward pre-hook and always-called forward hook. */
PyObject *ms_ex_root_pre(Executor *ex, PyObject *const *args,
                         Py_ssize_t nargs);
PyObject *ms_ex_root_post(Executor *ex, PyObject *const *args,
                          Py_ssize_t nargs);
/* Leave what an interrupted forward left entered: checkpoint frames
   (ms_ex_drop_stale), the root's autocast (ms_amp_drop_stale); warn if
   there was any and `warn` is set. */
int ms_ex_drop_stale(Executor *ex, int warn);
int ms_amp_drop_stale(Executor *ex, int warn);
/* Executor._abandon(): the root forward is left by an exception its hooks
   did not see; leave and drop everything the forward entered. */
int ms_ex_abandon(Executor *ex);

#endif /* MEMSCALE_EXECUTOR_INTERNAL_H */
