/*
 * plan.c: the execution plan, an immutable object with a stable JSON form.
 *
 * A Plan is what the engine decided: one LayerPlan per planning unit (the
 * techniques and the rule that chose them) and the figures the decision was
 * made on.  Its JSON has a fixed key order and exact number formatting, so
 * the same model, hardware and Config give the same bytes and the same
 * SHA-256 hash.
 */
#include "plan.h"

#include "engine.h"
#include "layer_stats.h"
#include "memory.h"

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t index;
    PyObject *name;       /* str */
    PyObject *kind;       /* str: class name */
    PyObject *techniques; /* tuple of str */
    PyObject *rule;       /* str */
    PyObject *tier;       /* str: "device", "host" or "disk" */
    long long bytes_saved;
    long long param_bytes;
    long long saved_bytes;
    long long input_bytes;
    double flops;
    unsigned mask;
    int tiles;
    int segment;
    int nested;
    int selective_level;
    double selective_threshold;
} LayerPlan;

typedef struct {
    PyObject_HEAD
    PyObject *layers; /* tuple of LayerPlan */
    PyObject *mode;   /* str */
    PyObject *device; /* str */
    PyObject *json;   /* str */
    PyObject *hash;   /* str: sha256 hex of json */
    long long device_count;
    long long capacity_bytes;
    long long budget_bytes;
    long long fixed_bytes;
    long long activation_bytes;
    long long peak_offset_bytes;
    long long plan_offset_bytes;
    long long peak_unoptimized_bytes;
    long long peak_projected_bytes;
    double pressure;
    double recompute_ratio;
    double predicted_slowdown;
    long long min_budget_bytes;
    double total_flops;
    char skipped; /* Py_T_BOOL members are a char */
    char fits;
    unsigned allowed;
} Plan;

static const char *const tech_names[] = {"checkpoint", "offload", "tiling",
                                         "selective"};
#define N_TECH (sizeof(tech_names) / sizeof(tech_names[0]))

/* ---- LayerPlan ---------------------------------------------------- */

static int
layer_traverse(LayerPlan *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->name);
    Py_VISIT(self->kind);
    Py_VISIT(self->techniques);
    Py_VISIT(self->rule);
    Py_VISIT(self->tier);
    return 0;
}

static int
layer_clear(LayerPlan *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->kind);
    Py_CLEAR(self->techniques);
    Py_CLEAR(self->rule);
    Py_CLEAR(self->tier);
    return 0;
}

static void
layer_dealloc(LayerPlan *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)layer_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
layer_repr(LayerPlan *self)
{
    return PyUnicode_FromFormat(
        "LayerPlan(%zd, %R, kind=%R, techniques=%R, "
        "rule=%R, tier=%R, tiles=%d, bytes_saved=%lld)",
        self->index, self->name, self->kind, self->techniques, self->rule,
        self->tier, self->tiles, self->bytes_saved);
}

static PyMemberDef layer_members[] = {
    {"index", Py_T_PYSSIZET, offsetof(LayerPlan, index), Py_READONLY,
     "Position of the layer among the planning units."},
    {"name", Py_T_OBJECT_EX, offsetof(LayerPlan, name), Py_READONLY,
     "Qualified module name, as in model.named_modules()."},
    {"kind", Py_T_OBJECT_EX, offsetof(LayerPlan, kind), Py_READONLY,
     "Class name of the module."},
    {"techniques", Py_T_OBJECT_EX, offsetof(LayerPlan, techniques),
     Py_READONLY, "Techniques applied to the layer (a tuple of str)."},
    {"rule", Py_T_OBJECT_EX, offsetof(LayerPlan, rule), Py_READONLY,
     "The engine rule that decided this entry."},
    {"tier", Py_T_OBJECT_EX, offsetof(LayerPlan, tier), Py_READONLY,
     "Where the layer's inputs wait for backward: 'device' (not\n"
     "offloaded), 'host' (host RAM of a GPU) or 'disk' (spill files)."},
    {"bytes_saved", Py_T_LONGLONG, offsetof(LayerPlan, bytes_saved),
     Py_READONLY, "Activation bytes the techniques free until backward."},
    {"param_bytes", Py_T_LONGLONG, offsetof(LayerPlan, param_bytes),
     Py_READONLY, "Parameter bytes of the layer."},
    {"saved_bytes", Py_T_LONGLONG, offsetof(LayerPlan, saved_bytes),
     Py_READONLY, "Activation bytes the layer saves for backward."},
    {"input_bytes", Py_T_LONGLONG, offsetof(LayerPlan, input_bytes),
     Py_READONLY, "Input bytes checkpointing keeps."},
    {"flops", Py_T_DOUBLE, offsetof(LayerPlan, flops), Py_READONLY,
     "Forward FLOPs of the layer."},
    {"tiles", Py_T_INT, offsetof(LayerPlan, tiles), Py_READONLY,
     "Tiles the layer's input is split into (1: not tiled)."},
    {"segment", Py_T_INT, offsetof(LayerPlan, segment), Py_READONLY,
     "Checkpointed: the index of the first layer of its checkpoint\n"
     "segment (its own index when recomputed alone); -1 otherwise.  A\n"
     "segment's layers are recomputed together from its first input."},
    {"nested", Py_T_INT, offsetof(LayerPlan, nested), Py_READONLY,
     "1 when its checkpoint segment is nested: the segment's recompute\n"
     "keeps only its layers' inputs, then recomputes each layer alone\n"
     "as backward reaches it (docs/planning.md); 0 otherwise."},
    {"selective_level", Py_T_INT, offsetof(LayerPlan, selective_level),
     Py_READONLY,
     "Run selective: which of its LayerStats.selective_levels (0: the\n"
     "first, fewest bytes kept); -1 otherwise."},
    {"selective_threshold", Py_T_DOUBLE,
     offsetof(LayerPlan, selective_threshold), Py_READONLY,
     "Run selective: the level's threshold, in FLOPs per byte written (an\n"
     "op whose output costs at least this much is kept, the rest are\n"
     "recomputed in backward); 0.0 otherwise."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot layer_slots[] = {
    {Py_tp_doc, "One layer's entry in a Plan (read-only)."},
    {Py_tp_dealloc, layer_dealloc},
    {Py_tp_traverse, layer_traverse},
    {Py_tp_clear, layer_clear},
    {Py_tp_repr, layer_repr},
    {Py_tp_members, layer_members},
    {0, NULL},
};

static PyType_Spec layer_spec = {
    .name = "memscale._core.LayerPlan",
    .basicsize = sizeof(LayerPlan),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = layer_slots,
};

/* ---- JSON writer -------------------------------------------------- */

typedef struct {
    char *buf;
    size_t len, cap;
} sbuf;

static int
sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n + 1) {
            cap *= 2;
        }
        char *nb = realloc(b->buf, cap);
        if (nb == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = '\0';
    return 0;
}

static int
sb_cstr(sbuf *b, const char *s)
{
    return sb_put(b, s, strlen(s));
}

static int
sb_ll(sbuf *b, long long v)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof(tmp), "%lld", v);
    return sb_put(b, tmp, (size_t)n);
}

static int
sb_double(sbuf *b, double v)
{
    /* repr(): the shortest string that round-trips; stable for a value. */
    char *s = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (s == NULL) {
        return -1;
    }
    int rc = sb_cstr(b, s);
    PyMem_Free(s);
    return rc;
}

static int
sb_jstr(sbuf *b, PyObject *str)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(str, &n);
    if (s == NULL || sb_put(b, "\"", 1) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            if (sb_put(b, esc, 2) < 0) {
                return -1;
            }
        }
        else if (c < 0x20) {
            int k = snprintf(esc, sizeof(esc), "\\u%04x", c);
            if (sb_put(b, esc, (size_t)k) < 0) {
                return -1;
            }
        }
        else if (sb_put(b, (const char *)&s[i], 1) < 0) {
            return -1;
        }
    }
    return sb_put(b, "\"", 1);
}

static int
sb_key(sbuf *b, const char *key, int first)
{
    if (!first && sb_put(b, ",", 1) < 0) {
        return -1;
    }
    if (sb_put(b, "\"", 1) < 0 || sb_cstr(b, key) < 0) {
        return -1;
    }
    return sb_put(b, "\":", 2);
}

static int
sb_mask(sbuf *b, unsigned mask)
{
    int first = 1;
    if (sb_put(b, "[", 1) < 0) {
        return -1;
    }
    for (size_t t = 0; t < N_TECH; t++) {
        if (mask & (1u << t)) {
            if ((!first && sb_put(b, ",", 1) < 0) || sb_put(b, "\"", 1) < 0
                || sb_cstr(b, tech_names[t]) < 0 || sb_put(b, "\"", 1) < 0)
            {
                return -1;
            }
            first = 0;
        }
    }
    return sb_put(b, "]", 1);
}

static PyObject *
plan_to_json_str(Plan *p)
{
    sbuf b = {NULL, 0, 0};
    PyObject *res = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(p->layers);

    if (sb_cstr(&b, "{") < 0 || sb_key(&b, "format", 1) < 0
        || sb_cstr(&b, "\"memscale-plan/1\"") < 0 || sb_key(&b, "mode", 0) < 0
        || sb_jstr(&b, p->mode) < 0 || sb_key(&b, "allowed", 0) < 0
        || sb_mask(&b, p->allowed) < 0 || sb_key(&b, "device", 0) < 0
        || sb_jstr(&b, p->device) < 0 || sb_key(&b, "device_count", 0) < 0
        || sb_ll(&b, p->device_count) < 0
        || sb_key(&b, "capacity_bytes", 0) < 0
        || sb_ll(&b, p->capacity_bytes) < 0
        || sb_key(&b, "budget_bytes", 0) < 0 || sb_ll(&b, p->budget_bytes) < 0
        || sb_key(&b, "fixed_bytes", 0) < 0 || sb_ll(&b, p->fixed_bytes) < 0
        || sb_key(&b, "activation_bytes", 0) < 0
        || sb_ll(&b, p->activation_bytes) < 0
        || sb_key(&b, "peak_offset_bytes", 0) < 0
        || sb_ll(&b, p->peak_offset_bytes) < 0
        || sb_key(&b, "plan_offset_bytes", 0) < 0
        || sb_ll(&b, p->plan_offset_bytes) < 0
        || sb_key(&b, "peak_unoptimized_bytes", 0) < 0
        || sb_ll(&b, p->peak_unoptimized_bytes) < 0
        || sb_key(&b, "peak_projected_bytes", 0) < 0
        || sb_ll(&b, p->peak_projected_bytes) < 0
        || sb_key(&b, "pressure", 0) < 0 || sb_double(&b, p->pressure) < 0
        || sb_key(&b, "total_flops", 0) < 0
        || sb_double(&b, p->total_flops) < 0
        || sb_key(&b, "recompute_ratio", 0) < 0
        || sb_double(&b, p->recompute_ratio) < 0
        || sb_key(&b, "predicted_slowdown", 0) < 0
        || sb_double(&b, p->predicted_slowdown) < 0
        || sb_key(&b, "skipped", 0) < 0
        || sb_cstr(&b, p->skipped ? "true" : "false") < 0
        || sb_key(&b, "fits", 0) < 0
        || sb_cstr(&b, p->fits ? "true" : "false") < 0
        || sb_key(&b, "min_budget_bytes", 0) < 0
        || sb_ll(&b, p->min_budget_bytes) < 0 || sb_key(&b, "layers", 0) < 0
        || sb_cstr(&b, "[") < 0)
    {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        LayerPlan *l = (LayerPlan *)PyTuple_GET_ITEM(p->layers, i);
        if ((i > 0 && sb_cstr(&b, ",") < 0) || sb_cstr(&b, "{") < 0
            || sb_key(&b, "index", 1) < 0 || sb_ll(&b, (long long)l->index) < 0
            || sb_key(&b, "name", 0) < 0 || sb_jstr(&b, l->name) < 0
            || sb_key(&b, "kind", 0) < 0 || sb_jstr(&b, l->kind) < 0
            || sb_key(&b, "techniques", 0) < 0 || sb_mask(&b, l->mask) < 0
            || sb_key(&b, "rule", 0) < 0 || sb_jstr(&b, l->rule) < 0
            || sb_key(&b, "tier", 0) < 0 || sb_jstr(&b, l->tier) < 0
            || sb_key(&b, "tiles", 0) < 0 || sb_ll(&b, (long long)l->tiles) < 0
            || sb_key(&b, "segment", 0) < 0
            || sb_ll(&b, (long long)l->segment) < 0
            /* Only where set: plans without nesting keep their bytes. */
            || (l->nested && (sb_key(&b, "nested", 0) < 0 || sb_ll(&b, 1) < 0))
            || sb_key(&b, "selective_level", 0) < 0
            || sb_ll(&b, (long long)l->selective_level) < 0
            || sb_key(&b, "selective_threshold", 0) < 0
            || sb_double(&b, l->selective_threshold) < 0
            || sb_key(&b, "bytes_saved", 0) < 0
            || sb_ll(&b, l->bytes_saved) < 0
            || sb_key(&b, "param_bytes", 0) < 0
            || sb_ll(&b, l->param_bytes) < 0
            || sb_key(&b, "saved_bytes", 0) < 0
            || sb_ll(&b, l->saved_bytes) < 0
            || sb_key(&b, "input_bytes", 0) < 0
            || sb_ll(&b, l->input_bytes) < 0 || sb_key(&b, "flops", 0) < 0
            || sb_double(&b, l->flops) < 0 || sb_cstr(&b, "}") < 0)
        {
            goto done;
        }
    }
    if (sb_cstr(&b, "]}") < 0) {
        goto done;
    }
    res = PyUnicode_DecodeUTF8(b.buf, (Py_ssize_t)b.len, "strict");
done:
    free(b.buf);
    return res;
}

static PyObject *
sha256_hex(PyObject *text)
{
    PyObject *hashlib = NULL, *data = NULL, *h = NULL, *res = NULL;
    hashlib = PyImport_ImportModule("hashlib");
    if (hashlib == NULL) {
        goto done;
    }
    data = PyUnicode_AsUTF8String(text);
    if (data == NULL) {
        goto done;
    }
    h = PyObject_CallMethod(hashlib, "sha256", "O", data);
    if (h == NULL) {
        goto done;
    }
    res = PyObject_CallMethod(h, "hexdigest", NULL);
done:
    Py_XDECREF(h);
    Py_XDECREF(data);
    Py_XDECREF(hashlib);
    return res;
}

/* ---- Plan --------------------------------------------------------- */

static int
plan_traverse(Plan *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->layers);
    Py_VISIT(self->mode);
    Py_VISIT(self->device);
    Py_VISIT(self->json);
    Py_VISIT(self->hash);
    return 0;
}

static int
plan_clear(Plan *self)
{
    Py_CLEAR(self->layers);
    Py_CLEAR(self->mode);
    Py_CLEAR(self->device);
    Py_CLEAR(self->json);
    Py_CLEAR(self->hash);
    return 0;
}

static void
plan_dealloc(Plan *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)plan_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
plan_repr(Plan *self)
{
    return PyUnicode_FromFormat("<memscale Plan %U: %zd layers, mode=%U, "
                                "skipped=%s, hash=%.12U>",
                                self->device, PyTuple_GET_SIZE(self->layers),
                                self->mode, self->skipped ? "True" : "False",
                                self->hash);
}

/* clang-format off */
PyDoc_STRVAR(plan_to_json_doc,
"to_json($self, /)\n--\n\n"
"The plan as canonical JSON (fixed key order, exact numbers).");
/* clang-format on */

static PyObject *
plan_to_json(Plan *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self->json);
}

static Py_ssize_t
plan_len(Plan *self)
{
    return PyTuple_GET_SIZE(self->layers);
}

static PyObject *
plan_get_techniques(Plan *self, void *Py_UNUSED(closure))
{
    /* {technique: number of layers}, in technique order. */
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return NULL;
    }
    for (size_t t = 0; t < N_TECH; t++) {
        long count = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->layers); i++) {
            LayerPlan *l = (LayerPlan *)PyTuple_GET_ITEM(self->layers, i);
            count += (l->mask >> t) & 1u;
        }
        PyObject *v = PyLong_FromLong(count);
        if (v == NULL || PyDict_SetItemString(d, tech_names[t], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyMethodDef plan_methods[] = {
    {"to_json", (PyCFunction)plan_to_json, METH_NOARGS, plan_to_json_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef plan_getset[] = {
    {"technique_counts", (getter)plan_get_techniques, NULL,
     "Number of layers per technique (a new dict).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define PLAN_LL(field, doc)                                                   \
    {#field, Py_T_LONGLONG, offsetof(Plan, field), Py_READONLY, doc}

static PyMemberDef plan_members[] = {
    {"layers", Py_T_OBJECT_EX, offsetof(Plan, layers), Py_READONLY,
     "The per-layer entries (a tuple of LayerPlan)."},
    {"mode", Py_T_OBJECT_EX, offsetof(Plan, mode), Py_READONLY,
     "The optimization mode the plan was made for."},
    {"device", Py_T_OBJECT_EX, offsetof(Plan, device), Py_READONLY,
     "Device type the plan was made for."},
    {"hash", Py_T_OBJECT_EX, offsetof(Plan, hash), Py_READONLY,
     "SHA-256 (hex) of to_json()."},
    PLAN_LL(device_count, "Number of devices of that type."),
    PLAN_LL(capacity_bytes, "Memory of one device."),
    PLAN_LL(budget_bytes, "Usable memory the plan must fit."),
    PLAN_LL(fixed_bytes, "Parameters, gradients and optimizer state."),
    PLAN_LL(activation_bytes, "Activations saved by an unoptimized step."),
    PLAN_LL(peak_offset_bytes,
            "Correction the OOM predictor gave the engine's peaks\n"
            "(predicted unoptimized peak minus the engine's model; 0 without\n"
            "a prediction)."),
    PLAN_LL(plan_offset_bytes,
            "The same correction for the peaks of plans (from a\n"
            "simulated optimized step; peak_offset_bytes when not given)."),
    PLAN_LL(peak_unoptimized_bytes, "Estimated peak without memscale."),
    PLAN_LL(peak_projected_bytes, "Estimated peak with this plan."),
    {"pressure", Py_T_DOUBLE, offsetof(Plan, pressure), Py_READONLY,
     "peak_unoptimized_bytes / budget_bytes."},
    {"total_flops", Py_T_DOUBLE, offsetof(Plan, total_flops), Py_READONLY,
     "Forward FLOPs of the whole model."},
    {"recompute_ratio", Py_T_DOUBLE, offsetof(Plan, recompute_ratio),
     Py_READONLY, "Recomputed forward FLOPs / forward FLOPs."},
    {"skipped", Py_T_BOOL, offsetof(Plan, skipped), Py_READONLY,
     "True when smart-skip left the model alone."},
    {"fits", Py_T_BOOL, offsetof(Plan, fits), Py_READONLY,
     "True when the projected peak fits the budget."},
    {"predicted_slowdown", Py_T_DOUBLE, offsetof(Plan, predicted_slowdown),
     Py_READONLY,
     "Predicted step time with the plan over without it (a step costs\n"
     "three forwards; recompute, offload transfers and tile calls add)."},
    {"min_budget_bytes", Py_T_LONGLONG, offsetof(Plan, min_budget_bytes),
     Py_READONLY,
     "When the budget planner found no plan that fits: the smallest\n"
     "budget it can reach with the allowed techniques; else -1."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot plan_slots[] = {
    {Py_tp_doc, "An immutable execution plan made by the decision engine."},
    {Py_tp_dealloc, plan_dealloc},
    {Py_tp_traverse, plan_traverse},
    {Py_tp_clear, plan_clear},
    {Py_tp_repr, plan_repr},
    {Py_tp_methods, plan_methods},
    {Py_tp_members, plan_members},
    {Py_tp_getset, plan_getset},
    {Py_sq_length, plan_len},
    {0, NULL},
};

static PyType_Spec plan_spec = {
    .name = "memscale._core.Plan",
    .basicsize = sizeof(Plan),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = plan_slots,
};

int
ms_plan_layer(PyObject *plan, Py_ssize_t i, unsigned *mask, int *tiles,
              int *segment, int *nested)
{
    Plan *p = (Plan *)plan;
    if (i < 0 || i >= PyTuple_GET_SIZE(p->layers)) {
        PyErr_SetString(PyExc_IndexError, "plan layer index out of range");
        return -1;
    }
    LayerPlan *l = (LayerPlan *)PyTuple_GET_ITEM(p->layers, i);
    *mask = l->mask;
    *tiles = l->tiles;
    *segment = l->segment;
    *nested = l->nested;
    return 0;
}

/* ---- build_plan --------------------------------------------------- */

static int
parse_mode(PyObject *mode, ms_mode *out)
{
    static const char *const names[] = {"conservative", "balanced",
                                        "aggressive"};
    if (!PyUnicode_Check(mode)) {
        PyErr_Format(PyExc_TypeError, "mode must be a str, got %.200s",
                     Py_TYPE(mode)->tp_name);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        if (PyUnicode_CompareWithASCIIString(mode, names[i]) == 0) {
            *out = (ms_mode)i;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "mode must be 'conservative', 'balanced' or 'aggressive', "
                 "got %R",
                 mode);
    return -1;
}

static LayerPlan *
make_layer(ms_state *st, Py_ssize_t index, PyObject *name, PyObject *kind,
           const ms_layer *in, const ms_choice *c)
{
    LayerPlan *l = PyObject_GC_New(LayerPlan, st->layer_plan_type);
    if (l == NULL) {
        return NULL;
    }
    l->index = index;
    l->name = Py_NewRef(name);
    l->kind = Py_NewRef(kind);
    l->techniques = NULL;
    l->rule = NULL;
    l->tier = NULL;
    l->bytes_saved = c->bytes_saved;
    l->param_bytes = in->param_bytes;
    l->saved_bytes = in->saved_bytes;
    l->input_bytes = in->input_bytes;
    l->flops = in->flops;
    l->mask = c->techniques;
    l->tiles = c->tiles;
    l->segment = c->segment;
    l->nested = c->nested != 0;
    const ms_sel_level *sel = (c->techniques & MS_TECH_SELECTIVE)
                                  ? ms_sel_at(in, c->sel_level)
                                  : NULL;
    l->selective_level = sel != NULL ? c->sel_level : -1;
    l->selective_threshold = sel != NULL ? sel->threshold : 0.0;
    PyObject_GC_Track(l);

    Py_ssize_t nt = 0;
    for (size_t t = 0; t < N_TECH; t++) {
        nt += (c->techniques >> t) & 1u;
    }
    l->techniques = PyTuple_New(nt);
    if (l->techniques == NULL) {
        goto error;
    }
    nt = 0;
    for (size_t t = 0; t < N_TECH; t++) {
        if (c->techniques & (1u << t)) {
            PyObject *s = PyUnicode_FromString(tech_names[t]);
            if (s == NULL) {
                goto error;
            }
            PyTuple_SET_ITEM(l->techniques, nt++, s);
        }
    }
    l->rule = PyUnicode_FromString(ms_rule_name(c->rule));
    l->tier = PyUnicode_FromString(ms_tier_name(c->tier));
    if (l->rule == NULL || l->tier == NULL) {
        goto error;
    }
    return l;
error:
    Py_DECREF(l);
    return NULL;
}

#define MS_KNOWN_TECH                                                         \
    (MS_TECH_CHECKPOINT | MS_TECH_OFFLOAD | MS_TECH_TILING | MS_TECH_SELECTIVE)

static int
check_bytes(const char *what, long long v)
{
    if (v < 0 || v > MS_MAX_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be >= 0 and <= 2**50 bytes, got %lld", what, v);
        return -1;
    }
    return 0;
}

static int
check_flops(const char *what, double v)
{
    if (!isfinite(v) || v < 0.0) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a finite number >= 0 (not inf or nan)", what);
        return -1;
    }
    return 0;
}

/* Remove an optional keyword from kw and parse it; absent: *out kept. */
static int
pop_ll(PyObject *kw, const char *name, long long *out)
{
    PyObject *v = PyDict_GetItemString(kw, name); /* borrowed */
    if (v == NULL) {
        return 0;
    }
    if (v == Py_None) { /* None: the default */
        return PyDict_DelItemString(kw, name);
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = x;
    return PyDict_DelItemString(kw, name);
}

static int
pop_double(PyObject *kw, const char *name, double *out)
{
    PyObject *v = PyDict_GetItemString(kw, name); /* borrowed */
    if (v == NULL) {
        return 0;
    }
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (!(x >= 0.0) || !isfinite(x)) {
        PyErr_Format(PyExc_ValueError,
                     "build_plan: %s must be a finite float >= 0, got %R",
                     name, v);
        return -1;
    }
    *out = x;
    return PyDict_DelItemString(kw, name);
}

static int
pop_bool(PyObject *kw, const char *name, int *out)
{
    PyObject *v = PyDict_GetItemString(kw, name); /* borrowed */
    if (v == NULL) {
        return 0;
    }
    if (!PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError,
                     "build_plan: %s must be a bool, got "
                     "%.200s",
                     name, Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = v == Py_True;
    return PyDict_DelItemString(kw, name);
}

PyObject *
ms_plan_build(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"layers",           "mode",
                             "allowed",          "force",
                             "budget_bytes",     "fixed_bytes",
                             "activation_bytes", "total_flops",
                             "device",           "device_count",
                             "capacity_bytes",   NULL};
    ms_state *st = ms_get_state(module);
    PyObject *layers_arg, *mode_obj, *device;
    long allowed;
    int force;
    long long budget, fixed, act, dcount, capacity;
    long long min_offload = 0, host_cap = -1, peak_offset = 0;
    long long plan_offset = LLONG_MIN;
    int host_tier = 0, disk_tier = 1;
    int solver = 0, async_offload = 0;
    double flop_rate = 0.0, offload_bw = 0.0, tile_overhead = 0.0;
    long long max_segment = 64, resolution = 512;
    double total_flops;
    PyObject *seq = NULL, *tuple = NULL;
    ms_layer *in = NULL;
    ms_choice *out = NULL;
    Plan *plan = NULL;

    /* The offload inputs are optional keywords; the rest are required
       (a format string cannot mix the two after "$"). */
    PyObject *rest = kwargs != NULL ? PyDict_Copy(kwargs) : PyDict_New();
    if (rest == NULL) {
        return NULL;
    }
    if (pop_ll(rest, "min_offload_bytes", &min_offload) < 0
        || pop_ll(rest, "host_cap_bytes", &host_cap) < 0
        || pop_ll(rest, "peak_offset_bytes", &peak_offset) < 0
        || pop_ll(rest, "plan_offset_bytes", &plan_offset) < 0
        || pop_bool(rest, "host_tier", &host_tier) < 0
        || pop_bool(rest, "disk_tier", &disk_tier) < 0
        || pop_bool(rest, "solver", &solver) < 0
        || pop_bool(rest, "async_offload", &async_offload) < 0
        || pop_double(rest, "flop_rate", &flop_rate) < 0
        || pop_double(rest, "offload_bandwidth", &offload_bw) < 0
        || pop_double(rest, "tile_overhead", &tile_overhead) < 0
        || pop_ll(rest, "max_segment", &max_segment) < 0
        || pop_ll(rest, "resolution", &resolution) < 0)
    {
        Py_DECREF(rest);
        return NULL;
    }
    int parsed = PyArg_ParseTupleAndKeywords(args, rest,
                                             "O$OlpLLLdULL:build_plan", kwlist,
                                             &layers_arg, &mode_obj, &allowed,
                                             &force, &budget, &fixed, &act,
                                             &total_flops, &device, &dcount,
                                             &capacity);
    Py_DECREF(rest);
    if (!parsed) {
        return NULL;
    }
    if (check_bytes("min_offload_bytes", min_offload) < 0) {
        return NULL;
    }
    if (plan_offset == LLONG_MIN) {
        plan_offset = peak_offset;
    }
    if (plan_offset < -MS_MAX_BYTES || plan_offset > MS_MAX_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "plan_offset_bytes must be between -2**50 and 2**50, "
                     "got %lld",
                     plan_offset);
        return NULL;
    }
    if (peak_offset < -MS_MAX_BYTES || peak_offset > MS_MAX_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "peak_offset_bytes must be between -2**50 and 2**50, "
                     "got %lld",
                     peak_offset);
        return NULL;
    }
    if (solver && !(flop_rate > 0.0)) {
        PyErr_SetString(PyExc_ValueError,
                        "build_plan: solver=True needs flop_rate > 0");
        return NULL;
    }
    if (max_segment < 1 || max_segment > 255 || resolution < 1
        || resolution > 65535)
    {
        PyErr_Format(PyExc_ValueError,
                     "build_plan: max_segment must be in [1, 255] and "
                     "resolution in [1, 65535], got %lld and %lld",
                     max_segment, resolution);
        return NULL;
    }
    if (host_cap < -1 || host_cap > MS_MAX_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "host_cap_bytes must be -1 (no cap) or between 0 and "
                     "2**50, got %lld",
                     host_cap);
        return NULL;
    }
    ms_problem prob = {0};
    if (parse_mode(mode_obj, &prob.mode) < 0) {
        return NULL;
    }
    if (budget <= 0) {
        PyErr_Format(PyExc_ValueError, "budget_bytes must be > 0, got %lld",
                     budget);
        return NULL;
    }
    if (check_bytes("budget_bytes", budget) < 0
        || check_bytes("fixed_bytes", fixed) < 0
        || check_bytes("activation_bytes", act) < 0
        || check_bytes("capacity_bytes", capacity) < 0
        || check_flops("total_flops", total_flops) < 0)
    {
        return NULL;
    }
    if (dcount < 1) {
        PyErr_Format(PyExc_ValueError, "device_count must be >= 1, got %lld",
                     dcount);
        return NULL;
    }
    if (allowed < 0 || (allowed & ~(long)MS_KNOWN_TECH) != 0) {
        PyErr_Format(PyExc_ValueError, "unknown technique bits in allowed=%ld",
                     allowed);
        return NULL;
    }
    prob.allowed = (unsigned)allowed;
    prob.force = force;
    prob.budget_bytes = budget;
    prob.fixed_bytes = fixed;
    prob.activation_bytes = act;
    prob.total_flops = total_flops;
    prob.min_offload_bytes = min_offload;
    prob.host_tier = host_tier;
    prob.host_cap_bytes = host_cap;
    prob.disk_tier = disk_tier;
    prob.peak_offset_bytes = peak_offset;
    prob.plan_offset_bytes = plan_offset;
    prob.solver = solver;
    prob.flop_rate = flop_rate;
    prob.offload_bw = offload_bw;
    prob.async_offload = async_offload;
    prob.tile_overhead = tile_overhead;
    prob.max_segment = (int)max_segment;
    prob.resolution = (int)resolution;

    seq = PySequence_Fast(layers_arg, "layers must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    /* A tuple of our own: parsing calls __index__ / __float__, Python code
       that could shrink the caller's list under the loops below. */
    Py_SETREF(seq, PySequence_Tuple(seq));
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    in = PyMem_Calloc(n ? (size_t)n : 1, sizeof(ms_layer));
    out = PyMem_Calloc(n ? (size_t)n : 1, sizeof(ms_choice));
    if (in == NULL || out == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name, *kind;
        if (ms_layer_stats_parse(PyTuple_GET_ITEM(seq, i), i, &name, &kind,
                                 &in[i])
            < 0)
        {
            goto error;
        }
    }
    /* Every size is <= 2**50; bound the sum the engine will make too. */
    double total = (double)fixed + (double)act;
    for (Py_ssize_t i = 0; i < n; i++) {
        total += (double)in[i].saved_bytes + (double)in[i].input_bytes;
    }
    if (total > (double)(1LL << 60)) {
        PyErr_SetString(PyExc_ValueError,
                        "the sizes add up to more than 2**60 bytes");
        goto error;
    }
    ms_result res;
    if (ms_engine_plan(&prob, in, (size_t)n, out, &res) < 0) {
        PyErr_NoMemory();
        goto error;
    }

    tuple = PyTuple_New(n);
    if (tuple == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name, *kind;
        ms_layer dummy;
        /* Parsed once already: cannot fail now, but check anyway. */
        if (ms_layer_stats_parse(PyTuple_GET_ITEM(seq, i), i, &name, &kind,
                                 &dummy)
            < 0)
        {
            goto error;
        }
        LayerPlan *l = make_layer(st, i, name, kind, &in[i], &out[i]);
        if (l == NULL) {
            goto error;
        }
        PyTuple_SET_ITEM(tuple, i, (PyObject *)l);
    }

    plan = PyObject_GC_New(Plan, st->plan_type);
    if (plan == NULL) {
        goto error;
    }
    plan->layers = Py_NewRef(tuple);
    plan->mode = Py_NewRef(mode_obj);
    plan->device = Py_NewRef(device);
    plan->json = NULL;
    plan->hash = NULL;
    plan->device_count = dcount;
    plan->capacity_bytes = capacity;
    plan->budget_bytes = budget;
    plan->fixed_bytes = fixed;
    plan->activation_bytes = act;
    plan->peak_offset_bytes = peak_offset;
    plan->plan_offset_bytes = plan_offset;
    plan->peak_unoptimized_bytes = res.peak_unoptimized;
    plan->peak_projected_bytes = res.peak_projected;
    plan->pressure = res.pressure;
    plan->recompute_ratio = res.recompute_ratio;
    plan->predicted_slowdown = res.predicted_slowdown;
    plan->min_budget_bytes = res.min_budget;
    plan->skipped = (char)(res.skipped != 0);
    plan->fits = (char)(res.fits != 0);
    plan->allowed = (unsigned)allowed;
    plan->total_flops = total_flops;
    PyObject_GC_Track(plan);
    plan->json = plan_to_json_str(plan);
    if (plan->json == NULL) {
        goto error;
    }
    plan->hash = sha256_hex(plan->json);
    if (plan->hash == NULL) {
        goto error;
    }
    Py_DECREF(tuple);
    Py_DECREF(seq);
    PyMem_Free(in);
    PyMem_Free(out);
    return (PyObject *)plan;

error:
    Py_XDECREF(plan);
    Py_XDECREF(tuple);
    Py_XDECREF(seq);
    PyMem_Free(in);
    PyMem_Free(out);
    return NULL;
}

int
ms_plan_init_types(PyObject *module, ms_state *st)
{
    st->layer_plan_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &layer_spec, NULL);
    if (st->layer_plan_type == NULL) {
        return -1;
    }
    st->plan_type = (PyTypeObject *)PyType_FromModuleAndSpec(module,
                                                             &plan_spec, NULL);
    if (st->plan_type == NULL) {
        return -1;
    }
    if (PyModule_AddType(module, st->layer_plan_type) < 0
        || PyModule_AddType(module, st->plan_type) < 0)
    {
        return -1;
    }
    return 0;
}
