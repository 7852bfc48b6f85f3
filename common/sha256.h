/* sha256.h - SHA-256 (FIPS 180-4), our own implementation.
 *
 * Used to fingerprint config.json and corpora in cache manifests, so a cache
 * made from one model/corpus is never silently reused with another. Not used
 * for anything secret: no constant-time concerns.
 *
 * Streaming: df_sha256_init, any number of df_sha256_update, df_sha256_final.
 * Any split of the input into update calls gives the same digest as the
 * one-shot df_sha256(). The context is a plain struct (no allocation) and can
 * be copied to fork a running hash. Not thread-safe per context.
 */
#ifndef DF_SHA256_H
#define DF_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

#define DF_SHA256_LEN 32 /* digest bytes */
#define DF_SHA256_HEX 65 /* hex digits + NUL */

typedef struct df_sha256_ctx {
    uint32_t h[8];
    uint64_t nbytes;  /* total bytes fed so far */
    uint8_t buf[64];  /* partial block */
    size_t nbuf;      /* bytes used in buf, < 64 */
} df_sha256_ctx;

void df_sha256_init(df_sha256_ctx *s);
void df_sha256_update(df_sha256_ctx *s, const void *data, size_t len);
/* Writes the digest; the context must be re-initialised before reuse. */
void df_sha256_final(df_sha256_ctx *s, uint8_t out[DF_SHA256_LEN]);

/* One shot. */
void df_sha256(const void *data, size_t len, uint8_t out[DF_SHA256_LEN]);

/* Lower-case hex of a digest into out (64 digits + NUL). */
void df_sha256_hex(const uint8_t digest[DF_SHA256_LEN], char out[DF_SHA256_HEX]);

/* hex of SHA-256 of data (convenience: one-shot + hex). */
void df_sha256_hex_of(const void *data, size_t len, char out[DF_SHA256_HEX]);

/* Which compression runs: 1 the x86 SHA extensions (SHA-NI, chosen where the
 * CPU has them), 0 the portable code. Same digests either way. */
int df_sha256_hw(void);
/* Tests and benchmarks: on 0 forces the portable code, on 1 uses SHA-NI where
 * the CPU has it; returns the previous df_sha256_hw(). Process-wide: not to be
 * called while other threads hash. */
int df_sha256_use_hw(int on);

/* Hashes a whole file by streaming reads (corpora can be large).
 * Returns 0, or a negative errno with e naming the file and offset. */
int df_sha256_file(const char *path, char out_hex[DF_SHA256_HEX], df_err *e);

#endif
