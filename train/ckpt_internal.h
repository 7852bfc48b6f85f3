/* ckpt_internal.h - what ckpt.c (checkpoints) and export.c (the serving export) share. */
#ifndef DF_CKPT_INTERNAL_H
#define DF_CKPT_INTERNAL_H

#include "err.h"

/* Removes a directory holding only files (what we create); refuses to
 * descend into subdirectories. A missing directory is fine. */
int df_ckpt_rm_flat_dir(const char *dir, df_err *e);

/* out (PATHN = 4096 bytes) = dir/name; -ENAMETOOLONG naming both. */
int df_ckpt_join(char *out, const char *dir, const char *name, df_err *e);

/* dir/name written atomically (df_file_write_atomic). */
int df_ckpt_write_text(const char *dir, const char *name, const void *data, size_t len,
                       df_err *e);

#endif
