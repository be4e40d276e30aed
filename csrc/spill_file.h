/*
 * spill_file.h: the spill files of a SpillStore and their slots
 * (spill_file.c).
 */
#ifndef MEMSCALE_SPILL_FILE_H
#define MEMSCALE_SPILL_FILE_H

#include "compat.h"

#include <stdint.h>
#include <sys/types.h>

/* An unlinked spill file shared by records, a slot each.  Touched only
   with the GIL held (the worker sees a job's descriptor and offset only). */
typedef struct SpillFile {
    int fd;
    int refs;    /* records in it, + 1 while it is the store's current */
    pid_t pid;   /* the creating process: the only one that writes it */
    int64_t end; /* the next free offset */
} SpillFile;

/* A store's files: its private directory and the file new slots go to. */
typedef struct {
    int dir_fd;                 /* the directory, opened by the store */
    SpillFile *cur;             /* the file new records go to, or NULL */
    unsigned long long counter; /* names the next file */
} SpillFiles;

/* A slot of `nbytes` for a new record: its file (a new reference) and
   offset, or NULL with errno set when no file can be opened. */
SpillFile *ms_spill_slot(SpillFiles *files, int64_t nbytes, int64_t *off);
/* The slot is no longer needed (no job in flight on it): free its disk
   space and drop the file reference; a file no record uses any more is
   closed.  `files` (the store's, or NULL once the store is gone) lets go
   of its current file when this was its last record. */
void ms_spill_slot_free(SpillFiles *files, SpillFile *f, int64_t off,
                        int64_t nbytes);
/* Drop one reference to f (NULL is allowed); the last one closes it. */
void ms_spill_file_unref(SpillFile *f);
/* Let go of the current file: records still in it keep it open. */
void ms_spill_files_end_current(SpillFiles *files);

#endif /* MEMSCALE_SPILL_FILE_H */
