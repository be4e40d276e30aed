/*
 * layer_stats.c: LayerStats, what the planner knows of one planning unit.
 *
 * A struct sequence (a named tuple made in C): the profiler's Python side
 * builds one per unit, and build_plan reads them, or plain tuples of the
 * same seven fields, into the engine's ms_layer.  A wrong layer is refused
 * with an error that names its index and the field.
 */
#include "layer_stats.h"

#include <limits.h>
#include <math.h>

/* The fields, in tuple order; the parser below names them from here. */
enum {
    F_NAME,
    F_KIND,
    F_PARAM_BYTES,
    F_SAVED_BYTES,
    F_INPUT_BYTES,
    F_FLOPS,
    F_FLAGS,
    N_FIELDS, /* the tuple's fields; by name only after it: */
    /* the per-layer calibration of the memory model, 0 when not measured */
    F_BACKWARD_BYTES = N_FIELDS,
    F_SEL_LEVELS, /* the selective profile */
    F_COST,       /* the whole recompute at the matmul rate */
    F_TAIL_FLOPS, /* what a recompute ending in it does not run */
    F_TAIL_COST,  /* the same at the matmul rate */
    N_ALL_FIELDS
};

/* clang-format off */
static PyStructSequence_Field fields[] = {
    [F_NAME] = {"name",
        "Qualified module name of the unit, as in model.named_modules()."},
    [F_KIND] = {"kind", "Class name of the module."},
    [F_PARAM_BYTES] = {"param_bytes",
        "Bytes of the parameters the unit owns."},
    [F_SAVED_BYTES] = {"saved_bytes",
        "Activation bytes the unit saves for backward in an unoptimized\n"
        "step (what checkpointing frees)."},
    [F_INPUT_BYTES] = {"input_bytes",
        "Bytes of the unit's inputs (what checkpointing keeps instead,\n"
        "and what offload moves)."},
    [F_FLOPS] = {"flops",
        "Forward FLOPs of the unit, a float (the cost of a recompute)."},
    [F_FLAGS] = {"flags",
        "Bit set of what the profiler and the first step found: 1 the\n"
        "unit changes its input in place, 2 it never ran while profiling,\n"
        "LAYER_TILEABLE it may run in tiles, LAYER_UNREPEATABLE its\n"
        "recompute did not match its forward."},
    [F_BACKWARD_BYTES] = {"backward_bytes",
        "Bytes the unit's recompute and backward need on top of its saved\n"
        "tensors and of what is held before it, measured per layer on the\n"
        "OOM predictor's simulated step (None or 0: not measured).  Not in\n"
        "the tuple: LayerStats(fields, {'backward_bytes': n})."},
    [F_SEL_LEVELS] = {"selective_levels",
        "Run selective: the saved-op sets the unit may run with, a tuple of\n"
        "1 to 8 (threshold, saved_bytes, flops): an op is kept when its\n"
        "FLOPs per byte written reach threshold (> 0; the thresholds\n"
        "decrease, so each level keeps more than the one before),\n"
        "saved_bytes are its kept outputs (held until backward besides the\n"
        "input) and flops the cost of recomputing the rest (None: no\n"
        "selective profile).  By name only:\n"
        "LayerStats(fields, {'selective_levels': ((t, b, f), ...)})."},
    [F_COST] = {"recompute_cost",
        "What recomputing the whole unit costs, in FLOPs at the matmul\n"
        "rate: its counted FLOPs with convolutions and attention weighted\n"
        "by the rates memscale.costs measured (a float; None or 0: its\n"
        "flops).  flops stays the counted FLOPs.  By name only:\n"
        "LayerStats(fields, {'recompute_cost': c})."},
    [F_TAIL_FLOPS] = {"tail_flops",
        "The unit's tail: the counted FLOPs of the ops a recompute that\n"
        "ends in it does not run, a float <= flops.  A recompute stops\n"
        "once the last tensor the forward saved for backward is saved\n"
        "again (torch's early stop, and memscale's), so the ops after that\n"
        "moment are not rerun: the unit checkpointed alone, or last in a\n"
        "segment, is charged its recompute less its tail (None or 0: the\n"
        "whole unit).  By name only: LayerStats(fields, {'tail_flops': f})."},
    [F_TAIL_COST] = {"tail_cost",
        "The tail at the matmul rate, as recompute_cost weighs the unit's\n"
        "ops, a float <= recompute_cost (None or 0: tail_flops).  By name\n"
        "only: LayerStats(fields, {'tail_cost': c})."},
    [N_ALL_FIELDS] = {NULL, NULL},
};

PyDoc_STRVAR(layer_stats_doc,
"LayerStats(sequence, dict=None)\n--\n\n"
"One planning unit's figures as the planner reads them: name, kind,\n"
"param_bytes, saved_bytes, input_bytes, flops, flags.  A tuple:\n"
"build_plan also accepts a plain tuple of these seven fields, or of\n"
"eight with backward_bytes (an attribute of LayerStats, not in the\n"
"tuple) last.  More are given by name in dict: selective_levels (the\n"
"layer run selective), recompute_cost (what recomputing it costs at\n"
"the matmul rate), tail_flops and tail_cost (what a recompute ending\n"
"in it does not run).");
/* clang-format on */

static PyStructSequence_Desc layer_stats_desc = {
    .name = "memscale._core.LayerStats",
    .doc = layer_stats_doc,
    .fields = fields,
    .n_in_sequence = N_FIELDS,
};

int
ms_layer_stats_init_type(PyObject *module, ms_state *st)
{
    st->layer_stats_type = PyStructSequence_NewType(&layer_stats_desc);
    if (st->layer_stats_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->layer_stats_type);
}

/* ---- parsing ------------------------------------------------------ */

#define MS_KNOWN_FLAGS                                                        \
    (MS_LAYER_INPLACE_INPUT | MS_LAYER_NOT_CALLED | MS_LAYER_TILEABLE         \
     | MS_LAYER_UNREPEATABLE)

static int
parse_str(PyObject *item, Py_ssize_t index, int f, PyObject **out)
{
    PyObject *v = PyTuple_GET_ITEM(item, f);
    if (!PyUnicode_Check(v)) {
        PyErr_Format(PyExc_TypeError,
                     "layers[%zd].%s must be a str, got %.200s", index,
                     fields[f].name, Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = v;
    return 0;
}

/* An int field's value v.  Not an int: a TypeError naming the field.
   Beyond a long long: *out = LLONG_MAX, which every range check below
   refuses (with the value as given). */
static int
ll_value(PyObject *v, Py_ssize_t index, int f, long long *out)
{
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            x = LLONG_MAX;
        }
        else {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError,
                             "layers[%zd].%s must be an int, got %.200s",
                             index, fields[f].name, Py_TYPE(v)->tp_name);
            }
            return -1;
        }
    }
    *out = x;
    return 0;
}

static int
parse_ll(PyObject *item, Py_ssize_t index, int f, long long *out)
{
    return ll_value(PyTuple_GET_ITEM(item, f), index, f, out);
}

/* A size in bytes (field f's value v): an int in [0, 2**50]. */
static int
bytes_value(PyObject *v, Py_ssize_t index, int f, int64_t *out)
{
    long long x;
    if (ll_value(v, index, f, &x) < 0) {
        return -1;
    }
    if (x < 0 || x > MS_MAX_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd].%s must be >= 0 and <= 2**50 bytes, got %R",
                     index, fields[f].name, v);
        return -1;
    }
    *out = x;
    return 0;
}

static int
parse_bytes(PyObject *item, Py_ssize_t index, int f, int64_t *out)
{
    return bytes_value(PyTuple_GET_ITEM(item, f), index, f, out);
}

/* A field past the tuple, by name: a new reference, or None (new) when
   the item has no such field (a plain tuple) or it is None; NULL with an
   error otherwise. */
static PyObject *
named_field(PyObject *item, int f)
{
    PyObject *v = PyObject_GetAttrString(item, fields[f].name);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return NULL;
        }
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    return v;
}

/* backward_bytes: the eighth item of a plain tuple, or the attribute of a
   LayerStats (None, or a tuple subclass without it: 0, not measured). */
static int
parse_backward(PyObject *item, Py_ssize_t index, int64_t *out)
{
    *out = 0;
    PyObject *v;
    if (PyTuple_GET_SIZE(item) > N_FIELDS) {
        v = Py_NewRef(PyTuple_GET_ITEM(item, F_BACKWARD_BYTES));
    }
    else if (PyTuple_CheckExact(item)) {
        return 0;
    }
    else {
        v = named_field(item, F_BACKWARD_BYTES);
        if (v == NULL) {
            return -1;
        }
    }
    int rc = v == Py_None ? 0 : bytes_value(v, index, F_BACKWARD_BYTES, out);
    Py_DECREF(v);
    return rc;
}

static int
parse_flops_value(PyObject *v, Py_ssize_t index, int f, double *out)
{
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "layers[%zd].%s must be a number, got %.200s", index,
                         fields[f].name, Py_TYPE(v)->tp_name);
        }
        return -1;
    }
    if (!isfinite(x) || x < 0.0) {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd].%s must be a finite number >= 0 (not inf "
                     "or nan), got %R",
                     index, fields[f].name, v);
        return -1;
    }
    *out = x;
    return 0;
}

/* recompute_cost, by name (None: 0, not given). */
static int
parse_cost(PyObject *item, Py_ssize_t index, double *out)
{
    *out = 0.0;
    PyObject *v = named_field(item, F_COST);
    if (v == NULL) {
        return -1;
    }
    int rc = v == Py_None ? 0 : parse_flops_value(v, index, F_COST, out);
    Py_DECREF(v);
    return rc;
}

/* tail_flops and tail_cost, by name (None: 0, not given), each no more
   than the whole it is a part of: flops, and the cost (its flops when
   not given). */
static int
parse_tail(PyObject *item, Py_ssize_t index, ms_layer *out)
{
    static const int tail_fields[2] = {F_TAIL_FLOPS, F_TAIL_COST};
    double whole[2] = {ms_layer_flops(out), ms_layer_cost(out)};
    double *dest[2] = {&out->tail_flops, &out->tail_cost};
    for (int k = 0; k < 2; k++) {
        int f = tail_fields[k];
        *dest[k] = 0.0;
        PyObject *v = named_field(item, f);
        if (v == NULL) {
            return -1;
        }
        int rc = v == Py_None ? 0 : parse_flops_value(v, index, f, dest[k]);
        if (rc == 0 && *dest[k] > whole[k]) {
            PyObject *w = PyFloat_FromDouble(whole[k]);
            if (w != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "layers[%zd].%s must be at most the unit's %s "
                             "(%R), got %R: the tail is a part of its "
                             "recompute",
                             index, fields[f].name,
                             k == 0 ? "flops" : "recompute_cost (or flops)", w,
                             v);
                Py_DECREF(w);
            }
            rc = -1;
        }
        Py_DECREF(v);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

static int
parse_flops(PyObject *item, Py_ssize_t index, double *out)
{
    return parse_flops_value(PyTuple_GET_ITEM(item, F_FLOPS), index, F_FLOPS,
                             out);
}

/* Level k of a selective profile: (threshold, saved_bytes, flops), its
   threshold below `above` (the previous level's; INFINITY for the
   first).  0, or -1 with an error naming the layer, the field and k. */
static int
parse_level(PyObject *v, Py_ssize_t index, Py_ssize_t k, double above,
            ms_sel_level *out)
{
    const char *name = fields[F_SEL_LEVELS].name;
    if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 3) {
        PyErr_Format(PyExc_TypeError,
                     "layers[%zd].%s[%zd] must be a tuple (threshold, "
                     "saved_bytes, flops), got %R",
                     index, name, k, v);
        return -1;
    }
    double t = PyFloat_AsDouble(PyTuple_GET_ITEM(v, 0));
    if (t == -1.0 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "layers[%zd].%s[%zd]: the threshold must be a "
                         "number, got %.200s",
                         index, name, k,
                         Py_TYPE(PyTuple_GET_ITEM(v, 0))->tp_name);
        }
        return -1;
    }
    if (!isfinite(t) || !(t > 0.0) || !(t < above)) {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd].%s[%zd]: the threshold must be a finite "
                     "number > 0 and below the previous level's (the "
                     "levels keep more ops in turn), got %R",
                     index, name, k, PyTuple_GET_ITEM(v, 0));
        return -1;
    }
    long long b;
    if (ll_value(PyTuple_GET_ITEM(v, 1), index, F_SEL_LEVELS, &b) < 0) {
        return -1;
    }
    if (b < 0 || b > MS_MAX_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd].%s[%zd]: saved_bytes must be >= 0 and <= "
                     "2**50, got %R",
                     index, name, k, PyTuple_GET_ITEM(v, 1));
        return -1;
    }
    double f;
    if (parse_flops_value(PyTuple_GET_ITEM(v, 2), index, F_SEL_LEVELS, &f) < 0)
    {
        return -1;
    }
    out->threshold = t;
    out->saved_bytes = b;
    out->flops = f;
    return 0;
}

/* The selective profile of a layer, when it has one: out->sel and
   out->flags gets MS_LAYER_SELECTIVE.  0, or -1 with an error naming the
   layer and the field. */
static int
parse_selective(PyObject *item, Py_ssize_t index, ms_layer *out)
{
    PyObject *levels = named_field(item, F_SEL_LEVELS);
    if (levels == NULL) {
        return -1;
    }
    int rc = -1;
    if (levels == Py_None) {
        rc = 0; /* no selective profile */
        goto done;
    }
    if (!PyTuple_Check(levels) || PyTuple_GET_SIZE(levels) < 1
        || PyTuple_GET_SIZE(levels) > MS_SEL_LEVELS)
    {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd].%s must be None or a tuple of 1 to %d "
                     "levels (threshold, saved_bytes, flops), got %R",
                     index, fields[F_SEL_LEVELS].name, (int)MS_SEL_LEVELS,
                     levels);
        goto done;
    }
    double above = INFINITY;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(levels); k++) {
        if (parse_level(PyTuple_GET_ITEM(levels, k), index, k, above,
                        &out->sel[k])
            < 0)
        {
            goto done;
        }
        above = out->sel[k].threshold;
    }
    out->sel_levels = (int)PyTuple_GET_SIZE(levels);
    out->flags |= MS_LAYER_SELECTIVE;
    rc = 0;
done:
    Py_DECREF(levels);
    return rc;
}

int
ms_layer_stats_parse(PyObject *item, Py_ssize_t index, PyObject **name,
                     PyObject **kind, ms_layer *out)
{
    if (!PyTuple_Check(item)) {
        PyErr_Format(PyExc_TypeError,
                     "layers[%zd] must be a LayerStats or a tuple (name, "
                     "kind, param_bytes, saved_bytes, input_bytes, flops, "
                     "flags), got %.200s",
                     index, Py_TYPE(item)->tp_name);
        return -1;
    }
    if (PyTuple_GET_SIZE(item) != N_FIELDS
        && PyTuple_GET_SIZE(item) != N_FIELDS + 1)
    {
        PyErr_Format(PyExc_TypeError,
                     "layers[%zd] has %zd fields; a layer has %d: (name, "
                     "kind, param_bytes, saved_bytes, input_bytes, flops, "
                     "flags), or %d with backward_bytes last",
                     index, PyTuple_GET_SIZE(item), (int)N_FIELDS,
                     (int)N_FIELDS + 1);
        return -1;
    }
    long long flags;
    if (parse_str(item, index, F_NAME, name) < 0
        || parse_str(item, index, F_KIND, kind) < 0
        || parse_bytes(item, index, F_PARAM_BYTES, &out->param_bytes) < 0
        || parse_bytes(item, index, F_SAVED_BYTES, &out->saved_bytes) < 0
        || parse_bytes(item, index, F_INPUT_BYTES, &out->input_bytes) < 0
        || parse_flops(item, index, &out->flops) < 0
        || parse_ll(item, index, F_FLAGS, &flags) < 0
        || parse_backward(item, index, &out->backward_bytes) < 0
        || parse_cost(item, index, &out->cost) < 0
        || parse_tail(item, index, out) < 0)
    {
        return -1;
    }
    if (flags < 0 || (flags & ~(long long)MS_KNOWN_FLAGS) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd].flags has unknown bits: %R (known: 1, 2, "
                     "LAYER_TILEABLE = %d, LAYER_UNREPEATABLE = %d)",
                     index, PyTuple_GET_ITEM(item, F_FLAGS),
                     (int)MS_LAYER_TILEABLE, (int)MS_LAYER_UNREPEATABLE);
        return -1;
    }
    out->flags = (unsigned)flags;
    out->sel_levels = 0;
    return parse_selective(item, index, out);
}
