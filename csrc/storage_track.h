/*
 * storage_track.h: track(), the OOM predictor's registration of the
 * storages operators return (see storage_track.c).
 */
#ifndef MEMSCALE_STORAGE_TRACK_H
#define MEMSCALE_STORAGE_TRACK_H

#include "state.h"

int ms_storage_track_init_type(PyObject *module, ms_state *st);
PyObject *ms_track(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
