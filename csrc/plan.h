/*
 * plan.h: the Plan and LayerPlan types (plan.c).
 */
#ifndef MEMSCALE_PLAN_H
#define MEMSCALE_PLAN_H

#include "state.h"

/* Create the Plan and LayerPlan types into the module state. */
int ms_plan_init_types(PyObject *module, ms_state *st);
/* Module function build_plan(layers, *, ...): run the engine, a Plan. */
PyObject *ms_plan_build(PyObject *module, PyObject *args, PyObject *kwargs);
/* Layer i of a plan: its technique mask, tile count (1: not tiled),
   checkpoint segment (first layer's index, or -1) and whether that
   segment is nested (1 or 0); -1 with an exception set. */
int ms_plan_layer(PyObject *plan, Py_ssize_t i, unsigned *mask, int *tiles,
                  int *segment, int *nested);

#endif /* MEMSCALE_PLAN_H */
