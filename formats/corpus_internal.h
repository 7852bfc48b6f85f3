/* corpus_internal.h - what the .dtok writer (corpus_writer.c) and the rest of
 * the corpus code (corpus.c: reader, JSONL corpora, importer) share; not part
 * of the public API (corpus.h).
 *
 * The header layout and the content accounting must be one for both sides:
 * a corpus's fingerprint and stats are the same whether computed while
 * writing, while loading JSONL, or recomputed from an opened .dtok.
 * df_corpus_fp_init must run before df_corpus_ones is read (it fills it once).
 */
#ifndef DF_CORPUS_INTERNAL_H
#define DF_CORPUS_INTERNAL_H

#include <stdint.h>

#include "corpus.h"
#include "sha256.h"

/* Header field offsets (docs/FORMAT-tokens.md). */
enum {
    H_MAGIC = 0,
    H_VERSION = 8,
    H_HDRBYTES = 12,
    H_FLAGS = 16,
    H_MAX_ID = 20,
    H_N_DOCS = 24,
    H_N_TOKENS = 32,
    H_N_LOSS = 40,
    H_MAX_DOC_LEN = 48,
    H_N_EMPTY = 56,
    H_N_SKIPPED = 64,
    H_TOKENS_OFF = 72,
    H_MASK_OFF = 80,
    H_OFFSETS_OFF = 88,
    H_FILE_BYTES = 96,
    H_CRC_TOKENS = 104,
    H_CRC_MASK = 108,
    H_CRC_OFFSETS = 112,
    H_RESERVED0 = 116,
    H_CONTENT_SHA = 120,
    H_SOURCE_SHA = 152,
    H_RESERVED1 = 184,
    H_CRC = 252,
};
enum { F_MASK = 1u, F_SOURCE_SHA = 2u, F_KNOWN = 3u };

static inline uint64_t align8(uint64_t v)
{
    return (v + 7) & ~(uint64_t)7;
}

/* corpus.c: content accounting (the fingerprint is defined there). */
extern uint8_t df_corpus_ones[4096]; /* a block of ones: the mask of maskless documents */
void df_corpus_fp_init(df_sha256_ctx *s);
void df_corpus_fp_doc(df_sha256_ctx *s, const uint32_t *ids, const uint8_t *mask, uint64_t len);
void df_corpus_fp_final(df_sha256_ctx *s, uint64_t n_docs, uint8_t out[32]);
/* Adds one document to the running stats. Returns the number of mask zeros. */
uint64_t df_corpus_account(df_corpus_stats *st, const uint32_t *ids, const uint8_t *mask,
                           uint64_t len);
/* 1 when every mask byte is 0 or 1; else 0 with *bad the first other one. */
int df_corpus_mask_valid(const uint8_t *mask, uint64_t len, uint64_t *bad);

#endif
