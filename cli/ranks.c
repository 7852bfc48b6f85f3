/* ranks.c - ranks from launchers, and one process per local GPU (ranks.h). */
#include "ranks.h"

#include <errno.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "knobs.h"
#include "opt.h"

extern char **environ;

/* An integer environment variable (0 <= v < 2^31), or -1. */
static long env_int(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v || *v == '-')
        return -1;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    return errno || *end || x >= 0x80000000ull ? -1 : (long)x;
}

int cli_launcher_rank(uint32_t *rank, uint32_t *world, int *local, df_err *e)
{
    const char *k[2][3] = {{"RANK", "WORLD_SIZE", "LOCAL_RANK"},
                           {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"}};
    for (int i = 0; i < 2; i++) {
        const char *rs = getenv(k[i][0]), *ws = getenv(k[i][1]);
        if (!(rs && *rs) && !(ws && *ws))
            continue;
        long r = env_int(k[i][0]), w = env_int(k[i][1]), l = env_int(k[i][2]);
        if (r < 0 || w < 1) {
            df_errf(e, -EINVAL, "%s '%s', %s '%s': want a rank in 0..%s - 1", k[i][0], rs ? rs : "",
                    k[i][1], ws ? ws : "", k[i][1]);
            return -1;
        }
        if (r >= w) {
            df_errf(e, -EINVAL, "%s %ld out of range for %s %ld", k[i][0], r, k[i][1], w);
            return -1;
        }
        if (w == 1)
            return 0;
        if (l < 0) {
            df_errf(e, -EINVAL, "%s %ld of %ld: %s is not set (or not a number)", k[i][0], r, w, k[i][2]);
            return -1;
        }
        *rank = (uint32_t)r;
        *world = (uint32_t)w;
        *local = (int)l;
        return 1;
    }
    return 0;
}

void cli_node_rank(uint32_t *node, uint32_t *nodes)
{
    long n = env_int("NODE_RANK"), c = env_int("NNODES");
    if (n < 0 || c < 1) {
        n = env_int("SLURM_NODEID");
        c = env_int("SLURM_NNODES");
    }
    *node = n >= 0 && c >= 1 && n < c ? (uint32_t)n : 0;
    *nodes = n >= 0 && c >= 1 && n < c ? (uint32_t)c : 1;
}

const char *cli_run_id_from_env(char *buf, int cap)
{
    const char *v = df_knob_str(DF_KNOB_RUN_ID);
    if (!v)
        v = getenv("TORCHELASTIC_RUN_ID");
    if (v && *v) {
        snprintf(buf, (size_t)cap, "%s", v);
        return buf;
    }
    const char *j = getenv("SLURM_JOB_ID"), *s = getenv("SLURM_STEP_ID");
    if (j && *j) {
        snprintf(buf, (size_t)cap, "slurm-%s.%s", j, s && *s ? s : "0");
        return buf;
    }
    return NULL;
}

int cli_master_from_env(const char **addr, int *port, df_err *e)
{
    const char *a = getenv("MASTER_ADDR"), *p = getenv("MASTER_PORT");
    if (!a || !*a)
        return 0;
    if (!p || !*p) {
        df_errf(e, -EINVAL, "MASTER_ADDR is set (%.200s) but MASTER_PORT is not", a);
        return -1;
    }
    int v = 0;
    if (df_opt_int("MASTER_PORT", p, 1, 65535, &v, e))
        return -1;
    const char *agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent && (!strcmp(agent, "True") || !strcmp(agent, "true") || !strcmp(agent, "1")))
        v = v < 65535 ? v + 1 : v - 1;
    *addr = a;
    *port = v;
    return 1;
}

int cli_spawn_ranks(const char *cmd, int argc, char **argv, int n, uint32_t node, uint32_t nodes,
                    cli_rank_extra_fn extra, void *ctx)
{
    pid_t pids[64];
    int started = 0, failed = 0;
    if (n > 64)
        n = 64;
    for (int i = 0; i < n; i++) {
        int cap = argc + 24;
        char **av = calloc((size_t)cap, sizeof *av);
        char gbuf[16], rbuf[16], wbuf[16];
        uint32_t rank = node * (uint32_t)n + (uint32_t)i;
        snprintf(gbuf, sizeof gbuf, "%d", i);
        snprintf(rbuf, sizeof rbuf, "%u", rank);
        snprintf(wbuf, sizeof wbuf, "%u", nodes * (uint32_t)n);
        if (!av) {
            failed++;
            break;
        }
        int k = 0;
        av[k++] = "dflash";
        for (int j = 0; j < argc; j++) /* argv[0] is the command */
            av[k++] = argv[j];
        av[k++] = "--gpu";
        av[k++] = gbuf;
        av[k++] = "--rank";
        av[k++] = rbuf;
        av[k++] = "--world-size";
        av[k++] = wbuf;
        if (extra) /* later options win */
            k += extra(ctx, i, rank, av + k, cap - 1 - k);
        av[k] = NULL;
        int rc = posix_spawn(&pids[i], "/proc/self/exe", NULL, NULL, av, environ);
        free(av);
        if (rc) {
            fprintf(stderr, "dflash %s: cannot start rank %s: %s\n", cmd, rbuf, strerror(rc));
            failed++;
            break;
        }
        started++;
    }
    for (int i = 0; i < started; i++) {
        int status = 0;
        while (waitpid(pids[i], &status, 0) < 0 && errno == EINTR)
            ;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "dflash %s: GPU %d (rank %u) failed (%s %d); rerun the same command "
                            "to resume\n", cmd, i, node * (uint32_t)n + (uint32_t)i,
                    WIFEXITED(status) ? "exit" : "signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
            failed++;
        }
    }
    return failed;
}
