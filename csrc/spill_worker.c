/*
 * spill_worker.c: the I/O of a SpillStore, on a worker thread or inline.
 *
 * A job moves a record's bytes between a tensor's memory and a slot of a
 * spill file.  An asynchronous store queues its jobs for one worker
 * thread: plain C, it never takes the GIL and never touches a Python
 * object; it only sees the job's descriptor, offset, pointer and length.
 * A synchronous store, a forked child (the thread does not exist there)
 * and a read the caller waits for run the job in the calling thread with
 * the GIL released.  Either way a job is marked busy under the mutex
 * before it runs, so that any other caller waits for it.
 *
 * fork(): ms_spill_worker_prepare_fork waits until no job is in flight,
 * so that a child never inherits a job half done by a thread it does not
 * have; ms_spill_worker_after_fork_child resets the lock, the conditions
 * and the queue in the child.  They are what the store's _prepare_fork and
 * _after_fork_child do, which memscale.offload registers with
 * os.register_at_fork.
 */
#include "spill_worker.h"

#include "clock.h"

#include <errno.h>
#include <unistd.h>

/* FNV-1a, 64 bits: a cheap checksum for the debug mode. */
static uint64_t
fnv1a(const unsigned char *p, int64_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (int64_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* The I/O of one job, with no Python object and no GIL. */
static void
job_run(SpillJob *job)
{
    long long t0 = ms_monotonic_ns();
    int64_t done = 0;
    job->err = 0;
    if (job->op == SPILL_JOB_WRITE && job->checksum) {
        job->sum = fnv1a((const unsigned char *)job->ptr, job->nbytes);
    }
    while (done < job->nbytes) {
        size_t chunk = (size_t)(job->nbytes - done);
        if (chunk > ((size_t)1 << 30)) {
            chunk = (size_t)1 << 30;
        }
        ssize_t r = job->op == SPILL_JOB_WRITE
                        ? pwrite(job->fd, job->ptr + done, chunk,
                                 (off_t)(job->off + done))
                        : pread(job->fd, job->ptr + done, chunk,
                                (off_t)(job->off + done));
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            job->err = errno;
            break;
        }
        if (r == 0) {
            /* short file */
            job->err = job->op == SPILL_JOB_WRITE ? ENOSPC : EIO;
            break;
        }
        done += r;
    }
    if (job->err == 0 && job->op == SPILL_JOB_READ && job->checksum) {
        job->sum = fnv1a((const unsigned char *)job->ptr, job->nbytes);
    }
    job->ns = ms_monotonic_ns() - t0;
}

/* A job has run: wake whoever waits for it.  Called with the mutex held. */
static void
job_done(SpillWorker *w, SpillJob *job)
{
    job->busy = 0;
    w->inflight--;
    pthread_cond_broadcast(&w->cv_done);
}

static void *
worker_main(void *arg)
{
    SpillWorker *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->head == NULL && !w->stop) {
            pthread_cond_wait(&w->cv_work, &w->mu);
        }
        if (w->head == NULL) {
            break; /* stop, and nothing left to do */
        }
        SpillJob *job = w->head;
        w->head = job->next;
        if (w->head == NULL) {
            w->tail = NULL;
        }
        pthread_mutex_unlock(&w->mu);
        job_run(job);
        pthread_mutex_lock(&w->mu);
        job_done(w, job);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int
ms_spill_worker_init(SpillWorker *w)
{
    if (pthread_mutex_init(&w->mu, NULL) != 0) {
        return -1;
    }
    if (pthread_cond_init(&w->cv_work, NULL) != 0) {
        pthread_mutex_destroy(&w->mu);
        return -1;
    }
    if (pthread_cond_init(&w->cv_done, NULL) != 0) {
        pthread_cond_destroy(&w->cv_work);
        pthread_mutex_destroy(&w->mu);
        return -1;
    }
    w->sync_ready = 1;
    return 0;
}

int
ms_spill_worker_start(SpillWorker *w)
{
    int e = pthread_create(&w->thread, NULL, worker_main, w);
    if (e != 0) {
        return e;
    }
    w->thread_started = 1;
    w->thread_pid = getpid();
    return 0;
}

void
ms_spill_worker_stop(SpillWorker *w)
{
    if (!w->thread_started) {
        return;
    }
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_broadcast(&w->cv_work);
    pthread_mutex_unlock(&w->mu);
    /* The worker never takes the GIL, but it may have jobs left to run. */
    Py_BEGIN_ALLOW_THREADS
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    w->thread_started = 0;
}

void
ms_spill_worker_destroy(SpillWorker *w)
{
    if (w->sync_ready) {
        pthread_cond_destroy(&w->cv_work);
        pthread_cond_destroy(&w->cv_done);
        pthread_mutex_destroy(&w->mu);
    }
}

long long
ms_spill_job_submit(SpillWorker *w, SpillJob *job, int inline_io)
{
    pthread_mutex_lock(&w->mu);
    job->busy = 1;
    w->inflight++;
    /* (In a forked child the worker does not exist: run it here.) */
    if (!inline_io && w->thread_started && !w->stop
        && w->thread_pid == getpid())
    {
        job->next = NULL;
        if (w->tail != NULL) {
            w->tail->next = job;
        }
        else {
            w->head = job;
        }
        w->tail = job;
        pthread_cond_signal(&w->cv_work);
        pthread_mutex_unlock(&w->mu);
        return 0;
    }
    pthread_mutex_unlock(&w->mu);
    long long t0 = ms_monotonic_ns();
    Py_BEGIN_ALLOW_THREADS
    job_run(job);
    pthread_mutex_lock(&w->mu);
    job_done(w, job);
    pthread_mutex_unlock(&w->mu);
    Py_END_ALLOW_THREADS
    return ms_monotonic_ns() - t0;
}

int
ms_spill_job_busy(SpillWorker *w, SpillJob *job)
{
    pthread_mutex_lock(&w->mu);
    int busy = job->busy;
    pthread_mutex_unlock(&w->mu);
    return busy;
}

long long
ms_spill_job_wait(SpillWorker *w, SpillJob *job)
{
    if (!ms_spill_job_busy(w, job)) {
        return 0;
    }
    long long t0 = ms_monotonic_ns();
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->mu);
    while (job->busy) {
        pthread_cond_wait(&w->cv_done, &w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    Py_END_ALLOW_THREADS
    return ms_monotonic_ns() - t0;
}

void
ms_spill_worker_prepare_fork(SpillWorker *w)
{
    /* A child must not inherit a job half done by a thread it does not
       have: wait until no job is in flight (the worker never needs the
       GIL to finish one). */
    if (w->sync_ready) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->mu);
        while (w->inflight > 0) {
            pthread_cond_wait(&w->cv_done, &w->mu);
        }
        pthread_mutex_unlock(&w->mu);
        Py_END_ALLOW_THREADS
    }
}

int
ms_spill_worker_after_fork_child(SpillWorker *w)
{
    /* Only the forking thread exists here: the worker is gone, and the
       lock and conditions may be in the state another thread left them
       in.  Start them afresh. */
    if (w->sync_ready) {
        if (pthread_mutex_init(&w->mu, NULL) != 0
            || pthread_cond_init(&w->cv_work, NULL) != 0
            || pthread_cond_init(&w->cv_done, NULL) != 0)
        {
            return -1;
        }
    }
    w->head = w->tail = NULL;
    w->inflight = 0;
    w->stop = 0;
    w->thread_started = 0;
    return 0;
}
