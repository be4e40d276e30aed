/*
 * spill.c: the disk tier of activation offload, SpillStore.
 *
 * A SpillStore owns a private directory.  put(tensor) copies a contiguous
 * CPU tensor into a slot of the store's spill file and returns a _Spilled
 * record standing for it; the caller drops the tensor, so its memory goes
 * back to the allocator.  get() reads the bytes back into a fresh tensor of
 * the same shape, strides and dtype.  The files and their slots are
 * spill_file.c's; the I/O, on a worker thread or inline, spill_worker.c's.
 *
 * A record's slot is freed when the record is read back or dropped.  No
 * path (an exception, a dropped graph, a killed process) can leave a spill
 * file behind: each is unlinked the moment it is created.
 *
 * fork(): a forked child may read back the records it inherited, but
 * spills into files of its own, and does its I/O synchronously (the worker
 * thread does not exist there).  memscale.offload registers fork hooks
 * (os.register_at_fork) that wait for the worker's jobs in flight before a
 * fork (_prepare_fork) and reset the lock and the worker in the child
 * (_after_fork_child); without them (a fork that bypasses os.fork), a child
 * still never submits to the parent's worker.
 *
 * Synchronous stores do the I/O in the calling thread with the GIL
 * released; asynchronous ones hand it to the worker thread.  The record
 * keeps the tensor whose memory the job reads or writes until the main
 * thread, holding the GIL, sees the job done ("reaping"); a record is
 * never freed with a job in flight.  While a layer is recomputed in
 * backward, get() starts reading the records offloaded just before it (the
 * next ones backward needs): prefetch_depth of them.
 *
 * Failures never corrupt data: a write that fails (disk full, file size
 * limit, cap reached) leaves the tensor in memory, and the store reports
 * it once through its log callback; a read that fails or (debug) whose
 * checksum differs raises.
 */
#include "spill.h"

#include "spill_file.h"
#include "spill_worker.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h> /* offsetof, for the member tables */
#include <string.h>
#include <unistd.h>

/* Record states. */
enum {
    R_WRITING = 1, /* async write in flight; tensor = source */
    R_DISK,        /* bytes in the file; no tensor */
    R_READING,     /* async read in flight; tensor = destination */
    R_LOADED,      /* tensor holds the data again; file closed */
    R_STALE,       /* changed in place while being written: get() raises */
};

typedef struct SpillStore SpillStore;

typedef struct {
    PyObject_HEAD
    SpillStore *store;
    PyObject *tensor;
    PyObject *shape;
    PyObject *stride;
    PyObject *dtype;
    PyObject *version; /* source's _version at put (async) */
    PyObject *weakreflist;
    int requires_grad;
    SpillFile *file; /* holding the bytes, or NULL */
    int64_t off;     /* the slot's offset in it */
    int state;
    int on_disk; /* counted in store->used_bytes */
    int64_t nbytes;
    uint64_t sum; /* checksum at write (debug) */
    SpillJob job;
} Spilled;

struct SpillStore {
    PyObject_HEAD
    PyObject *module;
    ms_state *st;
    PyObject *path;    /* str: the private directory */
    PyObject *log;     /* callable(kind, message) or None */
    PyObject *order;   /* list of weakrefs: records of this step */
    PyObject *pending; /* list of records with a write in flight */
    PyObject *weakreflist;
    SpillFiles files; /* the directory and the current file */
    int async;
    int debug;
    int closed;
    int prefetch_depth;
    int64_t min_bytes;
    int64_t max_bytes;  /* < 0: no cap */
    int64_t used_bytes; /* bytes in open spill files */
    unsigned logged;    /* kinds of events already logged */
    SpillWorker worker; /* the I/O: a thread, or inline */
    /* statistics */
    long long n_written, n_read, n_refused, n_failed, n_prefetched;
    long long n_verified, n_reused;
    long long bytes_written, bytes_read;
    long long io_ns, wait_ns;
    int64_t peak_used_bytes;
};

enum { LOG_CAP = 1u, LOG_WRITE_FAILED = 2u, LOG_CLOSED = 4u };

/* Report an event through the log callback, once per kind. */
static void
store_log(SpillStore *s, unsigned kind, const char *level, PyObject *msg)
{
    if (msg == NULL) {
        PyErr_Clear();
        return;
    }
    if (!(s->logged & kind) && s->log != NULL && s->log != Py_None) {
        s->logged |= kind;
        PyObject *r = PyObject_CallFunction(s->log, "sO", level, msg);
        if (r == NULL) {
            PyErr_WriteUnraisable(s->log);
        }
        Py_XDECREF(r);
    }
    Py_DECREF(msg);
}

/* ---- _Spilled ----------------------------------------------------- */

static int
spilled_traverse(Spilled *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->store);
    Py_VISIT(self->tensor);
    Py_VISIT(self->shape);
    Py_VISIT(self->stride);
    Py_VISIT(self->dtype);
    Py_VISIT(self->version);
    return 0;
}

/* The record's slot is no longer needed (its job is done): free its disk
   space; a file no record uses any more is closed. */
static void
drop_file(Spilled *r)
{
    SpillFile *f = r->file;
    if (f == NULL) {
        return;
    }
    r->file = NULL;
    ms_spill_slot_free(r->store != NULL ? &r->store->files : NULL, f, r->off,
                       r->nbytes);
}

/* Wait for the record's job, close and release its file. */
static void
spilled_release_file(Spilled *self)
{
    if (self->store != NULL) {
        SpillStore *s = self->store; /* the wait returns at once when idle */
        s->wait_ns += ms_spill_job_wait(&s->worker, &self->job);
    }
    drop_file(self);
    if (self->on_disk && self->store != NULL) {
        self->store->used_bytes -= self->nbytes;
        self->on_disk = 0;
    }
}

static int
spilled_clear(Spilled *self)
{
    /* The tensor may be the target of a job in flight: never free it
       before the job is done. */
    spilled_release_file(self);
    Py_CLEAR(self->tensor);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->stride);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->version);
    Py_CLEAR(self->store);
    return 0;
}

static void
spilled_dealloc(Spilled *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    (void)spilled_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}


/* Give back the disk bytes a record reserved. */
static void
unreserve(Spilled *r)
{
    if (r->on_disk) {
        r->store->used_bytes -= r->nbytes;
        r->on_disk = 0;
    }
}

/*
 * A finished write (the job is done).  Does nothing unless the record is
 * still R_WRITING: two callers may get here for one record, each after
 * releasing the GIL.  A failed write keeps the tensor in memory; a source
 * changed in place while it was written (async) makes the record stale.
 * Returns -1 with an exception set only when reading _version fails.
 */
static int
finish_write(Spilled *r)
{
    if (r->state != R_WRITING) {
        return 0;
    }
    SpillStore *s = r->store;
    s->io_ns += r->job.ns;
    if (r->job.err != 0) {
        /* The bytes are not on disk: the tensor stays in memory. */
        s->n_failed++;
        unreserve(r);
        drop_file(r);
        r->state = R_LOADED;
        store_log(s, LOG_WRITE_FAILED, "warning",
                  PyUnicode_FromFormat(
                      "memscale offload: writing to the spill directory %S "
                      "failed (%s); the tensor stays in memory (this is "
                      "reported once)",
                      s->path, strerror(r->job.err)));
        return 0;
    }
    int same = 1;
    if (r->tensor != NULL) {
        PyObject *now = PyObject_GetAttr(r->tensor, s->st->s_version);
        same = now ? PyObject_RichCompareBool(now, r->version, Py_EQ) : -1;
        Py_XDECREF(now);
        if (r->state != R_WRITING) {
            return same < 0 ? -1 : 0; /* finished meanwhile */
        }
    }
    if (same <= 0) {
        /* Torn or unknown: never hand these bytes back. */
        unreserve(r);
        drop_file(r);
        r->state = R_STALE;
        Py_CLEAR(r->tensor);
        return same < 0 ? -1 : 0;
    }
    r->sum = r->job.sum;
    s->n_written++;
    s->bytes_written += r->nbytes;
    r->state = R_DISK;
    return 0;
}

/* Let go of the source tensors whose writes are done (all of them, waiting,
   with wait_all).  The pending list is taken over first: nested or
   concurrent reaps (the GIL is released while waiting, the log callback
   runs Python) each work on their own records. */
static int
store_reap(SpillStore *s, int wait_all)
{
    if (s->pending == NULL || PyList_GET_SIZE(s->pending) == 0) {
        return 0;
    }
    PyObject *old = s->pending;
    s->pending = PyList_New(0);
    if (s->pending == NULL) {
        s->pending = old;
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(old); i++) {
        Spilled *r = (Spilled *)Py_NewRef(PyList_GET_ITEM(old, i));
        if (r->state == R_WRITING) {
            if (wait_all) {
                s->wait_ns += ms_spill_job_wait(&s->worker, &r->job);
            }
            if (r->state == R_WRITING
                && ms_spill_job_busy(&s->worker, &r->job))
            {
                if (s->pending == NULL
                    || PyList_Append(s->pending, (PyObject *)r) < 0)
                {
                    rc = -1; /* it stays R_WRITING: get() still works */
                }
            }
            else {
                if (finish_write(r) < 0) {
                    rc = -1;
                }
                if (r->state == R_DISK) {
                    Py_CLEAR(r->tensor); /* the memory goes back now */
                }
            }
        }
        Py_DECREF(r);
    }
    Py_DECREF(old);
    if (rc < 0 && !PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    return rc;
}

static int
call_is_true(PyObject *obj, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) {
        return -1;
    }
    int v = PyObject_IsTrue(r);
    Py_DECREF(r);
    return v;
}

static int64_t
call_int(PyObject *obj, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) {
        return -1;
    }
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    return (int64_t)v;
}

/* 1 if `t` can be spilled (a contiguous CPU activation, not a leaf, whose
   storage it covers), 0 if not, -1 with an exception set. */
static int
eligible(SpillStore *s, PyObject *t, int any_tensor, int64_t *nbytes)
{
    ms_state *st = s->st;
    if (!ms_is_tensor(st, t)) {
        return 0;
    }
    if (!any_tensor) {
        PyObject *grad_fn = PyObject_GetAttr(t, st->s_grad_fn);
        if (grad_fn == NULL) {
            return -1;
        }
        int leaf = grad_fn == Py_None;
        Py_DECREF(grad_fn);
        if (leaf) {
            return 0; /* parameters, buffers, the user's own inputs */
        }
    }
    int cpu = ms_is_on_cpu(st, t);
    if (cpu <= 0) {
        return cpu;
    }
    /* Raw bytes only stand for a plain strided tensor: not a sparse one,
       nor a lazily conjugated or negated view. */
    PyObject *layout = PyObject_GetAttr(t, st->s_layout);
    if (layout == NULL) {
        return -1;
    }
    int strided = layout == st->strided;
    Py_DECREF(layout);
    if (!strided) {
        return 0;
    }
    int flag = call_is_true(t, st->s_is_conj);
    if (flag != 0) {
        return flag < 0 ? -1 : 0;
    }
    flag = call_is_true(t, st->s_is_neg);
    if (flag != 0) {
        return flag < 0 ? -1 : 0;
    }
    int contiguous = call_is_true(t, st->s_is_contiguous);
    if (contiguous <= 0) {
        return contiguous;
    }
    int64_t numel = call_int(t, st->s_numel);
    int64_t esize = numel < 0 ? -1 : call_int(t, st->s_element_size);
    if (esize < 0) {
        return -1;
    }
    int64_t n = numel * esize;
    if (n <= 0 || n < s->min_bytes) {
        return 0;
    }
    /* A small view of a larger storage frees nothing when dropped. */
    PyObject *key = NULL;
    long long storage = 0;
    if (ms_storage_key_and_size(st, t, &key, &storage) < 0) {
        return -1;
    }
    Py_XDECREF(key);
    if (storage > n) {
        return 0;
    }
    *nbytes = n;
    return 1;
}

static void *
data_ptr(ms_state *st, PyObject *t)
{
    PyObject *r = PyObject_CallMethodNoArgs(t, st->s_data_ptr);
    if (r == NULL) {
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (p == NULL && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale offload: a tensor has no data");
    }
    return p;
}

/*
 * Spill `t`.  Returns a new record, Py_None (new reference) when the
 * tensor is not spilled (ineligible, over the cap, or the write failed:
 * it stays in memory), or NULL with an exception set.
 */
static PyObject *
spill_put(PyObject *store, PyObject *t, int any_tensor)
{
    SpillStore *s = (SpillStore *)store;
    ms_state *st = s->st;
    PyObject *shape = NULL, *stride = NULL, *dtype = NULL, *version = NULL;
    int64_t nbytes = 0;
    if (store_reap(s, 0) < 0) {
        return NULL;
    }
    if (s->closed) {
        Py_RETURN_NONE;
    }
    int ok = eligible(s, t, any_tensor, &nbytes);
    if (ok <= 0) {
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *rg = NULL;
    int requires_grad = -1;
    if ((shape = PyObject_GetAttr(t, st->s_shape)) == NULL
        || (stride = PyObject_CallMethodNoArgs(t, st->s_stride)) == NULL
        || (dtype = PyObject_GetAttr(t, st->s_dtype)) == NULL
        || (version = PyObject_GetAttr(t, st->s_version)) == NULL
        || (rg = PyObject_GetAttr(t, st->s_requires_grad)) == NULL
        || (requires_grad = PyObject_IsTrue(rg)) < 0)
    {
        goto error;
    }
    Py_CLEAR(rg);
    char *ptr = data_ptr(st, t);
    if (ptr == NULL) {
        goto error;
    }
    /* No Python code runs from the cap check to the reservation. */
    if (s->closed) {
        goto not_spilled;
    }
    if (s->max_bytes >= 0 && s->used_bytes + nbytes > s->max_bytes) {
        s->n_refused++;
        store_log(s, LOG_CAP, "info",
                  PyUnicode_FromFormat(
                      "memscale offload: the disk cap (max_disk_gb, %lld "
                      "bytes) is reached; further tensors stay in memory "
                      "this step (this is reported once)",
                      (long long)s->max_bytes));
        goto not_spilled;
    }
    int64_t off = 0;
    SpillFile *file = ms_spill_slot(&s->files, nbytes, &off);
    if (file == NULL) {
        int e = errno;
        s->n_failed++;
        store_log(s, LOG_WRITE_FAILED, "warning",
                  PyUnicode_FromFormat(
                      "memscale offload: cannot create a file in the spill "
                      "directory %S (%s); tensors stay in memory (this is "
                      "reported once)",
                      s->path, strerror(e)));
        goto not_spilled;
    }
    Spilled *r = PyObject_GC_New(Spilled, st->spilled_type);
    if (r == NULL) {
        ms_spill_file_unref(file);
        goto error;
    }
    r->store = (SpillStore *)Py_NewRef(store);
    r->tensor = Py_NewRef(t); /* until the bytes are written */
    r->shape = shape;
    r->stride = stride;
    r->dtype = dtype;
    r->version = version;
    shape = stride = dtype = version = NULL;
    r->weakreflist = NULL;
    r->requires_grad = requires_grad;
    r->file = file;
    r->off = off;
    r->nbytes = nbytes;
    r->sum = 0;
    memset(&r->job, 0, sizeof(r->job));
    r->job.op = SPILL_JOB_WRITE;
    r->job.fd = file->fd;
    r->job.off = off;
    r->job.ptr = ptr;
    r->job.nbytes = nbytes;
    r->job.checksum = s->debug;
    /* Reserve the bytes now, so that writes in flight count for the cap. */
    r->on_disk = 1;
    s->used_bytes += nbytes;
    if (s->used_bytes > s->peak_used_bytes) {
        s->peak_used_bytes = s->used_bytes;
    }
    r->state = R_WRITING;
    PyObject_GC_Track(r);
    if (s->async) {
        if (PyList_Append(s->pending, (PyObject *)r) < 0) {
            Py_DECREF(r); /* never submitted: nothing in flight */
            return NULL;
        }
        s->wait_ns += ms_spill_job_submit(&s->worker, &r->job, 0);
    }
    else {
        s->wait_ns += ms_spill_job_submit(&s->worker, &r->job, 1);
        if (finish_write(r) < 0) {
            Py_DECREF(r);
            return NULL;
        }
        if (r->state != R_DISK) {
            Py_DECREF(r);
            Py_RETURN_NONE; /* failed: reported; the caller keeps t */
        }
        Py_CLEAR(r->tensor);
    }
    if (s->order != NULL) {
        PyObject *ref = PyWeakref_NewRef((PyObject *)r, NULL);
        if (ref == NULL || PyList_Append(s->order, ref) < 0) {
            Py_XDECREF(ref);
            Py_DECREF(r);
            return NULL;
        }
        Py_DECREF(ref);
    }
    return (PyObject *)r;

not_spilled:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    Py_XDECREF(version);
    Py_RETURN_NONE;
error:
    Py_XDECREF(rg);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    Py_XDECREF(version);
    return NULL;
}

PyObject *
ms_spill_put(PyObject *store, PyObject *t)
{
    return spill_put(store, t, 0);
}

/*
 * Read an R_DISK record back: allocate a tensor of its layout and run the
 * read, on the worker (async prefetch) or here.  Allocating runs torch,
 * which may release the GIL: if the record has moved on meanwhile (another
 * caller started its read), the new tensor is dropped and 0 returned, as
 * when the read was started.  -1 with an exception set on failure.
 */
static int
begin_read(Spilled *r, int inline_io)
{
    SpillStore *s = r->store;
    ms_state *st = s->st;
    PyObject *kw = Py_BuildValue("{sO}", "dtype", r->dtype);
    PyObject *args = kw ? PyTuple_Pack(2, r->shape, r->stride) : NULL;
    PyObject *t = args ? PyObject_Call(st->empty_strided, args, kw) : NULL;
    Py_XDECREF(kw);
    Py_XDECREF(args);
    if (t == NULL) {
        return -1;
    }
    char *ptr = data_ptr(st, t);
    if (ptr == NULL) {
        Py_DECREF(t);
        return -1;
    }
    if (r->state != R_DISK) {
        Py_DECREF(t);
        return 0;
    }
    Py_XSETREF(r->tensor, t);
    r->job.op = SPILL_JOB_READ;
    r->job.fd = r->file->fd;
    r->job.off = r->off;
    r->job.ptr = ptr;
    r->job.nbytes = r->nbytes;
    r->job.checksum = s->debug;
    r->job.err = 0;
    r->state = R_READING;
    s->wait_ns += ms_spill_job_submit(&s->worker, &r->job,
                                      inline_io || !s->async);
    return 0;
}

/* The read is done (state R_READING): check it, close the file, make the
   tensor usable.  -1 with an exception set when the data cannot be had. */
static int
finish_read(Spilled *r)
{
    SpillStore *s = r->store;
    ms_state *st = s->st;
    s->io_ns += r->job.ns;
    if (r->job.err != 0 || (s->debug && r->job.sum != r->sum)) {
        /* The file is still there: a later get() tries again. */
        Py_CLEAR(r->tensor);
        r->state = R_DISK;
        if (r->job.err != 0) {
            PyErr_Format(PyExc_OSError,
                         "memscale offload: reading an offloaded tensor back "
                         "from %S failed: %s",
                         s->path, strerror(r->job.err));
        }
        else {
            PyErr_Format(PyExc_RuntimeError,
                         "memscale offload: an offloaded tensor of %lld bytes "
                         "came back from %S with a different checksum "
                         "(debug mode): the spill file was changed or the "
                         "disk returned bad data",
                         (long long)r->nbytes, s->path);
        }
        return -1;
    }
    if (r->requires_grad) {
        PyObject *res = PyObject_CallMethodOneArg(r->tensor,
                                                  st->s_requires_grad_,
                                                  Py_True);
        if (res == NULL) {
            return -1; /* still R_READING with its data: retried by get() */
        }
        Py_DECREF(res);
        if (r->state != R_READING) {
            return 0; /* another caller finished it meanwhile */
        }
    }
    if (s->debug) {
        s->n_verified++;
    }
    s->n_read++;
    s->bytes_read += r->nbytes;
    drop_file(r);
    unreserve(r);
    r->state = R_LOADED;
    return 0;
}

/*
 * Start reading up to prefetch_depth records put before `r` (backward
 * needs them next): walking back, records on disk are started and records
 * being read are counted, until prefetch_depth are being read.  Only an
 * optimisation: a failure (say, no memory for the buffer) stops it
 * silently, and get() reads those records when it needs them.
 */
static void
prefetch_before(Spilled *r)
{
    SpillStore *s = r->store;
    if (!s->async || s->prefetch_depth <= 0 || s->order == NULL) {
        return;
    }
    /* A private copy: reading may release the GIL, and new_step() may
       empty the store's list meanwhile. */
    PyObject *order = PyList_GetSlice(s->order, 0, PY_SSIZE_T_MAX);
    if (order == NULL) {
        PyErr_Clear();
        return;
    }
    Py_ssize_t at = -1;
    for (Py_ssize_t i = PyList_GET_SIZE(order) - 1; i >= 0 && at < 0; i--) {
        PyObject *obj;
        int alive = ms_weakref_get(PyList_GET_ITEM(order, i), &obj);
        if (alive < 0) {
            goto stop;
        }
        if (alive && obj == (PyObject *)r) {
            at = i;
        }
        Py_XDECREF(obj);
    }
    int counted = 0;
    for (Py_ssize_t i = at - 1; i >= 0 && counted < s->prefetch_depth; i--) {
        PyObject *obj;
        int alive = ms_weakref_get(PyList_GET_ITEM(order, i), &obj);
        if (alive < 0) {
            goto stop;
        }
        if (!alive) {
            continue;
        }
        Spilled *p = (Spilled *)obj;
        int rc = 0;
        if (p->state == R_DISK) {
            rc = begin_read(p, 0);
            if (rc == 0) {
                s->n_prefetched++;
            }
        }
        if (p->state == R_READING) {
            counted++;
        }
        Py_DECREF(obj);
        if (rc < 0) {
            goto stop;
        }
    }
    Py_DECREF(order);
    return;
stop:
    PyErr_Clear();
    Py_DECREF(order);
}

/* The tensor back (new reference), or NULL with an exception set.  Every
   step re-reads the state: the GIL is released while waiting and reading,
   and another caller may have moved the record on. */
PyObject *
ms_spill_get(PyObject *record)
{
    Spilled *r = (Spilled *)record;
    SpillStore *s = r->store;
    if (s == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale offload: this record was cleared");
        return NULL;
    }
    for (;;) {
        switch (r->state) {
        case R_WRITING:
            s->wait_ns += ms_spill_job_wait(&s->worker, &r->job);
            if (finish_write(r) < 0) {
                return NULL;
            }
            if (r->state == R_DISK && r->tensor != NULL) {
                /* Still holding the source: no need to read it back. */
                s->n_reused++;
                drop_file(r);
                unreserve(r);
                r->state = R_LOADED;
            }
            continue;
        case R_READING:
            s->wait_ns += ms_spill_job_wait(&s->worker, &r->job);
            if (r->state == R_READING && finish_read(r) < 0) {
                return NULL;
            }
            continue;
        case R_DISK:
            if (begin_read(r, 1) < 0) {
                return NULL;
            }
            continue;
        case R_STALE:
            PyErr_SetString(PyExc_RuntimeError,
                            "memscale offload: an offloaded tensor was "
                            "modified in place while it was being written, "
                            "so it cannot be recomputed from; avoid the "
                            "in-place update or turn offloading off "
                            "(Config(enable_offloading=False))");
            return NULL;
        case R_LOADED:
            if (r->tensor != NULL) {
                break;
            }
            PyErr_SetString(PyExc_RuntimeError,
                            "memscale offload: internal error: a loaded "
                            "record without its tensor");
            return NULL;
        default:
            PyErr_SetString(PyExc_RuntimeError,
                            "memscale offload: internal error: bad record "
                            "state");
            return NULL;
        }
        break;
    }
    PyObject *t = Py_NewRef(r->tensor);
    prefetch_before(r);
    if (store_reap(s, 0) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

int
ms_spill_flush(PyObject *store)
{
    return store_reap((SpillStore *)store, 1);
}

int
ms_spill_new_step(PyObject *store)
{
    SpillStore *s = (SpillStore *)store;
    if (store_reap(s, 0) < 0) {
        return -1;
    }
    if (s->order != NULL
        && PyList_SetSlice(s->order, 0, PyList_GET_SIZE(s->order), NULL) < 0)
    {
        return -1;
    }
    return 0;
}

static PyObject *
spilled_get(Spilled *self, PyObject *Py_UNUSED(ignored))
{
    return ms_spill_get((PyObject *)self);
}

/* Start reading the record back on the worker thread, so that a later
   get() finds it read or in flight (the optimizer state's tier prefetches
   the next parameter's state with it).  True when a read was started;
   False when there is nothing to start: a synchronous or closed store,
   or a record not on disk. */
static PyObject *
spilled_prefetch(Spilled *self, PyObject *Py_UNUSED(ignored))
{
    SpillStore *s = self->store;
    if (s == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memscale offload: this record was cleared");
        return NULL;
    }
    if (!s->async || s->closed || self->state != R_DISK) {
        Py_RETURN_FALSE;
    }
    if (begin_read(self, 0) < 0) {
        return NULL;
    }
    if (self->state != R_READING) {
        Py_RETURN_FALSE; /* another caller moved it on meanwhile */
    }
    s->n_prefetched++;
    Py_RETURN_TRUE;
}

static PyObject *
spilled_get_state(Spilled *self, void *Py_UNUSED(c))
{
    static const char *names[] = {"new",     "writing", "disk",
                                  "reading", "loaded",  "stale"};
    int k = self->state >= 0 && self->state <= R_STALE ? self->state : 0;
    return PyUnicode_FromString(names[k]);
}

static PyMethodDef spilled_methods[] = {
    {"get", (PyCFunction)spilled_get, METH_NOARGS,
     "get($self, /)\n--\n\nThe tensor, read back if it is on disk."},
    {"prefetch", (PyCFunction)spilled_prefetch, METH_NOARGS,
     "prefetch($self, /)\n--\n\nStart reading the tensor back on the I/O "
     "thread;\nwhether a read was started."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef store_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(SpillStore, weakreflist),
     Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef spilled_members[] = {
    {"nbytes", Py_T_LONGLONG, offsetof(Spilled, nbytes), Py_READONLY,
     "Bytes of the tensor."},
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(Spilled, weakreflist),
     Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef spilled_getset[] = {
    {"state", (getter)spilled_get_state, NULL,
     "'writing', 'disk', 'reading', 'loaded' or 'stale'.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot spilled_slots[] = {
    {Py_tp_doc, "A tensor offloaded to a spill file."},
    {Py_tp_dealloc, spilled_dealloc},
    {Py_tp_traverse, spilled_traverse},
    {Py_tp_clear, spilled_clear},
    {Py_tp_methods, spilled_methods},
    {Py_tp_members, spilled_members},
    {Py_tp_getset, spilled_getset},
    {0, NULL},
};

static PyType_Spec spilled_spec = {
    .name = "memscale._core._Spilled",
    .basicsize = sizeof(Spilled),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE
             | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = spilled_slots,
};

/* ---- SpillStore --------------------------------------------------- */

static PyObject *
store_prepare_fork(SpillStore *s, PyObject *Py_UNUSED(ignored))
{
    ms_spill_worker_prepare_fork(&s->worker);
    Py_RETURN_NONE;
}

static PyObject *
store_after_fork_child(SpillStore *s, PyObject *Py_UNUSED(ignored))
{
    /* The worker is gone: this store does its I/O synchronously. */
    if (ms_spill_worker_after_fork_child(&s->worker) < 0) {
        return PyErr_NoMemory();
    }
    s->async = 0;
    Py_RETURN_NONE;
}

static int
store_traverse(SpillStore *s, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(s));
    Py_VISIT(s->module);
    Py_VISIT(s->path);
    Py_VISIT(s->log);
    Py_VISIT(s->order);
    Py_VISIT(s->pending);
    return 0;
}

static int
store_clear(SpillStore *s)
{
    s->closed = 1; /* whatever still calls in spills nothing */
    /* Records in `pending` wait for their own jobs when freed. */
    Py_CLEAR(s->pending);
    Py_CLEAR(s->order);
    Py_CLEAR(s->log);
    return 0;
}

static void
store_dealloc(SpillStore *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    if (s->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)s);
    }
    (void)store_clear(s);
    ms_spill_worker_stop(&s->worker);
    /* Records still alive keep the current file open. */
    ms_spill_files_end_current(&s->files);
    ms_spill_worker_destroy(&s->worker);
    if (s->files.dir_fd >= 0) {
        close(s->files.dir_fd);
    }
    Py_CLEAR(s->path);
    Py_CLEAR(s->module);
    tp->tp_free((PyObject *)s);
    Py_DECREF(tp);
}

static PyObject *
store_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {
        "path",           "async_io", "min_bytes", "max_bytes",
        "prefetch_depth", "debug",    "log",       NULL};
    PyObject *path = NULL, *log = Py_None;
    int async_io = 0, debug = 0, depth = 0;
    long long min_bytes = 0, max_bytes = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "U|$pLLipO:SpillStore",
                                     kwlist, &path, &async_io, &min_bytes,
                                     &max_bytes, &depth, &debug, &log))
    {
        return NULL;
    }
    if (min_bytes < 0 || depth < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "SpillStore: min_bytes and prefetch_depth must be "
                        ">= 0");
        return NULL;
    }
    if (log != Py_None && !PyCallable_Check(log)) {
        PyErr_SetString(PyExc_TypeError, "SpillStore: log must be callable");
        return NULL;
    }
    PyObject *module = PyType_GetModuleByDef(type, &ms_module_def);
    if (module == NULL) {
        return NULL;
    }
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(path, &encoded)) {
        return NULL;
    }
    int dir_fd, open_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    dir_fd = open(PyBytes_AS_STRING(encoded),
                  O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    open_errno = errno;
    Py_END_ALLOW_THREADS
    Py_DECREF(encoded);
    if (dir_fd < 0) {
        errno = open_errno;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        return NULL;
    }
    SpillStore *s = (SpillStore *)type->tp_alloc(type, 0);
    if (s == NULL) {
        close(dir_fd);
        return NULL;
    }
    s->module = Py_NewRef(module);
    s->st = ms_get_state(module);
    s->path = Py_NewRef(path);
    s->log = Py_NewRef(log);
    s->files.dir_fd = dir_fd;
    s->async = async_io;
    s->debug = debug;
    s->prefetch_depth = depth;
    s->min_bytes = min_bytes;
    s->max_bytes = max_bytes;
    s->order = PyList_New(0);
    s->pending = PyList_New(0);
    if (s->order == NULL || s->pending == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    if (ms_spill_worker_init(&s->worker) < 0) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    if (async_io) {
        int e = ms_spill_worker_start(&s->worker);
        if (e != 0) {
            Py_DECREF(s);
            errno = e;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return (PyObject *)s;
}

static PyObject *
store_put(SpillStore *s, PyObject *t)
{
    return spill_put((PyObject *)s, t, 0);
}

static PyObject *
store_put_copy(SpillStore *s, PyObject *t)
{
    return spill_put((PyObject *)s, t, 1);
}

static PyObject *
store_flush(SpillStore *s, PyObject *Py_UNUSED(ignored))
{
    if (ms_spill_flush((PyObject *)s) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
store_new_step(SpillStore *s, PyObject *Py_UNUSED(ignored))
{
    if (ms_spill_new_step((PyObject *)s) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
store_close(SpillStore *s, PyObject *Py_UNUSED(ignored))
{
    /* No new work from here on (put() spills no more; reads of records
       still alive run inline), then finish what is in flight (its tensors
       are released) and stop the worker; surviving records keep their
       files until they go. */
    s->closed = 1;
    s->async = 0;
    int rc = store_reap(s, 1);
    ms_spill_worker_stop(&s->worker);
    /* Records still alive keep the current file open. */
    ms_spill_files_end_current(&s->files);
    if (store_reap(s, 1) < 0) {
        rc = -1;
    }
    if (s->order != NULL
        && PyList_SetSlice(s->order, 0, PyList_GET_SIZE(s->order), NULL) < 0)
    {
        rc = -1;
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
store_get_stats(SpillStore *s, void *Py_UNUSED(c))
{
    return Py_BuildValue("{sLsLsLsLsLsLsLsLsLsdsdsLsL}", "tensors_written",
                         s->n_written, "tensors_read", s->n_read,
                         "bytes_written", s->bytes_written, "bytes_read",
                         s->bytes_read, "refused_over_cap", s->n_refused,
                         "write_failures", s->n_failed, "prefetched",
                         s->n_prefetched, "verified", s->n_verified,
                         "reused_in_flight", s->n_reused, "io_seconds",
                         (double)s->io_ns / 1e9, "wait_seconds",
                         (double)s->wait_ns / 1e9, "bytes_on_disk",
                         (long long)s->used_bytes, "peak_bytes_on_disk",
                         (long long)s->peak_used_bytes);
}

static PyObject *
store_get_path(SpillStore *s, void *Py_UNUSED(c))
{
    return Py_NewRef(s->path);
}

static PyObject *
store_get_async(SpillStore *s, void *Py_UNUSED(c))
{
    return PyBool_FromLong(s->async);
}

static PyObject *
store_get_closed(SpillStore *s, void *Py_UNUSED(c))
{
    return PyBool_FromLong(s->closed);
}

static PyMethodDef store_methods[] = {
    {"put", (PyCFunction)store_put, METH_O,
     "put($self, tensor, /)\n--\n\n"
     "Spill tensor (a non-leaf activation); a record (with .get()), or\n"
     "None if it stays in memory."},
    {"put_copy", (PyCFunction)store_put_copy, METH_O,
     "put_copy($self, tensor, /)\n--\n\n"
     "put() for a host copy of a device tensor (a leaf)."},
    {"flush", (PyCFunction)store_flush, METH_NOARGS,
     "flush($self, /)\n--\n\nWait for every write in flight."},
    {"new_step", (PyCFunction)store_new_step, METH_NOARGS,
     "new_step($self, /)\n--\n\nForget the prefetch order of the last step."},
    {"close", (PyCFunction)store_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
     "Finish writes in flight and stop the I/O thread; put() spills no "
     "more."},
    {"_prepare_fork", (PyCFunction)store_prepare_fork, METH_NOARGS,
     "_prepare_fork($self, /)\n--\n\n"
     "Wait until no I/O job is in flight (before os.fork())."},
    {"_after_fork_child", (PyCFunction)store_after_fork_child, METH_NOARGS,
     "_after_fork_child($self, /)\n--\n\n"
     "In a forked child: reset the lock, forget the parent's worker, and do\n"
     "the I/O synchronously."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef store_getset[] = {
    {"stats", (getter)store_get_stats, NULL, "Counters and timings.", NULL},
    {"path", (getter)store_get_path, NULL, "The spill directory.", NULL},
    {"async_io", (getter)store_get_async, NULL,
     "Whether a background thread does the I/O.", NULL},
    {"closed", (getter)store_get_closed, NULL, "Whether close() ran.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot store_slots[] = {
    {Py_tp_doc,
     "SpillStore(path, *, async_io=False, min_bytes=0, max_bytes=-1, "
     "prefetch_depth=0, debug=False, log=None)\n--\n\n"
     "The disk tier of activation offload, in the private directory path."},
    {Py_tp_new, store_new},
    {Py_tp_dealloc, store_dealloc},
    {Py_tp_traverse, store_traverse},
    {Py_tp_clear, store_clear},
    {Py_tp_methods, store_methods},
    {Py_tp_members, store_members},
    {Py_tp_getset, store_getset},
    {0, NULL},
};

static PyType_Spec store_spec = {
    .name = "memscale._core.SpillStore",
    .basicsize = sizeof(SpillStore),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC
             | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = store_slots,
};

int
ms_spill_init_types(PyObject *module, ms_state *st)
{
    st->spilled_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &spilled_spec, NULL);
    if (st->spilled_type == NULL) {
        return -1;
    }
    st->spill_store_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &store_spec, NULL);
    if (st->spill_store_type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->spill_store_type);
}

int
ms_is_spilled(ms_state *st, PyObject *obj)
{
    return PyObject_TypeCheck(obj, st->spilled_type);
}
