/*
 * memory.c: the memory model of a plan (see memory.h).
 */
#include "memory.h"

void
ms_mem_terms_of(const ms_layer *L, size_t n, const ms_solver_choice *c,
                ms_mem_terms *terms)
{
    int64_t held = 0, worst = 0;
    size_t worst_at = n;
    for (size_t i = 0; i < n;) {
        if (c[i].seg_start < 0 && c[i].selective) {
            int64_t at =
                ms_add_sat(held, ms_mem_selective_backward(&L[i], c[i].level));
            if (at > worst) {
                worst = at;
                worst_at = i;
            }
            held = ms_add_sat(held, ms_mem_selective_held(&L[i], c[i].level));
            i++;
            continue;
        }
        if (c[i].seg_start < 0) {
            held = ms_add_sat(held, ms_mem_saved(&L[i]));
            i++;
            continue;
        }
        size_t j = i;
        int64_t saved = 0, transient = 0, inputs = 0;
        while (j < n && c[j].seg_start == (int)i) {
            if (c[i].nested) {
                transient = ms_mem_nest_step(transient, inputs, &L[j]);
                inputs = ms_add_sat(inputs, ms_mem_stored(&L[j], 0));
            }
            else {
                saved = ms_add_sat(saved, ms_mem_saved(&L[j]));
                transient = ms_mem_seg_step(transient, saved, &L[j]);
            }
            j++;
        }
        if (c[i].tiles > 1) {
            transient = ms_mem_tile_share(&L[i], c[i].tiles);
        }
        int64_t at = ms_add_sat(held, transient);
        if (at > worst) {
            worst = at;
            worst_at = i;
        }
        held = ms_add_sat(held, ms_mem_stored(&L[i], c[i].offload));
        i = j;
    }
    terms->end = held;
    terms->recompute = worst;
    terms->recompute_at = worst_at;
}

int64_t
ms_mem_peak(const ms_mem_terms *terms, size_t n, int64_t base,
            int64_t peak_offset, int64_t plan_offset, size_t *at)
{
    int64_t end = ms_offset_peak(ms_add_sat(base, terms->end), peak_offset);
    int64_t rec = ms_offset_peak(ms_add_sat(base, terms->recompute),
                                 plan_offset);
    if (at != NULL) {
        *at = end >= rec ? n : terms->recompute_at;
    }
    return end >= rec ? end : rec;
}
