/*
 * compat.h: the CPython API as memscale._core uses it, on every supported
 * Python (3.11 and later).
 *
 * Every C file of the extension that touches a Python object includes this
 * header first (through state.h): it includes Python.h, gives 3.11 the
 * member-definition names of 3.12, saves and restores a pending exception
 * around clean-up calls, and reads a weak reference the 3.13 way.
 */
#ifndef MEMSCALE_COMPAT_H
#define MEMSCALE_COMPAT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Member-definition names of 3.12+, on 3.11 too. */
#if PY_VERSION_HEX < 0x030C0000
#include "structmember.h"
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_T_LONGLONG T_LONGLONG
#define Py_T_DOUBLE T_DOUBLE
#define Py_T_BOOL T_BOOL
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_INT T_INT
#define Py_READONLY READONLY
#endif

/*
 * Saving and restoring a pending exception around clean-up calls, on every
 * supported Python (PyErr_GetRaisedException only exists from 3.12 on).
 */
#if PY_VERSION_HEX >= 0x030C0000
typedef struct {
    PyObject *exc;
} ms_exc_state;

static inline void
ms_exc_save(ms_exc_state *s)
{
    s->exc = PyErr_GetRaisedException();
}

static inline void
ms_exc_restore(ms_exc_state *s)
{
    PyErr_SetRaisedException(s->exc);
    s->exc = NULL;
}

static inline int
ms_exc_pending(const ms_exc_state *s)
{
    return s->exc != NULL;
}
#else
typedef struct {
    PyObject *type, *value, *tb;
} ms_exc_state;

static inline void
ms_exc_save(ms_exc_state *s)
{
    PyErr_Fetch(&s->type, &s->value, &s->tb);
}

static inline void
ms_exc_restore(ms_exc_state *s)
{
    PyErr_Restore(s->type, s->value, s->tb);
    s->type = s->value = s->tb = NULL;
}

static inline int
ms_exc_pending(const ms_exc_state *s)
{
    return s->type != NULL;
}
#endif

/*
 * The referent of a weak reference, as PyWeakref_GetRef (3.13+) gives it:
 * 1 and a new reference in *out, 0 and NULL if it is gone, -1 and NULL
 * with an exception set.
 */
static inline int
ms_weakref_get(PyObject *ref, PyObject **out)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyWeakref_GetRef(ref, out);
#else
    PyObject *obj = PyWeakref_GetObject(ref);
    *out = NULL;
    if (obj == NULL) {
        return -1;
    }
    if (obj == Py_None) {
        return 0;
    }
    *out = Py_NewRef(obj);
    return 1;
#endif
}

#endif /* MEMSCALE_COMPAT_H */
