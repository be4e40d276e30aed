/*
 * engine.c: the rule-based, deterministic decision engine.
 *
 * Memory model of one training step (memory.h, shared with the budget
 * planner).  F (parameters, gradients, optimizer state) is alive
 * throughout.  Activations outside the planned layers (embeddings, the
 * loss) are alive from their forward to the end of backward.  Layer j
 * holds h_j from its forward until backward reaches it: its saved
 * activations, or, checkpointed, only its inputs.  The peak is the larger
 * of the end of forward and the moment each checkpointed layer i is
 * recomputed, when layers after i are already freed:
 *
 *     peak = F + rest + max(sum_j h_j,
 *                           max_{i checkpointed} sum_{j<i} h_j + saved_i)
 *
 * The rules make one-layer segments only; the budget planner (solver.c)
 * also makes longer ones.
 *
 * Layers are taken most-bytes-freed-per-FLOP first (ties: forward order)
 * until the peak fits the budget.
 *
 * Offload (BALANCED and AGGRESSIVE) then moves checkpointed layers' inputs
 * off the device until backward reloads them: such a layer holds nothing
 * while it waits (h_j = 0), and is back to saved_j while recomputed.
 * BALANCED offloads in forward order (earlier layers wait longest and sit
 * under every later recompute) while the peak is over budget; AGGRESSIVE,
 * and force_optimize, offload every checkpointed layer whose inputs reach
 * min_offload_bytes.  Tiers: a GPU's host RAM up to host_cap_bytes, then
 * disk (if allowed); on a host whose device is its RAM, disk only.
 *
 * When the OOM predictor has simulated the step, peak_offset_bytes is its
 * unoptimized peak minus the model's, and the unoptimized peak (pressure,
 * smart-skip) carries it; plan_offset_bytes is the same correction for the
 * peaks of plans (from simulating optimized steps; peak_offset_bytes when
 * not given), so the engine decides from the predicted peaks (transient
 * workspace, the loss, allocator detail the model leaves out).
 */
#include "engine.h"
#include "memory.h"
#include "solver.h"

#include <math.h>
#include <string.h>

#include <stdlib.h>

static const char *const rule_names[MS_RULE_COUNT] = {
    [MS_RULE_SMART_SKIP] = "smart-skip",
    [MS_RULE_FORCE_ALL] = "force-all",
    [MS_RULE_PRESSURE] = "pressure",
    [MS_RULE_FITS] = "fits",
    [MS_RULE_DISABLED] = "disabled",
    [MS_RULE_INPLACE_INPUT] = "ineligible:inplace-input",
    [MS_RULE_NOT_CALLED] = "ineligible:not-called",
    [MS_RULE_NO_SAVINGS] = "ineligible:no-savings",
    [MS_RULE_SOLVER] = "solver",
    [MS_RULE_UNREPEATABLE] = "ineligible:unrepeatable",
};

const char *
ms_rule_name(ms_rule rule)
{
    if ((int)rule < 0 || rule >= MS_RULE_COUNT) {
        return "unknown";
    }
    return rule_names[rule];
}

const char *
ms_tier_name(ms_tier tier)
{
    switch (tier) {
    case MS_TIER_HOST:
        return "host";
    case MS_TIER_DISK:
        return "disk";
    default:
        return "device";
    }
}

unsigned
ms_mode_base_techniques(ms_mode mode)
{
    switch (mode) {
    case MS_MODE_CONSERVATIVE:
        return MS_TECH_CHECKPOINT;
    case MS_MODE_BALANCED:
        return MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_SELECTIVE;
    case MS_MODE_AGGRESSIVE:
        return MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_TILING
               | MS_TECH_SELECTIVE;
    }
    return 0;
}

static int64_t
freed_bytes(const ms_layer *layer)
{
    int64_t d = layer->saved_bytes - layer->input_bytes;
    return d > 0 ? d : 0;
}

/* Peak of the step for the plan in `c` (the rules make one-layer
   segments only), by the one memory model (memory.h).  The end of the
   forward carries the unoptimized step's correction (the backward of what
   follows the layers starts there); recomputes carry the plans'
   correction.  *at (if not NULL) is the layer whose recompute makes the
   peak, or n when it is the end of the forward. */
static int64_t
peak_at(const ms_problem *p, const ms_layer *layers, size_t n,
        const ms_solver_choice *c, int64_t rest, size_t *at)
{
    ms_mem_terms terms;
    ms_mem_terms_of(layers, n, c, &terms);
    return ms_mem_peak(&terms, n, ms_add_sat(p->fixed_bytes, rest),
                       p->peak_offset_bytes, p->plan_offset_bytes, at);
}

static int64_t
projected_peak(const ms_problem *p, const ms_layer *layers, size_t n,
               const ms_solver_choice *c, int64_t rest)
{
    return peak_at(p, layers, n, c, rest, NULL);
}

static int
is_checkpointed(const ms_solver_choice *c, size_t i)
{
    return c[i].seg_start >= 0;
}

typedef struct {
    size_t index;
    double ratio;
} candidate;

/*
 * Tiling shrinks what a checkpointed layer's recompute holds, and nothing
 * else: it pays only while that recompute makes the peak.  Double the tiles
 * of the layer whose recompute makes the peak, while it may be tiled
 * further, until the peak fits the budget, or (minimize: force_optimize
 * and AGGRESSIVE, once the plan fits) until another term makes it (the end
 * of the forward, or a layer that cannot be tiled further).  Only tiles
 * that lowered the peak are kept: a doubling that merely tied it, with
 * nothing lower after, is undone, so halving any layer's tiles raises the
 * peak.  Returns 0, or -1 out of memory.
 */
static int
plan_tiles(const ms_problem *p, const ms_layer *layers, size_t n,
           ms_solver_choice *c, int64_t rest, int minimize)
{
    int *best = malloc((n ? n : 1) * sizeof(int));
    if (best == NULL) {
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        best[i] = c[i].tiles;
    }
    size_t at;
    int64_t cur = peak_at(p, layers, n, c, rest, &at);
    int64_t low = cur;
    while ((minimize || cur > p->budget_bytes) && at < n
           && (layers[at].flags & MS_LAYER_TILEABLE)
           && layers[at].saved_bytes > 1 && c[at].tiles < MS_MAX_TILES)
    {
        c[at].tiles *= 2;
        int64_t next = peak_at(p, layers, n, c, rest, &at);
        if (next > cur) {
            break; /* cannot happen: a tile holds no more than the layer */
        }
        cur = next;
        if (cur < low) {
            low = cur;
            for (size_t i = 0; i < n; i++) {
                best[i] = c[i].tiles;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        c[i].tiles = best[i];
    }
    free(best);
    return 0;
}

static int
candidate_cmp(const void *a, const void *b)
{
    const candidate *x = a, *y = b;
    if (x->ratio > y->ratio) {
        return -1;
    }
    if (x->ratio < y->ratio) {
        return 1;
    }
    return (x->index > y->index) - (x->index < y->index);
}

static ms_rule
ineligible_reason(const ms_layer *layer)
{
    if (layer->flags & MS_LAYER_NOT_CALLED) {
        return MS_RULE_NOT_CALLED;
    }
    if (layer->flags & MS_LAYER_INPLACE_INPUT) {
        return MS_RULE_INPLACE_INPUT;
    }
    if (layer->flags & MS_LAYER_UNREPEATABLE) {
        return MS_RULE_UNREPEATABLE;
    }
    if (freed_bytes(layer) <= 0) {
        return MS_RULE_NO_SAVINGS;
    }
    return MS_RULE_COUNT; /* eligible */
}

/* Where `bytes` of offloaded input go: a GPU's host RAM while the cap
   allows (counted in *host_used), else disk if allowed, else nowhere
   (MS_TIER_DEVICE). */
static ms_tier
pick_tier(const ms_problem *p, int64_t *host_used, int64_t bytes)
{
    if (p->host_tier
        && (p->host_cap_bytes < 0
            || ms_add_sat(*host_used, bytes) <= p->host_cap_bytes))
    {
        *host_used = ms_add_sat(*host_used, bytes);
        return MS_TIER_HOST;
    }
    return p->disk_tier ? MS_TIER_DISK : MS_TIER_DEVICE;
}

/* The solver's view of the problem, for the activation budget `avail`. */
static ms_solver_problem
solver_problem(const ms_problem *p, unsigned base, int64_t avail)
{
    ms_solver_problem sp;
    memset(&sp, 0, sizeof(sp));
    sp.budget_bytes = avail;
    sp.allowed = base;
    if (!(p->host_tier || p->disk_tier)) {
        sp.allowed &= ~(unsigned)MS_TECH_OFFLOAD; /* nowhere to put it */
    }
    sp.flop_rate = p->flop_rate > 0.0 ? p->flop_rate : 1.0;
    sp.offload_bw = p->offload_bw;
    sp.async_offload = p->async_offload;
    sp.min_offload_bytes = p->min_offload_bytes;
    sp.tile_overhead = p->tile_overhead;
    sp.max_segment = p->max_segment > 0 ? p->max_segment : 1;
    sp.nested = 1;
    sp.resolution = p->resolution > 0 ? p->resolution : 512;
    return sp;
}

/* Whether checkpointed layer i is the last of its segment in `out`. */
static int
ends_segment(const ms_choice *out, size_t n, size_t i)
{
    return i + 1 == n || !(out[i + 1].techniques & MS_TECH_CHECKPOINT)
           || out[i + 1].segment != out[i].segment;
}

/* Step time with the plan over step time without, with a step costing
   three forwards (forward, and backward at twice its cost).  A forward
   costs the model's counted FLOPs, with each layer's cost in place of its
   FLOPs (ms_layer_cost: convolutions and attention at their rates); a
   segment's recompute stops early in its last layer (its tail). */
static double
slowdown(const ms_problem *p, const ms_layer *layers, size_t n,
         const ms_choice *out)
{
    if (!(p->total_flops > 0.0) || !(p->flop_rate > 0.0)) {
        return 1.0;
    }
    ms_solver_problem sp = solver_problem(
        p, MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_TILING, 0);
    double extra = 0.0, forward = p->total_flops;
    for (size_t i = 0; i < n; i++) {
        double counted = layers[i].flops;
        forward += ms_layer_cost(&layers[i])
                   - (counted > 0.0 && isfinite(counted) ? counted : 0.0);
        const ms_sel_level *s = (out[i].techniques & MS_TECH_SELECTIVE)
                                    ? ms_sel_at(&layers[i], out[i].sel_level)
                                    : NULL;
        if (s != NULL) {
            double f = s->flops;
            extra += (f > 0.0 && isfinite(f) ? f : 0.0) / sp.flop_rate;
        }
        if (!(out[i].techniques & MS_TECH_CHECKPOINT)) {
            continue;
        }
        extra += ms_layer_cost(&layers[i]) / sp.flop_rate;
        if (out[i].nested && !ends_segment(out, n, i)) {
            /* The nested recompute's first pass runs it once more. */
            extra += ms_layer_cost(&layers[i]) / sp.flop_rate;
        }
        if (ends_segment(out, n, i) || out[i].nested) {
            extra -= ms_layer_tail_cost(&layers[i]) / sp.flop_rate;
        }
        if (out[i].segment == (int)i) {
            if (out[i].techniques & MS_TECH_OFFLOAD && sp.offload_bw > 0.0) {
                extra += ms_solver_offload_seconds(&sp, &layers[i]);
            }
            if (out[i].tiles > 1) {
                extra += (double)(out[i].tiles - 1) * sp.tile_overhead;
            }
        }
    }
    return forward > 0.0 ? 1.0 + extra / (3.0 * forward / sp.flop_rate) : 1.0;
}

/* The budget planner: 1 when it found a plan (out and res set), 0 when no
   plan fits (res->min_budget set), -1 out of memory. */
static int
solve(const ms_problem *p, const ms_layer *layers, size_t n, ms_choice *out,
      ms_result *res, unsigned base, int64_t rest)
{
    /* fixed + rest + recompute term + plan_offset <= budget, and
       fixed + rest + end term + peak_offset <= budget. */
    int64_t avail = p->budget_bytes - ms_add_sat(p->fixed_bytes, rest)
                    - p->plan_offset_bytes;
    ms_solver_problem sp = solver_problem(p, base, avail);
    sp.end_extra = p->plan_offset_bytes - p->peak_offset_bytes;
    ms_solver_choice *c = malloc((n ? n : 1) * sizeof(ms_solver_choice));
    if (c == NULL) {
        return -1;
    }
    ms_solver_result r;
    int rc = ms_solve(&sp, layers, n, c, &r);
    if (rc != 0) {
        free(c);
        return rc == -1 ? -1 : 0;
    }
    if (!r.feasible) {
        int64_t worst = 0;
        if (ms_solver_min_budget(&sp, layers, n, &worst) != 0) {
            free(c);
            return -1;
        }
        res->min_budget =
            ms_offset_peak(ms_add_sat(ms_add_sat(p->fixed_bytes, rest), worst),
                           p->plan_offset_bytes);
        free(c);
        return 0;
    }
    int64_t host_used = 0;
    for (size_t i = 0; i < n; i++) {
        if (c[i].seg_start < 0 && c[i].selective) {
            int64_t held = ms_mem_selective_held(&layers[i], c[i].level);
            out[i].techniques = MS_TECH_SELECTIVE;
            out[i].sel_level = c[i].level;
            out[i].rule = MS_RULE_SOLVER;
            out[i].bytes_saved = layers[i].saved_bytes > held
                                     ? layers[i].saved_bytes - held
                                     : 0;
        }
        if (c[i].seg_start < 0) {
            continue;
        }
        out[i].techniques = MS_TECH_CHECKPOINT;
        out[i].rule = MS_RULE_SOLVER;
        out[i].segment = c[i].seg_start;
        out[i].nested = c[c[i].seg_start].nested;
        out[i].bytes_saved = layers[i].saved_bytes;
        if (c[i].seg_start != (int)i) {
            continue;
        }
        if (c[i].offload) {
            ms_tier tier = pick_tier(p, &host_used, layers[i].input_bytes);
            out[i].techniques |= MS_TECH_OFFLOAD;
            /* The solver offloads only where a tier exists. */
            out[i].tier = tier != MS_TIER_DEVICE ? tier : MS_TIER_DISK;
        }
        else {
            int64_t keep = layers[i].input_bytes;
            out[i].bytes_saved = layers[i].saved_bytes > keep
                                     ? layers[i].saved_bytes - keep
                                     : 0;
        }
        if (c[i].tiles > 1) {
            out[i].techniques |= MS_TECH_TILING;
            out[i].tiles = c[i].tiles;
        }
    }
    ms_mem_terms terms = {r.end_bytes, r.recompute_bytes, n};
    res->peak_projected = ms_mem_peak(&terms, n,
                                      ms_add_sat(p->fixed_bytes, rest),
                                      p->peak_offset_bytes,
                                      p->plan_offset_bytes, NULL);
    res->fits = res->peak_projected <= p->budget_bytes;
    res->recompute_ratio = p->total_flops > 0.0
                               ? r.recompute_flops / p->total_flops
                               : 0.0;
    res->predicted_slowdown = slowdown(p, layers, n, out);
    free(c);
    return 1;
}

int
ms_engine_plan(const ms_problem *p, const ms_layer *layers, size_t n,
               ms_choice *out, ms_result *res)
{
    ms_solver_choice *c = malloc((n ? n : 1) * sizeof(ms_solver_choice));
    candidate *cands = malloc((n ? n : 1) * sizeof(candidate));
    if (c == NULL || cands == NULL) {
        free(c);
        free(cands);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        c[i].seg_start = -1; /* kept */
        c[i].offload = 0;
        c[i].tiles = 1;
        c[i].selective = 0;
        c[i].level = 0;
        c[i].nested = 0;
    }

    int64_t in_layers = 0;
    for (size_t i = 0; i < n; i++) {
        in_layers = ms_add_sat(in_layers, layers[i].saved_bytes);
    }
    int64_t rest = p->activation_bytes - in_layers;
    if (rest < 0) {
        rest = 0;
    }
    /* Tiling is off in every mode but AGGRESSIVE unless asked for
       (enable_tiling), and then in any mode: `allowed` says which. */
    unsigned base = (ms_mode_base_techniques(p->mode)
                     | (p->allowed & MS_TECH_TILING))
                    & p->allowed;

    res->peak_unoptimized =
        ms_offset_peak(ms_add_sat(ms_add_sat(p->fixed_bytes, rest), in_layers),
                       p->peak_offset_bytes);
    res->pressure = p->budget_bytes > 0 ? (double)res->peak_unoptimized
                                              / (double)p->budget_bytes
                                        : 0.0;
    res->skipped = !p->force && res->peak_unoptimized <= p->budget_bytes;

    size_t ncand = 0;
    for (size_t i = 0; i < n; i++) {
        out[i].techniques = 0;
        out[i].tier = MS_TIER_DEVICE;
        out[i].bytes_saved = 0;
        out[i].tiles = 1;
        out[i].segment = -1;
        out[i].sel_level = -1;
        out[i].nested = 0;
        ms_rule why = ineligible_reason(&layers[i]);
        if (res->skipped) {
            out[i].rule = MS_RULE_SMART_SKIP;
        }
        else if (!(base & MS_TECH_CHECKPOINT)) {
            out[i].rule = MS_RULE_DISABLED;
        }
        else if (why != MS_RULE_COUNT) {
            out[i].rule = why;
        }
        else {
            out[i].rule = MS_RULE_FITS;
            double cost = layers[i].flops > 1.0 ? layers[i].flops : 1.0;
            cands[ncand].index = i;
            cands[ncand].ratio = (double)freed_bytes(&layers[i]) / cost;
            ncand++;
        }
    }

    res->min_budget = -1;
    res->predicted_slowdown = 1.0;
    if (p->solver && !res->skipped && !p->force && (base & MS_TECH_CHECKPOINT))
    {
        int rc = solve(p, layers, n, out, res, base, rest);
        if (rc != 0) {
            free(c);
            free(cands);
            return rc < 0 ? -1 : 0; /* > 0: solved, out and res are set */
        }
        /* Nothing fits: res->min_budget says what would; the rules below
           make the best effort they can. */
    }

    int64_t peak = res->peak_unoptimized;
    if (!res->skipped && ncand > 0) {
        qsort(cands, ncand, sizeof(candidate), candidate_cmp);
        for (size_t k = 0; k < ncand; k++) {
            if (!p->force && peak <= p->budget_bytes) {
                break;
            }
            size_t i = cands[k].index;
            c[i].seg_start = (int)i;
            out[i].techniques = MS_TECH_CHECKPOINT;
            out[i].segment = (int)i;
            out[i].rule = p->force ? MS_RULE_FORCE_ALL : MS_RULE_PRESSURE;
            out[i].bytes_saved = freed_bytes(&layers[i]);
            peak = projected_peak(p, layers, n, c, rest);
        }
    }

    if (!res->skipped && (base & MS_TECH_OFFLOAD)) {
        int all = p->force || p->mode == MS_MODE_AGGRESSIVE;
        int64_t host_used = 0;
        for (size_t i = 0; i < n; i++) {
            if (!all && peak <= p->budget_bytes) {
                break;
            }
            if (!is_checkpointed(c, i) || c[i].offload
                || layers[i].input_bytes <= 0
                || layers[i].input_bytes < p->min_offload_bytes)
            {
                continue;
            }
            ms_tier tier = pick_tier(p, &host_used, layers[i].input_bytes);
            if (tier == MS_TIER_DEVICE) {
                continue; /* nowhere to put it */
            }
            c[i].offload = 1;
            out[i].techniques |= MS_TECH_OFFLOAD;
            out[i].tier = tier;
            out[i].bytes_saved = layers[i].saved_bytes;
            peak = projected_peak(p, layers, n, c, rest);
        }
    }

    if (!res->skipped && (base & MS_TECH_TILING)) {
        int all = p->force || p->mode == MS_MODE_AGGRESSIVE;
        if (plan_tiles(p, layers, n, c, rest, all && peak <= p->budget_bytes)
            < 0)
        {
            free(c);
            free(cands);
            return -1;
        }
        for (size_t i = 0; i < n; i++) {
            if (c[i].tiles > 1) {
                out[i].techniques |= MS_TECH_TILING;
                out[i].tiles = c[i].tiles;
            }
        }
        peak = projected_peak(p, layers, n, c, rest);
    }

    /* Every layer the rules checkpoint is a segment of its own: its
       recompute stops early in it (ms_layer_tail_flops). */
    double recomputed = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (is_checkpointed(c, i)) {
            recomputed += ms_layer_flops(&layers[i])
                          - ms_layer_tail_flops(&layers[i]);
        }
    }
    res->peak_projected = peak;
    res->recompute_ratio = p->total_flops > 0.0 ? recomputed / p->total_flops
                                                : 0.0;
    res->fits = peak <= p->budget_bytes;
    res->predicted_slowdown = slowdown(p, layers, n, out);
    free(c);
    free(cands);
    return 0;
}
