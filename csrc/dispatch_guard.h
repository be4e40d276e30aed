/*
 * dispatch_guard.h: DispatchGuard, the __torch_dispatch__ of memscale's
 * dispatch modes (see dispatch_guard.c).
 */
#ifndef MEMSCALE_DISPATCH_GUARD_H
#define MEMSCALE_DISPATCH_GUARD_H

#include "state.h"

int ms_dispatch_guard_init_type(PyObject *module, ms_state *st);

#endif
