/* params.c - the drafter's parameter table (see params.h). */
#include "params.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basis.h"

static int add(df_params *ps, int cap, const char *name, int64_t d0, int64_t d1, int is_norm)
{
    if (ps->n >= cap)
        return -ENOSPC;
    df_param *p = &ps->p[ps->n++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = d1 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->numel = d0 * (d1 ? d1 : 1);
    p->offset = ps->total;
    p->is_norm = is_norm;
    ps->total += p->numel;
    return 0;
}

int df_params_build(const df_drafter_config *c, df_params *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    int64_t H = c->hidden_size, D = c->head_dim, nq = c->num_attention_heads,
            nkv = c->num_key_value_heads, F = c->intermediate_size, K = c->num_target_features;
    if (H <= 0 || D <= 0 || nq <= 0 || nkv <= 0 || F <= 0 || K <= 0 || c->num_hidden_layers <= 0)
        return df_errf(e, -EINVAL, "drafter config has non-positive sizes");
    int cap = 3 + 11 * c->num_hidden_layers;
    out->p = calloc((size_t)cap, sizeof *out->p);
    if (!out->p)
        return df_errf(e, -ENOMEM, "out of memory");
    char n[96];
    int rc = add(out, cap, "fc.weight", H, df_drafter_fc_in(c), 0);
    rc |= add(out, cap, "hidden_norm.weight", H, 0, 1);
    for (int i = 0; i < c->num_hidden_layers && !rc; i++) {
#define P(suffix, d0, d1, norm)                                 \
    snprintf(n, sizeof n, "layers.%d.%s", i, suffix);           \
    rc |= add(out, cap, n, d0, d1, norm)
        P("input_layernorm.weight", H, 0, 1);
        P("self_attn.q_proj.weight", nq * D, H, 0);
        P("self_attn.k_proj.weight", nkv * D, H, 0);
        P("self_attn.v_proj.weight", nkv * D, H, 0);
        P("self_attn.o_proj.weight", H, nq * D, 0);
        P("self_attn.q_norm.weight", D, 0, 1);
        P("self_attn.k_norm.weight", D, 0, 1);
        P("post_attention_layernorm.weight", H, 0, 1);
        P("mlp.gate_proj.weight", F, H, 0);
        P("mlp.up_proj.weight", F, H, 0);
        P("mlp.down_proj.weight", H, F, 0);
#undef P
    }
    rc |= add(out, cap, "norm.weight", H, 0, 1);
    if (rc) {
        df_params_free(out);
        return df_errf(e, -EINVAL, "parameter table overflow");
    }
    return 0;
}

void df_params_free(df_params *ps)
{
    free(ps->p);
    memset(ps, 0, sizeof *ps);
}

int df_params_find(const df_params *ps, const char *name)
{
    for (int i = 0; i < ps->n; i++)
        if (!strcmp(ps->p[i].name, name))
            return i;
    return -1;
}

/* splitmix64 + Box-Muller: deterministic, platform-independent. */
static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Elements [k0, k1) of one tensor's stream: each element takes the
 * stream's next two numbers, and the stream only adds a constant per
 * number, so element k starts at state s0 + 2k * gamma: slices are
 * independent and give the same bits as one pass. */
typedef struct init_slice {
    float *w;
    int64_t k0, k1;
    uint64_t s0;
    double std;
} init_slice;

static void init_range(const init_slice *j)
{
    uint64_t s = j->s0 + 2 * (uint64_t)j->k0 * 0x9E3779B97F4A7C15ull;
    for (int64_t k = j->k0; k < j->k1; k++) {
        double u1 = ((mix(&s) >> 11) + 1) * 0x1.0p-53, u2 = (mix(&s) >> 11) * 0x1.0p-53;
        j->w[k] = (float)(j->std * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
}

static void *init_main(void *arg)
{
    init_slice *j = arg;
    init_range(j);
    return NULL;
}

#define INIT_THREADS 32
#define INIT_MIN_SLICE ((int64_t)1 << 20) /* elements: smaller tensors take one pass */

void df_params_init_one(const df_params *ps, int i, float *flat, float std, uint64_t seed)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = ncpu < 1 ? 1 : ncpu > INIT_THREADS ? INIT_THREADS : (int)ncpu;
    const df_param *p = &ps->p[i];
    float *w = flat + p->offset;
    if (p->is_norm) {
        for (int64_t k = 0; k < p->numel; k++)
            w[k] = 1.0f;
        return;
    }
    /* one stream per tensor, so adding a layer does not shift the others;
     * big tensors (the 27B drafter's 1.7 G parameters: a minute in one
     * thread) in slices over the cores */
    uint64_t s0 = seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(i + 1));
    int64_t per = (p->numel + nt - 1) / nt;
    if (per < INIT_MIN_SLICE)
        per = INIT_MIN_SLICE;
    init_slice job[INIT_THREADS];
    pthread_t th[INIT_THREADS];
    int started[INIT_THREADS] = {0}, n = 0;
    for (int64_t k0 = 0; k0 < p->numel && n < INIT_THREADS; k0 += per, n++) {
        job[n] = (init_slice){w, k0, k0 + per < p->numel ? k0 + per : p->numel, s0, std};
        /* the last slice here; a thread that cannot start: here too */
        started[n] = k0 + per < p->numel && pthread_create(&th[n], NULL, init_main, &job[n]) == 0;
    }
    for (int t = 0; t < n; t++)
        if (!started[t])
            init_range(&job[t]);
    for (int t = 0; t < n; t++)
        if (started[t])
            pthread_join(th[t], NULL);
}

void df_params_init(const df_params *ps, float *flat, float std, uint64_t seed)
{
    for (int i = 0; i < ps->n; i++)
        df_params_init_one(ps, i, flat, std, seed);
}

/* fc's initial value: the mean of the K feature layers, fc = [I I ... I] / K
 * (on a projected cache fc_r = that map times P^T, so fc_r z is its value on
 * the features z keeps). The context then starts in the target's own
 * residual space, where the drafter's token embeddings (the target's) live,
 * instead of in a random projection of it. Why: with fc drawn at random, a
 * third of qwen3-code-8m's seeds stayed on a plateau (eval loss ~3.7-4.0
 * against ~3.0), the step where the loss drops (steps 800-1600) not reached
 * in 4000 steps; which seeds did was decided by fc's draw jointly with the
 * last layer's (docs/log/2026-12-04-session-18.md). */
void df_params_init_fc_mean(const df_params *ps, const df_drafter_config *c, const df_basis *b,
                            float *flat)
{
    int i = df_params_find(ps, "fc.weight");
    if (i < 0)
        return;
    int64_t H = c->hidden_size, K = c->num_target_features, in = df_drafter_fc_in(c);
    float *w = flat + ps->p[i].offset; /* H x in, row-major */
    memset(w, 0, (size_t)(H * in) * sizeof *w);
    for (int64_t h = 0; h < H; h++)
        if (!b) {
            for (int64_t k = 0; k < K; k++)
                w[h * in + k * H + h] = (float)(1.0 / (double)K);
        } else { /* column r of fc_r: (1/K) sum_k P[r][k H + h] */
            for (int64_t r = 0; r < in; r++) {
                double sum = 0;
                for (int64_t k = 0; k < K; k++)
                    sum += b->P[r * (int64_t)b->D + k * H + h];
                w[h * in + r] = (float)(sum / (double)K);
            }
        }
}

/* "PREFIX=S[,PREFIX=S...]": each parameter whose name starts with PREFIX
 * drawn again with seed S (the bits that seed gives it). */
int df_params_init_overrides(const df_params *ps, float *flat, float std, const char *spec,
                              df_err *e)
{
    const char *p = spec;
    while (*p) {
        const char *eq = strchr(p, '='), *end = strchr(p, ',');
        if (!end)
            end = p + strlen(p);
        char *num_end = NULL;
        errno = 0;
        /* digits only: strtoull would take "-1" (wrapping) and an overflow (ULLONG_MAX) */
        unsigned long long seed = eq && eq < end && eq[1] >= '0' && eq[1] <= '9'
                                      ? strtoull(eq + 1, &num_end, 10) : 0;
        if (!eq || eq >= end || eq == p || num_end != end || seed == 0 || errno == ERANGE)
            return df_errf(e, -EINVAL, "--init-seed-for: '%.*s' is not PREFIX=SEED (SEED >= 1)",
                           (int)(end - p), p);
        int hits = 0;
        for (int i = 0; i < ps->n; i++)
            if (!strncmp(ps->p[i].name, p, (size_t)(eq - p))) {
                df_params_init_one(ps, i, flat, std, (uint64_t)seed);
                hits++;
            }
        if (!hits)
            return df_errf(e, -EINVAL, "--init-seed-for: no parameter name starts with '%.*s'",
                           (int)(eq - p), p);
        p = *end ? end + 1 : end;
    }
    return 0;
}
