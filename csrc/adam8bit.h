/*
 * adam8bit.h: the 8-bit AdamW update kernel (adam8bit.c).
 */
#ifndef MEMSCALE_ADAM8BIT_H
#define MEMSCALE_ADAM8BIT_H

#include "state.h"

/* Module function adamw8bit_step(param, grad, ...). */
PyObject *ms_adamw8bit_step(PyObject *module, PyObject *args,
                            PyObject *kwargs);

#endif /* MEMSCALE_ADAM8BIT_H */
