#include "synth.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dtype.h"

void df_synth_defaults(df_synth_opts *o)
{
    o->base_scale = 1.0f;
    o->chan_log_sigma = 0.3f;
    o->mean_frac = 0.3f;
    o->token_log_sigma = 0.2f;
    o->tail = 0.3f;
    o->rho = 0.0f;
    o->massive_channels = 4;
    o->massive_gain = 100.0f;
    o->sink_frac = 0.01f;
}

/* splitmix64: tiny, seedable, and good enough for test data. */
typedef struct synth_rng {
    uint64_t s;
    double spare; /* Box-Muller makes normals in pairs */
    int has_spare;
} synth_rng;

static uint64_t rng_u64(synth_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1): never 0, so log() is finite. */
static double rng_unit(synth_rng *r)
{
    return ((double)(rng_u64(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double rng_normal(synth_rng *r)
{
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u = rng_unit(r), v = rng_unit(r);
    double m = sqrt(-2.0 * log(u));
    r->spare = m * sin(6.283185307179586 * v);
    r->has_spare = 1;
    return m * cos(6.283185307179586 * v);
}

void df_synth_bf16(uint16_t *out, size_t tokens, size_t hidden, uint64_t seed,
                   const df_synth_opts *opts)
{
    df_synth_opts o;
    if (opts)
        o = *opts;
    else
        df_synth_defaults(&o);
    if (!tokens || !hidden)
        return;
    if (o.massive_channels > hidden)
        o.massive_channels = (uint32_t)hidden;
    if (o.rho < 0 || o.rho >= 1)
        o.rho = 0;

    /* Channel parameters come from the seed alone (one seed = one layer);
     * token noise from a second stream, so changing `tokens` keeps channels. */
    synth_rng rc = {seed * 0x2545F4914F6CDD1Dull + 1, 0, 0};
    synth_rng rt = {seed ^ 0xD1B54A32D192ED03ull, 0, 0};

    float *scale = malloc(hidden * sizeof *scale);
    float *mean = malloc(hidden * sizeof *mean);
    float *state = calloc(hidden, sizeof *state);
    float *massive = calloc(hidden, sizeof *massive); /* signed size, 0 = ordinary */
    if (!scale || !mean || !state || !massive) {
        /* Test-data generator: on OOM fill zeros rather than crash callers. */
        memset(out, 0, tokens * hidden * sizeof *out);
        goto done;
    }
    for (size_t c = 0; c < hidden; c++) {
        scale[c] = o.base_scale * (float)exp(o.chan_log_sigma * rng_normal(&rc));
        mean[c] = o.mean_frac * scale[c] * (float)rng_normal(&rc);
    }
    for (uint32_t k = 0; k < o.massive_channels; k++) {
        size_t c;
        do
            c = (size_t)(rng_u64(&rc) % hidden);
        while (massive[c] != 0);
        float sign = (rng_u64(&rc) & 1) ? 1.0f : -1.0f;
        massive[c] = sign * o.massive_gain * o.base_scale * (float)(0.5 + rng_unit(&rc));
    }

    const float innov = sqrtf(1.0f - o.rho * o.rho);
    for (size_t t = 0; t < tokens; t++) {
        float g = (float)exp(o.token_log_sigma * rng_normal(&rt));
        int sink = t == 0 || rng_unit(&rt) < o.sink_frac;
        uint16_t *row = out + t * hidden;
        for (size_t c = 0; c < hidden; c++) {
            float z = (float)(rng_normal(&rt) * exp(o.tail * rng_normal(&rt)));
            /* scale-mixture variance is exp(2 tail^2): renormalize to unit */
            z *= (float)exp(-o.tail * o.tail);
            float a = t == 0 || o.rho == 0 ? z : o.rho * state[c] + innov * z;
            state[c] = a;
            float x;
            if (massive[c] != 0)
                x = massive[c] * g * (sink ? 10.0f : 1.0f) * (1.0f + 0.05f * z);
            else
                x = mean[c] + scale[c] * g * a;
            row[c] = df_f32_to_bf16(x);
        }
    }
done:
    free(scale);
    free(mean);
    free(state);
    free(massive);
}

int df_synth_load_bf16(const char *path, size_t hidden, uint16_t **out, size_t *tokens,
                       df_err *e)
{
    *out = NULL;
    *tokens = 0;
    if (!hidden)
        return df_errf(e, -EINVAL, "%s: hidden size must be > 0", path);
    FILE *f = fopen(path, "rb");
    if (!f)
        return df_errf(e, -errno, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        int rc = -errno;
        fclose(f);
        return df_errf(e, rc, "%s: stat: %s", path, strerror(-rc));
    }
    size_t row = hidden * 2, size = (size_t)st.st_size;
    if (size == 0 || size % row) {
        fclose(f);
        return df_errf(e, -EINVAL, "%s: size %zu is not a whole number of %zu-element bf16 rows",
                       path, size, hidden);
    }
    uint16_t *buf = malloc(size);
    if (!buf) {
        fclose(f);
        return df_errf(e, -ENOMEM, "%s: cannot allocate %zu bytes", path, size);
    }
    if (fread(buf, 1, size, f) != size) {
        int rc = ferror(f) ? -EIO : -EINVAL;
        fclose(f);
        free(buf);
        return df_errf(e, rc, "%s: short read", path);
    }
    fclose(f);
    *out = buf;
    *tokens = size / row;
    return 0;
}
