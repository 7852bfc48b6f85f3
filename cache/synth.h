/* synth.h - hidden-state-like bf16 data: what `dflash cache synth` writes (a
 * cache to size and benchmark training without a target), and the codec
 * benchmark's and tests' input.
 *
 * Why synthetic data at all: the benchmarks must run anywhere (CI, a laptop)
 * without a model; and real data is only a sample of one model. What matters
 * to a byte-plane codec is the distribution of the bf16 high byte (sign and
 * exponent) within a block, so the generator reproduces the features of LLM
 * residual streams that shape it:
 *
 *   x[t][c] = mean_c + s_c * g_t * a[t][c]            (ordinary channels)
 *
 *   s_c   per-channel scale, log-normal: exp(N(0, chan_log_sigma)) * base_scale.
 *         Real residual streams have channels whose RMS differ by 10x and more
 *         (LayerNorm weights, outlier features); this spreads the exponents.
 *   mean_c a per-channel offset, N(0, mean_frac) * s_c: residual channels
 *         are not zero-mean.
 *   g_t   per-token gain, log-normal exp(N(0, token_log_sigma)): the norm of a
 *         token's hidden state varies with position and token type.
 *   a     unit-variance heavy-tailed noise: a Gaussian whose scale is itself
 *         log-normal, exp(N(0, tail)) (a scale mixture, so the tails are fatter
 *         than a Gaussian's, as measured activations are). With rho > 0 it is
 *         an AR(1) process along tokens, a = rho*a_prev + sqrt(1-rho^2)*noise:
 *         neighbouring tokens are correlated as in real text.
 *
 *   Massive activations (Sun et al. 2024, "Massive activations in LLMs"): a
 *   few fixed channels (massive_channels of them, picked from the seed) hold a
 *   large value of fixed sign, massive_gain * base_scale * g_t * (1 + 5% noise),
 *   and at "sink" tokens (token 0 and a sink_frac fraction of the others) ten
 *   times more: large LLMs show values ~1000x the median there in late layers.
 *
 * The defaults were set so that the split-zstd codec's ratio on this data
 * (~0.67 of raw) is close to what real hidden states of a small Qwen3 gave
 * (0.664-0.679, shared/models/qwen3-code-8m/README.md); the massive channels
 * add the large-model feature that the small model lacks. Everything is a
 * deterministic function of (tokens, hidden, seed, opts): one seed is one
 * "layer" (its channel scales), so the same seed gives the same channels.
 */
#ifndef DF_SYNTH_H
#define DF_SYNTH_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

typedef struct df_synth_opts {
    float base_scale;          /* median channel scale (default 1) */
    float chan_log_sigma;      /* sigma of ln(channel scale) (default 0.3) */
    float mean_frac;           /* sigma of channel mean / channel scale (default 0.3) */
    float token_log_sigma;     /* sigma of ln(token gain) (default 0.2) */
    float tail;                /* sigma of ln(per-element scale): tail weight (default 0.3) */
    float rho;                 /* AR(1) correlation of neighbouring tokens, [0,1) (default 0) */
    uint32_t massive_channels; /* channels with massive activations (default 4; 0 = none) */
    float massive_gain;        /* their size over base_scale (default 100) */
    float sink_frac;           /* fraction of tokens where they spike 10x more (default 0.01) */
} df_synth_opts;

/* Fills o with the defaults above. */
void df_synth_defaults(df_synth_opts *o);

/* Writes tokens x hidden bf16 values (row-major, host order = little-endian)
 * to out. opts NULL means the defaults. massive_channels is capped at hidden. */
void df_synth_bf16(uint16_t *out, size_t tokens, size_t hidden, uint64_t seed,
                   const df_synth_opts *opts);

/* Reads a raw little-endian bf16 file of whole rows of `hidden` elements
 * (e.g. a dump of real hidden states: `tensor.view(torch.int16).numpy().tofile()`).
 * On success *out (free() it) holds the values and *tokens the row count.
 * Returns 0, -errno, or -EINVAL when the size is not a whole number of rows. */
int df_synth_load_bf16(const char *path, size_t hidden, uint16_t **out, size_t *tokens,
                       df_err *e);

#endif
