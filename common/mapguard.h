/* mapguard.h - a clear error, not "Bus error", when an input file mapped
 * read-only (a .dtok corpus, a safetensors checkpoint) is truncated or
 * rewritten by another process while a run reads it.
 *
 * Reading a page of a MAP_PRIVATE file mapping that lies past the file's
 * current end raises SIGBUS. The modules that map inputs register each
 * mapping (df_mapguard_add / _remove); main installs the handler once
 * (df_mapguard_install). The handler, for a fault inside a registered
 * mapping, writes "dflash: PATH: read at byte N of a mapping the file no
 * longer covers: ..." to stderr and ends the process with status 1
 * (_exit: the run's checkpoints and cache files are as durable as at any
 * other crash, and a resume continues from them). A SIGBUS anywhere else
 * is left to the default action, as without the guard.
 *
 * Registration is lock-free and safe against the handler; at most
 * DF_MAPGUARD_SLOTS mappings at once (more are simply not guarded). Paths
 * longer than the slot's buffer are cut. Library code only registers:
 * installing a signal handler is main's decision. */
#ifndef DF_MAPGUARD_H
#define DF_MAPGUARD_H

#include <stddef.h>

#define DF_MAPGUARD_SLOTS 64

/* Registers [base, base + len) as a mapping of path. Returns 0, or -ENOSPC
 * when every slot is taken (the mapping then works unguarded). */
int df_mapguard_add(const void *base, size_t len, const char *path);

/* Forgets the mapping at base (call before munmap). */
void df_mapguard_remove(const void *base);

/* Installs the SIGBUS handler (idempotent). 0 or a negative errno. */
int df_mapguard_install(void);

#endif
