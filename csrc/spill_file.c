/*
 * spill_file.c: the spill files of a SpillStore and their slots.
 *
 * One file holds many records, each in a slot at its own page-aligned
 * offset, so a store holds one descriptor however many tensors it spills:
 * a deep model does not run the process out of descriptors (RLIMIT_NOFILE).
 * A slot is punched out of the file (its disk space freed) when its record
 * no longer needs it; once no record uses a file it is closed, and the
 * next slot opens a new one.  A file is unlinked the moment it is created
 * (0600, in a directory the caller made 0700): its bytes live exactly as
 * long as the descriptor.
 *
 * A file belongs to the process that created it.  A forked child that
 * inherits one may read its records back, but never writes, punches or
 * truncates it (the parent's records live there): it opens its own.
 */
#include "spill_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/falloc.h>
#endif

/* Slots start on page boundaries, so that punching one out frees whole
   pages and never touches a neighbour's bytes. */
#define SLOT_ALIGN ((int64_t)4096)
/* A file past this size is not extended: new records go to a new one. */
#define FILE_ROTATE_BYTES ((int64_t)1 << 40)

void
ms_spill_file_unref(SpillFile *f)
{
    if (f == NULL) {
        return;
    }
    if (--f->refs == 0) {
        close(f->fd);
        PyMem_Free(f);
    }
}

/* Free the disk space of one slot (best effort: a file system without
   hole punching keeps it until the file starts over or is closed). */
static void
file_punch(SpillFile *f, int64_t off, int64_t nbytes)
{
#if defined(__linux__) && defined(FALLOC_FL_PUNCH_HOLE)
    if (f->pid == getpid() && nbytes > 0) {
        int64_t len = (nbytes + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN;
        (void)fallocate(f->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        (off_t)off, (off_t)len);
    }
#else
    (void)f;
    (void)off;
    (void)nbytes;
#endif
}

/* Open an anonymous 0600 file in the store's directory. */
static int
open_spill_file(SpillFiles *files)
{
    char name[64];
    for (int attempt = 0; attempt < 16; attempt++) {
        snprintf(name, sizeof(name), "spill-%llu", files->counter++);
        int fd = openat(files->dir_fd, name,
                        O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
            /* Unlinked at once: the bytes live as long as the descriptor. */
            (void)unlinkat(files->dir_fd, name, 0);
            return fd;
        }
        if (errno != EEXIST) {
            return -1;
        }
    }
    return -1;
}

SpillFile *
ms_spill_slot(SpillFiles *files, int64_t nbytes, int64_t *off)
{
    pid_t me = getpid();
    SpillFile *f = files->cur;
    if (f != NULL && (f->pid != me || f->end > FILE_ROTATE_BYTES)) {
        /* Inherited from the parent (its records live there), or large:
           leave it to the records still in it. */
        files->cur = NULL;
        ms_spill_file_unref(f);
        f = NULL;
    }
    if (f != NULL && f->refs == 1 && f->end > 0) {
        /* No record is in it any more: start over. */
        (void)ftruncate(f->fd, 0);
        f->end = 0;
    }
    if (f == NULL) {
        int fd = open_spill_file(files);
        if (fd < 0) {
            return NULL;
        }
        f = PyMem_Malloc(sizeof(SpillFile));
        if (f == NULL) {
            close(fd);
            errno = ENOMEM;
            return NULL;
        }
        f->fd = fd;
        f->refs = 1;
        f->pid = me;
        f->end = 0;
        files->cur = f;
    }
    *off = f->end;
    f->end += (nbytes + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN;
    f->refs++;
    return f;
}

void
ms_spill_slot_free(SpillFiles *files, SpillFile *f, int64_t off,
                   int64_t nbytes)
{
    file_punch(f, off, nbytes);
    if (files != NULL && files->cur == f && f->refs == 2) {
        files->cur = NULL; /* the store's reference goes too */
        ms_spill_file_unref(f);
    }
    ms_spill_file_unref(f);
}

void
ms_spill_files_end_current(SpillFiles *files)
{
    ms_spill_file_unref(files->cur);
    files->cur = NULL;
}
