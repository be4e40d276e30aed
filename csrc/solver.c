/*
 * solver.c: the budget planner.  The least predicted overhead (recompute,
 * offload transfers, tile calls) whose predicted peak fits a memory budget,
 * by dynamic programming over the layer chain.  Plain C over plain structs:
 * no Python object crosses this file, so it is tested on its own
 * (tests/c/test_solver.c, with an exhaustive reference search).
 *
 * The memory model is memory.h's, the one the engine's rules use too.
 * The chain is cut into units: a kept layer, or a checkpoint segment
 * [a..b] (one layer, or a run of layers recomputed together from the one
 * stored input of layer a, as in checkpoint_sequential and the rotor
 * dynamic program's segments).  The DP below adds the same terms
 * (ms_mem_saved, ms_mem_stored, ms_mem_tile_share) one unit at a time;
 * every plan it returns is measured again whole by ms_mem_terms_of.
 *
 * A kept layer may also run selective (MS_LAYER_SELECTIVE layers, when
 * MS_TECH_SELECTIVE is allowed), at one of its levels (ms_layer.sel: the
 * saved-op sets the profiler offers, nested, each keeping more of the
 * costly ops' outputs and recomputing less): it then holds its input and
 * the outputs that level keeps, and its backward holds
 * ms_mem_selective_backward (memory.h), a recompute term checked against
 * the budget like a segment's.
 *
 * Nested (when p->nested is set and no plan of two levels fits): a
 * segment may also be nested (memory.h): its recompute runs its layers
 * but the last keeping only their inputs, then recomputes each layer
 * alone, so it costs its layers but the last once more, and each layer's
 * tail is not run (each is the last of its own recompute).  The DP then runs
 * again with nested segments as one more move (a second tree forest, as
 * below); a plan that fits on two levels is never nested.
 *
 * Overhead, in seconds: each checkpointed layer is recomputed once (its
 * cost / flop_rate: its forward FLOPs, convolutions and attention weighted
 * by their measured rates, ms_layer_cost), less, in the last layer of
 * each segment (a layer alone is its own), its tail (ms_layer_tail_cost:
 * the recompute stops once the last tensor backward needs exists, so the
 * ops after it are not rerun; a segment's other layers run whole, their
 * outputs feeding the next), a selective layer recomputes
 * the ops its level does not keep (the level's flops / flop_rate, weighted
 * alike); an offloaded input is written and read once at offload_bw
 * (asynchronously, the write hides behind the layer's forward and the read
 * behind its backward, about twice the forward); a layer in t tiles makes
 * t - 1 more calls of tile_overhead each.
 *
 * The DP runs over (layer i, bytes held by the layers before i), the held
 * bytes grouped in buckets of ceil(budget / resolution) bytes.  Each state
 * keeps the exact bytes held on the path that reached it, so every memory
 * check is exact and a plan it returns fits the exact budget; within a
 * bucket only the cheapest path survives (ties: the one holding less), so
 * the plan is optimal when the bucket is one byte and close to it
 * otherwise.  Work: O(n x (resolution + 1) x (log max_segment + levels));
 * memory: 4
 * bytes of back-pointer per state, two rows of costs, and one tournament
 * tree of max_segment + 1 leaves per bucket (see below).
 */
#include "solver.h"
#include "memory.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RESOLUTION 65535
/* The back-pointer stores a segment's length in 8 bits: max_segment is
   capped at this many layers. */
#define SEGMENT_LEN_LIMIT 255

/* Back-pointer of a state: prev_h (16 bits) | length (8; 0 = kept) |
   code (8: bit 0 offloaded, bits 1-3 log2 of the tiles, bit 4 a kept
   layer run selective, or a segment nested, bits 5-7 the level). */
typedef uint32_t back_t;
#define BACK_NONE UINT32_MAX
#define BACK_SELECTIVE 16
#define BACK_NESTED 16
#define BACK_LEVEL_SHIFT 5
_Static_assert(MS_SEL_LEVELS <= 8,
               "a level must fit the back-pointer's 3 bits");

static back_t
back_pack(size_t prev_h, int len, int offload, int tiles_log2)
{
    return (back_t)prev_h << 16 | (back_t)len << 8
           | (back_t)(offload | tiles_log2 << 1);
}

static int
eligible(const ms_layer *l)
{
    return !(l->flags
             & (MS_LAYER_NOT_CALLED | MS_LAYER_INPLACE_INPUT
                | MS_LAYER_UNREPEATABLE));
}

static int
can_offload(const ms_solver_problem *p, const ms_layer *l)
{
    return (p->allowed & MS_TECH_OFFLOAD) && p->offload_bw > 0.0
           && l->input_bytes > 0 && l->input_bytes >= p->min_offload_bytes;
}

static int
can_tile(const ms_solver_problem *p, const ms_layer *l)
{
    return (p->allowed & MS_TECH_TILING) && (l->flags & MS_LAYER_TILEABLE)
           && l->saved_bytes > 1;
}

/* Recomputing `l` whole: its cost (FLOPs at the matmul rate) over it. */
static double
seconds(const ms_solver_problem *p, const ms_layer *l)
{
    return ms_layer_cost(l) / p->flop_rate;
}

/* What a recompute ending in `l` does not run (its tail), in seconds. */
static double
tail_seconds(const ms_solver_problem *p, const ms_layer *l)
{
    return ms_layer_tail_cost(l) / p->flop_rate;
}

/* Whether layer i, checkpointed, is the last of its segment. */
static int
ends_segment(const ms_solver_choice *c, size_t n, size_t i)
{
    return i + 1 == n || c[i + 1].seg_start != c[i].seg_start;
}

static int
can_select(const ms_solver_problem *p, const ms_layer *l)
{
    return (p->allowed & MS_TECH_SELECTIVE) && (l->flags & MS_LAYER_SELECTIVE)
           && l->sel_levels > 0 && eligible(l);
}

/* The recompute of `l` run selective at `level` (0 for no such level). */
static double
sel_flops(const ms_layer *l, int level)
{
    const ms_sel_level *s = ms_sel_at(l, level);
    return s != NULL && s->flops > 0.0 && isfinite(s->flops) ? s->flops : 0.0;
}

double
ms_solver_offload_seconds(const ms_solver_problem *p, const ms_layer *l)
{
    double t = (double)ms_nonneg(l->input_bytes) / p->offload_bw;
    if (!p->async_offload) {
        return 2.0 * t;
    }
    double c = seconds(p, l);
    return (t > c ? t - c : 0.0) + (t > 2.0 * c ? t - 2.0 * c : 0.0);
}

int
ms_solver_check(const ms_solver_problem *p, const ms_layer *L, size_t n,
                const ms_solver_choice *c)
{
    for (size_t i = 0; i < n; i++) {
        int s = c[i].seg_start;
        if (s < 0) {
            if (c[i].offload || c[i].tiles != 1 || c[i].nested
                || (c[i].selective
                    && (!can_select(p, &L[i])
                        || ms_sel_at(&L[i], c[i].level) == NULL)))
            {
                return -1;
            }
            continue;
        }
        if (c[i].selective || (size_t)s > i || !eligible(&L[i])
            || !(p->allowed & MS_TECH_CHECKPOINT))
        {
            return -1;
        }
        if ((size_t)s < i
            && (c[i - 1].seg_start != s || c[i].offload || c[i].tiles != 1
                || c[i].nested))
        {
            return -1;
        }
        if ((size_t)s == i && c[i].nested
            && (!p->nested || c[i].offload || c[i].tiles != 1))
        {
            return -1;
        }
        if ((size_t)s == i) {
            if (c[i].offload && !can_offload(p, &L[i])) {
                return -1;
            }
            int t = c[i].tiles;
            if (t != 1) {
                int single = i + 1 == n || c[i + 1].seg_start != (int)i;
                if (!single || !can_tile(p, &L[i]) || t < 2 || t > MS_MAX_TILES
                    || (t & (t - 1)) != 0)
                {
                    return -1;
                }
            }
        }
    }
    return 0;
}

/* The plan's peak in the units of budget_bytes (see ms_solver_result). */
static int64_t
budget_peak(const ms_solver_problem *p, int64_t end, int64_t rec)
{
    int64_t e = end - p->end_extra;
    return e > rec ? e : rec;
}

/* res's memory terms for the plan c, by the memory model (memory.h). */
static void
plan_terms(const ms_solver_problem *p, const ms_layer *L, size_t n,
           const ms_solver_choice *c, ms_solver_result *res)
{
    ms_mem_terms terms;
    ms_mem_terms_of(L, n, c, &terms);
    res->end_bytes = terms.end;
    res->recompute_bytes = terms.recompute;
    res->peak_bytes = budget_peak(p, terms.end, terms.recompute);
}

double
ms_solver_overhead(const ms_solver_problem *p, const ms_layer *L, size_t n,
                   const ms_solver_choice *c, double *recompute_flops)
{
    double total = 0.0, flops = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (c[i].seg_start < 0) {
            if (c[i].selective) {
                total += sel_flops(&L[i], c[i].level) / p->flop_rate;
                flops += sel_flops(&L[i], c[i].level);
            }
            continue;
        }
        total += seconds(p, &L[i]);
        flops += ms_layer_flops(&L[i]);
        if (c[c[i].seg_start].nested && !ends_segment(c, n, i)) {
            /* Run once more, by the first pass, for the next input. */
            total += seconds(p, &L[i]);
            flops += ms_layer_flops(&L[i]);
        }
        if (ends_segment(c, n, i) || c[c[i].seg_start].nested) {
            /* The recompute stops early in its last layer. */
            total -= tail_seconds(p, &L[i]);
            flops -= ms_layer_tail_flops(&L[i]);
        }
        if (c[i].seg_start == (int)i) {
            if (c[i].offload) {
                total += ms_solver_offload_seconds(p, &L[i]);
            }
            if (c[i].tiles > 1) {
                total += (double)(c[i].tiles - 1) * p->tile_overhead;
            }
        }
    }
    if (recompute_flops != NULL) {
        *recompute_flops = flops;
    }
    return total;
}

/* All kept: always a plan, the unoptimized one. */
static void
keep_all(ms_solver_choice *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        out[i].seg_start = -1;
        out[i].offload = 0;
        out[i].tiles = 1;
        out[i].selective = 0;
        out[i].level = 0;
        out[i].nested = 0;
    }
}

static int
problem_ok(const ms_solver_problem *p)
{
    return p->flop_rate > 0.0 && isfinite(p->flop_rate)
           && !(p->offload_bw < 0.0) && !isnan(p->offload_bw)
           && p->tile_overhead >= 0.0 && isfinite(p->tile_overhead)
           && p->max_segment >= 1 && p->resolution >= 1;
}

/*
 * A segment [i..j] costs the prefix-sum difference P[j+1] - P[i], so the
 * candidates it offers row j+1 are G + P[j+1] with G = f(i, h) - P[i]
 * (plus the offload cost), for every j up to the last one whose recompute
 * fits (its "expiry").  Each target column keeps its live candidates in a
 * small tournament tree over a ring of expiry slots: live expiries lie in
 * [k, k + max_segment] at row k, so the tree has max_segment + 1 leaves,
 * an insertion or an expiry costs O(log max_segment) and the row's best
 * candidate is the root.  The whole DP is O(n x buckets x log max_segment).
 */
typedef struct {
    int64_t held; /* exact bytes held at the target state */
    uint32_t src_i;
    uint16_t src_h;
    uint8_t offload;
} cand;

/* A candidate's g apart from the rest (the tree compares only g: the
   leaves a fix reads lie together). */
typedef struct {
    size_t leaves;  /* a power of two >= max_segment + 1 */
    double *g;      /* columns x leaves: INFINITY where no candidate */
    cand *leaf;     /* columns x leaves */
    uint32_t *node; /* columns x leaves: index of the best leaf below */
    uint32_t *live; /* columns: leaves holding a candidate */
} forest;

/* Leaf `slot` changed: recompute the winners on its path to the root.
   Once a node keeps a winner other than `slot`, nothing above it changes. */
static void
tree_fix(forest *t, size_t col, size_t slot)
{
    const double *g = t->g + col * t->leaves;
    uint32_t *node = t->node + col * t->leaves;
    size_t k = (slot + t->leaves) / 2;
    while (k >= 1) {
        uint32_t a, b;
        a = 2 * k >= t->leaves ? (uint32_t)(2 * k - t->leaves) : node[2 * k];
        b = 2 * k + 1 >= t->leaves ? (uint32_t)(2 * k + 1 - t->leaves)
                                   : node[2 * k + 1];
        uint32_t win = g[b] < g[a] ? b : a;
        if (win == node[k] && win != (uint32_t)slot) {
            break;
        }
        node[k] = win;
        k /= 2;
    }
}

static void
tree_offer(forest *t, size_t col, size_t slot, double g, int64_t held,
           size_t src_i, size_t src_h, int offload)
{
    if (!(g < INFINITY)) {
        return; /* no candidate (an infinite offload cost) */
    }
    size_t at = col * t->leaves + slot;
    cand *c = &t->leaf[at];
    if (g < t->g[at] || (g == t->g[at] && held < c->held)) {
        t->live[col] += t->g[at] == INFINITY;
        t->g[at] = g;
        c->held = held;
        c->src_i = (uint32_t)src_i;
        c->src_h = (uint16_t)src_h;
        c->offload = (uint8_t)offload;
        tree_fix(t, col, slot);
    }
}

static void
tree_expire(forest *t, size_t col, size_t slot)
{
    size_t at = col * t->leaves + slot;
    if (t->g[at] != INFINITY) {
        t->g[at] = INFINITY;
        t->live[col]--;
        tree_fix(t, col, slot);
    }
}

/* The index (into g and leaf) of the column's best candidate. */
static size_t
tree_best(const forest *t, size_t col)
{
    const uint32_t *node = t->node + col * t->leaves;
    return col * t->leaves + (t->leaves > 1 ? node[1] : 0);
}

/* The largest end e in [lo, *end] (exclusive ends of segments starting
   at i) whose term term[e - i] fits `room`, given term[lo - i] does; it
   is left in *end.  A row's states come in the order of their held
   bytes, so each has less room than the one before and an end no
   greater: the search goes down from the last state's end, and takes
   O(max_segment) steps over the whole row (the term only grows with the
   segment). */
static size_t
longest_fit(const int64_t *term, size_t i, size_t lo, size_t *end,
            int64_t room)
{
    size_t e = *end;
    while (e > lo && term[e - i] > room) {
        e--;
    }
    *end = e;
    return e;
}

/* Adding x >= 0 bytes (the memory terms are clamped at 0) to a state of
   bucket h, whose held bytes are h * bucket + r (0 <= r < bucket: every
   move writes a state into the bucket of its own held bytes): with
   q = x / bucket and rem = x % bucket, worked out once per row, the
   sum's bucket is h + q, plus one when r + rem reaches a bucket, without
   a division per state.  A sum that saturated is divided as it is. */
typedef struct {
    int64_t q, rem;
} bucket_step;

static bucket_step
step_of(int64_t x, int64_t bucket)
{
    assert(x >= 0);
    bucket_step s = {x / bucket, x % bucket};
    return s;
}

static inline size_t
bucket_after(size_t h, int64_t r, bucket_step s, int64_t sum, int64_t bucket)
{
    if (sum == INT64_MAX) {
        return (size_t)(sum / bucket);
    }
    size_t b = h + (size_t)s.q + (size_t)(r + s.rem >= bucket);
    assert(b == (size_t)(sum / bucket));
    return b;
}

/* One run of the DP; with `nested`, nested segments are a move too. */
static int
solve_pass(const ms_solver_problem *p, const ms_layer *L, size_t n,
           ms_solver_choice *out, ms_solver_result *res, int nested)
{
    memset(res, 0, sizeof(*res));
    keep_all(out, n);
    int64_t B = p->budget_bytes;
    /* What everything held at the end of the forward may reach. */
    int64_t BE = p->end_extra >= 0 ? ms_add_sat(B, p->end_extra)
                                   : B + p->end_extra;
    if (B < 0 || BE < 0 || n > UINT32_MAX - 1) {
        plan_terms(p, L, n, out, res);
        return (B < 0 || BE < 0) ? 0 : -2;
    }
    int64_t R = p->resolution < MAX_RESOLUTION ? p->resolution
                                               : MAX_RESOLUTION;
    int64_t bucket = BE > R ? ms_ceil_div(BE, R) : 1;
    size_t M = (size_t)(BE / bucket); /* capacity, in buckets */
    size_t W = (size_t)(p->max_segment < SEGMENT_LEN_LIMIT
                            ? p->max_segment
                            : SEGMENT_LEN_LIMIT);
    size_t width = M + 1;
    forest t = {1, NULL, NULL, NULL, NULL};
    while (t.leaves < W + 1) {
        t.leaves *= 2;
    }
    /* Nested segments: candidates g = cost - (P[i] + Q[i]), arriving at
       row r with g + P[r - 1] + Q[r] (the first pass runs i .. r - 2,
       and each layer is recomputed alone, less its tail). */
    forest tn = {t.leaves, NULL, NULL, NULL, NULL};

    double *cur = malloc(width * sizeof(double));
    double *next = malloc(width * sizeof(double));
    int64_t *cur_held = malloc(width * sizeof(int64_t));
    int64_t *next_held = malloc(width * sizeof(int64_t));
    back_t *back = malloc((n + 1) * width * sizeof(back_t));
    int64_t *SP = malloc((n + 1) * sizeof(int64_t)); /* saved prefix */
    double *P = malloc((n + 1) * sizeof(double));    /* cost prefix */
    size_t *run_end = malloc((n ? n : 1) * sizeof(size_t));
    /* rt[k]: the recompute term of the segment i .. i + k - 1 (row i,
       ms_mem_seg_step): the largest over its layers m of saved(i .. m) +
       backward(m).  Non-decreasing in k. */
    int64_t *rt = malloc((W + 1) * sizeof(int64_t));
    /* nt[k]: the recompute term of the nested segment i .. i + k - 1
       (ms_mem_nest_step); non-decreasing in k. */
    int64_t *nt = malloc((W + 1) * sizeof(int64_t));
    double *Q = malloc((n + 1) * sizeof(double)); /* cost less tail prefix */
    t.g = malloc(width * t.leaves * sizeof(double));
    t.leaf = malloc(width * t.leaves * sizeof(cand));
    t.node = calloc(width * t.leaves, sizeof(uint32_t));
    t.live = calloc(width, sizeof(uint32_t));
    if (nested) {
        tn.g = malloc(width * tn.leaves * sizeof(double));
        tn.leaf = malloc(width * tn.leaves * sizeof(cand));
        tn.node = calloc(width * tn.leaves, sizeof(uint32_t));
        tn.live = calloc(width, sizeof(uint32_t));
    }
    int rc = -1;
    if (cur == NULL || next == NULL || back == NULL || SP == NULL || P == NULL
        || run_end == NULL || t.g == NULL || t.leaf == NULL || t.node == NULL
        || t.live == NULL || cur_held == NULL || next_held == NULL
        || rt == NULL || nt == NULL || Q == NULL
        || (nested
            && (tn.g == NULL || tn.leaf == NULL || tn.node == NULL
                || tn.live == NULL)))
    {
        goto done;
    }
    for (size_t k = 0; k < width * t.leaves; k++) {
        t.g[k] = INFINITY;
        if (nested) {
            tn.g[k] = INFINITY;
        }
    }
    for (size_t k = 0; k < (n + 1) * width; k++) {
        back[k] = BACK_NONE;
    }
    SP[0] = 0;
    P[0] = 0.0;
    Q[0] = 0.0;
    for (size_t i = 0; i < n; i++) {
        SP[i + 1] = ms_add_sat(SP[i], ms_mem_saved(&L[i]));
        P[i + 1] = P[i] + seconds(p, &L[i]);
        Q[i + 1] = Q[i] + seconds(p, &L[i]) - tail_seconds(p, &L[i]);
    }
    /* run_end[i]: one past the last layer a segment starting at i may
       reach (eligible layers only). */
    for (size_t i = n; i-- > 0;) {
        run_end[i] = (i + 1 < n && eligible(&L[i + 1])) ? run_end[i + 1]
                                                        : i + 1;
    }
    for (size_t h = 0; h < width; h++) {
        cur[h] = next[h] = INFINITY;
        cur_held[h] = next_held[h] = 0;
    }
    cur[0] = 0.0;
    int ckpt = (p->allowed & MS_TECH_CHECKPOINT) != 0;

    for (size_t i = 0; i <= n; i++) {
        /* Row i is complete: direct arrivals are in cur; segment arrivals
           are the trees' roots (after dropping what expired at i - 1). */
        if (ckpt && i > 0) {
            size_t slot = (i - 1) % t.leaves;
            for (size_t h = 0; h < width; h++) {
                if (t.live[h] == 0) {
                    continue; /* no candidate in this column */
                }
                tree_expire(&t, h, slot);
                size_t b = tree_best(&t, h);
                const cand *c = &t.leaf[b];
                /* A segment ending at layer i - 1 stops early there. */
                double v = t.g[b] + P[i] - tail_seconds(p, &L[i - 1]);
                if (t.g[b] < INFINITY
                    && (v < cur[h] || (v == cur[h] && c->held < cur_held[h])))
                {
                    cur[h] = v;
                    cur_held[h] = c->held;
                    back[i * width + h] = back_pack(c->src_h,
                                                    (int)(i - c->src_i),
                                                    c->offload, 0);
                }
            }
        }
        if (ckpt && nested && i > 0) {
            size_t slot = (i - 1) % tn.leaves;
            for (size_t h = 0; h < width; h++) {
                if (tn.live[h] == 0) {
                    continue;
                }
                tree_expire(&tn, h, slot);
                size_t b = tree_best(&tn, h);
                const cand *c = &tn.leaf[b];
                double v = tn.g[b] + P[i - 1] + Q[i];
                if (tn.g[b] < INFINITY
                    && (v < cur[h] || (v == cur[h] && c->held < cur_held[h])))
                {
                    cur[h] = v;
                    cur_held[h] = c->held;
                    back[i * width + h] = back_pack(c->src_h,
                                                    (int)(i - c->src_i), 0, 0)
                                          | BACK_NESTED;
                }
            }
        }
        if (i == n) {
            break;
        }
        /* The layer's selective levels worth a move: what each holds,
           its backward term and its cost; a level no better than keeping
           the layer (holding as much) or than another level (holding as
           much, no less backward, costing as much) is left out. */
        int n_sel = 0;
        int sel_level[MS_SEL_LEVELS];
        int64_t sel_held[MS_SEL_LEVELS], sel_bw[MS_SEL_LEVELS];
        double sel_cost[MS_SEL_LEVELS];
        int levels = can_select(p, &L[i]) ? L[i].sel_levels : 0;
        for (int j = 0; j < levels && j < MS_SEL_LEVELS; j++) {
            int64_t hj = ms_mem_selective_held(&L[i], j);
            int64_t bj = ms_mem_selective_backward(&L[i], j);
            double cj = sel_flops(&L[i], j) / p->flop_rate;
            int worse = hj >= ms_mem_saved(&L[i]);
            for (int k = 0; k < levels && k < MS_SEL_LEVELS && !worse; k++) {
                int64_t hk = ms_mem_selective_held(&L[i], k);
                int64_t bk = ms_mem_selective_backward(&L[i], k);
                double ck = sel_flops(&L[i], k) / p->flop_rate;
                /* k is as good everywhere (ties: the lower level stays) */
                worse = k != j && hk <= hj && bk <= bj && ck <= cj
                        && (hk < hj || bk < bj || ck < cj || k < j);
            }
            if (!worse) {
                sel_level[n_sel] = j;
                sel_held[n_sel] = hj;
                sel_bw[n_sel] = bj;
                sel_cost[n_sel] = cj;
                n_sel++;
            }
        }
        int ok_ckpt = ckpt && eligible(&L[i]);
        int ok_off = ok_ckpt && can_offload(p, &L[i]);
        int ok_tile = ok_ckpt && can_tile(p, &L[i]);
        double off_cost = ok_off ? ms_solver_offload_seconds(p, &L[i]) : 0.0;
        size_t last = run_end[i] < i + W ? run_end[i] : i + W; /* exclusive */
        rt[0] = 0;
        nt[0] = 0;
        int64_t inputs = 0;
        for (size_t k = i; k < last; k++) {
            rt[k - i + 1] = ms_mem_seg_step(rt[k - i], SP[k + 1] - SP[i],
                                            &L[k]);
            if (nested) {
                nt[k - i + 1] = ms_mem_nest_step(nt[k - i], inputs, &L[k]);
                inputs = ms_add_sat(inputs, ms_mem_stored(&L[k], 0));
            }
        }
        /* Where the longest segment (nested segment) starting at i whose
           recompute fits ended for the state before (longest_fit). */
        size_t seg_end = last, nest_end = last;
        bucket_step kept_step = step_of(ms_mem_saved(&L[i]), bucket);
        bucket_step in_step = step_of(ms_mem_stored(&L[i], 0), bucket);
        bucket_step sel_step[MS_SEL_LEVELS];
        for (int k = 0; k < n_sel; k++) {
            sel_step[k] = step_of(sel_held[k], bucket);
        }
        for (size_t h = 0; h < width; h++) {
            double v = cur[h];
            if (v == INFINITY) {
                continue;
            }
            /* The exact bytes held on the path that reached this state:
               every check below is exact; only states whose held bytes
               fall in the same bucket compete (the cheaper one stays). */
            int64_t held = cur_held[h];
            int64_t room = B - held;
            int64_t r = held - (int64_t)h * bucket; /* held % bucket */
            /* Kept. */
            int64_t hk_bytes = ms_add_sat(held, ms_mem_saved(&L[i]));
            if (hk_bytes <= BE) {
                size_t hk = bucket_after(h, r, kept_step, hk_bytes, bucket);
                if (v < next[hk]
                    || (v == next[hk] && hk_bytes < next_held[hk]))
                {
                    next[hk] = v;
                    next_held[hk] = hk_bytes;
                    back[(i + 1) * width + hk] = back_pack(h, 0, 0, 0);
                }
            }
            /* Selective, at each level: holds its input and the outputs
               the level keeps; its backward must fit the recompute
               budget. */
            for (int k = 0; k < n_sel; k++) {
                if (sel_bw[k] > room) {
                    continue;
                }
                int64_t hs_bytes = ms_add_sat(held, sel_held[k]);
                if (hs_bytes > BE) {
                    continue;
                }
                double cs = v + sel_cost[k];
                size_t hs = bucket_after(h, r, sel_step[k], hs_bytes, bucket);
                if (cs < next[hs]
                    || (cs == next[hs] && hs_bytes < next_held[hs]))
                {
                    next[hs] = cs;
                    next_held[hs] = hs_bytes;
                    back[(i + 1) * width + hs] = back_pack(h, 0, 0, 0)
                                                 | BACK_SELECTIVE
                                                 | (back_t)sel_level[k]
                                                       << BACK_LEVEL_SHIFT;
                }
            }
            if (!ok_ckpt) {
                continue;
            }
            /* A segment starting here holds its input, or (offloaded)
               nothing: held stays. */
            int64_t in_bytes = ms_add_sat(held, ms_mem_stored(&L[i], 0));
            int in_fits = in_bytes <= BE;
            size_t hin = in_fits
                             ? bucket_after(h, r, in_step, in_bytes, bucket)
                             : 0;
            if (rt[1] <= room) {
                /* The longest segment whose recompute fits. */
                size_t lo = longest_fit(rt, i, i + 1, &seg_end, room);
                size_t slot = lo & (t.leaves - 1); /* expires after row lo */
                double g = v - P[i];
                if (in_fits) {
                    tree_offer(&t, hin, slot, g, in_bytes, i, h, 0);
                }
                if (ok_off) {
                    tree_offer(&t, h, slot, g + off_cost, held, i, h, 1);
                }
            }
            if (nested && in_fits && last > i + 1 && nt[2] <= room) {
                /* The longest nested segment whose recompute fits. */
                size_t lo = longest_fit(nt, i, i + 2, &nest_end, room);
                tree_offer(&tn, hin, lo & (tn.leaves - 1), v - P[i] - Q[i],
                           in_bytes, i, h, 0);
            }
            /* One layer in tiles, when it does not fit whole: the fewest
               tiles whose share fits. */
            if (ok_tile && rt[1] > room) {
                int lg = 1;
                for (int tl = 2; tl <= MS_MAX_TILES; tl *= 2, lg++) {
                    if (ms_mem_tile_share(&L[i], tl) > room) {
                        continue;
                    }
                    double c = v + (P[i + 1] - P[i]) - tail_seconds(p, &L[i])
                               + (tl - 1) * p->tile_overhead;
                    if (in_fits
                        && (c < next[hin]
                            || (c == next[hin] && in_bytes < next_held[hin])))
                    {
                        next[hin] = c;
                        next_held[hin] = in_bytes;
                        back[(i + 1) * width + hin] = back_pack(h, 1, 0, lg);
                    }
                    if (ok_off
                        && (c + off_cost < next[h]
                            || (c + off_cost == next[h]
                                && held < next_held[h])))
                    {
                        next[h] = c + off_cost;
                        next_held[h] = held;
                        back[(i + 1) * width + h] = back_pack(h, 1, 1, lg);
                    }
                    break;
                }
            }
        }
        double *tmp = cur;
        cur = next;
        next = tmp;
        int64_t *tmph = cur_held;
        cur_held = next_held;
        next_held = tmph;
        for (size_t h = 0; h < width; h++) {
            next[h] = INFINITY;
            next_held[h] = 0;
        }
    }

    double best = INFINITY;
    size_t best_h = 0;
    for (size_t h = 0; h <= M; h++) {
        if (cur[h] < best) {
            best = cur[h];
            best_h = h;
        }
    }
    if (best < INFINITY) {
        /* Walk the back-pointers from (n, best_h). */
        size_t i = n, h = best_h;
        while (i > 0) {
            back_t b = back[i * width + h];
            size_t prev_h = b >> 16;
            int len = (int)(b >> 8 & 0xff);
            int code = (int)(b & 0xff);
            if (len == 0) {
                i -= 1; /* kept: out[i] already says so */
                out[i].selective = (code & BACK_SELECTIVE) != 0;
                out[i].level = out[i].selective ? code >> BACK_LEVEL_SHIFT : 0;
            }
            else {
                size_t start = i - (size_t)len;
                for (size_t k = start; k < i; k++) {
                    out[k].seg_start = (int)start;
                }
                out[start].offload = code & 1;
                out[start].tiles = 1 << (code >> 1 & 7);
                out[start].nested = (code & BACK_NESTED) != 0 && len > 1;
                i = start;
            }
            h = prev_h;
        }
        res->feasible = 1;
        res->overhead_seconds = ms_solver_overhead(p, L, n, out,
                                                   &res->recompute_flops);
    }
    /* The plan found, or all kept. */
    plan_terms(p, L, n, out, res);
    rc = 0;
done:
    free(cur);
    free(next);
    free(cur_held);
    free(next_held);
    free(back);
    free(SP);
    free(P);
    free(run_end);
    free(rt);
    free(nt);
    free(Q);
    free(t.g);
    free(t.leaf);
    free(t.node);
    free(t.live);
    free(tn.g);
    free(tn.leaf);
    free(tn.node);
    free(tn.live);
    return rc;
}

int
ms_solve(const ms_solver_problem *p, const ms_layer *L, size_t n,
         ms_solver_choice *out, ms_solver_result *res)
{
    memset(res, 0, sizeof(*res));
    keep_all(out, n);
    if (!problem_ok(p)) {
        return -2;
    }
    int rc = solve_pass(p, L, n, out, res, 0);
    if (rc == 0 && !res->feasible && p->nested
        && (p->allowed & MS_TECH_CHECKPOINT))
    {
        rc = solve_pass(p, L, n, out, res, 1);
    }
    return rc;
}

int
ms_solver_min_budget(const ms_solver_problem *p, const ms_layer *L, size_t n,
                     int64_t *min_budget)
{
    ms_solver_choice *c = malloc((n ? n : 1) * sizeof(ms_solver_choice));
    if (c == NULL) {
        return -1;
    }
    keep_all(c, n);
    ms_mem_terms terms;
    ms_mem_terms_of(L, n, c, &terms);
    /* All kept always fits this. */
    int64_t hi = budget_peak(p, terms.end, terms.recompute);
    if (hi < 0) {
        hi = 0;
    }
    int64_t lo = -1; /* nothing fits below 0 */
    ms_solver_problem q = *p;
    ms_solver_result r;
    int rc = 0;
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        q.budget_bytes = mid;
        rc = ms_solve(&q, L, n, c, &r);
        if (rc != 0) {
            break;
        }
        if (r.feasible) {
            hi = mid;
        }
        else {
            lo = mid;
        }
    }
    free(c);
    *min_budget = hi;
    return rc;
}
