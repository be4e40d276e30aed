/*
 * fake_calls.h: FakeCalls, the OOM predictor's caller of operators on fake
 * tensors (see fake_calls.c).
 */
#ifndef MEMSCALE_FAKE_CALLS_H
#define MEMSCALE_FAKE_CALLS_H

#include "state.h"

int ms_fake_calls_init_type(PyObject *module, ms_state *st);

#endif
