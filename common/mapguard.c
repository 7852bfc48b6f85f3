/* mapguard.c - see mapguard.h. The slots are written by the thread that
 * maps or unmaps and read by the signal handler: a slot's path and length
 * are stored before its base is published (release), and the handler reads
 * the base first (acquire); a base of 0 is a free slot. */
#include "mapguard.h"

#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    _Atomic uintptr_t base;
    size_t len;
    char path[240];
} slot;

static slot g_slots[DF_MAPGUARD_SLOTS];

int df_mapguard_add(const void *base, size_t len, const char *path)
{
    if (!base || !len)
        return 0;
    for (int i = 0; i < DF_MAPGUARD_SLOTS; i++) {
        uintptr_t free_v = 0;
        /* claim with a marker that no address takes (1), fill, publish */
        if (!atomic_compare_exchange_strong(&g_slots[i].base, &free_v, (uintptr_t)1))
            continue;
        g_slots[i].len = len;
        size_t n = path ? strlen(path) : 0;
        if (n >= sizeof g_slots[i].path)
            n = sizeof g_slots[i].path - 1;
        memcpy(g_slots[i].path, path ? path : "", n);
        g_slots[i].path[n] = 0;
        atomic_store_explicit(&g_slots[i].base, (uintptr_t)base, memory_order_release);
        return 0;
    }
    return -ENOSPC;
}

void df_mapguard_remove(const void *base)
{
    if (!base)
        return;
    for (int i = 0; i < DF_MAPGUARD_SLOTS; i++)
        if (atomic_load_explicit(&g_slots[i].base, memory_order_acquire) == (uintptr_t)base) {
            atomic_store_explicit(&g_slots[i].base, (uintptr_t)0, memory_order_release);
            return;
        }
}

/* async-signal-safe output: write(2) of pieces, numbers by hand */
static void put(const char *s)
{
    size_t n = strlen(s);
    while (n > 0) {
        ssize_t w = write(2, s, n);
        if (w <= 0)
            return;
        s += w, n -= (size_t)w;
    }
}

static void put_u(uintptr_t v)
{
    char b[24];
    int i = (int)sizeof b;
    b[--i] = 0;
    do {
        b[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v && i > 0);
    put(b + i);
}

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < DF_MAPGUARD_SLOTS; i++) {
        uintptr_t b = atomic_load_explicit(&g_slots[i].base, memory_order_acquire);
        if (b > 1 && a >= b && a - b < g_slots[i].len) {
            put("dflash: ");
            put(g_slots[i].path);
            put(": read at byte ");
            put_u(a - b);
            put(" of a mapping the file no longer covers: it was truncated or rewritten while this "
                "run read it (input files must stay unchanged during a run)\n");
            _exit(1);
        }
    }
    /* not ours: the default action, as without the guard */
    signal(sig, SIG_DFL);
    raise(sig);
}

int df_mapguard_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, NULL) == 0 ? 0 : -errno;
}
