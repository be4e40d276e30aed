/*
 * solver.h: the budget planner (solver.c), in plain C: the plan of least
 * predicted overhead whose peak fits a budget, by dynamic programming over
 * the chain of layers.  Like the engine it plans for (engine.h), no Python
 * object crosses this interface.
 */
#ifndef MEMSCALE_SOLVER_H
#define MEMSCALE_SOLVER_H

#include "engine.h"

typedef struct {
    int64_t budget_bytes; /* what a recompute term of the peak may hold:
                             held before a segment + its recompute */
    int64_t end_extra;    /* the end-of-forward term (everything held)
                             may hold budget_bytes + end_extra */
    unsigned allowed;     /* MS_TECH_* the solver may use */
    double flop_rate;     /* FLOP/s: forward FLOPs to seconds (> 0) */
    double offload_bw;    /* bytes/s each way to the offload tier; 0: none */
    int async_offload;    /* transfers overlap compute */
    int64_t min_offload_bytes; /* smaller inputs are not offloaded */
    double tile_overhead;      /* seconds per extra call of a tiled layer */
    int max_segment; /* longest checkpoint segment, in layers (>= 1) */
    int resolution;  /* memory buckets of the DP (>= 1) */
    int nested;      /* when no plan of two levels fits, nested segments
                        (ms_solver_choice.nested) may be used */
} ms_solver_problem;

typedef struct {
    int seg_start; /* -1: kept; else the first layer of its segment */
    int offload;   /* the segment's stored input is offloaded (first layer) */
    int tiles;     /* 1, or a power of two up to MS_MAX_TILES (a one-layer
                      segment) */
    int selective; /* kept (seg_start -1) as a selective layer */
    int level;     /* selective: which of the layer's levels (ms_layer.sel) */
    int nested;    /* the segment (first layer) is nested: its recompute
                      keeps only its layers' inputs, then recomputes each
                      layer alone as backward reaches it (memory.h) */
} ms_solver_choice;

typedef struct {
    int feasible;
    int64_t peak_bytes;      /* max(end - end_extra, worst recompute): the
                                plan fits when this is <= budget_bytes */
    int64_t end_bytes;       /* held at the end of the forward, exact */
    int64_t recompute_bytes; /* the worst recompute term, exact */
    double overhead_seconds; /* recompute + offload + tile calls */
    double recompute_flops;
} ms_solver_result;

/*
 * The plan of least overhead whose peak fits p->budget_bytes (see solver.c
 * for the model).  Returns 0 (res->feasible says whether one exists; if not,
 * out is all kept), -1 when memory for the DP cannot be had, -2 for an
 * invalid problem.
 */
int ms_solve(const ms_solver_problem *p, const ms_layer *layers, size_t n,
             ms_solver_choice *out, ms_solver_result *res);
/* The memory model of a choice vector: memory.h (ms_mem_terms_of). */
double ms_solver_overhead(const ms_solver_problem *p, const ms_layer *layers,
                          size_t n, const ms_solver_choice *c,
                          double *recompute_flops);
double ms_solver_offload_seconds(const ms_solver_problem *p,
                                 const ms_layer *layer);
/* 0 when c is a plan the problem allows, -1 otherwise. */
int ms_solver_check(const ms_solver_problem *p, const ms_layer *layers,
                    size_t n, const ms_solver_choice *c);
/* The smallest budget_bytes with a feasible plan (binary search). */
int ms_solver_min_budget(const ms_solver_problem *p, const ms_layer *layers,
                         size_t n, int64_t *min_budget);

#endif /* MEMSCALE_SOLVER_H */
