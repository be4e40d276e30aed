/*
 * storage_track.c: track(tracker, tensor, category=None), the OOM
 * predictor's registration of the storage an operator returned
 * (memscale/predictor/_tracker.py, StorageTracker.track, calls it for
 * every output of every simulated operator).
 *
 * The tracker keeps, per storage it has seen, a serial: its bytes now
 * (`sizes`), at birth (`sizes_at_birth`) and its category, and an event
 * (serial, +/- bytes) in `events` for each allocation, resize and free.
 * `_known` maps id(storage) to (weak reference, serial); the weak
 * reference's callback, a Freed, records the free when the storage dies
 * (while the tracker is active).  Everything lives in the tracker's own
 * lists and dict, which the Python side reads; this file only does the
 * per-output work without the interpreter.
 */
#include "storage_track.h"

#include <stddef.h> /* offsetof, for the member table */

/* ------------------------------------------------------------------ */
/* Freed: the callback of a storage's weak reference                   */

typedef struct {
    PyObject_HEAD
    PyObject *tracker; /* the StorageTracker */
    PyObject *known;   /* its _known dict */
    PyObject *key;     /* id(storage) */
    Py_ssize_t serial;
    vectorcallfunc vectorcall;
} Freed;

/* tracker.sizes, a list holding `serial`: a new reference, or NULL with
   an exception set. */
static PyObject *
sizes_holding(ms_state *st, PyObject *tracker, Py_ssize_t serial)
{
    PyObject *sizes = PyObject_GetAttr(tracker, st->s_sizes);
    if (sizes != NULL && !PyList_Check(sizes)) {
        PyErr_SetString(PyExc_TypeError,
                        "track: the tracker's sizes are not a list");
        Py_CLEAR(sizes);
    }
    else if (sizes != NULL && (serial < 0 || serial >= PyList_GET_SIZE(sizes)))
    {
        PyErr_SetString(PyExc_IndexError,
                        "track: a serial the tracker's sizes do not hold");
        Py_CLEAR(sizes);
    }
    return sizes;
}

/* tracker._died(serial): the serial's bytes freed now, if the tracker is
   active and it still has some.  0, or -1 with an exception set. */
static int
died(ms_state *st, PyObject *tracker, Py_ssize_t serial)
{
    PyObject *active = PyObject_GetAttr(tracker, st->s_active);
    if (active == NULL) {
        return -1;
    }
    int on = PyObject_IsTrue(active);
    Py_DECREF(active);
    if (on <= 0) {
        return on;
    }
    PyObject *sizes = sizes_holding(st, tracker, serial);
    if (sizes == NULL) {
        return -1;
    }
    int r = -1;
    PyObject *size = Py_NewRef(PyList_GET_ITEM(sizes, serial));
    int nonzero = PyObject_IsTrue(size);
    if (nonzero <= 0) {
        r = nonzero;
        Py_DECREF(size);
        goto done;
    }
    PyObject *events = PyObject_GetAttr(tracker, st->s_events);
    if (events != NULL && !PyList_Check(events)) {
        PyErr_SetString(PyExc_TypeError,
                        "track: the tracker's events are not a list");
        Py_CLEAR(events);
    }
    PyObject *neg = events != NULL ? PyNumber_Negative(size) : NULL;
    Py_DECREF(size);
    PyObject *event = neg != NULL ? Py_BuildValue("(nO)", serial, neg) : NULL;
    if (event != NULL && PyList_Append(events, event) == 0) {
        PyObject *zero = PyLong_FromLong(0);
        r = zero == NULL ? -1 : PyList_SetItem(sizes, serial, zero);
    }
    Py_XDECREF(event);
    Py_XDECREF(neg);
    Py_XDECREF(events);
done:
    Py_DECREF(sizes);
    return r;
}

static PyObject *
freed_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                 PyObject *kwnames)
{
    Freed *f = (Freed *)self;
    if (PyVectorcall_NARGS(nargsf) != 1
        || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0))
    {
        PyErr_SetString(PyExc_TypeError, "Freed takes the weak reference");
        return NULL;
    }
    ms_state *st = PyType_GetModuleState(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    /* Forget the storage unless another one took its id since. */
    PyObject *entry = PyDict_GetItemWithError(f->known, f->key);
    if (entry == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) > 0
        && PyTuple_GET_ITEM(entry, 0) == args[0]
        && PyDict_DelItem(f->known, f->key) < 0)
    {
        return NULL;
    }
    if (died(st, f->tracker, f->serial) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static int
freed_traverse(Freed *f, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(f));
    Py_VISIT(f->tracker);
    Py_VISIT(f->known);
    Py_VISIT(f->key);
    return 0;
}

static int
freed_clear(Freed *f)
{
    Py_CLEAR(f->tracker);
    Py_CLEAR(f->known);
    Py_CLEAR(f->key);
    return 0;
}

static void
freed_dealloc(Freed *f)
{
    PyTypeObject *tp = Py_TYPE(f);
    PyObject_GC_UnTrack(f);
    (void)freed_clear(f);
    tp->tp_free((PyObject *)f);
    Py_DECREF(tp);
}

static PyMemberDef freed_members[] = {
    {"serial", Py_T_PYSSIZET, offsetof(Freed, serial), Py_READONLY,
     "The serial whose free it records."},
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(Freed, vectorcall),
     Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot freed_slots[] = {
    {Py_tp_doc, "The callback of a tracked storage's weak reference: "
                "records the storage's free (made by track())."},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_dealloc, freed_dealloc},
    {Py_tp_traverse, freed_traverse},
    {Py_tp_clear, freed_clear},
    {Py_tp_members, freed_members},
    {0, NULL},
};

static PyType_Spec freed_spec = {
    .name = "memscale._core._Freed",
    .basicsize = sizeof(Freed),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = freed_slots,
};

/* ------------------------------------------------------------------ */
/* track()                                                              */

/* The bytes of the tracked device's memory the storage takes
   (StorageTracker._allocated): a new int, or NULL with an exception. */
static PyObject *
allocated(ms_state *st, PyObject *tracker, PyObject *t, PyObject *storage)
{
    PyObject *nbytes = PyObject_CallMethodNoArgs(storage, st->s_nbytes);
    if (nbytes == NULL) {
        return NULL;
    }
    PyObject *granule = PyObject_GetAttr(tracker, st->s_granule);
    if (granule == NULL) {
        Py_DECREF(nbytes);
        return NULL;
    }
    int some = granule == Py_None ? 0 : PyObject_IsTrue(nbytes);
    if (some <= 0) {
        Py_DECREF(granule);
        if (some < 0) {
            Py_CLEAR(nbytes);
        }
        return nbytes;
    }
    PyObject *out = NULL;
    if (!PyTuple_Check(granule) || PyTuple_GET_SIZE(granule) != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "track: the tracker's granule is not (bytes, "
                        "device type)");
        goto done;
    }
    /* A storage of another device type than the granule's takes none. */
    PyObject *device = PyObject_GetAttr(t, st->s_device);
    PyObject *type = device != NULL ? PyObject_GetAttr(device, st->s_type)
                                    : NULL;
    Py_XDECREF(device);
    if (type == NULL) {
        goto done;
    }
    int same = PyObject_RichCompareBool(type, PyTuple_GET_ITEM(granule, 1),
                                        Py_EQ);
    Py_DECREF(type);
    if (same < 0) {
        goto done;
    }
    if (!same) {
        out = PyLong_FromLong(0);
        goto done;
    }
    /* in_blocks: rounded up to a multiple of the granule. */
    PyObject *g = PyTuple_GET_ITEM(granule, 0);
    PyObject *neg = PyNumber_Negative(nbytes);
    PyObject *q = neg != NULL ? PyNumber_FloorDivide(neg, g) : NULL;
    PyObject *blocks = q != NULL ? PyNumber_Negative(q) : NULL;
    out = blocks != NULL ? PyNumber_Multiply(blocks, g) : NULL;
    Py_XDECREF(blocks);
    Py_XDECREF(q);
    Py_XDECREF(neg);
done:
    Py_DECREF(granule);
    Py_DECREF(nbytes);
    return out;
}

/* The category of a storage born now (StorageTracker._category): a new
   reference, or NULL with an exception. */
static PyObject *
category_now(ms_state *st, PyObject *tracker)
{
    int r = 0;
    PyObject *phase = PyObject_GetAttr(tracker, st->s_phase);
    if (phase == NULL) {
        return NULL;
    }
    if (PyUnicode_Check(phase)) {
        r = PyUnicode_CompareWithASCIIString(phase, "forward") == 0;
    }
    Py_DECREF(phase);
    if (!r) {
        PyObject *depth = PyObject_GetAttr(tracker, st->s_recompute_depth);
        if (depth == NULL) {
            return NULL;
        }
        PyObject *zero = PyLong_FromLong(0);
        r = zero == NULL ? -1 : PyObject_RichCompareBool(depth, zero, Py_GT);
        Py_XDECREF(zero);
        Py_DECREF(depth);
        if (r < 0) {
            return NULL;
        }
    }
    return Py_NewRef(r ? st->s_activations : st->s_workspace);
}

/* Append `item` (a new reference, or NULL: an error) to tracker.<name>. */
static int
append_to(PyObject *tracker, PyObject *name, PyObject *item)
{
    if (item == NULL) {
        return -1;
    }
    PyObject *list = PyObject_GetAttr(tracker, name);
    if (list != NULL && !PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "track: the tracker's %U is not a list",
                     name);
        Py_CLEAR(list);
    }
    int r = list == NULL ? -1 : PyList_Append(list, item);
    Py_XDECREF(list);
    Py_DECREF(item);
    return r;
}

/* A storage seen before, resized in place: its event and new size. */
static int
resized(ms_state *st, PyObject *tracker, Py_ssize_t serial, PyObject *nbytes)
{
    PyObject *sizes = sizes_holding(st, tracker, serial);
    if (sizes == NULL) {
        return -1;
    }
    int r = -1;
    /* (owned: comparing may run Python code that replaces it) */
    PyObject *before = Py_NewRef(PyList_GET_ITEM(sizes, serial));
    int same = PyObject_RichCompareBool(nbytes, before, Py_EQ);
    if (same != 0) {
        r = same < 0 ? -1 : 0;
        Py_DECREF(before);
        goto done;
    }
    PyObject *delta = PyNumber_Subtract(nbytes, before);
    Py_DECREF(before);
    PyObject *event = delta != NULL ? Py_BuildValue("(nO)", serial, delta)
                                    : NULL;
    Py_XDECREF(delta);
    if (append_to(tracker, st->s_events, event) == 0) {
        r = PyList_SetItem(sizes, serial, Py_NewRef(nbytes));
    }
done:
    Py_DECREF(sizes);
    return r;
}

/* A new serial of `nbytes` (StorageTracker._born): its number, or -1
   with an exception. */
static Py_ssize_t
born(ms_state *st, PyObject *tracker, PyObject *nbytes, PyObject *category)
{
    PyObject *sizes = PyObject_GetAttr(tracker, st->s_sizes);
    if (sizes == NULL) {
        return -1;
    }
    if (!PyList_Check(sizes)) {
        PyErr_SetString(PyExc_TypeError, "track: the tracker's sizes are "
                                         "not a list");
        Py_DECREF(sizes);
        return -1;
    }
    Py_ssize_t serial = PyList_GET_SIZE(sizes);
    int r = PyList_Append(sizes, nbytes);
    Py_DECREF(sizes);
    if (r < 0
        || append_to(tracker, st->s_sizes_at_birth, Py_NewRef(nbytes)) < 0)
    {
        return -1;
    }
    int truthy = category != Py_None ? PyObject_IsTrue(category) : 0;
    if (truthy < 0) {
        return -1;
    }
    PyObject *cat = truthy ? Py_NewRef(category) : category_now(st, tracker);
    if (append_to(tracker, st->s_categories, cat) < 0) {
        return -1;
    }
    int some = PyObject_IsTrue(nbytes);
    if (some < 0
        || (some
            && append_to(tracker, st->s_events,
                         Py_BuildValue("(nO)", serial, nbytes))
                   < 0))
    {
        return -1;
    }
    return serial;
}

/* track(tracker, t, category): register t's storage; its new serial, or
   None when it was known (a resize in place recorded). */
static PyObject *
track_one(ms_state *st, PyObject *tracker, PyObject *t, PyObject *category)
{
    PyObject *storage = NULL, *known = NULL, *key = NULL, *nbytes = NULL;
    PyObject *out = NULL;
    storage = PyObject_CallMethodNoArgs(t, st->s_untyped_storage);
    known = storage != NULL ? PyObject_GetAttr(tracker, st->s_known) : NULL;
    key = known != NULL ? PyLong_FromVoidPtr(storage) : NULL;
    if (key == NULL) {
        goto done;
    }
    if (!PyDict_Check(known)) {
        PyErr_SetString(PyExc_TypeError,
                        "track: the tracker's _known is not a dict");
        goto done;
    }
    PyObject *entry = PyDict_GetItemWithError(known, key); /* borrowed */
    if (entry == NULL && PyErr_Occurred()) {
        goto done;
    }
    if (entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2
        && PyWeakref_Check(PyTuple_GET_ITEM(entry, 0)))
    {
        Py_INCREF(entry);
        PyObject *alive;
        int r = ms_weakref_get(PyTuple_GET_ITEM(entry, 0), &alive);
        int same = r > 0 && alive == storage;
        Py_XDECREF(alive);
        if (r < 0) {
            Py_DECREF(entry);
            goto done;
        }
        if (same) {
            Py_ssize_t serial = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
            Py_DECREF(entry);
            if (serial == -1 && PyErr_Occurred()) {
                goto done;
            }
            nbytes = allocated(st, tracker, t, storage);
            if (nbytes != NULL && resized(st, tracker, serial, nbytes) == 0) {
                out = Py_NewRef(Py_None);
            }
            goto done;
        }
        Py_DECREF(entry);
    }
    nbytes = allocated(st, tracker, t, storage);
    if (nbytes == NULL) {
        goto done;
    }
    Py_ssize_t serial = born(st, tracker, nbytes, category);
    if (serial < 0) {
        goto done;
    }
    Freed *f = PyObject_GC_New(Freed, st->freed_type);
    if (f == NULL) {
        goto done;
    }
    f->tracker = Py_NewRef(tracker);
    f->known = Py_NewRef(known);
    f->key = Py_NewRef(key);
    f->serial = serial;
    f->vectorcall = freed_vectorcall;
    PyObject_GC_Track(f);
    PyObject *ref = PyWeakref_NewRef(storage, (PyObject *)f);
    Py_DECREF(f);
    PyObject *value = ref != NULL ? Py_BuildValue("(Nn)", ref, serial) : NULL;
    if (value != NULL && PyDict_SetItem(known, key, value) == 0) {
        out = PyLong_FromSsize_t(serial);
    }
    Py_XDECREF(value);
done:
    Py_XDECREF(nbytes);
    Py_XDECREF(key);
    Py_XDECREF(known);
    Py_XDECREF(storage);
    return out;
}

PyObject *
ms_track(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError,
                        "track(tracker, tensor, category=None)");
        return NULL;
    }
    ms_state *st = ms_get_state(module);
    return track_one(st, args[0], args[1], nargs == 3 ? args[2] : Py_None);
}

int
ms_storage_track_init_type(PyObject *module, ms_state *st)
{
    st->freed_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &freed_spec, NULL);
    return st->freed_type == NULL ? -1 : 0;
}
