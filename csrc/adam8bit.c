/*
 * adam8bit.c: the update kernel of memscale's 8-bit AdamW.
 *
 * The two moment estimates are stored in 8 bits per element, block-wise:
 * each block of `block` elements keeps one fp32 scale (its largest
 * magnitude) and one byte per element.
 *
 *   exp_avg      int8,  linear:   m = q * scale_m / 127
 *   exp_avg_sq   uint8, sqrt:     v = (q * scale_v / 255)^2
 *
 * The second moment is stored as its square root, which halves its
 * dynamic range in bits.  Both are rounded stochastically (see the encode
 * loop), and a non-zero v keeps at least one level: it never decodes to 0,
 * so an element never takes a step of lr * m / eps.  Each step decodes a
 * block into fp32, applies AdamW (decoupled weight decay, bias correction)
 * with the fp32 moments, and encodes the new moments back.  The tensors are
 * reached through data_ptr() after their dtype, device, size and layout
 * are checked; the loop runs with the GIL released, its blocks split over
 * `threads` POSIX threads (they share nothing but read-only arguments).
 */
#include "adam8bit.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#define MAX_BLOCK 4096

typedef struct {
    float *param;
    const float *grad;
    int8_t *qm;
    float *sm;
    uint8_t *qv;
    float *sv;
    int64_t n;
    int64_t block;
    float lr, beta1, beta2, eps, wd, bc1, bc2_sqrt;
    int64_t first_block, end_block; /* the blocks this worker updates */
    uint64_t seed;                  /* stochastic rounding: from step */
} step_args;

/* SplitMix64's finalizer: a well-mixed 64-bit hash. */
static uint64_t
mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* floor() for |x| < 2**31, without a libm call. */
static inline float
floor_small(float x)
{
    int i = (int)x;
    return (float)(i - (x < (float)i));
}

static void
run_step(const step_args *a)
{
    float m[MAX_BLOCK], r[MAX_BLOCK];
    const float decay = 1.0f - a->lr * a->wd;
    const float step_size = a->lr / a->bc1;
    const float inv_bc2 = 1.0f / a->bc2_sqrt;
    const float b1 = a->beta1, c1 = 1.0f - a->beta1;
    const float b2 = a->beta2, c2 = 1.0f - a->beta2;
    for (int64_t b = a->first_block; b < a->end_block; b++) {
        int64_t lo = b * a->block;
        int64_t len = a->n - lo < a->block ? a->n - lo : a->block;
        const float dm = a->sm[b] * (1.0f / 127.0f);
        const float dv = a->sv[b] * (1.0f / 255.0f);
        const float *g = a->grad + lo;
        const int8_t *qm = a->qm + lo;
        const uint8_t *qv = a->qv + lo;
        float *param = a->param + lo;
        float amax_m = 0.0f, amax_r = 0.0f;
        /* Decode, update the moments and the parameter (vectorizable). */
        for (int64_t k = 0; k < len; k++) {
            float mk = b1 * ((float)qm[k] * dm) + c1 * g[k];
            float rk0 = (float)qv[k] * dv;
            float rk = sqrtf(b2 * rk0 * rk0 + c2 * g[k] * g[k]);
            param[k] = param[k] * decay
                       - step_size * mk / (rk * inv_bc2 + a->eps);
            m[k] = mk;
            r[k] = rk;
            /* A non-finite moment (an inf or NaN gradient) stays out of the
               block's scales: an infinite scale would decode every other
               element of the block as 0 * inf = NaN at the next step.
               Only that element's parameter shows it, as in AdamW. */
            amax_m = fmaxf(amax_m, isfinite(mk) ? fabsf(mk) : 0.0f);
            amax_r = fmaxf(amax_r, isfinite(rk) ? rk : 0.0f);
        }
        a->sm[b] = amax_m;
        a->sv[b] = amax_r;
        /* Encode, with stochastic rounding: rounding to the nearest level
           (or up) has fixed points, e.g. round(0.9 * q) == q for |q| <= 5,
           so a small moment would never decay and its parameter would keep
           moving.  The random offsets come from a hash of (step, element),
           so the result does not depend on how blocks are split over
           threads.  A non-zero sqrt(v) keeps at least one level. */
        int8_t *qm_out = a->qm + lo;
        uint8_t *qv_out = a->qv + lo;
        for (int64_t k = 0; k < len; k++) {
            uint64_t h = mix64(a->seed ^ (uint64_t)(lo + k));
            float u1 = (float)(h >> 40) * (1.0f / 16777216.0f);
            float u2 = (float)((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
            float xm = amax_m > 0.0f ? m[k] / amax_m * 127.0f : 0.0f;
            float xv = amax_r > 0.0f ? r[k] / amax_r * 255.0f : 0.0f;
            /* Non-finite moments (a NaN or inf gradient) encode as 0, and
               keep no level of v; the parameter itself already shows the
               NaN. */
            if (!(xm >= -127.0f && xm <= 127.0f)) {
                xm = 0.0f;
            }
            if (!(xv >= 0.0f && xv <= 255.0f)) {
                xv = 0.0f;
            }
            float fm = floor_small(xm + u1); /* |xm + u1| < 129 */
            float fv = floor_small(xv + u2);
            if (fv < 1.0f && r[k] > 0.0f && isfinite(r[k])) {
                fv = 1.0f;
            }
            qm_out[k] = (int8_t)(fm > 127.0f    ? 127.0f
                                 : fm < -127.0f ? -127.0f
                                                : fm);
            qv_out[k] = (uint8_t)(fv > 255.0f ? 255.0f : fv);
        }
    }
}

static void *
run_step_thread(void *arg)
{
    run_step(arg);
    return NULL;
}

#define MAX_THREADS 64

/* Blocks are independent: split them over `threads` (this thread
   included); if a thread cannot be started, its share runs here. */
static void
run_parallel(const step_args *a, int threads)
{
    int64_t nblocks = (a->n + a->block - 1) / a->block;
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if ((int64_t)threads > nblocks / 16) { /* small tensors: not worth it */
        threads = (int)(nblocks / 16);
    }
    if (threads < 2) {
        step_args one = *a;
        one.first_block = 0;
        one.end_block = nblocks;
        run_step(&one);
        return;
    }
    step_args part[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        part[t] = *a;
        part[t].first_block = nblocks * t / threads;
        part[t].end_block = nblocks * (t + 1) / threads;
        started[t] =
            t > 0
            && pthread_create(&tid[t], NULL, run_step_thread, &part[t]) == 0;
    }
    for (int t = 0; t < threads; t++) {
        if (!started[t]) {
            run_step(&part[t]);
        }
    }
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(tid[t], NULL);
        }
    }
}

/* The error for a tensor that is not on the CPU (a CUDA or meta tensor):
   the kernel reads and writes its memory directly, so it refuses it and
   says where the 8-bit update for that device is. */
static void
refuse_device(ms_state *st, PyObject *t, const char *what)
{
    PyObject *dev = PyObject_GetAttr(t, st->s_device);
    PyObject *name = dev ? PyObject_Str(dev) : NULL;
    Py_XDECREF(dev);
    if (name == NULL) {
        return;
    }
    PyErr_Format(PyExc_ValueError,
                 "adamw8bit_step: %s is on %U, and memscale's 8-bit kernel "
                 "runs on CPU tensors only; memscale.optim.AdamW8bit keeps "
                 "float32 moments for parameters elsewhere, and "
                 "memscale.optim.make_8bit_adamw picks bitsandbytes' "
                 "AdamW8bit for CUDA parameters when it is installed",
                 what, name);
    Py_DECREF(name);
}

/* The data pointer of `t` after checking it: a contiguous CPU tensor of
   `dtype_name` with `numel` elements (numel < 0: any, reported back). */
static void *
checked_ptr(ms_state *st, PyObject *t, const char *what,
            const char *dtype_name, int64_t *numel)
{
    if (!ms_is_tensor(st, t)) {
        PyErr_Format(PyExc_TypeError, "adamw8bit_step: %s must be a tensor",
                     what);
        return NULL;
    }
    PyObject *dtype = PyObject_GetAttr(t, st->s_dtype);
    PyObject *dstr = dtype ? PyObject_Str(dtype) : NULL;
    Py_XDECREF(dtype);
    if (dstr == NULL) {
        return NULL;
    }
    int ok = PyUnicode_CompareWithASCIIString(dstr, dtype_name) == 0;
    Py_DECREF(dstr);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "adamw8bit_step: %s must be %s", what,
                     dtype_name);
        return NULL;
    }
    ok = ms_is_on_cpu(st, t);
    if (ok <= 0) {
        if (ok == 0) {
            refuse_device(st, t, what);
        }
        return NULL;
    }
    PyObject *c = PyObject_CallMethodNoArgs(t, st->s_is_contiguous);
    ok = c ? PyObject_IsTrue(c) : -1;
    Py_XDECREF(c);
    if (ok <= 0) {
        if (ok == 0) {
            PyErr_Format(PyExc_ValueError,
                         "adamw8bit_step: %s must be contiguous", what);
        }
        return NULL;
    }
    PyObject *nobj = PyObject_CallMethodNoArgs(t, st->s_numel);
    long long n = nobj ? PyLong_AsLongLong(nobj) : -1;
    Py_XDECREF(nobj);
    if (n < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "adamw8bit_step: bad numel");
        }
        return NULL;
    }
    if (*numel >= 0 && n != *numel) {
        PyErr_Format(PyExc_ValueError,
                     "adamw8bit_step: %s has %lld elements, expected %lld",
                     what, n, (long long)*numel);
        return NULL;
    }
    *numel = n;
    PyObject *p = PyObject_CallMethodNoArgs(t, st->s_data_ptr);
    void *ptr = p ? PyLong_AsVoidPtr(p) : NULL;
    Py_XDECREF(p);
    if (ptr == NULL && !PyErr_Occurred() && n > 0) {
        PyErr_Format(PyExc_ValueError, "adamw8bit_step: %s has no data", what);
    }
    return ptr;
}

PyObject *
ms_adamw8bit_step(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"param",
                             "grad",
                             "exp_avg",
                             "exp_avg_scale",
                             "exp_avg_sq",
                             "exp_avg_sq_scale",
                             "lr",
                             "beta1",
                             "beta2",
                             "eps",
                             "weight_decay",
                             "step",
                             "block",
                             "threads",
                             NULL};
    ms_state *st = ms_get_state(module);
    PyObject *tp, *tg, *tqm, *tsm, *tqv, *tsv;
    double lr, beta1, beta2, eps, wd;
    long long step, block;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs,
                                     "OOOOOO$dddddLLi:adamw8bit_step", kwlist,
                                     &tp, &tg, &tqm, &tsm, &tqv, &tsv, &lr,
                                     &beta1, &beta2, &eps, &wd, &step, &block,
                                     &threads))
    {
        return NULL;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError,
                     "adamw8bit_step: threads must be >= 1, got %d", threads);
        return NULL;
    }
    if (block < 1 || block > MAX_BLOCK) {
        PyErr_Format(PyExc_ValueError,
                     "adamw8bit_step: block must be in [1, %d], got %lld",
                     MAX_BLOCK, block);
        return NULL;
    }
    if (step < 1 || !(beta1 >= 0.0 && beta1 < 1.0)
        || !(beta2 >= 0.0 && beta2 < 1.0) || !(eps > 0.0) || !isfinite(lr)
        || !isfinite(wd))
    {
        PyErr_SetString(PyExc_ValueError,
                        "adamw8bit_step: needs step >= 1, 0 <= betas < 1, "
                        "eps > 0 and finite lr and weight_decay");
        return NULL;
    }
    step_args a;
    int64_t n = -1;
    a.param = checked_ptr(st, tp, "param", "torch.float32", &n);
    if (a.param == NULL && PyErr_Occurred()) {
        return NULL;
    }
    a.grad = checked_ptr(st, tg, "grad", "torch.float32", &n);
    if (a.grad == NULL && PyErr_Occurred()) {
        return NULL;
    }
    a.qm = checked_ptr(st, tqm, "exp_avg", "torch.int8", &n);
    if (a.qm == NULL && PyErr_Occurred()) {
        return NULL;
    }
    a.qv = checked_ptr(st, tqv, "exp_avg_sq", "torch.uint8", &n);
    if (a.qv == NULL && PyErr_Occurred()) {
        return NULL;
    }
    int64_t nblocks = (n + block - 1) / block;
    int64_t nb = nblocks;
    a.sm = checked_ptr(st, tsm, "exp_avg_scale", "torch.float32", &nb);
    if (a.sm == NULL && PyErr_Occurred()) {
        return NULL;
    }
    nb = nblocks;
    a.sv = checked_ptr(st, tsv, "exp_avg_sq_scale", "torch.float32", &nb);
    if (a.sv == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (n == 0) {
        Py_RETURN_NONE;
    }
    a.n = n;
    a.block = block;
    a.lr = (float)lr;
    a.beta1 = (float)beta1;
    a.beta2 = (float)beta2;
    a.eps = (float)eps;
    a.wd = (float)wd;
    a.bc1 = (float)(1.0 - pow(beta1, (double)step));
    a.bc2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step));
    a.seed = mix64((uint64_t)step * 0x9e3779b97f4a7c15ULL);
    if (!(a.eps > 0.0f) || !(a.beta1 < 1.0f) || !(a.beta2 < 1.0f)
        || !(a.bc1 > 0.0f) || !(a.bc2_sqrt > 0.0f))
    {
        PyErr_SetString(PyExc_ValueError,
                        "adamw8bit_step: eps, betas or the step make a zero "
                        "or infinite term in float32 (eps too small, or a "
                        "beta too close to 1)");
        return NULL;
    }
    /* The tensors stay referenced by the caller's frame while the GIL is
       released (the arguments), so their memory cannot go away. */
    Py_BEGIN_ALLOW_THREADS
    run_parallel(&a, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
