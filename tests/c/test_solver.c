/*
 * test_solver.c: the budget planner (csrc/solver.c), tested on its own.
 *
 * Built by tests/test_engine_c.py like test_engine.c (C11, -Werror, ASan
 * and UBSan where available).  Groups:
 *   model       the memory model and overhead on hand-computed cases
 *   known       small chains with a known optimum
 *   selective   a layer run selective: its memory terms, cost, and the
 *               solver choosing it where it pays
 *   tail        the early stop: a recompute ending in a layer skips its
 *               tail, so singles beat a segment where that is cheaper
 *   nested      a nested segment: its memory terms and cost by hand, and
 *               the least budget falling below two levels' with it
 *   exhaustive  every plan of random chains of up to 7 layers enumerated:
 *               the solver's overhead equals the best plan's that fits;
 *               with nesting allowed, the best two-level plan's where one
 *               fits (never nested), else the best nested plan's
 *   exhaustive nested  the same below the least budget of two levels,
 *               against every plan with nested segments
 *   fuzz        random large chains: no crash, a plan it returns is valid
 *               and fits, overheads agree with the model
 *   min-budget  the smallest feasible budget is feasible and one byte less
 *               is not (exact granularity)
 *   timing      1,000 and 10,000 layers: a plan that fits (the times are
 *               printed; scripts/solver_bench.py measures them)
 * The last line is "N passed, M failed"; exit status 0 only if none failed.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "../../csrc/memory.h"
#include "../../csrc/solver.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static long n_passed, n_failed, group_failed, group_checks;
static char ctx[160];

static void
check_at(int ok, int line, const char *what)
{
    group_checks++;
    if (ok) {
        n_passed++;
        return;
    }
    n_failed++;
    group_failed++;
    if (n_failed <= 30) {
        printf("FAIL test_solver.c:%d: %s -- %s\n", line, what, ctx);
    }
}
#define CHECK(c) check_at(!!(c), __LINE__, #c)

static void
group_begin(void)
{
    group_failed = group_checks = 0;
    ctx[0] = 0;
}

static void
group_end(const char *name)
{
    printf("%s %-12s %ld checks, %ld failed\n", group_failed ? "FAIL" : "ok  ",
           name, group_checks, group_failed);
}

static uint64_t lcg;

static uint32_t
rnd(void)
{
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(lcg >> 32);
}

static int64_t
rnd_range(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd() % (uint32_t)(hi - lo + 1));
}

static ms_layer
layer(int64_t saved, int64_t input, double flops, unsigned flags)
{
    ms_layer l;
    memset(&l, 0, sizeof(l));
    l.saved_bytes = saved;
    l.input_bytes = input;
    l.flops = flops;
    l.flags = flags;
    return l;
}

static ms_solver_problem
problem(int64_t budget, unsigned allowed)
{
    ms_solver_problem p;
    memset(&p, 0, sizeof(p));
    p.budget_bytes = budget;
    p.allowed = allowed;
    p.flop_rate = 1.0;
    p.offload_bw = 0.0;
    p.async_offload = 0;
    p.min_offload_bytes = 0;
    p.tile_overhead = 0.5;
    p.max_segment = 255;
    p.resolution = 65535;
    return p;
}

#define ALL (MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_TILING)

/* A plan's peak in the units of budget_bytes: the end-of-forward term may
   hold end_extra more than a recompute term. */
static int64_t
bpeak(const ms_solver_problem *p, const ms_layer *L, size_t n,
      const ms_solver_choice *c)
{
    ms_mem_terms t;
    ms_mem_terms_of(L, n, c, &t);
    return t.end - p->end_extra > t.recompute ? t.end - p->end_extra
                                              : t.recompute;
}

/* max(end, recompute) of a plan, by the shared memory model. */
static int64_t
model_peak(const ms_layer *L, size_t n, const ms_solver_choice *c)
{
    ms_mem_terms t;
    ms_mem_terms_of(L, n, c, &t);
    return t.end > t.recompute ? t.end : t.recompute;
}

/* ---- model ------------------------------------------------------------ */

static void
test_model(void)
{
    group_begin();
    ms_layer L[3] = {layer(10, 2, 1, 0), layer(20, 3, 2, 0), layer(30, 4, 4, 0)};
    ms_solver_choice c[3] = {{-1, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    ms_solver_problem p = problem(1000, ALL);
    CHECK(model_peak(L, 3, c) == 60);
    CHECK(ms_solver_overhead(&p, L, 3, c, NULL) == 0.0);
    /* Layer 1 alone: held 10, recompute 10 + 20 = 30; held 10+3+30 = 43. */
    c[1].seg_start = 1;
    CHECK(model_peak(L, 3, c) == 43);
    {
        /* The terms, where the worst recompute is, and the corrected peak. */
        ms_mem_terms t;
        size_t at = 99;
        ms_mem_terms_of(L, 3, c, &t);
        CHECK(t.end == 43 && t.recompute == 30 && t.recompute_at == 1);
        CHECK(ms_mem_peak(&t, 3, 100, 0, 0, &at) == 143 && at == 3);
        CHECK(ms_mem_peak(&t, 3, 100, -20, 0, &at) == 130 && at == 1);
        CHECK(ms_mem_peak(&t, 3, 0, -50, -40, &at) == 0 && at == 3);
        CHECK(ms_mem_peak(&t, 3, INT64_MAX - 5, 0, 0, NULL) == INT64_MAX);
    }
    CHECK(ms_solver_overhead(&p, L, 3, c, NULL) == 2.0);
    /* A recompute cost (its convolutions at their rate) in place of the
       counted FLOPs; the FLOPs recomputed stay the counted ones.  0, nan
       or negative: its FLOPs; infinite: nothing. */
    {
        double fl = 0;
        L[1].cost = 5.0;
        CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 5.0 && fl == 2.0);
        L[1].cost = NAN;
        CHECK(ms_solver_overhead(&p, L, 3, c, NULL) == 2.0);
        L[1].cost = -1.0;
        CHECK(ms_solver_overhead(&p, L, 3, c, NULL) == 2.0);
        L[1].cost = INFINITY;
        CHECK(ms_solver_overhead(&p, L, 3, c, NULL) == 0.0);
        L[1].cost = 0.0;
        /* Its tail (the ops after its last saved tensor) is not rerun:
           tail_cost off the overhead (tail_flops when 0), tail_flops off
           the FLOPs; each at most the whole, nan or negative: none. */
        L[1].tail_flops = 0.5;
        CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 1.5 && fl == 1.5);
        L[1].tail_cost = 1.5;
        CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 0.5 && fl == 1.5);
        L[1].tail_flops = 9.0;
        L[1].tail_cost = 9.0;
        CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 0.0 && fl == 0.0);
        L[1].tail_flops = NAN;
        L[1].tail_cost = -1.0;
        CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 2.0 && fl == 2.0);
        L[1].tail_flops = 0.0;
        L[1].tail_cost = 0.0;
    }
    /* Segment [1..2]: held 10 + 3; recompute 10 + 50 = 60. */
    c[2].seg_start = 1;
    CHECK(model_peak(L, 3, c) == 60);
    CHECK(ms_solver_check(&p, L, 3, c) == 0);
    /* Segment [0..2]: held 2; recompute 60. */
    c[0].seg_start = c[1].seg_start = c[2].seg_start = 0;
    CHECK(model_peak(L, 3, c) == 60);
    double flops = 0;
    CHECK(ms_solver_overhead(&p, L, 3, c, &flops) == 7.0 && flops == 7.0);
    /* Singles, layer 2 in 4 tiles: 5 held + ceil(30 / 4) = 13 at its recompute. */
    ms_solver_choice d[3] = {{0, 0, 1, 0, 0, 0}, {1, 0, 1, 0, 0, 0}, {2, 0, 4, 0, 0, 0}};
    CHECK(ms_solver_check(&p, L, 3, d) == -1); /* not tileable */
    L[2].flags = MS_LAYER_TILEABLE;
    CHECK(ms_solver_check(&p, L, 3, d) == 0);
    CHECK(model_peak(L, 3, d) == 22); /* layer 1: 2 + 20 */
    CHECK(ms_solver_overhead(&p, L, 3, d, NULL) == 7.0 + 3 * 0.5);
    /* Offload of layer 1's input: not allowed without bandwidth. */
    d[1].offload = 1;
    CHECK(ms_solver_check(&p, L, 3, d) == -1);
    p.offload_bw = 1.0;
    CHECK(ms_solver_check(&p, L, 3, d) == 0);
    CHECK(ms_solver_offload_seconds(&p, &L[1]) == 6.0); /* 3 bytes x 2 */
    p.async_offload = 1; /* write 3 - 2 hidden, read 3 - 4: hidden */
    CHECK(ms_solver_offload_seconds(&p, &L[1]) == 1.0);
    /* Invalid shapes. */
    ms_solver_choice e[3] = {{-1, 0, 1, 0, 0, 0}, {0, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    CHECK(ms_solver_check(&p, L, 3, e) == -1); /* segment not a run */
    ms_solver_choice g[3] = {{0, 0, 2, 0, 0, 0}, {0, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    CHECK(ms_solver_check(&p, L, 3, g) == -1); /* tiles on a 2-layer segment */
    {
        /* A segment's backward terms: when backward reaches a layer, the
           saved tensors of the layers up to it are alive, not those after
           it (their backward is done).  Segment [0..2] of saved 10/20/30,
           backward 25/5/0: max(10 + 25, 30 + 5, 60 + 0) = 60, not
           60 + 25; with backward 45 on layer 0: 10 + 45 = 55 < 60; 55 on
           layer 1: 30 + 55 = 85. */
        ms_layer B[3] = {layer(10, 2, 1, 0), layer(20, 3, 2, 0),
                         layer(30, 4, 4, 0)};
        ms_solver_choice s[3] = {{0, 0, 1, 0, 0, 0}, {0, 0, 1, 0, 0, 0}, {0, 0, 1, 0, 0, 0}};
        B[0].backward_bytes = 25;
        B[1].backward_bytes = 5;
        CHECK(model_peak(B, 3, s) == 60);
        B[0].backward_bytes = 45;
        CHECK(model_peak(B, 3, s) == 60);
        B[1].backward_bytes = 55;
        CHECK(model_peak(B, 3, s) == 85);
        /* The solver agrees: 60 fits the first two, not the third. */
        ms_solver_problem q = problem(84, MS_TECH_CHECKPOINT);
        ms_solver_choice out[3];
        ms_solver_result r;
        B[1].backward_bytes = 5;
        CHECK(ms_solve(&q, B, 3, out, &r) == 0 && r.feasible);
        CHECK(r.peak_bytes == bpeak(&q, B, 3, out));
    }
    group_end("model");
}

/* ---- known ------------------------------------------------------------ */

static void
test_known(void)
{
    group_begin();
    /* Four equal layers, saved 10, input 1, cost 1.  All kept: 40. */
    ms_layer L[4];
    for (int i = 0; i < 4; i++) {
        L[i] = layer(10, 1, 1, 0);
    }
    ms_solver_choice c[4];
    ms_solver_result r;
    ms_solver_problem p = problem(40, MS_TECH_CHECKPOINT);
    CHECK(ms_solve(&p, L, 4, c, &r) == 0);
    CHECK(r.feasible && r.overhead_seconds == 0.0 && r.peak_bytes == 40);
    /* 39: one layer must be checkpointed, the cheapest is any; cost 1. */
    p.budget_bytes = 39;
    CHECK(ms_solve(&p, L, 4, c, &r) == 0);
    CHECK(r.feasible && r.overhead_seconds == 1.0 && r.peak_bytes <= 39);
    /* 13: singles hold 1 each and recompute 10; the last layer kept:
       held 3 + 10 = 13 at the end of the forward (segments of two would
       recompute 20). */
    p.budget_bytes = 13;
    CHECK(ms_solve(&p, L, 4, c, &r) == 0);
    CHECK(r.feasible && r.overhead_seconds == 3.0 && r.peak_bytes == 13);
    CHECK(c[3].seg_start == -1);
    /* 12: no plan (singles need 13, longer segments more). */
    p.budget_bytes = 12;
    CHECK(ms_solve(&p, L, 4, c, &r) == 0);
    CHECK(!r.feasible);
    int64_t mb = 0;
    CHECK(ms_solver_min_budget(&p, L, 4, &mb) == 0 && mb == 13);
    /* Segments win where inputs are large: saved 10, input 8.  Singles
       need 8 x 3 + 10 = 34 (the fourth recompute, or the fourth kept); at
       26, [0..1] as one segment (held 8, recompute 20), then [2] and [3]
       alone (16 + 10) fit, and no plan without a segment does. */
    for (int i = 0; i < 4; i++) {
        L[i] = layer(10, 8, 1, 0);
    }
    p.budget_bytes = 26;
    CHECK(ms_solve(&p, L, 4, c, &r) == 0);
    CHECK(r.feasible && r.peak_bytes <= 26);
    int longest = 0;
    for (int i = 0, run = 0; i < 4; i++) {
        run = (c[i].seg_start >= 0 && i > 0 && c[i].seg_start == c[i - 1].seg_start)
                  ? run + 1 : 1;
        longest = run > longest ? run : longest;
    }
    CHECK(longest >= 2);
    /* An in-place layer is never checkpointed; it is kept. */
    L[1].flags = MS_LAYER_INPLACE_INPUT;
    p.budget_bytes = 1000;
    p.allowed = MS_TECH_CHECKPOINT;
    CHECK(ms_solve(&p, L, 4, c, &r) == 0 && r.feasible && c[1].seg_start == -1);
    /* Without CHECKPOINT nothing is checkpointed. */
    L[1].flags = 0;
    p.allowed = 0;
    p.budget_bytes = 39;
    CHECK(ms_solve(&p, L, 4, c, &r) == 0 && !r.feasible);
    /* Tiling: one layer of 100 saved; budget 30 fits 4 tiles (25). */
    ms_layer T[1] = {layer(100, 5, 3, MS_LAYER_TILEABLE)};
    ms_solver_choice tc[1];
    p = problem(30, ALL);
    CHECK(ms_solve(&p, T, 1, tc, &r) == 0);
    CHECK(r.feasible && tc[0].tiles == 4 && r.peak_bytes == 25);
    CHECK(r.overhead_seconds == 3.0 + 3 * 0.5);
    /* Offload when the input is what does not fit: saved 10, input 9, two
       layers, budget 19: singles hold 9 + recompute 10 = 19 fits. 18: the
       first input must go. */
    ms_layer O[2] = {layer(10, 9, 1, 0), layer(10, 9, 1, 0)};
    ms_solver_choice oc[2];
    p = problem(18, ALL);
    p.offload_bw = 9.0; /* 1 s each way */
    CHECK(ms_solve(&p, O, 2, oc, &r) == 0);
    CHECK(r.feasible && r.peak_bytes <= 18);
    CHECK(oc[0].offload == 1 || oc[1].offload == 1);
    /* Invalid problems. */
    p.flop_rate = 0.0;
    CHECK(ms_solve(&p, O, 2, oc, &r) == -2);
    p = problem(-1, ALL);
    CHECK(ms_solve(&p, O, 2, oc, &r) == 0 && !r.feasible);
    /* Empty chain: always feasible at 0. */
    p = problem(0, ALL);
    CHECK(ms_solve(&p, O, 0, oc, &r) == 0 && r.feasible && r.peak_bytes == 0);
    group_end("known");
}

/* ---- tail ---------------------------------------------------------------- */

static void
test_tail(void)
{
    group_begin();
    /* Four layers: saved 10, input 1, recompute 4, of which the last op
       (tail 1) is not rerun when a recompute ends in the layer. */
    ms_layer L[4];
    for (int i = 0; i < 4; i++) {
        L[i] = layer(10, 1, 4.0, 0);
        L[i].tail_flops = 1.0;
    }
    ms_solver_problem p = problem(1000, MS_TECH_CHECKPOINT);
    /* A segment skips its last layer's tail only: [0..1] costs 4 + 3;
       [0] and [1] alone 3 + 3. */
    ms_solver_choice seg[4] = {
        {0, 0, 1, 0, 0, 0}, {0, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    ms_solver_choice one[4] = {
        {0, 0, 1, 0, 0, 0}, {1, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    double fl = -1.0;
    CHECK(ms_solver_overhead(&p, L, 4, seg, &fl) == 7.0 && fl == 7.0);
    CHECK(ms_solver_overhead(&p, L, 4, one, &fl) == 6.0 && fl == 6.0);
    /* Budget 22: both fit ([0..1] holds 1 and recomputes 20 with 0
       before it, or 1 + 1 + 20 kept at the end; singles hold 2 + 20).
       Without tails they tie; with them the singles win. */
    ms_solver_choice c[4];
    ms_solver_result r;
    p.budget_bytes = 22;
    CHECK(bpeak(&p, L, 4, seg) <= 22 && bpeak(&p, L, 4, one) <= 22);
    CHECK(ms_solve(&p, L, 4, c, &r) == 0 && r.feasible);
    CHECK(r.overhead_seconds == 6.0 && r.recompute_flops == 6.0);
    for (int i = 0; i < 4; i++) {
        CHECK(c[i].seg_start == -1 || c[i].seg_start == i);
    }
    /* A tail at the matmul rate (tail_cost 3) is what the overhead
       skips; the FLOPs recomputed skip tail_flops: two singles cost
       1 + 1 and recompute 3 + 3 counted FLOPs. */
    for (int i = 0; i < 4; i++) {
        L[i].tail_cost = 3.0;
    }
    CHECK(ms_solve(&p, L, 4, c, &r) == 0 && r.feasible);
    CHECK(r.overhead_seconds == 2.0 && r.recompute_flops == 6.0);
    /* A tiled layer (alone) skips its tail too: one layer of 100 saved
       in 4 tiles at budget 30 costs 3 - 1 + 3 x 0.5. */
    ms_layer T[1] = {layer(100, 5, 3, MS_LAYER_TILEABLE)};
    T[0].tail_flops = 1.0;
    ms_solver_choice tc[1];
    p = problem(30, ALL);
    CHECK(ms_solve(&p, T, 1, tc, &r) == 0);
    CHECK(r.feasible && tc[0].tiles == 4);
    CHECK(r.overhead_seconds == 2.0 + 3 * 0.5 && r.recompute_flops == 2.0);
    /* No tail: the plans and overheads of before (the known group's). */
    for (int i = 0; i < 4; i++) {
        L[i].tail_flops = 0.0;
        L[i].tail_cost = 0.0;
    }
    p = problem(22, MS_TECH_CHECKPOINT);
    CHECK(ms_solve(&p, L, 4, c, &r) == 0 && r.feasible);
    CHECK(r.overhead_seconds == 8.0 && r.recompute_flops == 8.0);
    group_end("tail");
}

/* ---- selective ---------------------------------------------------------- */

static void
test_selective(void)
{
    group_begin();
    /* Layer 1 saves 100 with input 10; run selective it keeps 30 of its
       costly outputs besides the input (held 40) and recomputes 2 FLOPs
       of cheap ops; checkpointed it would recompute 50. */
    ms_layer L[3] = {layer(50, 10, 50.0, 0), layer(100, 10, 50.0, 0),
                     layer(50, 10, 50.0, 0)};
    L[1].flags |= MS_LAYER_SELECTIVE;
    L[1].sel_levels = 1;
    L[1].sel[0] = (ms_sel_level){4.0, 30, 2.0};
    ms_solver_choice c[3] = {{-1, 0, 1, 0, 0, 0}, {-1, 0, 1, 1, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    ms_mem_terms t;
    ms_mem_terms_of(L, 3, c, &t);
    /* end: 50 + (10 + 30) + 50; its backward: 50 before + max(40, 100). */
    CHECK(t.end == 140);
    CHECK(t.recompute == 150 && t.recompute_at == 1);
    ms_solver_problem p = problem(150, ALL | MS_TECH_SELECTIVE);
    double fl = -1.0;
    CHECK(ms_solver_check(&p, L, 3, c) == 0);
    CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 2.0 && fl == 2.0);
    /* Not allowed, not profiled, or inside a segment: refused. */
    ms_solver_problem q = problem(150, ALL);
    CHECK(ms_solver_check(&q, L, 3, c) == -1);
    c[0].selective = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1);
    c[0].selective = 0;
    c[1].seg_start = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1);

    /* All kept holds 200.  A budget of 150: selective on layer 1 (cost 2)
       beats checkpointing any layer (cost 50). */
    ms_solver_choice d[3];
    ms_solver_result r;
    CHECK(ms_solve(&p, L, 3, d, &r) == 0 && r.feasible);
    CHECK(d[0].seg_start == -1 && !d[0].selective);
    CHECK(d[1].seg_start == -1 && d[1].selective);
    CHECK(d[2].seg_start == -1 && !d[2].selective);
    CHECK(r.overhead_seconds == 2.0 && r.recompute_flops == 2.0);
    CHECK(r.end_bytes == 140 && r.peak_bytes == 150);
    /* Without the technique the solver checkpoints a layer instead. */
    CHECK(ms_solve(&q, L, 3, d, &r) == 0 && r.feasible);
    CHECK(r.overhead_seconds == 50.0 && !d[1].selective);
    /* Its backward must fit too: below 150 selective alone cannot, so
       layer 0 is checkpointed as well (recompute 50 at 10 + 100 held). */
    p.budget_bytes = 120;
    CHECK(ms_solve(&p, L, 3, d, &r) == 0 && r.feasible);
    CHECK(r.peak_bytes <= 120 && ms_solver_check(&p, L, 3, d) == 0);
    /* A level the layer does not have is refused. */
    c[1].level = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1);
    group_end("selective");
}

static void
test_selective_levels(void)
{
    group_begin();
    /* Layer 0 (saves 100, input 10) has three levels: keep 10 and
       recompute 30, keep 30 and recompute 2, keep 60 and recompute 0.5. */
    ms_layer L[3] = {layer(100, 10, 50.0, 0), layer(50, 10, 50.0, 0),
                     layer(50, 10, 50.0, 0)};
    L[0].flags |= MS_LAYER_SELECTIVE;
    L[0].sel_levels = 3;
    L[0].sel[0] = (ms_sel_level){64.0, 10, 30.0};
    L[0].sel[1] = (ms_sel_level){16.0, 30, 2.0};
    L[0].sel[2] = (ms_sel_level){4.0, 60, 0.5};
    ms_solver_choice c[3] = {
        {-1, 0, 1, 1, 2, 0}, {-1, 0, 1, 0, 0, 0}, {-1, 0, 1, 0, 0, 0}};
    ms_mem_terms t;
    ms_mem_terms_of(L, 3, c, &t);
    /* Level 2: end (10 + 60) + 50 + 50; its backward max(70, 100). */
    CHECK(t.end == 170 && t.recompute == 100 && t.recompute_at == 0);
    ms_solver_problem p = problem(170, ALL | MS_TECH_SELECTIVE);
    double fl = -1.0;
    CHECK(ms_solver_check(&p, L, 3, c) == 0);
    CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 0.5 && fl == 0.5);
    c[0].level = 3; /* no such level */
    CHECK(ms_solver_check(&p, L, 3, c) == -1);
    c[0].level = -1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1);

    /* Each budget gets the level that keeps the most that fits (170: the
       last, 140: the middle one, 120: the first); checkpointing a layer
       (50) never pays here. */
    static const struct {
        int64_t budget;
        int level;
        double cost;
    } want[] = {{170, 2, 0.5}, {169, 1, 2.0}, {140, 1, 2.0}, {139, 0, 30.0},
                {120, 0, 30.0}};
    for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++) {
        ms_solver_choice d[3];
        ms_solver_result r;
        p.budget_bytes = want[k].budget;
        snprintf(ctx, sizeof(ctx), "budget %lld", (long long)want[k].budget);
        CHECK(ms_solve(&p, L, 3, d, &r) == 0 && r.feasible);
        CHECK(d[0].seg_start == -1 && d[0].selective
              && d[0].level == want[k].level);
        CHECK(d[1].seg_start == -1 && !d[1].selective);
        CHECK(d[2].seg_start == -1 && !d[2].selective);
        CHECK(r.overhead_seconds == want[k].cost);
        CHECK(r.peak_bytes <= want[k].budget);
    }
    ctx[0] = '\0';
    group_end("selective levels");
}

/* ---- nested ------------------------------------------------------------- */

static void
test_nested(void)
{
    group_begin();
    /* Three layers, one nested segment [0..2]: while layer k is recomputed
       alone and run backward, the inputs of the layers before it are held
       (layer 0's is the segment's stored input). */
    ms_layer L[6];
    L[0] = layer(10, 1, 1.0, 0);
    L[1] = layer(20, 2, 2.0, 0);
    L[2] = layer(30, 3, 4.0, 0);
    L[1].backward_bytes = 5;
    L[2].tail_flops = 1.0;
    ms_solver_problem p = problem(100, MS_TECH_CHECKPOINT);
    ms_solver_choice c[6];
    for (size_t i = 0; i < 3; i++) {
        c[i] = (ms_solver_choice){.seg_start = 0, .tiles = 1};
    }
    c[0].nested = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1); /* nesting not allowed */
    p.nested = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == 0);
    ms_mem_terms t;
    ms_mem_terms_of(L, 3, c, &t);
    /* max(10, 1 + 20 + 5, 1 + 2 + 30) */
    CHECK(t.end == 1 && t.recompute == 33 && t.recompute_at == 0);
    /* Each layer recomputed alone (less its tail) and layers 0, 1 once
       more by the first pass: 7 - 1 + 3. */
    double fl = 0.0;
    CHECK(ms_solver_overhead(&p, L, 3, c, &fl) == 9.0 && fl == 9.0);
    c[0].nested = 0; /* two levels: all saved tensors at once */
    ms_mem_terms_of(L, 3, c, &t);
    CHECK(t.recompute == 60 && ms_solver_overhead(&p, L, 3, c, NULL) == 6.0);
    c[1].nested = 1; /* only on the first layer */
    CHECK(ms_solver_check(&p, L, 3, c) == -1);
    c[1].nested = 0;
    c[2].seg_start = -1; /* nor on a kept layer */
    CHECK(ms_solver_check(&p, L, 3, c) == 0);
    c[2].nested = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1);
    c[2] = (ms_solver_choice){.seg_start = 0, .tiles = 1};
    c[0].nested = 1;
    c[0].offload = 1;
    CHECK(ms_solver_check(&p, L, 3, c) == -1);

    /* Six layers saving 100 bytes from 10-byte inputs: two levels need
       five inputs held beside a layer's saved tensors (150); nested
       segments of 3, 2 and 1 layers need two (120). */
    for (size_t i = 0; i < 6; i++) {
        L[i] = layer(100, 10, 1.0, 0);
    }
    p = problem(0, MS_TECH_CHECKPOINT);
    int64_t two = -1, nest = -1;
    CHECK(ms_solver_min_budget(&p, L, 6, &two) == 0 && two == 150);
    p.nested = 1;
    CHECK(ms_solver_min_budget(&p, L, 6, &nest) == 0 && nest == 120);
    ms_solver_result r;
    p.budget_bytes = nest;
    CHECK(ms_solve(&p, L, 6, c, &r) == 0 && r.feasible
          && r.peak_bytes == 120);
    int nested = 0;
    for (size_t i = 0; i < 6; i++) {
        nested += c[i].seg_start == (int)i && c[i].nested;
    }
    CHECK(nested >= 2 && ms_solver_check(&p, L, 6, c) == 0);
    /* Where two levels fit, the plan is theirs, nested allowed or not. */
    p.budget_bytes = two;
    ms_solver_choice d[6];
    CHECK(ms_solve(&p, L, 6, c, &r) == 0 && r.feasible);
    p.nested = 0;
    ms_solver_result r2;
    CHECK(ms_solve(&p, L, 6, d, &r2) == 0 && r2.feasible);
    CHECK(memcmp(c, d, sizeof(c)) == 0
          && r.overhead_seconds == r2.overhead_seconds);
    group_end("nested");
}

/* ---- exhaustive --------------------------------------------------------- */

static double best_cost;
static int64_t best_peak;
static int enum_nested; /* enumerate nested segments too */

static void
enumerate(const ms_solver_problem *p, const ms_layer *L, size_t n, size_t i,
          ms_solver_choice *c)
{
    if (i == n) {
        if (ms_solver_check(p, L, n, c) != 0) {
            return;
        }
        int64_t peak = bpeak(p, L, n, c);
        if (peak <= p->budget_bytes) {
            double cost = ms_solver_overhead(p, L, n, c, NULL);
            if (cost < best_cost) {
                best_cost = cost;
                best_peak = peak;
            }
        }
        return;
    }
    c[i].seg_start = -1;
    c[i].offload = 0;
    c[i].tiles = 1;
    c[i].selective = 0;
    c[i].level = 0;
    c[i].nested = 0;
    enumerate(p, L, n, i + 1, c);
    for (int lv = 0; lv < L[i].sel_levels; lv++) {
        c[i].selective = 1;
        c[i].level = lv;
        enumerate(p, L, n, i + 1, c);
    }
    c[i].selective = 0;
    c[i].level = 0;
    for (size_t j = i; j < n; j++) {
        for (size_t k = i; k <= j; k++) {
            c[k].seg_start = (int)i;
            c[k].offload = 0;
            c[k].tiles = 1;
            c[k].selective = 0;
            c[k].level = 0;
            c[k].nested = 0;
        }
        for (int off = 0; off < 2; off++) {
            for (int t = 1; t <= MS_MAX_TILES; t *= 2) {
                if (t > 1 && j != i) {
                    break;
                }
                c[i].offload = off;
                c[i].tiles = t;
                enumerate(p, L, n, j + 1, c);
            }
        }
        if (enum_nested && j > i) {
            c[i].offload = 0;
            c[i].tiles = 1;
            c[i].nested = 1;
            enumerate(p, L, n, j + 1, c);
            c[i].nested = 0;
        }
    }
}

static void
random_chain(ms_layer *L, size_t n, int64_t scale)
{
    for (size_t i = 0; i < n; i++) {
        unsigned flags = 0;
        if (rnd() % 6 == 0) {
            flags |= MS_LAYER_INPLACE_INPUT;
        }
        if (rnd() % 3 == 0) {
            flags |= MS_LAYER_TILEABLE;
        }
        L[i] = layer(rnd_range(0, scale), rnd_range(0, scale / 2),
                     (double)rnd_range(0, 20), flags);
        L[i].sel_levels = 0;
        if (rnd() % 2 == 0) {
            L[i].backward_bytes = rnd_range(0, scale / 2);
        }
        if (rnd() % 3 == 0) {
            /* recomputed at a cost of its own (0: its flops) */
            L[i].cost = (double)rnd_range(0, 40);
        }
        if (rnd() % 2 == 0) {
            /* a tail (the early stop), sometimes more than the whole:
               taken as the whole */
            L[i].tail_flops = (double)rnd_range(0, 24);
            if (rnd() % 2 == 0) {
                L[i].tail_cost = (double)rnd_range(0, 44);
            }
        }
        if (rnd() % 2 == 0) {
            /* 1 to 3 nested levels: each keeps more and recomputes less
               (a level may also keep more than the layer saves). */
            L[i].flags |= MS_LAYER_SELECTIVE;
            L[i].sel_levels = (int)rnd_range(1, 3);
            int64_t kept = rnd_range(0, scale / 4);
            double cost = (double)rnd_range(4, 12);
            for (int k = 0; k < L[i].sel_levels; k++) {
                L[i].sel[k] = (ms_sel_level){(double)(64 >> k), kept, cost};
                kept += rnd_range(0, scale / 4);
                cost -= (double)rnd_range(0, 4);
                cost = cost > 0.0 ? cost : 0.0;
            }
        }
    }
}

/* The solver's plan c (result r) against the enumerated best: feasible
   alike, and where it is, valid, within the budget and as cheap.  1 when
   feasible. */
static int
check_best(const ms_solver_problem *p, const ms_layer *L, size_t n,
           const ms_solver_choice *c, const ms_solver_result *r)
{
    CHECK(r->feasible == (best_cost < INFINITY));
    if (r->feasible) {
        CHECK(ms_solver_check(p, L, n, c) == 0);
        CHECK(r->peak_bytes == bpeak(p, L, n, c));
        CHECK(r->peak_bytes <= p->budget_bytes);
        CHECK(fabs(r->overhead_seconds - best_cost) <= 1e-9);
    }
    return r->feasible;
}

static void
test_exhaustive(void)
{
    enum { CASES = 1500, MAXN = 6 };
    ms_layer L[MAXN];
    ms_solver_choice c[MAXN], e[MAXN];
    ms_solver_result r;
    long feasible = 0, nested_plans = 0;
    lcg = 0x501feULL;
    group_begin();
    for (int k = 0; k < CASES; k++) {
        size_t n = (size_t)rnd_range(1, MAXN);
        random_chain(L, n, 60);
        int64_t total = 0;
        for (size_t i = 0; i < n; i++) {
            total += L[i].saved_bytes;
        }
        ms_solver_problem p = problem(rnd_range(0, total + 5),
                                      (unsigned)rnd_range(0, 15));
        p.tile_overhead = (double)rnd_range(0, 4) / 2.0;
        if (rnd() % 3 == 0) {
            p.end_extra = rnd_range(-30, 30);
        }
        if (rnd() % 2) {
            p.offload_bw = (double)rnd_range(1, 30);
            p.async_offload = (int)(rnd() % 2);
            p.min_offload_bytes = rnd_range(0, 20);
        }
        p.nested = k % 2;
        snprintf(ctx, sizeof(ctx),
                 "case %d (n=%zu, budget %lld, allowed %u, nested %d)", k, n,
                 (long long)p.budget_bytes, p.allowed, p.nested);
        best_cost = INFINITY;
        best_peak = -1;
        enum_nested = 0;
        enumerate(&p, L, n, 0, e);
        int two_levels = best_cost < INFINITY;
        if (!two_levels && p.nested) {
            enum_nested = 1;
            enumerate(&p, L, n, 0, e);
        }
        CHECK(ms_solve(&p, L, n, c, &r) == 0);
        for (size_t i = 0; two_levels && i < n; i++) {
            CHECK(!c[i].nested);
        }
        nested_plans += !two_levels && r.feasible;
        feasible += check_best(&p, L, n, c, &r);
    }
    printf("exhaustive: %ld of %d cases feasible (%ld nested only)\n",
           feasible, (int)CASES, nested_plans);
    CHECK(feasible > CASES / 5 && feasible < CASES && nested_plans > 0);
    group_end("exhaustive");
}

/* Below the least budget of two levels, where only nesting may fit: the
   solver's overhead is the best nested plan's. */
static void
test_exhaustive_nested(void)
{
    enum { CASES = 600, MAXN = 6 };
    ms_layer L[MAXN];
    ms_solver_choice c[MAXN], e[MAXN];
    ms_solver_result r;
    long feasible = 0;
    lcg = 0x4e57ULL;
    group_begin();
    for (int k = 0; k < CASES; k++) {
        size_t n = (size_t)rnd_range(2, MAXN);
        random_chain(L, n, 60);
        ms_solver_problem p = problem(0, (unsigned)rnd_range(0, 15)
                                             | MS_TECH_CHECKPOINT);
        int64_t two = 0;
        CHECK(ms_solver_min_budget(&p, L, n, &two) == 0);
        p.budget_bytes = two - rnd_range(1, 10);
        p.nested = 1;
        snprintf(ctx, sizeof(ctx), "case %d (n=%zu, budget %lld, allowed %u)",
                 k, n, (long long)p.budget_bytes, p.allowed);
        best_cost = INFINITY;
        enum_nested = 1;
        enumerate(&p, L, n, 0, e);
        enum_nested = 0;
        CHECK(ms_solve(&p, L, n, c, &r) == 0);
        feasible += check_best(&p, L, n, c, &r);
    }
    printf("exhaustive nested: %ld of %d cases below two levels feasible\n",
           feasible, (int)CASES);
    CHECK(feasible > CASES / 20);
    group_end("exhaustive nested");
}

/* ---- fuzz ---------------------------------------------------------------- */

static void
test_fuzz(void)
{
    enum { ROUNDS = 300, MAXN = 400 };
    ms_layer *L = malloc(MAXN * sizeof(ms_layer));
    ms_solver_choice *c = malloc(MAXN * sizeof(ms_solver_choice));
    ms_solver_result r;
    lcg = 0xf022ULL;
    group_begin();
    if (L == NULL || c == NULL) {
        CHECK(0);
        free(L);
        free(c);
        group_end("fuzz");
        return;
    }
    for (int k = 0; k < ROUNDS; k++) {
        size_t n = (size_t)rnd_range(0, MAXN);
        int64_t scale = (int64_t)1 << rnd_range(4, 40);
        random_chain(L, n, scale);
        for (size_t i = 0; i < n; i++) {
            if (rnd() % 50 == 0) {
                L[i].flops = rnd() % 2 ? INFINITY : NAN;
            }
            if (rnd() % 50 == 0) {
                L[i].saved_bytes = -L[i].saved_bytes; /* nonsense in */
            }
        }
        int64_t total = 0;
        for (size_t i = 0; i < n; i++) {
            total += L[i].saved_bytes > 0 ? L[i].saved_bytes : 0;
        }
        ms_solver_problem p = problem(rnd() % 10 == 0 ? INT64_MAX / 4
                                                      : rnd_range(0, 1 << 30) * (total / (1 << 30) + 1),
                                      (unsigned)rnd_range(0, 15));
        p.resolution = (int)rnd_range(1, 2048);
        p.max_segment = (int)rnd_range(1, 400);
        p.offload_bw = rnd() % 2 ? (double)rnd_range(1, 1 << 30) : 0.0;
        p.async_offload = (int)(rnd() % 2);
        if (rnd() % 3 == 0) {
            p.end_extra = rnd_range(-(1 << 30), 1 << 30);
        }
        p.nested = k % 2;
        snprintf(ctx, sizeof(ctx), "round %d (n=%zu)", k, n);
        CHECK(ms_solve(&p, L, n, c, &r) == 0);
        if (r.feasible) {
            CHECK(ms_solver_check(&p, L, n, c) == 0);
            CHECK(r.peak_bytes == bpeak(&p, L, n, c));
            CHECK(r.peak_bytes <= p.budget_bytes);
            CHECK(r.overhead_seconds == ms_solver_overhead(&p, L, n, c, NULL));
        }
    }
    free(L);
    free(c);
    group_end("fuzz");
}

/* ---- min-budget ----------------------------------------------------------- */

static void
test_min_budget(void)
{
    enum { CASES = 300, MAXN = 6 };
    ms_layer L[MAXN];
    ms_solver_choice c[MAXN];
    ms_solver_result r;
    lcg = 0xb0dULL;
    group_begin();
    for (int k = 0; k < CASES; k++) {
        size_t n = (size_t)rnd_range(1, MAXN);
        random_chain(L, n, 60);
        ms_solver_problem p = problem(0, (unsigned)rnd_range(0, 15));
        p.offload_bw = rnd() % 2 ? 5.0 : 0.0;
        p.nested = k % 2;
        int64_t mb = -1;
        snprintf(ctx, sizeof(ctx), "case %d", k);
        CHECK(ms_solver_min_budget(&p, L, n, &mb) == 0);
        p.budget_bytes = mb;
        CHECK(ms_solve(&p, L, n, c, &r) == 0 && r.feasible);
        if (mb > 0) {
            p.budget_bytes = mb - 1;
            CHECK(ms_solve(&p, L, n, c, &r) == 0 && !r.feasible);
        }
    }
    group_end("min-budget");
}

/* ---- timing ---------------------------------------------------------------- */

static double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void
test_timing(void)
{
    static const size_t sizes[] = {1000, 10000};
    group_begin();
    for (size_t s = 0; s < 2; s++) {
        size_t n = sizes[s];
        ms_layer *L = malloc(n * sizeof(ms_layer));
        ms_solver_choice *c = malloc(n * sizeof(ms_solver_choice));
        if (L == NULL || c == NULL) {
            CHECK(0);
            free(L);
            free(c);
            continue;
        }
        lcg = 0x7173ULL + s;
        int64_t total = 0;
        for (size_t i = 0; i < n; i++) {
            /* Transformer-like: blocks of ~24 MiB saved, 2 MiB input. */
            L[i] = layer(rnd_range(20, 28) << 20, 2 << 20,
                         (double)rnd_range(8, 12) * 1e9, MS_LAYER_TILEABLE);
            total += L[i].saved_bytes;
        }
        ms_solver_problem p = problem(total / 5, ALL); /* 20% */
        p.flop_rate = 1e11;
        p.offload_bw = 2e9;
        p.async_offload = 1;
        p.tile_overhead = 2e-5;
        p.max_segment = 64;
        p.resolution = 512;
        ms_solver_result r;
        double t0 = now();
        int rc = ms_solve(&p, L, n, c, &r);
        double dt = now() - t0;
        snprintf(ctx, sizeof(ctx), "n=%zu", n);
        CHECK(rc == 0 && r.feasible && r.peak_bytes <= p.budget_bytes);
        printf("time %zu layers: %.6f s\n", n, dt);
        free(L);
        free(c);
    }
    group_end("timing");
}

int
main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_model();
    test_known();
    test_tail();
    test_selective();
    test_selective_levels();
    test_nested();
    test_exhaustive();
    test_exhaustive_nested();
    test_fuzz();
    test_min_budget();
    test_timing();
    printf("%ld passed, %ld failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
