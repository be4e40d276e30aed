/*
 * tiling.h: slicing a layer's inputs into tiles, joining the outputs
 * (tiling.c).
 */
#ifndef MEMSCALE_TILING_H
#define MEMSCALE_TILING_H

#include "state.h"

/* The lead tensor's extent along dim and its shape (new reference), or
 *extent = 0 and *lead_shape = NULL when there is nothing to tile. */
int ms_tile_extent(ms_state *st, PyObject *args, PyObject *kwargs, int dim,
                   Py_ssize_t *extent, PyObject **lead_shape);
/* Start and length of tile j of `tiles` over `extent`. */
void ms_tile_range(Py_ssize_t extent, int tiles, int j, Py_ssize_t *start,
                   Py_ssize_t *len);
/* The arguments of one tile (new references). */
int ms_tile_slice(ms_state *st, PyObject *args, PyObject *kwargs, int dim,
                  PyObject *lead_shape, Py_ssize_t start, Py_ssize_t len,
                  PyObject **targs, PyObject **tkwargs);
/* The tiles' outputs (a non-empty list) joined along dim. */
PyObject *ms_tile_merge(ms_state *st, PyObject *outs, int dim);
/* Module function tile_call(fn, args, kwargs, dim, tiles). */
PyObject *ms_tile_call(PyObject *module, PyObject *const *args,
                       Py_ssize_t nargs);

#endif /* MEMSCALE_TILING_H */
