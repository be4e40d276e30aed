/*
 * layer_stats.h: LayerStats, the planner's figures of one planning unit,
 * and their conversion to the engine's ms_layer (layer_stats.c).
 */
#ifndef MEMSCALE_LAYER_STATS_H
#define MEMSCALE_LAYER_STATS_H

#include "state.h"

#include "engine.h"

/* Sizes above this are not a real device: refusing them keeps every sum
   the engine makes far from int64 overflow. */
#define MS_MAX_BYTES (1LL << 50)

/* Create the LayerStats type (a struct sequence) into the module state. */
int ms_layer_stats_init_type(PyObject *module, ms_state *st);
/* Parse layers[index], a LayerStats or a plain tuple of its seven fields,
   into *out; *name and *kind are borrowed from it.  0, or -1 with an
   exception that names the layer index and the field. */
int ms_layer_stats_parse(PyObject *item, Py_ssize_t index, PyObject **name,
                         PyObject **kind, ms_layer *out);

#endif /* MEMSCALE_LAYER_STATS_H */
