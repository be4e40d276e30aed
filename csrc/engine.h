/*
 * engine.h: the decision engine, in plain C.
 *
 * No Python object crosses this interface, so the rules can be unit-tested
 * and fuzzed on their own.  Sizes are bytes, costs are forward FLOPs (a
 * deterministic measure: timings would make plans differ between runs).
 */
#ifndef MEMSCALE_ENGINE_H
#define MEMSCALE_ENGINE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Technique bits, shared by the engine, the plan and
 * the executor. */
enum {
    MS_TECH_CHECKPOINT = 1u << 0,
    MS_TECH_OFFLOAD = 1u << 1,
    MS_TECH_TILING = 1u << 2,
    /* Selective checkpointing inside the layer: it keeps its input and
       the outputs of its costly ops, and recomputes the cheap ones in
       backward (memscale/_selective.py); the C executor runs it kept. */
    MS_TECH_SELECTIVE = 1u << 3,
};

/* The most tiles a layer is split into. */
#define MS_MAX_TILES 16


/* Where an offloaded layer's inputs wait for backward. */
typedef enum {
    MS_TIER_DEVICE = 0, /* not offloaded */
    MS_TIER_HOST = 1,   /* host RAM (a GPU's host), capped */
    MS_TIER_DISK = 2,   /* spill files */
} ms_tier;

typedef enum {
    MS_MODE_CONSERVATIVE = 0,
    MS_MODE_BALANCED = 1,
    MS_MODE_AGGRESSIVE = 2,
} ms_mode;

/* Why a layer got what it got.  Names: ms_rule_name(). */
typedef enum {
    MS_RULE_SMART_SKIP = 0, /* the model fits comfortably: left alone */
    MS_RULE_FORCE_ALL,      /* force_optimize: base techniques everywhere */
    MS_RULE_PRESSURE,       /* chosen, in savings order, to fit budget */
    MS_RULE_FITS,           /* not needed: the budget is met without it */
    MS_RULE_DISABLED,       /* no technique of the mode is enabled */
    MS_RULE_INPLACE_INPUT,  /* modifies its input in place: unsafe */
    MS_RULE_NOT_CALLED,     /* never ran while profiling */
    MS_RULE_NO_SAVINGS,     /* keeps as much as it would free */
    MS_RULE_SOLVER,         /* the budget planner's least-overhead plan */
    MS_RULE_UNREPEATABLE,   /* its recompute did not match its forward */
    MS_RULE_COUNT
} ms_rule;

/* Layer flags reported by the profiler. */
enum {
    MS_LAYER_INPLACE_INPUT = 1u << 0,
    MS_LAYER_NOT_CALLED = 1u << 1,
    /* may be tiled (verified when it first runs) */
    MS_LAYER_TILEABLE = 1u << 2,
    /* Its recompute did not match its forward (found at the first step). */
    MS_LAYER_UNREPEATABLE = 1u << 3,
    /* Has a selective profile (ms_layer.sel, at least one level): may run
       selective.  Set by the parser (layer_stats.c) when LayerStats has
       one, never given in LayerStats.flags. */
    MS_LAYER_SELECTIVE = 1u << 4,
};

/* The most saved-op sets (levels) of a layer run selective. */
#define MS_SEL_LEVELS 8

/* One level of a layer run selective: the ops whose FLOPs per byte they
   write reach `threshold` are kept, the rest recomputed in backward.  The
   levels of a layer are nested (thresholds decrease, so each keeps what
   the one before keeps and more). */
typedef struct {
    double threshold;    /* FLOPs per byte: an op at or above it is kept */
    int64_t saved_bytes; /* its kept outputs, held besides the input */
    double flops;        /* the recompute, in FLOPs at the matmul rate: the
                            recomputed ops' FLOPs at their class's rate, and
                            the elements an op without a formula writes at
                            the element rate (one FLOP each by default) */
} ms_sel_level;

typedef struct {
    int64_t param_bytes; /* parameters owned by the layer */
    int64_t saved_bytes; /* activations it saves for backward */
    int64_t input_bytes; /* what checkpointing keeps instead: inputs,
                            and the checkpoint's RNG state where it takes
                            the device's memory (_planning.plan_problem);
                            a segment keeps its first layer's */
    double flops;        /* forward cost (counted FLOPs) */
    unsigned flags;      /* MS_LAYER_* */
    /* Recomputing it whole, in FLOPs at the matmul rate (its counted
       FLOPs with convolutions and attention weighted by their measured
       rates, memscale/_costs.py); 0 when not given: its flops.  Read
       through ms_layer_cost. */
    double cost;
    /* Its recompute's and backward's bytes on top of its saved tensors,
       measured per layer (memory.h); 0 when not measured. */
    int64_t backward_bytes;
    /* Selective (with MS_LAYER_SELECTIVE): sel_levels levels (1 to
       MS_SEL_LEVELS), fewest kept bytes first. */
    int sel_levels;
    ms_sel_level sel[MS_SEL_LEVELS];
    /* The tail: what a recompute that ends in this layer does not run.
       A recompute stops once the last tensor the layer's forward saved
       for backward is saved again (torch's and memscale's early stop), so
       the ops after that moment are not rerun: in counted FLOPs
       (tail_flops, at most flops) and at the matmul rate (tail_cost, at
       most the cost; 0 when not given: its tail_flops).  A layer
       checkpointed alone is charged its cost less its tail; a segment,
       its layers' costs less its last layer's tail.  Read through
       ms_layer_tail_flops and ms_layer_tail_cost; 0: the whole layer is
       recomputed. */
    double tail_flops;
    double tail_cost;
} ms_layer;

/* What recomputing `l` whole costs, in FLOPs at the matmul rate: its cost
   when given, else its counted FLOPs; 0 for a negative, infinite or nan
   figure. */
static inline double
ms_layer_cost(const ms_layer *l)
{
    double f = l->cost > 0.0 ? l->cost : l->flops;
    return f > 0.0 && isfinite(f) ? f : 0.0;
}

/* The counted FLOPs of `l` (0 for a negative, infinite or nan figure). */
static inline double
ms_layer_flops(const ms_layer *l)
{
    return l->flops > 0.0 && isfinite(l->flops) ? l->flops : 0.0;
}

/* x, or 0 for a negative, infinite or nan figure, at most `whole`. */
static inline double
ms_tail_clamp(double x, double whole)
{
    x = x > 0.0 && isfinite(x) ? x : 0.0;
    return x < whole ? x : whole;
}

/* The counted FLOPs a recompute ending in `l` does not run (at most its
   flops). */
static inline double
ms_layer_tail_flops(const ms_layer *l)
{
    return ms_tail_clamp(l->tail_flops, ms_layer_flops(l));
}

/* The same at the matmul rate: its tail_cost when given, else its
   tail_flops, at most ms_layer_cost. */
static inline double
ms_layer_tail_cost(const ms_layer *l)
{
    return ms_tail_clamp(l->tail_cost > 0.0 ? l->tail_cost : l->tail_flops,
                         ms_layer_cost(l));
}

typedef struct {
    ms_mode mode;
    unsigned allowed;          /* MS_TECH_* the engine may use */
    int force;                 /* force_optimize */
    int64_t budget_bytes;      /* usable device memory */
    int64_t fixed_bytes;       /* params + grads + optimizer state */
    int64_t activation_bytes;  /* all activations saved, whole model */
    double total_flops;        /* forward cost of the whole model */
    int64_t min_offload_bytes; /* inputs smaller than this stay */
    int host_tier;             /* the device has a separate host RAM */
    int64_t host_cap_bytes; /* offload bytes host RAM may take; < 0: no cap */
    int disk_tier;          /* spilling to disk is allowed */
    int64_t peak_offset_bytes; /* signed correction of every peak estimate:
                                  the OOM predictor's unoptimized peak minus
                                  this model's (0 without a prediction) */
    int64_t plan_offset_bytes; /* the same for the peaks of plans (from a
                                  simulated optimized step) */
    /* The budget planner (solver.c): used when solver is set, the model
       does not fit and force is off.  Costs: */
    int solver;
    double flop_rate;  /* FLOP/s (> 0 when solver is set) */
    double offload_bw; /* bytes/s to the offload tier */
    int async_offload;
    double tile_overhead; /* seconds per extra tile call */
    int max_segment;      /* longest checkpoint segment */
    int resolution;       /* memory buckets of the DP */
} ms_problem;

typedef struct {
    unsigned techniques; /* MS_TECH_* */
    ms_rule rule;
    ms_tier tier;        /* MS_TIER_DEVICE unless offloaded */
    int64_t bytes_saved; /* predicted, while the layer waits for backward */
    int tiles;           /* > 1: run in this many tiles (MS_TECH_TILING) */
    int segment;         /* checkpointed: the first layer of its segment
                            (itself when alone); -1 otherwise */
    int sel_level;       /* run selective: its level (ms_layer.sel); -1
                            otherwise */
    int nested;          /* checkpointed in a nested segment (its
                            recompute recomputes each layer alone again:
                            memory.h); 0 otherwise */
} ms_choice;

typedef struct {
    int64_t peak_unoptimized;  /* fixed + activations */
    int64_t peak_projected;    /* with the plan */
    double pressure;           /* peak_unoptimized / budget */
    double recompute_ratio;    /* recomputed FLOPs / forward FLOPs */
    int skipped;               /* smart-skip */
    int fits;                  /* peak_projected <= budget */
    double predicted_slowdown; /* step time with the plan / without */
    int64_t min_budget;        /* when nothing fits: the smallest budget the
                                  solver reaches; else -1 */
} ms_result;

/* The techniques a mode starts from (before Config overrides). */
unsigned ms_mode_base_techniques(ms_mode mode);

/* Stable, lowercase, hyphenated rule names. */
const char *ms_rule_name(ms_rule rule);

/* "device", "host" or "disk". */
const char *ms_tier_name(ms_tier tier);

/*
 * Plan n layers.  out has room for n choices.  Returns 0, or -1 when memory
 * for the work arrays cannot be had (nothing is written then).
 */
int ms_engine_plan(const ms_problem *problem, const ms_layer *layers, size_t n,
                   ms_choice *out, ms_result *result);

#endif /* MEMSCALE_ENGINE_H */
