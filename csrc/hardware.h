/*
 * hardware.h: hardware detection (hardware.c).
 */
#ifndef MEMSCALE_HARDWARE_H
#define MEMSCALE_HARDWARE_H

#include "state.h"

/* Module function detect_hardware(device_type, index=0). */
PyObject *ms_detect_hardware(PyObject *module, PyObject *args,
                             PyObject *kwargs);

#endif /* MEMSCALE_HARDWARE_H */
