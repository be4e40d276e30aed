/*
 * profiler.h: the Profiler type (profiler.c).
 */
#ifndef MEMSCALE_PROFILER_H
#define MEMSCALE_PROFILER_H

#include "state.h"

/* Create the Profiler type into the module state. */
int ms_profiler_init_types(PyObject *module, ms_state *st);

/* What the Python methods begin_pass(), end_pass(ok) and detach() of a
   Profiler (an instance of st->profiler_type) do: 0, or -1 with an
   exception set. */
int ms_profiler_begin_pass(PyObject *profiler);
int ms_profiler_end_pass(PyObject *profiler, int ok);
int ms_profiler_detach(PyObject *profiler);
/* Count `tensor` as saved for backward by the pass running (nothing when
   none is): what the Profiler's own saved-tensor hook does, for a tensor
   a checkpoint frame's hook took instead (a pass measured under a plan).
   0, or -1 with an exception set. */
int ms_profiler_count(PyObject *profiler, PyObject *tensor);

#endif /* MEMSCALE_PROFILER_H */
