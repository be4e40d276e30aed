/*
 * executor.h: the Executor type (executor.c and its sibling files, whose
 * shared structures are in executor_internal.h).
 */
#ifndef MEMSCALE_EXECUTOR_H
#define MEMSCALE_EXECUTOR_H

#include "state.h"

/* Create the Executor type and its helper types into the module state,
   and add Executor to the module. */
int ms_executor_init_types(PyObject *module, ms_state *st);

#endif /* MEMSCALE_EXECUTOR_H */
