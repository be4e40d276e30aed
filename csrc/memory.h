/*
 * memory.h: the memory model of a plan, in one place.
 *
 * The engine's rules (engine.c) and the budget planner (solver.c) judge a
 * plan by these terms and nothing else.  A kept layer holds its saved
 * tensors from its forward until backward reaches it; a checkpoint segment
 * [a..b] (one layer, or a run recomputed together from the input of layer
 * a) holds that input, or nothing when it is offloaded.  When backward
 * reaches a segment, everything held before it is still held and the
 * recompute adds the saved tensors of the segment's layers (one tile's
 * share of them for a tiled single layer); when backward reaches each of
 * its layers, the saved tensors of the layers up to it are alive and its
 * backward term adds to them (what a layer's recompute and backward need
 * beyond its saved tensors: gradients in flight, temporaries; measured per
 * layer by the OOM predictor, 0 when not measured): the segment's term is
 * the largest of these (ms_mem_seg_step).  A selective layer (kept as a
 * unit, ms_solver_choice.selective) holds its input and the outputs of its
 * costly ops (those of its level, ms_solver_choice.level); at its backward
 * the cheap ones are recomputed, so it then holds ms_mem_selective_backward (a
 * recompute term like a segment's, without a measured backward term):
 *
 *     end       = sum over units of what they hold
 *     recompute = max over segments (held before it + its transient)
 *
 * A nested segment (ms_solver_choice.nested, solver.c) recomputes on one
 * more level: its recompute first runs its layers but the last keeping
 * only the input of each (with its RNG state: input_bytes), then each
 * layer alone from its input, last first, as backward reaches it; while
 * layer k is recomputed and run backward, the inputs of the segment's
 * layers before k are held besides its own saved tensors and backward
 * term (ms_mem_nest_step).
 *
 * The step's peak adds what is alive throughout (parameters, gradients,
 * optimizer state, activations outside the planned layers) and the OOM
 * predictor's corrections: ms_mem_peak().
 *
 * Sizes are bytes; a negative size counts as 0 and sums saturate at
 * INT64_MAX (sizes come from Python and from fuzzers, and signed overflow
 * is undefined behaviour).
 */
#ifndef MEMSCALE_MEMORY_H
#define MEMSCALE_MEMORY_H

#include "solver.h"

#include <stddef.h>
#include <stdint.h>

/* a + b for a, b >= 0, saturating at INT64_MAX. */
static inline int64_t
ms_add_sat(int64_t a, int64_t b)
{
    return a > INT64_MAX - b ? INT64_MAX : a + b;
}

static inline int64_t
ms_nonneg(int64_t v)
{
    return v > 0 ? v : 0;
}

/* ceil(a / b) for a >= 0, b > 0. */
static inline int64_t
ms_ceil_div(int64_t a, int64_t b)
{
    return a / b + (a % b != 0);
}

/* v + offset (the offset may be negative), never below 0. */
static inline int64_t
ms_offset_peak(int64_t v, int64_t offset)
{
    if (offset >= 0) {
        return ms_add_sat(v, offset);
    }
    return v + offset < 0 ? 0 : v + offset;
}

/* What a layer saves for backward: held until then when the layer is kept,
   added again while it is recomputed. */
static inline int64_t
ms_mem_saved(const ms_layer *layer)
{
    return ms_nonneg(layer->saved_bytes);
}

/* What a segment that starts at `layer` holds until backward. */
static inline int64_t
ms_mem_stored(const ms_layer *layer, int offloaded)
{
    return offloaded ? 0 : ms_nonneg(layer->input_bytes);
}

/* What the backward of a recomputed layer needs on top of its saved
   tensors (measured per layer on a simulated step; 0 when not). */
static inline int64_t
ms_mem_backward(const ms_layer *layer)
{
    return ms_nonneg(layer->backward_bytes);
}

/* A segment's recompute term, one layer further: `worst` over its layers
   so far, `saved` the saved tensors of its layers up to and including
   `layer`.  When backward reaches a layer of a recomputed segment, the
   saved tensors of the segment's layers up to it are alive (those after it
   were freed by their backward) and its own backward term adds to them
   (which counts what is in flight then, the gradients of the layers after
   it among them): the segment's term is the largest of these. */
static inline int64_t
ms_mem_seg_step(int64_t worst, int64_t saved, const ms_layer *layer)
{
    int64_t at = ms_add_sat(saved, ms_mem_backward(layer));
    return at > worst ? at : worst;
}

/* A nested segment's recompute term, one layer further: `worst` over its
   layers so far, `inputs` the stored inputs of its layers before `layer`
   (held while `layer` is recomputed alone and run backward). */
static inline int64_t
ms_mem_nest_step(int64_t worst, int64_t inputs, const ms_layer *layer)
{
    int64_t at = ms_add_sat(inputs, ms_add_sat(ms_mem_saved(layer),
                                               ms_mem_backward(layer)));
    return at > worst ? at : worst;
}

/* What the recompute of a single layer in `tiles` tiles adds: one tile's
   share of its saved tensors and of its backward term. */
static inline int64_t
ms_mem_tile_share(const ms_layer *layer, int tiles)
{
    return ms_ceil_div(ms_add_sat(ms_nonneg(layer->saved_bytes),
                                  ms_mem_backward(layer)),
                       tiles);
}

/* Level `level` of a selective layer (ms_layer.sel); NULL when it has no
   such level. */
static inline const ms_sel_level *
ms_sel_at(const ms_layer *layer, int level)
{
    return level >= 0 && level < layer->sel_levels && level < MS_SEL_LEVELS
               ? &layer->sel[level]
               : NULL;
}

/* What a selective layer run at `level` holds until backward: its input
   and the outputs of the ops that level keeps. */
static inline int64_t
ms_mem_selective_held(const ms_layer *layer, int level)
{
    const ms_sel_level *s = ms_sel_at(layer, level);
    return ms_add_sat(ms_nonneg(layer->input_bytes),
                      s != NULL ? ms_nonneg(s->saved_bytes) : 0);
}

/* What is alive for a selective layer at its backward: what it holds and
   the cheap outputs recomputed (its saved tensors, the input among them),
   whichever is more. */
static inline int64_t
ms_mem_selective_backward(const ms_layer *layer, int level)
{
    int64_t held = ms_mem_selective_held(layer, level);
    int64_t saved = ms_mem_saved(layer);
    return held > saved ? held : saved;
}

/* The terms of a plan given as a choice vector (ms_solver_choice: kept,
   or the first layer of its segment, offloaded, tiles). */
typedef struct {
    int64_t end;         /* held at the end of the forward */
    int64_t recompute;   /* the worst recompute term (0: none) */
    size_t recompute_at; /* first layer of that segment; n when none */
} ms_mem_terms;

void ms_mem_terms_of(const ms_layer *layers, size_t n,
                     const ms_solver_choice *choices, ms_mem_terms *terms);

/* The step's peak: base (alive throughout) plus the larger of the end term
   with peak_offset and the recompute term with plan_offset (the OOM
   predictor's corrections of the unoptimized step and of plans).  *at (if
   not NULL): n when the end of the forward makes the peak, else the layer
   whose recompute does. */
int64_t ms_mem_peak(const ms_mem_terms *terms, size_t n, int64_t base,
                    int64_t peak_offset, int64_t plan_offset, size_t *at);

#endif /* MEMSCALE_MEMORY_H */
