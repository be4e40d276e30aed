/*
 * clock.h: the monotonic clock of the timings memscale._core reports (the
 * executor's recompute time, the spill store's I/O and wait times).
 */
#ifndef MEMSCALE_CLOCK_H
#define MEMSCALE_CLOCK_H

#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds; 0 if it cannot be read. */
static inline long long
ms_monotonic_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        return 0;
    }
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#endif /* MEMSCALE_CLOCK_H */
