/*
 * spill_worker.h: the I/O jobs of a SpillStore and the thread that runs
 * them (spill_worker.c).
 */
#ifndef MEMSCALE_SPILL_WORKER_H
#define MEMSCALE_SPILL_WORKER_H

#include "compat.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

enum { SPILL_JOB_WRITE = 1, SPILL_JOB_READ = 2 };

/* One read or write of a record's bytes: plain C, no Python object. */
typedef struct SpillJob {
    struct SpillJob *next;
    int op;
    int fd;
    int64_t off; /* where in the file */
    char *ptr;
    int64_t nbytes;
    int checksum; /* compute the checksum of the bytes moved */
    uint64_t sum; /* result */
    int err;      /* errno of a failure, 0 when it worked */
    int64_t ns;   /* time the I/O took */
    int busy;     /* queued or running: guarded by the worker's mutex */
} SpillJob;

/* The queue, its lock and the thread (when the store is asynchronous). */
typedef struct {
    pthread_t thread;
    pid_t thread_pid; /* the process the worker runs in */
    int inflight;     /* jobs submitted and not done (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    SpillJob *head, *tail;
    int stop;
    int thread_started;
    int sync_ready; /* mu/cv initialised */
} SpillWorker;

/* Initialise the lock and conditions: 0, or -1 (nothing to destroy). */
int ms_spill_worker_init(SpillWorker *w);
/* Start the thread: 0, or the error number of pthread_create. */
int ms_spill_worker_start(SpillWorker *w);
/* Let the thread finish the jobs queued, and join it (the GIL, held by
   the caller, is released meanwhile).  Nothing when none runs. */
void ms_spill_worker_stop(SpillWorker *w);
/* Destroy the lock and conditions (after ms_spill_worker_stop). */
void ms_spill_worker_destroy(SpillWorker *w);

/* Run a job: on the thread when there is one (and it is not stopping),
   else here with the GIL released.  Returns the nanoseconds the caller
   waited for it (0 when queued). */
long long ms_spill_job_submit(SpillWorker *w, SpillJob *job, int inline_io);
/* Whether the job is queued or running. */
int ms_spill_job_busy(SpillWorker *w, SpillJob *job);
/* Block (GIL released) until the job is done; the nanoseconds waited. */
long long ms_spill_job_wait(SpillWorker *w, SpillJob *job);

/* Before fork(): wait (GIL released) until no job is in flight. */
void ms_spill_worker_prepare_fork(SpillWorker *w);
/* In a forked child: the thread is gone; reset the lock, the conditions
   and the queue.  0, or -1 when they cannot be initialised again. */
int ms_spill_worker_after_fork_child(SpillWorker *w);

#endif /* MEMSCALE_SPILL_WORKER_H */
