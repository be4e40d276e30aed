/*
 * units.h: the planning units of a model (units.c).
 */
#ifndef MEMSCALE_UNITS_H
#define MEMSCALE_UNITS_H

#include "state.h"

/* Module function find_units(model): a list of (name, module) pairs. */
PyObject *ms_find_units(PyObject *module, PyObject *model);

#endif /* MEMSCALE_UNITS_H */
