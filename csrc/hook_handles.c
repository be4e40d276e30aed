/*
 * hook_handles.c: forward hooks on every planning unit, kept as handles.
 *
 * The Profiler (attach / detach) and the Executor (apply / detach, and the
 * root module's hooks) both register an owner's pre- and post-hook method
 * on a list of modules and later remove them through the RemovableHandles
 * torch returns: one implementation serves both.
 */
#include "hook_handles.h"

int
ms_remove_handles(ms_state *st, PyObject *handles)
{
    int rc = 0;
    Py_ssize_t n = PyList_GET_SIZE(handles);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyObject_CallMethodNoArgs(PyList_GET_ITEM(handles, i),
                                                st->s_remove);
        if (r == NULL) {
            /* Keep removing the others; report the first failure. */
            if (rc == 0) {
                rc = -1;
                ms_exc_state saved;
                ms_exc_save(&saved);
                for (Py_ssize_t j = i + 1; j < n; j++) {
                    PyObject *r2 =
                        PyObject_CallMethodNoArgs(PyList_GET_ITEM(handles, j),
                                                  st->s_remove);
                    if (r2 == NULL) {
                        PyErr_WriteUnraisable(PyList_GET_ITEM(handles, j));
                    }
                    Py_XDECREF(r2);
                }
                ms_exc_restore(&saved);
                break;
            }
        }
        Py_XDECREF(r);
    }
    if (PyList_SetSlice(handles, 0, n, NULL) < 0) {
        rc = -1;
    }
    return rc;
}

/*
 * For each unit: owner.<pre_name> as a forward pre-hook with kwargs, and
 * owner.<post_name> as a forward hook with always_call=True, so a forward
 * that raises still reaches the post-hook.  Handles are appended to
 * `handles`; on failure the ones registered here are removed again.
 */
int
ms_register_unit_hooks(ms_state *st, PyObject *owner, PyObject *units,
                       PyObject *handles, PyObject *pre_name,
                       PyObject *post_name)
{
    PyObject *pre = NULL, *post = NULL, *kw_pre = NULL, *kw_post = NULL;
    Py_ssize_t start = PyList_GET_SIZE(handles);
    int rc = -1;

    pre = PyObject_GetAttr(owner, pre_name);
    post = PyObject_GetAttr(owner, post_name);
    kw_pre = Py_BuildValue("{OO}", st->s_with_kwargs, Py_True);
    kw_post = Py_BuildValue("{OO}", st->s_always_call, Py_True);
    if (pre == NULL || post == NULL || kw_pre == NULL || kw_post == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(units); i++) {
        PyObject *unit = PyList_GET_ITEM(units, i);
        PyObject *reg = NULL, *a = NULL, *h = NULL;
        int ok = 0;
        reg = PyObject_GetAttr(unit, st->s_register_forward_pre_hook);
        a = PyTuple_Pack(1, pre);
        if (reg != NULL && a != NULL) {
            h = PyObject_Call(reg, a, kw_pre);
        }
        if (h != NULL && PyList_Append(handles, h) == 0) {
            Py_CLEAR(h);
            Py_SETREF(reg,
                      PyObject_GetAttr(unit, st->s_register_forward_hook));
            Py_SETREF(a, PyTuple_Pack(1, post));
            if (reg != NULL && a != NULL) {
                h = PyObject_Call(reg, a, kw_post);
            }
            ok = h != NULL && PyList_Append(handles, h) == 0;
        }
        Py_XDECREF(h);
        Py_XDECREF(a);
        Py_XDECREF(reg);
        if (!ok) {
            goto done;
        }
    }
    rc = 0;
done:
    if (rc < 0 && PyList_GET_SIZE(handles) > start) {
        /* Undo what this call registered. */
        ms_exc_state saved;
        ms_exc_save(&saved);
        PyObject *mine = PyList_GetSlice(handles, start,
                                         PyList_GET_SIZE(handles));
        if (mine == NULL || ms_remove_handles(st, mine) < 0
            || PyList_SetSlice(handles, start, PyList_GET_SIZE(handles), NULL)
                   < 0)
        {
            PyErr_WriteUnraisable(owner);
        }
        Py_XDECREF(mine);
        ms_exc_restore(&saved);
    }
    Py_XDECREF(pre);
    Py_XDECREF(post);
    Py_XDECREF(kw_pre);
    Py_XDECREF(kw_post);
    return rc;
}
