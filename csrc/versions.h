/*
 * versions.h: recording the versions of a call's input tensors and
 * telling an in-place change (versions.c).
 */
#ifndef MEMSCALE_VERSIONS_H
#define MEMSCALE_VERSIONS_H

#include "state.h"

/* Append (tensor, tensor._version) for every tensor in obj (nested in
   tuples, lists and dict values) to the list out. */
int ms_collect_versions(ms_state *st, PyObject *obj, PyObject *out);
/* 1 if every recorded (tensor, version) input is unchanged, 0 if not, -1
   with an exception set.  A tensor may be recorded through a weak
   reference: one that is gone counts as unchanged. */
int ms_versions_unchanged(ms_state *st, PyObject *versions);

#endif /* MEMSCALE_VERSIONS_H */
