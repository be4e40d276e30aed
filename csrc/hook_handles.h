/*
 * hook_handles.h: registering forward hooks on the planning units and
 * removing them (hook_handles.c).
 */
#ifndef MEMSCALE_HOOK_HANDLES_H
#define MEMSCALE_HOOK_HANDLES_H

#include "state.h"

/* Register owner.<pre_name> / owner.<post_name> as forward pre-hook (with
   kwargs) and always-called forward hook of every module of `units`,
   appending the removable handles to the list `handles`. */
int ms_register_unit_hooks(ms_state *st, PyObject *owner, PyObject *units,
                           PyObject *handles, PyObject *pre_name,
                           PyObject *post_name);
/* Remove every handle of the list and empty it; the first error wins. */
int ms_remove_handles(ms_state *st, PyObject *handles);

#endif /* MEMSCALE_HOOK_HANDLES_H */
