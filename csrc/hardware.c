/*
 * hardware.c: what the device a model trains on offers (detect_hardware).
 *
 * The host CPU's capacity is its RAM, lowered to a cgroup memory limit
 * where one is set; a CUDA device is described through torch.cuda.
 */
#include "hardware.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Host RAM, lowered to a cgroup v2 / v1 memory limit where one is set. */
static long long
host_memory_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    long long total = (pages > 0 && page > 0) ? (long long)pages * page : 0;
    static const char *const limits[] = {
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    };
    for (size_t i = 0; i < sizeof(limits) / sizeof(limits[0]); i++) {
        FILE *f = fopen(limits[i], "r");
        if (f == NULL) {
            continue;
        }
        long long lim;
        if (fscanf(f, "%lld", &lim) == 1 && lim > 0
            && (total == 0 || lim < total))
        {
            total = lim;
        }
        fclose(f);
    }
    return total;
}

PyObject *
ms_detect_hardware(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"device_type", "index", NULL};
    const char *device;
    int index = 0;
    ms_state *st = ms_get_state(module);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|i:detect_hardware",
                                     kwlist, &device, &index))
    {
        return NULL;
    }
    if (strcmp(device, "cpu") == 0) {
        long long cap = host_memory_bytes();
        if (cap <= 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            "memscale could not read the host's memory size; "
                            "set Config(memory_budget_gb=...)");
            return NULL;
        }
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        return Py_BuildValue("{sssisisLsOss}", "device", "cpu", "index", 0,
                             "count", 1, "capacity_bytes", cap, "bf16",
                             Py_True, "name",
                             cores > 0 ? "host CPU" : "host CPU (cores ?)");
    }
    if (strcmp(device, "cuda") != 0) {
        PyErr_Format(PyExc_ValueError,
                     "memscale plans for 'cpu' and 'cuda' devices, not '%s'; "
                     "move the model to one of them or set "
                     "Config(memory_budget_gb=...)",
                     device);
        return NULL;
    }
    /* CUDA: thin, through torch.cuda (not runnable on CPU-only hosts). */
    PyObject *cuda = NULL, *count = NULL, *props = NULL, *total = NULL,
             *name = NULL, *bf16 = NULL, *res = NULL;
    cuda = PyObject_GetAttrString(st->torch, "cuda");
    if (cuda == NULL) {
        goto done;
    }
    count = PyObject_CallMethod(cuda, "device_count", NULL);
    if (count == NULL) {
        goto done;
    }
    long n = PyLong_AsLong(count);
    if (n == -1 && PyErr_Occurred()) {
        goto done;
    }
    if (index < 0 || index >= n) {
        PyErr_Format(PyExc_RuntimeError,
                     "CUDA device %d is not available (%ld devices)", index,
                     n);
        goto done;
    }
    props = PyObject_CallMethod(cuda, "get_device_properties", "i", index);
    if (props == NULL) {
        goto done;
    }
    total = PyObject_GetAttrString(props, "total_memory");
    name = PyObject_GetAttrString(props, "name");
    bf16 = PyObject_CallMethod(cuda, "is_bf16_supported", NULL);
    if (total == NULL || name == NULL || bf16 == NULL) {
        goto done;
    }
    res = Py_BuildValue("{sssisOsOsOsO}", "device", "cuda", "index", index,
                        "count", count, "capacity_bytes", total, "bf16", bf16,
                        "name", name);
done:
    Py_XDECREF(cuda);
    Py_XDECREF(count);
    Py_XDECREF(props);
    Py_XDECREF(total);
    Py_XDECREF(name);
    Py_XDECREF(bf16);
    return res;
}
