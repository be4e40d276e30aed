/*
 * test_engine.c: the decision engine (csrc/engine.c), tested on its own.
 *
 * A standalone program, no Python: tests/test_engine_c.py compiles it with
 * csrc/engine.c (-std=c11 -Wall -Wextra -Werror, under ASan/UBSan where the
 * compiler has them) and runs it.  One line per check group, then a last
 * line "N passed, M failed"; the exit status is 0 only when nothing failed.
 *
 * The reference model below is written from the comment at the top of
 * engine.c, not from its code:
 *
 *     peak = F + rest + max(sum_j h_j,
 *                           max_{i checkpointed} sum_{j<i} h_j + saved_i)
 *
 * with h_j = input_j for a checkpointed layer and saved_j otherwise, and
 * rest = activation_bytes - sum_j saved_j (never below 0).  A layer tiled
 * in t tiles holds ceil(saved_i / t) at its recompute instead of saved_i.
 */
#include "../../csrc/engine.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- checks ----------------------------------------------------------- */

static long n_passed, n_failed;
static long group_passed, group_failed;
static int shown;

#define MAX_SHOWN 30

static void
check_at(int ok, const char *file, int line, const char *what,
         const char *detail)
{
    if (ok) {
        n_passed++;
        group_passed++;
        return;
    }
    n_failed++;
    group_failed++;
    if (shown++ < MAX_SHOWN) {
        printf("FAIL %s:%d: %s%s%s\n", file, line, what,
               detail[0] ? " -- " : "", detail);
    }
}

#define CHECK(cond) check_at(!!(cond), __FILE__, __LINE__, #cond, "")

/* A check with context (case number, layer index) in its message. */
static char ctx[160];
#define CHECKC(cond) check_at(!!(cond), __FILE__, __LINE__, #cond, ctx)

static void
group_begin(void)
{
    group_passed = 0;
    group_failed = 0;
}

static void
group_end(const char *name)
{
    printf("%s %-16s %ld checks, %ld failed\n", group_failed ? "FAIL" : "ok  ",
           name, group_passed + group_failed, group_failed);
}

/* ---- helpers ---------------------------------------------------------- */

/* A fixed-seed 64-bit LCG (Knuth's MMIX constants); high bits only. */
static uint64_t lcg_state;

static uint32_t
rnd32(void)
{
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(lcg_state >> 32);
}

static uint64_t
rnd64(void)
{
    uint64_t hi = rnd32();
    return (hi << 32) | rnd32();
}

/* Uniform in [lo, hi] (hi - lo < 2^32). */
static int64_t
rnd_range(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd32() % (uint32_t)(hi - lo + 1));
}

static ms_problem
problem(int64_t budget, int64_t fixed, int64_t activation, double flops)
{
    ms_problem p;
    memset(&p, 0, sizeof(p));
    p.mode = MS_MODE_CONSERVATIVE;
    p.allowed = MS_TECH_CHECKPOINT;
    p.force = 0;
    p.budget_bytes = budget;
    p.fixed_bytes = fixed;
    p.activation_bytes = activation;
    p.total_flops = flops;
    return p;
}

static ms_layer
layer(int64_t saved, int64_t input, double flops, unsigned flags)
{
    ms_layer l;
    memset(&l, 0, sizeof(l));
    l.param_bytes = 0;
    l.saved_bytes = saved;
    l.input_bytes = input;
    l.flops = flops;
    l.flags = flags;
    return l;
}

static int64_t
sum_saved(const ms_layer *layers, size_t n)
{
    int64_t s = 0;
    for (size_t i = 0; i < n; i++) {
        s += layers[i].saved_bytes;
    }
    return s;
}

static double
sum_flops(const ms_layer *layers, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) {
        s += layers[i].flops;
    }
    return s;
}

static int
eligible(const ms_layer *l)
{
    return !(l->flags & (MS_LAYER_NOT_CALLED | MS_LAYER_INPLACE_INPUT
                         | MS_LAYER_UNREPEATABLE))
           && l->saved_bytes > l->input_bytes;
}

/* The rule an ineligible layer gets (not-called is reported first). */
static ms_rule
ineligible_rule(const ms_layer *l)
{
    if (l->flags & MS_LAYER_NOT_CALLED) {
        return MS_RULE_NOT_CALLED;
    }
    if (l->flags & MS_LAYER_INPLACE_INPUT) {
        return MS_RULE_INPLACE_INPUT;
    }
    if (l->flags & MS_LAYER_UNREPEATABLE) {
        return MS_RULE_UNREPEATABLE;
    }
    return MS_RULE_NO_SAVINGS;
}

/* The documented memory model, evaluated for the set marked in `ck` and
   the tile counts `tiles` (NULL: none tiled). */
static int64_t
ref_peak_tiled(const ms_problem *p, const ms_layer *L, size_t n,
               const unsigned char *ck, const int *tiles)
{
    int64_t in_layers = sum_saved(L, n);
    int64_t rest = p->activation_bytes - in_layers;
    if (rest < 0) {
        rest = 0;
    }
    int64_t end_of_forward = 0;
    for (size_t j = 0; j < n; j++) {
        end_of_forward += ck[j] ? L[j].input_bytes : L[j].saved_bytes;
    }
    int64_t worst = end_of_forward;
    for (size_t i = 0; i < n; i++) {
        if (!ck[i]) {
            continue;
        }
        int64_t before = 0;
        for (size_t j = 0; j < i; j++) {
            before += ck[j] ? L[j].input_bytes : L[j].saved_bytes;
        }
        int64_t held = L[i].saved_bytes;
        if (tiles != NULL && tiles[i] > 1) {
            held = (held + tiles[i] - 1) / tiles[i];
        }
        if (before + held > worst) {
            worst = before + held;
        }
    }
    return p->fixed_bytes + rest + worst;
}

static int64_t
ref_peak(const ms_problem *p, const ms_layer *L, size_t n,
         const unsigned char *ck)
{
    return ref_peak_tiled(p, L, n, ck, NULL);
}

static int
tiling_on(const ms_problem *p)
{
    return (p->allowed & MS_TECH_TILING) != 0;
}

static int
rule_ok(ms_rule r)
{
    const char *name = ms_rule_name(r);
    return (int)r >= 0 && r < MS_RULE_COUNT && name != NULL
           && strcmp(name, "unknown") != 0;
}

/* Checks that hold for every plan, whatever the input. */
static void
check_invariants(const ms_problem *p, const ms_layer *L, size_t n,
                 const ms_choice *out, const ms_result *r)
{
    unsigned char *ck = calloc(n ? n : 1, 1);
    int *tiles = malloc((n ? n : 1) * sizeof(int));
    int all_eligible_chosen = 1, any_chosen = 0, bad_rule = 0, bad_tech = 0,
        bad_saved = 0, bad_tiles = 0;
    if (ck == NULL || tiles == NULL) {
        CHECKC(ck != NULL && tiles != NULL);
        free(ck);
        free(tiles);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        ck[i] = out[i].techniques != 0;
        any_chosen |= ck[i];
        tiles[i] = out[i].tiles;
        if (!rule_ok(out[i].rule)) {
            bad_rule = 1;
        }
        if (out[i].techniques
            & ~(unsigned)(MS_TECH_CHECKPOINT | MS_TECH_TILING))
        {
            bad_tech = 1;
        }
        /* Tiled: checkpointed, a candidate, allowed, a power of two. */
        int t = out[i].tiles;
        if (out[i].techniques & MS_TECH_TILING) {
            if (!(out[i].techniques & MS_TECH_CHECKPOINT)
                || !(L[i].flags & MS_LAYER_TILEABLE) || !tiling_on(p)
                || t < 2 || t > MS_MAX_TILES || (t & (t - 1)) != 0)
            {
                bad_tiles = 1;
            }
        }
        else if (t != 1) {
            bad_tiles = 1;
        }
        if (ck[i]
            && (!eligible(&L[i])
                || (out[i].rule != MS_RULE_PRESSURE
                    && out[i].rule != MS_RULE_FORCE_ALL)))
        {
            bad_tech = 1;
        }
        if (out[i].bytes_saved
            != (ck[i] ? L[i].saved_bytes - L[i].input_bytes : 0))
        {
            bad_saved = 1;
        }
        if (eligible(&L[i]) && !ck[i]) {
            all_eligible_chosen = 0;
        }
    }
    CHECKC(!bad_rule);
    CHECKC(!bad_tech);
    CHECKC(!bad_saved);
    CHECKC(!bad_tiles);
    CHECKC(!(r->skipped && any_chosen));
    CHECKC(r->skipped == (!p->force && r->peak_unoptimized <= p->budget_bytes));
    CHECKC(r->fits == (r->peak_projected <= p->budget_bytes));
    CHECKC(r->peak_projected <= r->peak_unoptimized);
    CHECKC(r->peak_projected == ref_peak_tiled(p, L, n, ck, tiles));
    if (p->force && !r->skipped
        && (ms_mode_base_techniques(p->mode) & p->allowed & MS_TECH_CHECKPOINT))
    {
        CHECKC(all_eligible_chosen);
    }
    if (!r->fits && tiling_on(p)) {
        /* Over budget: tiling went as far as it helps.  Every candidate
           at the most tiles reaches no lower peak. */
        int *most = malloc((n ? n : 1) * sizeof(int));
        if (most != NULL) {
            for (size_t i = 0; i < n; i++) {
                most[i] = (ck[i] && (L[i].flags & MS_LAYER_TILEABLE)
                           && L[i].saved_bytes > 1)
                              ? MS_MAX_TILES
                              : 1;
            }
            CHECKC(ref_peak_tiled(p, L, n, ck, most) >= r->peak_projected
                   || r->skipped);
            free(most);
        }
    }
    else if (r->fits && !(p->force || p->mode == MS_MODE_AGGRESSIVE)) {
        /* Fits: no layer has more tiles than it needs. */
        for (size_t i = 0; i < n; i++) {
            if (tiles[i] > 1) {
                tiles[i] /= 2;
                CHECKC(ref_peak_tiled(p, L, n, ck, tiles) > p->budget_bytes);
                tiles[i] *= 2;
            }
        }
    }
    /* Every tile pays: with any layer's tiles halved, the peak is higher. */
    for (size_t i = 0; i < n; i++) {
        if (tiles[i] > 1) {
            tiles[i] /= 2;
            CHECKC(ref_peak_tiled(p, L, n, ck, tiles) > r->peak_projected);
            tiles[i] *= 2;
        }
    }
    free(ck);
    free(tiles);
}

/* ---- groups ------------------------------------------------------------ */

static void
test_names(void)
{
    static const char *const expected[MS_RULE_COUNT] = {
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
    group_begin();
    for (int r = 0; r < MS_RULE_COUNT; r++) {
        const char *name = ms_rule_name((ms_rule)r);
        snprintf(ctx, sizeof(ctx), "rule %d", r);
        CHECKC(name != NULL && strcmp(name, expected[r]) == 0);
    }
    CHECK(ms_rule_name(MS_RULE_COUNT) != NULL);
    CHECK(strcmp(ms_rule_name(MS_RULE_COUNT), "unknown") == 0);
    CHECK(strcmp(ms_rule_name((ms_rule)-1), "unknown") == 0);
    CHECK(strcmp(ms_rule_name((ms_rule)1000), "unknown") == 0);
    CHECK(ms_mode_base_techniques(MS_MODE_CONSERVATIVE) == MS_TECH_CHECKPOINT);
    CHECK(ms_mode_base_techniques(MS_MODE_BALANCED)
          == (MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_SELECTIVE));
    CHECK(ms_mode_base_techniques(MS_MODE_AGGRESSIVE)
          == (MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_TILING
              | MS_TECH_SELECTIVE));
    group_end("names");
}

static void
test_smart_skip(void)
{
    /* Eligible and ineligible layers alike: all left alone. */
    ms_layer L[4] = {
        layer(100, 10, 50, 0),
        layer(100, 10, 50, MS_LAYER_INPLACE_INPUT),
        layer(100, 10, 50, MS_LAYER_NOT_CALLED),
        layer(10, 10, 50, 0),
    };
    ms_choice out[4];
    ms_result r;
    int64_t acts = sum_saved(L, 4) + 40; /* rest = 40 */
    int64_t unopt = 1000 + acts;

    group_begin();
    for (int mode = 0; mode < 3; mode++) {
        /* budget == peak is still "fits"; budget far above too. */
        int64_t budgets[2] = {unopt, unopt * 100};
        for (int b = 0; b < 2; b++) {
            ms_problem p = problem(budgets[b], 1000, acts, 200);
            p.mode = (ms_mode)mode;
            p.allowed = MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_TILING;
            snprintf(ctx, sizeof(ctx), "mode %d budget %" PRId64, mode,
                     budgets[b]);
            CHECKC(ms_engine_plan(&p, L, 4, out, &r) == 0);
            CHECKC(r.skipped == 1);
            CHECKC(r.fits == 1);
            CHECKC(r.peak_unoptimized == unopt);
            CHECKC(r.peak_projected == unopt);
            CHECKC(r.recompute_ratio == 0.0);
            CHECKC(r.pressure == (double)unopt / (double)budgets[b]);
            for (int i = 0; i < 4; i++) {
                CHECKC(out[i].rule == MS_RULE_SMART_SKIP);
                CHECKC(out[i].techniques == 0);
                CHECKC(out[i].bytes_saved == 0);
            }
            check_invariants(&p, L, 4, out, &r);
        }
    }
    /* One byte short: no longer skipped. */
    ms_problem p = problem(unopt - 1, 1000, acts, 200);
    snprintf(ctx, sizeof(ctx), "budget one byte short");
    CHECKC(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECKC(r.skipped == 0);
    CHECKC(out[0].rule != MS_RULE_SMART_SKIP);
    /* Skip wins over "disabled": a fitting model is left alone either way. */
    p = problem(unopt, 1000, acts, 200);
    p.allowed = 0;
    CHECKC(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECKC(r.skipped == 1 && out[0].rule == MS_RULE_SMART_SKIP);
    group_end("smart-skip");
}

static void
test_force(void)
{
    ms_layer L[7] = {
        layer(100, 10, 50, 0),                      /* eligible */
        layer(100, 10, 50, MS_LAYER_INPLACE_INPUT), /* inplace */
        layer(100, 10, 50, MS_LAYER_NOT_CALLED),    /* not called */
        layer(10, 10, 50, 0),                       /* saved == input */
        layer(5, 10, 50, 0),                        /* saved < input */
        layer(0, 0, 0, 0),                          /* nothing at all */
        layer(300, 0, 0, 0),                        /* eligible, 0 flops */
    };
    const ms_rule want[7] = {
        MS_RULE_FORCE_ALL,   MS_RULE_INPLACE_INPUT, MS_RULE_NOT_CALLED,
        MS_RULE_NO_SAVINGS,  MS_RULE_NO_SAVINGS,    MS_RULE_NO_SAVINGS,
        MS_RULE_FORCE_ALL,
    };
    ms_choice out[7];
    ms_result r;
    int64_t acts = sum_saved(L, 7);

    group_begin();
    for (int mode = 0; mode < 3; mode++) {
        /* force ignores the budget: huge, tight, or zero. */
        int64_t budgets[3] = {INT64_C(1) << 50, 1, 0};
        for (int b = 0; b < 3; b++) {
            ms_problem p = problem(budgets[b], 64, acts, 400);
            p.mode = (ms_mode)mode;
            p.force = 1;
            snprintf(ctx, sizeof(ctx), "mode %d budget %" PRId64, mode,
                     budgets[b]);
            CHECKC(ms_engine_plan(&p, L, 7, out, &r) == 0);
            CHECKC(r.skipped == 0);
            for (int i = 0; i < 7; i++) {
                snprintf(ctx, sizeof(ctx), "mode %d budget %" PRId64
                         " layer %d", mode, budgets[b], i);
                CHECKC(out[i].rule == want[i]);
                CHECKC(out[i].techniques
                       == (want[i] == MS_RULE_FORCE_ALL ? MS_TECH_CHECKPOINT
                                                        : 0u));
            }
            snprintf(ctx, sizeof(ctx), "mode %d", mode);
            CHECKC(out[0].bytes_saved == 90 && out[6].bytes_saved == 300);
            CHECKC(r.recompute_ratio == 50.0 / 400.0);
            check_invariants(&p, L, 7, out, &r);
        }
    }
    /* A forced layer is checkpointed alone: its recompute stops early, so
       its tail (the ops after its last saved tensor) is not recomputed;
       a tail beyond the layer's FLOPs is taken as them (layer 6 has
       none). tail_cost, at the matmul rate, is what the slowdown skips:
       (50 - 30) / (3 x 400) more than a step. */
    L[0].tail_flops = 20.0;
    L[0].tail_cost = 30.0;
    L[6].tail_flops = 5.0;
    {
        ms_problem p = problem(1, 64, acts, 400);
        p.force = 1;
        p.flop_rate = 1.0;
        snprintf(ctx, sizeof(ctx), "tails");
        CHECKC(ms_engine_plan(&p, L, 7, out, &r) == 0);
        CHECKC(r.recompute_ratio == 30.0 / 400.0);
        CHECKC(fabs(r.predicted_slowdown - (1.0 + 20.0 / 1200.0)) < 1e-12);
        check_invariants(&p, L, 7, out, &r);
    }
    group_end("force-all");
}

static void
test_ineligible_flags(void)
{
    /* Under pressure with nothing fitting: each flag on its own. */
    struct {
        ms_layer l;
        ms_rule want;
    } cases[] = {
        {layer(100, 10, 5, MS_LAYER_INPLACE_INPUT), MS_RULE_INPLACE_INPUT},
        {layer(100, 10, 5, MS_LAYER_NOT_CALLED), MS_RULE_NOT_CALLED},
        {layer(100, 100, 5, 0), MS_RULE_NO_SAVINGS},
        {layer(1, 100, 5, 0), MS_RULE_NO_SAVINGS},
        {layer(0, 0, 5, 0), MS_RULE_NO_SAVINGS},
        {layer(100, 99, 5, 0), MS_RULE_PRESSURE},
        {layer(100, 99, 5, 1u << 7), MS_RULE_PRESSURE}, /* unknown flag bit */
    };
    group_begin();
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        /* rest = 10 > budget: never skipped */
        ms_problem p = problem(0, 0, cases[c].l.saved_bytes + 10, 5);
        ms_choice out;
        ms_result r;
        snprintf(ctx, sizeof(ctx), "case %zu", c);
        CHECKC(ms_engine_plan(&p, &cases[c].l, 1, &out, &r) == 0);
        CHECKC(out.rule == cases[c].want);
        CHECKC(out.techniques
               == (cases[c].want == MS_RULE_PRESSURE ? MS_TECH_CHECKPOINT
                                                     : 0u));
        check_invariants(&p, &cases[c].l, 1, &out, &r);
    }
    /* Both flags: ineligible either way. */
    ms_layer both = layer(100, 10, 5,
                          MS_LAYER_INPLACE_INPUT | MS_LAYER_NOT_CALLED);
    ms_problem p = problem(1, 0, 100, 5);
    ms_choice out;
    ms_result r;
    snprintf(ctx, sizeof(ctx), "both flags");
    CHECKC(ms_engine_plan(&p, &both, 1, &out, &r) == 0);
    CHECKC(out.techniques == 0);
    CHECKC(out.rule == MS_RULE_NOT_CALLED || out.rule == MS_RULE_INPLACE_INPUT);
    group_end("ineligible");
}

static void
test_greedy(void)
{
    /*
     * Five layers, all saving 100 and keeping 10 (freed 90), with costs
     * chosen so that the order is L4 (0 FLOPs: cost 1), L1 and L3 (ratio 3,
     * tied: forward order), L2 (ratio 2), L0 (ratio 1).  Peaks along that
     * order, from the model: 500, 500, 410, 320, 230, 140.
     */
    ms_layer L[5] = {
        layer(100, 10, 90, 0), layer(100, 10, 30, 0), layer(100, 10, 45, 0),
        layer(100, 10, 30, 0), layer(100, 10, 0, 0),
    };
    const int order[5] = {4, 1, 3, 2, 0};
    struct {
        int64_t budget;
        int picks;
        int64_t peak;
        int fits;
    } cases[] = {
        {500, 0, 500, 1}, /* smart-skip */
        {499, 2, 410, 1}, /* L4 alone leaves the peak at 500 */
        {410, 2, 410, 1}, {409, 3, 320, 1}, {320, 3, 320, 1},
        {319, 4, 230, 1}, {231, 4, 230, 1}, {230, 4, 230, 1},
        {229, 5, 140, 1}, {140, 5, 140, 1},
        {139, 5, 140, 0}, /* nothing suffices: all, and not fitting */
        {1, 5, 140, 0},
    };
    group_begin();
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        ms_problem p = problem(cases[c].budget, 0, 500, 195);
        ms_choice out[5];
        ms_result r;
        snprintf(ctx, sizeof(ctx), "budget %" PRId64, cases[c].budget);
        CHECKC(ms_engine_plan(&p, L, 5, out, &r) == 0);
        CHECKC(r.peak_unoptimized == 500);
        CHECKC(r.peak_projected == cases[c].peak);
        CHECKC(r.fits == cases[c].fits);
        CHECKC(r.skipped == (cases[c].picks == 0));
        double recomputed = 0.0;
        for (int k = 0; k < 5; k++) {
            int i = order[k];
            snprintf(ctx, sizeof(ctx), "budget %" PRId64 " pick %d (layer %d)",
                     cases[c].budget, k, i);
            if (k < cases[c].picks) {
                CHECKC(out[i].techniques == MS_TECH_CHECKPOINT);
                CHECKC(out[i].rule == MS_RULE_PRESSURE);
                CHECKC(out[i].bytes_saved == 90);
                recomputed += L[i].flops;
            }
            else {
                CHECKC(out[i].techniques == 0);
                CHECKC(out[i].rule == (cases[c].picks == 0 ? MS_RULE_SMART_SKIP
                                                           : MS_RULE_FITS));
                CHECKC(out[i].bytes_saved == 0);
            }
        }
        snprintf(ctx, sizeof(ctx), "budget %" PRId64, cases[c].budget);
        CHECKC(r.recompute_ratio == recomputed / 195.0);
        if (cases[c].picks == 5 && !cases[c].fits) {
            CHECKC(r.peak_projected > p.budget_bytes);
        }
        check_invariants(&p, L, 5, out, &r);
    }
    /* Larger freed bytes per FLOP first, whatever the position. */
    ms_layer M[3] = {
        layer(1000, 0, 100, 0), /* ratio 10 */
        layer(400, 0, 10, 0),   /* ratio 40 */
        layer(50, 0, 1, 0),     /* ratio 50 */
    };
    ms_problem p = problem(1449, 0, 1450, 111);
    ms_choice out[3];
    ms_result r;
    snprintf(ctx, sizeof(ctx), "ratio order");
    CHECKC(ms_engine_plan(&p, M, 3, out, &r) == 0);
    /* After L2 alone: max(1400, 1400 + 50) = 1450 > budget; after L1 too:
       max(1000, 1000 + 400) = 1400 <= 1449: stop. */
    CHECKC(out[2].techniques == MS_TECH_CHECKPOINT);
    CHECKC(out[1].techniques == MS_TECH_CHECKPOINT);
    CHECKC(out[0].techniques == 0 && out[0].rule == MS_RULE_FITS);
    CHECKC(r.peak_projected == 1400 && r.fits == 1);
    group_end("greedy");
}

static void
test_nothing_suffices(void)
{
    ms_layer L[6] = {
        layer(100, 10, 10, 0),
        layer(100, 10, 10, MS_LAYER_INPLACE_INPUT),
        layer(200, 20, 10, 0),
        layer(10, 10, 10, 0),
        layer(300, 30, 10, MS_LAYER_NOT_CALLED),
        layer(400, 40, 10, 0),
    };
    ms_choice out[6];
    ms_result r;
    /* F alone is over budget. */
    ms_problem p = problem(5000, 5000, sum_saved(L, 6) + 7, 60);
    group_begin();
    snprintf(ctx, sizeof(ctx), "fixed over budget");
    CHECKC(ms_engine_plan(&p, L, 6, out, &r) == 0);
    CHECKC(r.skipped == 0);
    CHECKC(r.fits == 0);
    CHECKC(r.peak_projected > p.budget_bytes);
    for (int i = 0; i < 6; i++) {
        snprintf(ctx, sizeof(ctx), "layer %d", i);
        CHECKC((out[i].techniques == MS_TECH_CHECKPOINT) == eligible(&L[i]));
        CHECKC(out[i].rule
               == (eligible(&L[i]) ? MS_RULE_PRESSURE : ineligible_rule(&L[i])));
    }
    check_invariants(&p, L, 6, out, &r);
    /* Not even the first: only ineligible layers, under pressure. */
    ms_layer I[2] = {layer(100, 100, 1, 0),
                     layer(100, 1, 1, MS_LAYER_INPLACE_INPUT)};
    p = problem(10, 0, 200, 2);
    snprintf(ctx, sizeof(ctx), "nothing eligible");
    CHECKC(ms_engine_plan(&p, I, 2, out, &r) == 0);
    CHECKC(r.skipped == 0 && r.fits == 0);
    CHECKC(r.peak_projected == r.peak_unoptimized);
    CHECKC(out[0].techniques == 0 && out[1].techniques == 0);
    CHECKC(out[0].rule == MS_RULE_NO_SAVINGS);
    CHECKC(out[1].rule == MS_RULE_INPLACE_INPUT);
    group_end("nothing-fits");
}

static void
test_disabled(void)
{
    ms_layer L[3] = {
        layer(100, 10, 10, 0),
        layer(100, 10, 10, MS_LAYER_NOT_CALLED),
        layer(10, 10, 10, 0),
    };
    const unsigned allowed[] = {0, MS_TECH_OFFLOAD, MS_TECH_TILING,
                                MS_TECH_OFFLOAD | MS_TECH_TILING, 1u << 5};
    group_begin();
    for (size_t a = 0; a < sizeof(allowed) / sizeof(allowed[0]); a++) {
        for (int force = 0; force < 2; force++) {
            for (int mode = 0; mode < 3; mode++) {
                ms_problem p = problem(1, 0, 210, 30);
                ms_choice out[3];
                ms_result r;
                p.allowed = allowed[a];
                p.force = force;
                p.mode = (ms_mode)mode;
                snprintf(ctx, sizeof(ctx), "allowed %#x force %d mode %d",
                         allowed[a], force, mode);
                CHECKC(ms_engine_plan(&p, L, 3, out, &r) == 0);
                CHECKC(r.skipped == 0);
                CHECKC(r.fits == 0);
                CHECKC(r.peak_projected == r.peak_unoptimized);
                CHECKC(r.recompute_ratio == 0.0);
                for (int i = 0; i < 3; i++) {
                    CHECKC(out[i].rule == MS_RULE_DISABLED);
                    CHECKC(out[i].techniques == 0);
                    CHECKC(out[i].bytes_saved == 0);
                }
                check_invariants(&p, L, 3, out, &r);
            }
        }
    }
    group_end("disabled");
}

static void
test_empty(void)
{
    ms_choice out[1];
    ms_result r;
    group_begin();
    /* Fits: skipped.  F + activations count, even without layers. */
    ms_problem p = problem(100, 60, 40, 0.0);
    snprintf(ctx, sizeof(ctx), "n=0 fits");
    CHECKC(ms_engine_plan(&p, NULL, 0, NULL, &r) == 0);
    CHECKC(r.skipped == 1 && r.fits == 1);
    CHECKC(r.peak_unoptimized == 100 && r.peak_projected == 100);
    CHECKC(r.recompute_ratio == 0.0);
    /* Under pressure: nothing to choose, does not fit. */
    p = problem(99, 60, 40, 0.0);
    snprintf(ctx, sizeof(ctx), "n=0 pressure");
    CHECKC(ms_engine_plan(&p, NULL, 0, out, &r) == 0);
    CHECKC(r.skipped == 0 && r.fits == 0);
    CHECKC(r.peak_projected == 100);
    CHECKC(r.pressure == 100.0 / 99.0);
    /* Forced: not skipped, fits. */
    p = problem(1000, 60, 40, 0.0);
    p.force = 1;
    snprintf(ctx, sizeof(ctx), "n=0 force");
    CHECKC(ms_engine_plan(&p, NULL, 0, out, &r) == 0);
    CHECKC(r.skipped == 0 && r.fits == 1);
    /* Zero budget: pressure is reported as 0, nothing divides by zero. */
    p = problem(0, 0, 0, 0.0);
    snprintf(ctx, sizeof(ctx), "n=0 zero budget");
    CHECKC(ms_engine_plan(&p, NULL, 0, out, &r) == 0);
    CHECKC(r.pressure == 0.0);
    CHECKC(r.skipped == 1 && r.fits == 1);
    group_end("empty");
}

/* Field by field: ms_choice has padding bytes. */
static int
same_choices(const ms_choice *a, const ms_choice *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (a[i].techniques != b[i].techniques || a[i].rule != b[i].rule
            || a[i].tier != b[i].tier || a[i].bytes_saved != b[i].bytes_saved)
        {
            return 0;
        }
    }
    return 1;
}

/* A random problem of n layers; small sizes so budgets fall in between. */
static void
random_small(ms_problem *p, ms_layer *L, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned flags = 0;
        if (rnd32() % 8 == 0) {
            flags |= MS_LAYER_INPLACE_INPUT;
        }
        if (rnd32() % 8 == 0) {
            flags |= MS_LAYER_NOT_CALLED;
        }
        L[i] = layer(rnd_range(0, 100), rnd_range(0, 60),
                     (double)rnd_range(0, 50), flags);
        L[i].param_bytes = rnd_range(0, 1000);
    }
    *p = problem(0, rnd_range(0, 100), sum_saved(L, n) + rnd_range(0, 50),
                 sum_flops(L, n) + (double)rnd_range(0, 100));
    p->mode = (ms_mode)rnd_range(0, 2);
    p->allowed = rnd32() % 10 == 0 ? (unsigned)rnd_range(0, 7)
                                   : MS_TECH_CHECKPOINT;
    p->force = rnd32() % 10 == 0;
    /* Budget: anywhere from below the best reachable peak to above the
       unoptimized one. */
    int64_t unopt = p->fixed_bytes + p->activation_bytes;
    int64_t lo = p->fixed_bytes - 20;
    p->budget_bytes = rnd_range(lo > 0 ? lo : 0, unopt + 20);
}

/* freed_a / cost_a > freed_b / cost_b, exactly (small integers). */
static int
better(const ms_layer *a, size_t ia, const ms_layer *b, size_t ib)
{
    int64_t fa = a->saved_bytes - a->input_bytes;
    int64_t fb = b->saved_bytes - b->input_bytes;
    int64_t ca = a->flops > 1.0 ? (int64_t)a->flops : 1;
    int64_t cb = b->flops > 1.0 ? (int64_t)b->flops : 1;
    if (fa * cb != fb * ca) {
        return fa * cb > fb * ca;
    }
    return ia < ib;
}

static void
test_exhaustive(void)
{
    enum { CASES = 2000, MAXN = 8 };
    long fit_cases = 0, partial_cases = 0, nofit_cases = 0;
    lcg_state = 0x5eed5eedULL;
    group_begin();
    for (int c = 0; c < CASES; c++) {
        size_t n = (size_t)rnd_range(0, MAXN);
        ms_layer L[MAXN];
        ms_choice out[MAXN], out2[MAXN];
        ms_result r, r2;
        ms_problem p;
        random_small(&p, L, n);
        snprintf(ctx, sizeof(ctx), "case %d (n=%zu)", c, n);
        CHECKC(ms_engine_plan(&p, L, n, out, &r) == 0);

        /* The reference decision. */
        unsigned char ck[MAXN] = {0};
        size_t order[MAXN], m = 0;
        int64_t unopt = ref_peak(&p, L, n, ck);
        int skipped = !p.force && unopt <= p.budget_bytes;
        int enabled = (ms_mode_base_techniques(p.mode) & p.allowed
                       & MS_TECH_CHECKPOINT) != 0;
        for (size_t i = 0; i < n; i++) {
            if (eligible(&L[i])) {
                /* insertion into the greedy order */
                size_t k = m++;
                while (k > 0 && better(&L[i], i, &L[order[k - 1]], order[k - 1])) {
                    order[k] = order[k - 1];
                    k--;
                }
                order[k] = i;
            }
        }
        size_t picks = 0;
        int64_t peak = unopt;
        if (!skipped && enabled) {
            while (picks < m && (p.force || peak > p.budget_bytes)) {
                ck[order[picks++]] = 1;
                peak = ref_peak(&p, L, n, ck);
            }
        }
        CHECKC(r.peak_unoptimized == unopt);
        CHECKC(r.skipped == skipped);
        CHECKC(r.peak_projected == peak);
        CHECKC(r.fits == (peak <= p.budget_bytes));
        if (r.fits) {
            CHECKC(r.peak_projected <= p.budget_bytes);
        }
        double recomputed = 0.0;
        for (size_t i = 0; i < n; i++) {
            ms_rule want;
            if (skipped) {
                want = MS_RULE_SMART_SKIP;
            }
            else if (!enabled) {
                want = MS_RULE_DISABLED;
            }
            else if (!eligible(&L[i])) {
                want = ineligible_rule(&L[i]);
            }
            else if (ck[i]) {
                want = p.force ? MS_RULE_FORCE_ALL : MS_RULE_PRESSURE;
            }
            else {
                want = MS_RULE_FITS;
            }
            snprintf(ctx, sizeof(ctx), "case %d (n=%zu) layer %zu", c, n, i);
            CHECKC(out[i].rule == want);
            CHECKC(out[i].techniques == (ck[i] ? MS_TECH_CHECKPOINT : 0u));
            if (ck[i]) {
                recomputed += L[i].flops;
            }
        }
        snprintf(ctx, sizeof(ctx), "case %d (n=%zu)", c, n);
        CHECKC(r.recompute_ratio
               == (p.total_flops > 0.0 ? recomputed / p.total_flops : 0.0));

        /* Greedy stops as soon as it fits: one pick fewer did not fit. */
        if (!p.force && picks > 0 && r.fits) {
            ck[order[picks - 1]] = 0;
            CHECKC(ref_peak(&p, L, n, ck) > p.budget_bytes);
            ck[order[picks - 1]] = 1;
        }
        /* Exhaustively: some set of eligible layers fits iff the plan
           does (when the engine may checkpoint and is not skipping). */
        if (!skipped && enabled) {
            int any_fits = 0;
            int64_t best = INT64_MAX;
            for (unsigned mask = 0; mask < (1u << n); mask++) {
                unsigned char s[MAXN] = {0};
                int ok = 1;
                for (size_t i = 0; i < n && ok; i++) {
                    if (mask & (1u << i)) {
                        ok = eligible(&L[i]);
                        s[i] = 1;
                    }
                }
                if (!ok) {
                    continue;
                }
                int64_t pk = ref_peak(&p, L, n, s);
                if (pk < best) {
                    best = pk;
                }
                any_fits |= pk <= p.budget_bytes;
            }
            CHECKC(r.fits == any_fits);
            /* No checkpoint set gets lower than "all eligible". */
            if (picks == m) {
                CHECKC(r.peak_projected == best);
            }
            if (!p.force) {
                if (!any_fits) {
                    nofit_cases++;
                }
                else if (picks < m) {
                    partial_cases++;
                }
            }
        }
        else {
            fit_cases++;
        }
        check_invariants(&p, L, n, out, &r);

        /* Deterministic: the same input gives the same output. */
        memset(out2, 0, sizeof(out2));
        memset(&r2, 0, sizeof(r2));
        CHECKC(ms_engine_plan(&p, L, n, out2, &r2) == 0);
        CHECKC(same_choices(out, out2, n));
        CHECKC(r.peak_projected == r2.peak_projected && r.fits == r2.fits
               && r.skipped == r2.skipped && r.pressure == r2.pressure);
    }
    /* The generator reaches every kind of case. */
    snprintf(ctx, sizeof(ctx), "coverage: %ld skipped/disabled, %ld partial, "
             "%ld not fitting", fit_cases, partial_cases, nofit_cases);
    CHECKC(fit_cases > 100 && partial_cases > 100 && nofit_cases > 50);
    group_end("exhaustive");
}


/* ---- offload ------------------------------------------------------------ */

/* The peak with per-layer state: 0 kept, 1 checkpointed, 2 checkpointed and
   offloaded (h = 0 while waiting), from the model in engine.c's comment. */
static int64_t
ref_peak_offload(const ms_problem *p, const ms_layer *L, size_t n,
                 const unsigned char *st)
{
    int64_t in_layers = 0, prefix = 0, worst = 0;
    for (size_t i = 0; i < n; i++) {
        in_layers += L[i].saved_bytes;
    }
    int64_t rest = p->activation_bytes - in_layers;
    if (rest < 0) {
        rest = 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (st[i]) {
            if (prefix + L[i].saved_bytes > worst) {
                worst = prefix + L[i].saved_bytes;
            }
            if (st[i] == 1) {
                int64_t freed = L[i].saved_bytes - L[i].input_bytes;
                prefix += L[i].saved_bytes - (freed > 0 ? freed : 0);
            }
        }
        else {
            prefix += L[i].saved_bytes;
        }
    }
    if (prefix > worst) {
        worst = prefix;
    }
    return p->fixed_bytes + rest + worst;
}

static void
test_offload(void)
{
    group_begin();
    /* Four equal layers: saved 100, input 10.  A CPU host: disk only. */
    ms_layer L[4];
    for (size_t i = 0; i < 4; i++) {
        L[i] = layer(100, 10, 10.0, 0);
    }
    L[2].input_bytes = 4; /* below min_offload_bytes below */
    ms_choice out[4];
    ms_result r;
    ms_problem p = problem(1, 50, 400, 40.0);
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD;
    p.disk_tier = 1;
    p.min_offload_bytes = 5;

    /* CONSERVATIVE never offloads. */
    p.force = 1;
    p.mode = MS_MODE_CONSERVATIVE;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    for (size_t i = 0; i < 4; i++) {
        CHECK(out[i].techniques == MS_TECH_CHECKPOINT);
        CHECK(out[i].tier == MS_TIER_DEVICE);
    }

    /* BALANCED + force: every checkpointed layer with inputs >= min. */
    p.mode = MS_MODE_BALANCED;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    unsigned char want[4] = {2, 2, 1, 2};
    for (size_t i = 0; i < 4; i++) {
        CHECK(out[i].techniques
              == (want[i] == 2 ? (MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD)
                               : MS_TECH_CHECKPOINT));
        CHECK(out[i].tier == (want[i] == 2 ? MS_TIER_DISK : MS_TIER_DEVICE));
        CHECK(out[i].bytes_saved == (want[i] == 2 ? 100 : 96));
    }
    CHECK(r.peak_projected == ref_peak_offload(&p, L, 4, want));
    /* Peak: recompute of layer 3 = 4 (layer 2's input) + 100, over F. */
    CHECK(r.peak_projected == 50 + 104);

    /* OFFLOAD not allowed: checkpointing only. */
    p.allowed = MS_TECH_CHECKPOINT;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECK(out[0].techniques == MS_TECH_CHECKPOINT);
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD;

    /* No tier to put it in: nothing is offloaded. */
    p.disk_tier = 0;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    for (size_t i = 0; i < 4; i++) {
        CHECK(out[i].tier == MS_TIER_DEVICE);
        CHECK(!(out[i].techniques & MS_TECH_OFFLOAD));
    }

    /* A GPU: host RAM up to its cap (two layers' inputs), then disk... */
    p.host_tier = 1;
    p.host_cap_bytes = 20;
    p.disk_tier = 1;
    L[2].input_bytes = 10;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECK(out[0].tier == MS_TIER_HOST && out[1].tier == MS_TIER_HOST);
    CHECK(out[2].tier == MS_TIER_DISK && out[3].tier == MS_TIER_DISK);
    /* ...or, without a disk tier, the device. */
    p.disk_tier = 0;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECK(out[0].tier == MS_TIER_HOST && out[1].tier == MS_TIER_HOST);
    CHECK(out[2].tier == MS_TIER_DEVICE && out[3].tier == MS_TIER_DEVICE);
    CHECK(out[2].techniques == MS_TECH_CHECKPOINT);
    /* No cap. */
    p.host_cap_bytes = -1;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECK(out[3].tier == MS_TIER_HOST);

    /* BALANCED under pressure: checkpoint everything (peak 50 + 130),
       then offload in forward order only while over budget. */
    p.host_tier = 0;
    p.disk_tier = 1;
    p.force = 0;
    unsigned char all_ck[4] = {1, 1, 1, 1};
    unsigned char first[4] = {2, 1, 1, 1};
    int64_t ck_peak = ref_peak_offload(&p, L, 4, all_ck);
    int64_t one_peak = ref_peak_offload(&p, L, 4, first);
    CHECK(one_peak < ck_peak);
    p.budget_bytes = one_peak;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    CHECK(out[0].tier == MS_TIER_DISK);
    CHECK(out[1].tier == MS_TIER_DEVICE && out[3].tier == MS_TIER_DEVICE);
    CHECK(r.peak_projected == one_peak && r.fits);
    /* AGGRESSIVE: every checkpointed layer, fitting or not. */
    p.mode = MS_MODE_AGGRESSIVE;
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD;
    CHECK(ms_engine_plan(&p, L, 4, out, &r) == 0);
    for (size_t i = 0; i < 4; i++) {
        CHECK(out[i].tier == MS_TIER_DISK);
    }

    /* Fuzz: offload only on checkpointed layers, a tier iff offloaded,
       host bytes within the cap, the peak as the reference computes it. */
    lcg_state = 7;
    enum { MAXN = 12 };
    long bad = 0;
    for (int c = 0; c < 3000; c++) {
        size_t n = (size_t)rnd_range(0, MAXN);
        ms_layer F[MAXN];
        ms_choice o[MAXN];
        ms_problem q;
        random_small(&q, F, n);
        q.allowed = (unsigned)rnd_range(0, 7);
        q.min_offload_bytes = rnd_range(0, 40);
        q.host_tier = (int)rnd_range(0, 1);
        q.host_cap_bytes = rnd_range(-1, 100);
        q.disk_tier = (int)rnd_range(0, 1);
        if (ms_engine_plan(&q, F, n, o, &r) != 0) {
            bad++;
            continue;
        }
        unsigned char st[MAXN];
        int64_t host = 0;
        for (size_t i = 0; i < n; i++) {
            int off = (o[i].techniques & MS_TECH_OFFLOAD) != 0;
            int ck = (o[i].techniques & MS_TECH_CHECKPOINT) != 0;
            st[i] = (unsigned char)(off ? 2 : ck ? 1 : 0);
            if ((off && !ck) || (off != (o[i].tier != MS_TIER_DEVICE))
                || (off && F[i].input_bytes < q.min_offload_bytes)
                || (off && q.mode == MS_MODE_CONSERVATIVE)
                || (o[i].tier == MS_TIER_HOST && !q.host_tier)
                || (o[i].tier == MS_TIER_DISK && !q.disk_tier))
            {
                bad++;
            }
            if (o[i].tier == MS_TIER_HOST) {
                host += F[i].input_bytes;
            }
        }
        if (q.host_cap_bytes >= 0 && host > q.host_cap_bytes) {
            bad++;
        }
        if (r.peak_projected != ref_peak_offload(&q, F, n, st)) {
            bad++;
        }
    }
    CHECK(bad == 0);
    group_end("offload");
}

/* The predictor's correction moves every peak by the same signed amount,
   never below 0, and the decisions follow the corrected peaks. */
static void
test_tiling(void)
{
    /* Two blocks of 400 saved / 4 input: checkpointed, the recompute of
       the second holds 4 + 400; tiled in t, 4 + 400 / t. */
    ms_layer L[2] = {
        layer(400, 4, 10, MS_LAYER_TILEABLE),
        layer(400, 4, 10, MS_LAYER_TILEABLE),
    };
    ms_choice out[2];
    ms_result r;
    group_begin();
    for (int want = 2; want <= MS_MAX_TILES; want *= 2) {
        ms_problem p = problem(4 + 400 / want, 0, 800, 20);
        p.allowed = MS_TECH_CHECKPOINT | MS_TECH_TILING;
        snprintf(ctx, sizeof(ctx), "tiles %d", want);
        CHECKC(ms_engine_plan(&p, L, 2, out, &r) == 0);
        CHECKC(r.fits);
        CHECKC(out[0].tiles == want && out[1].tiles == want);
        CHECKC(out[0].techniques == (MS_TECH_CHECKPOINT | MS_TECH_TILING));
        CHECKC(r.peak_projected == 4 + 400 / want);
        check_invariants(&p, L, 2, out, &r);
        /* Without the candidate flag, or without TILING allowed: none. */
        ms_layer plain[2] = {layer(400, 4, 10, 0), layer(400, 4, 10, 0)};
        CHECKC(ms_engine_plan(&p, plain, 2, out, &r) == 0);
        CHECKC(out[0].tiles == 1 && out[1].tiles == 1 && !r.fits);
        p.allowed = MS_TECH_CHECKPOINT;
        CHECKC(ms_engine_plan(&p, L, 2, out, &r) == 0);
        CHECKC(out[0].tiles == 1 && out[1].tiles == 1 && !r.fits);
    }
    /* Below what 16 tiles reach: 16 tiles, and the plan says it misses. */
    ms_problem p = problem(20, 0, 800, 20);
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_TILING;
    CHECK(ms_engine_plan(&p, L, 2, out, &r) == 0);
    CHECK(!r.fits && out[1].tiles == MS_MAX_TILES);
    CHECK(r.peak_projected == 4 + 25);
    check_invariants(&p, L, 2, out, &r);
    /* Forced and fitting: as many tiles as lower the peak.  The recompute
       terms stay above the end of the forward (8) up to 16 tiles: the
       second layer's 4 + 25 is the least peak. */
    p = problem(100000, 0, 800, 20);
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_TILING;
    p.force = 1;
    CHECK(ms_engine_plan(&p, L, 2, out, &r) == 0);
    CHECK(out[0].tiles == 16 && out[1].tiles == 16);
    CHECK(r.peak_projected == 4 + 25);
    check_invariants(&p, L, 2, out, &r);
    /* AGGRESSIVE, not forced: checkpointing the first layer meets 404;
       then the end of the forward (4 + 400, the second layer kept) makes
       the peak, and no tile would lower it. */
    p.budget_bytes = 404;
    p.force = 0;
    p.mode = MS_MODE_AGGRESSIVE;
    CHECK(ms_engine_plan(&p, L, 2, out, &r) == 0);
    CHECK(r.fits && r.peak_projected == 404);
    CHECK(out[0].techniques == MS_TECH_CHECKPOINT && out[1].techniques == 0);
    CHECK(out[0].tiles == 1 && out[1].tiles == 1);
    check_invariants(&p, L, 2, out, &r);
    /* Where the end of the forward makes the peak, tiling does not pay
       and no layer is tiled: a kept layer of 500 after two checkpointed
       ones holds 100 + 100 + 500 at the end, above either recompute
       (100 + 400, 400). */
    ms_layer E[3] = {
        layer(400, 100, 10, MS_LAYER_TILEABLE),
        layer(400, 100, 10, MS_LAYER_TILEABLE),
        layer(500, 100, 10, MS_LAYER_INPLACE_INPUT),
    };
    ms_choice out3[3];
    p = problem(100000, 0, 1300, 20);
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_TILING;
    p.force = 1;
    p.mode = MS_MODE_AGGRESSIVE;
    CHECK(ms_engine_plan(&p, E, 3, out3, &r) == 0);
    CHECK(out3[0].techniques == MS_TECH_CHECKPOINT
          && out3[1].techniques == MS_TECH_CHECKPOINT);
    CHECK(out3[0].tiles == 1 && out3[1].tiles == 1 && out3[2].tiles == 1);
    CHECK(r.peak_projected == 700);
    check_invariants(&p, E, 3, out3, &r);
    /* A kept layer of 250 instead: the second recompute (100 + 400) makes
       the peak; 2 tiles bring it below the end's 450, and more would not
       lower the peak. */
    E[2] = layer(250, 100, 10, MS_LAYER_INPLACE_INPUT);
    p.activation_bytes = 1050;
    CHECK(ms_engine_plan(&p, E, 3, out3, &r) == 0);
    CHECK(out3[0].tiles == 1 && out3[1].tiles == 2 && r.peak_projected == 450);
    check_invariants(&p, E, 3, out3, &r);
    p = problem(100, 0, 800, 20); /* pressure 8: 8 tiles when forced */
    p.allowed = MS_TECH_CHECKPOINT | MS_TECH_TILING;
    p.mode = MS_MODE_AGGRESSIVE;
    CHECK(ms_engine_plan(&p, L, 2, out, &r) == 0);
    CHECK(r.fits && out[0].tiles == 4 && out[1].tiles == 8);
    check_invariants(&p, L, 2, out, &r);

    /* Random small problems with tiling candidates. */
    lcg_state = 0x711eULL;
    for (int c = 0; c < 3000; c++) {
        ms_layer R[8];
        size_t n = (size_t)rnd_range(0, 8);
        ms_problem q;
        random_small(&q, R, n);
        for (size_t i = 0; i < n; i++) {
            if (rnd32() % 2) {
                R[i].flags |= MS_LAYER_TILEABLE;
            }
        }
        q.allowed |= MS_TECH_TILING;
        ms_choice o[8];
        snprintf(ctx, sizeof(ctx), "random tiling case %d", c);
        CHECKC(ms_engine_plan(&q, R, n, o, &r) == 0);
        check_invariants(&q, R, n, o, &r);
    }
    group_end("tiling");
}

static void
test_peak_offset(void)
{
    group_begin();
    ms_layer L[3];
    for (size_t i = 0; i < 3; i++) {
        L[i] = layer(100, 10, 10.0, 0);
    }
    ms_choice out[3];
    ms_result r0, r;
    ms_problem p = problem(1000, 50, 300, 30.0);
    CHECK(ms_engine_plan(&p, L, 3, out, &r0) == 0);
    CHECK(r0.skipped && r0.peak_unoptimized == 350);
    /* The simulated step needs 700 more than the model says: over budget,
       so the engine checkpoints until the corrected peak fits. */
    p.peak_offset_bytes = p.plan_offset_bytes = 700;
    CHECK(ms_engine_plan(&p, L, 3, out, &r) == 0);
    CHECK(r.peak_unoptimized == 1050 && !r.skipped);
    CHECK(r.pressure == 1050.0 / 1000.0);
    CHECK(out[0].techniques == MS_TECH_CHECKPOINT);
    CHECK(r.fits && r.peak_projected <= 1000);
    /* Negative: the model overestimates; the plan may skip. */
    p.budget_bytes = 300;
    p.peak_offset_bytes = p.plan_offset_bytes = -60;
    CHECK(ms_engine_plan(&p, L, 3, out, &r) == 0);
    CHECK(r.peak_unoptimized == 290 && r.skipped);
    /* Never below 0. */
    p.peak_offset_bytes = p.plan_offset_bytes = -100000;
    p.force = 1;
    CHECK(ms_engine_plan(&p, L, 3, out, &r) == 0);
    CHECK(r.peak_unoptimized == 0 && r.peak_projected == 0);
    /* Saturates instead of overflowing. */
    p.peak_offset_bytes = p.plan_offset_bytes = INT64_MAX;
    CHECK(ms_engine_plan(&p, L, 3, out, &r) == 0);
    CHECK(r.peak_unoptimized == INT64_MAX);
    /* The two corrections apart: the unoptimized peak carries one, the
       plans' peaks the other. */
    p = problem(1000, 50, 300, 30.0);
    p.peak_offset_bytes = 700;
    p.plan_offset_bytes = 100;
    CHECK(ms_engine_plan(&p, L, 3, out, &r) == 0);
    CHECK(r.peak_unoptimized == 1050 && !r.skipped);
    CHECK(r.fits && r.peak_projected <= 1000);
    int64_t with_100 = r.peak_projected;
    p.plan_offset_bytes = 0;
    CHECK(ms_engine_plan(&p, L, 3, out, &r) == 0);
    CHECK(r.peak_projected <= with_100); /* only recompute terms move */
    group_end("peak-offset");
}

static void
test_determinism(void)
{
    enum { MAXN = 64 };
    lcg_state = 42;
    group_begin();
    for (int c = 0; c < 200; c++) {
        size_t n = (size_t)rnd_range(0, MAXN);
        ms_layer L[MAXN];
        ms_problem p;
        ms_choice a[MAXN], b[MAXN];
        ms_result ra, rb;
        random_small(&p, L, n);
        /* Same fill in both: byte-for-byte equality. */
        memset(a, 0xA5, sizeof(a));
        memset(b, 0xA5, sizeof(b));
        memset(&ra, 0xA5, sizeof(ra));
        memset(&rb, 0xA5, sizeof(rb));
        snprintf(ctx, sizeof(ctx), "case %d (n=%zu)", c, n);
        CHECKC(ms_engine_plan(&p, L, n, a, &ra) == 0);
        CHECKC(ms_engine_plan(&p, L, n, b, &rb) == 0);
        CHECKC(memcmp(a, b, sizeof(a)) == 0);
        CHECKC(memcmp(&ra, &rb, sizeof(ra)) == 0);
        /* Different fill: every field is written (none is left over). */
        memset(b, 0x00, sizeof(b));
        memset(&rb, 0xFF, sizeof(rb));
        CHECKC(ms_engine_plan(&p, L, n, b, &rb) == 0);
        int same = 1;
        for (size_t i = 0; i < n; i++) {
            same &= a[i].techniques == b[i].techniques
                    && a[i].rule == b[i].rule && a[i].tier == b[i].tier
                    && a[i].bytes_saved == b[i].bytes_saved;
        }
        CHECKC(same);
        CHECKC(ra.peak_unoptimized == rb.peak_unoptimized
               && ra.peak_projected == rb.peak_projected
               && ra.pressure == rb.pressure
               && ra.recompute_ratio == rb.recompute_ratio
               && ra.skipped == rb.skipped && ra.fits == rb.fits);
        /* Beyond n nothing is touched. */
        unsigned char fill[sizeof(ms_choice)];
        memset(fill, 0xA5, sizeof(fill));
        CHECKC(n == MAXN || memcmp(&a[n], fill, sizeof(fill)) == 0);
        /* The input is not modified. */
        ms_layer copy[MAXN];
        ms_problem pcopy;
        memcpy(copy, L, n * sizeof(ms_layer));
        memcpy(&pcopy, &p, sizeof(p));
        CHECKC(ms_engine_plan(&p, L, n, b, &rb) == 0);
        CHECKC(memcmp(copy, L, n * sizeof(ms_layer)) == 0);
        CHECKC(memcmp(&pcopy, &p, sizeof(p)) == 0);
    }
    group_end("determinism");
}

static int64_t
rnd_size(void)
{
    switch (rnd32() % 5) {
    case 0:
        return 0;
    case 1:
        return rnd_range(0, 1000);
    case 2:
        return (int64_t)(rnd64() % (UINT64_C(1) << 30));
    case 3:
        return INT64_C(1) << 40; /* the largest size of the fuzz */
    default:
        return (int64_t)(rnd64() % ((UINT64_C(1) << 40) + 1));
    }
}

static double
rnd_flops(void)
{
    switch (rnd32() % 8) {
    case 0:
        return 0.0;
    case 1:
        return 0.5;
    case 2:
        return 1e15 * (double)rnd32();
    case 3:
        return rnd32() % 64 == 0 ? HUGE_VAL : 1.0;
    default:
        return (double)rnd_range(0, 1 << 20);
    }
}

static void
test_fuzz(void)
{
    enum { ROUNDS = 3000, MAXN = 200 };
    ms_layer *L = malloc(MAXN * sizeof(ms_layer));
    ms_choice *out = malloc(MAXN * sizeof(ms_choice));
    lcg_state = 0xF022ULL;
    group_begin();
    if (L == NULL || out == NULL) {
        CHECK(L != NULL && out != NULL);
        free(L);
        free(out);
        group_end("fuzz");
        return;
    }
    for (int c = 0; c < ROUNDS; c++) {
        size_t n = (size_t)rnd_range(0, MAXN);
        for (size_t i = 0; i < n; i++) {
            L[i] = layer(rnd_size(), rnd_size(), rnd_flops(), rnd32() % 16);
            L[i].param_bytes = rnd_size();
            if (rnd32() % 2) {
                L[i].flags = 0;
            }
        }
        ms_problem p = problem(0, rnd_size(), 0, 0.0);
        int64_t in_layers = sum_saved(L, n);
        switch (rnd32() % 3) {
        case 0:
            p.activation_bytes = in_layers + rnd_size();
            break;
        case 1:
            p.activation_bytes = rnd_size(); /* may undercount the layers */
            break;
        default:
            p.activation_bytes = 0;
        }
        int64_t unopt = p.fixed_bytes + (p.activation_bytes > in_layers
                                             ? p.activation_bytes
                                             : in_layers);
        switch (rnd32() % 5) {
        case 0:
            p.budget_bytes = rnd_size();
            break;
        case 1:
            p.budget_bytes = unopt;
            break;
        case 2:
            p.budget_bytes = unopt / 2 + 1;
            break;
        case 3:
            p.budget_bytes = -(int64_t)rnd_range(0, 1000);
            break;
        default:
            p.budget_bytes = INT64_MAX;
        }
        p.total_flops = rnd32() % 4 ? sum_flops(L, n) : rnd_flops();
        p.mode = (ms_mode)rnd_range(0, 2);
        p.allowed = rnd32();
        p.force = (int)(rnd32() % 3) - 1; /* any non-zero is true */
        ms_result r;
        snprintf(ctx, sizeof(ctx), "round %d (n=%zu)", c, n);
        CHECKC(ms_engine_plan(&p, L, n, out, &r) == 0);
        CHECKC(r.pressure >= 0.0 || isnan(r.pressure));
        check_invariants(&p, L, n, out, &r);
    }
    free(L);
    free(out);
    group_end("fuzz");
}

int
main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_names();
    test_smart_skip();
    test_force();
    test_ineligible_flags();
    test_greedy();
    test_nothing_suffices();
    test_disabled();
    test_empty();
    test_determinism();
    test_exhaustive();
    test_fuzz();
    test_offload();
    test_tiling();
    test_peak_offset();
    printf("%ld passed, %ld failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
