/*
 * spill.h: the disk tier of offload, SpillStore (spill.c).
 */
#ifndef MEMSCALE_SPILL_H
#define MEMSCALE_SPILL_H

#include "state.h"

/* Create the SpillStore and _Spilled types into the module state. */
int ms_spill_init_types(PyObject *module, ms_state *st);
/* A record standing for the spilled tensor, Py_None when the tensor stays
   in memory, NULL with an exception set. */
PyObject *ms_spill_put(PyObject *store, PyObject *tensor);
/* The tensor back (new reference). */
PyObject *ms_spill_get(PyObject *record);
/* Wait for every write in flight. */
int ms_spill_flush(PyObject *store);
/* A new training step: forget the last one's prefetch order. */
int ms_spill_new_step(PyObject *store);
/* Whether obj is a record ms_spill_put returned. */
int ms_is_spilled(ms_state *st, PyObject *obj);

#endif /* MEMSCALE_SPILL_H */
