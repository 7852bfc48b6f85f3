/* corpus.h - tokenized corpora: binary token shards (.dtok), JSONL, one opener.
 *
 * A corpus is a list of documents; document i = len_i token ids (u32) and a
 * loss mask (one 0/1 byte per token; "no mask" means all ones). Two forms:
 *   - .dtok, the binary shard (docs/FORMAT-tokens.md, byte by byte): written
 *     by df_corpus_writer (streaming, bounded memory, atomic finish), read by
 *     mmap with every byte validated at open (header, sizes vs file length,
 *     offset table, section CRC32Cs, mask values, max id), then random access
 *     by document index in O(1) with no copy;
 *   - JSONL ({"input_ids":[..],"loss_mask":[..]} per line, jsonl.h), parsed
 *     whole into memory by df_corpus_open (about 5 bytes per token: import big
 *     corpora to .dtok once instead).
 * df_corpus_open takes either (".dtok" name or the magic -> binary, else
 * JSONL), so every consumer accepts both.
 *
 * Empty documents (input_ids []) are skipped by the importer and the JSONL
 * opener by default, counted, and logged (warning with the first line
 * numbers); opts.strict_empty makes them an error. Blank lines are skipped.
 *
 * Error codes: -DF_ECORRUPT (malformed or inconsistent data, failed CRC),
 * -DF_EVERSION (a .dtok version this build does not read), -DF_EMISMATCH (a
 * token id >= opts.vocab), -E2BIG (a document longer than opts.max_len),
 * -EINVAL (bad arguments), errno codes for I/O. Messages name the file and
 * the place: "FILE:LINE:COL" for JSONL, "FILE: doc N" / "at byte X" for .dtok.
 *
 * Fingerprint: SHA-256 over the token content only (independent of the form:
 * the same documents in JSONL or .dtok, with or without an all-ones mask,
 * give the same fingerprint). Defined in docs/FORMAT-tokens.md.
 *
 * An open df_corpus is read-only: df_corpus_doc may be called from many threads.
 * A .dtok must not be truncated by someone else while mapped (SIGBUS).
 *
 * Host byte order must be little-endian (x86-64, aarch64): the mmap'd
 * sections are returned as-is.
 */
#ifndef DF_CORPUS_H
#define DF_CORPUS_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DF_DTOK_MAGIC "DFLASHTK"
#define DF_DTOK_VERSION 1
#define DF_DTOK_HEADER_BYTES 256

enum { DF_CORPUS_DTOK = 1, DF_CORPUS_JSONL = 2 };

typedef struct df_corpus_opts {
    uint64_t vocab;    /* > 0: every id must be < vocab (error names doc + token index) */
    uint64_t max_len;  /* > 0: every document must have <= max_len tokens */
    int strict_empty;  /* an empty document is an error instead of skipped/counted */
    int skip_crc;      /* .dtok: do not check CRCs (fuzzing, or a quick look); every
                          structural check still runs, so access stays memory-safe */
} df_corpus_opts;

#define DF_CORPUS_EMPTY_LINES 8 /* how many empty-document line numbers are kept */

typedef struct df_corpus_stats {
    int format;                /* DF_CORPUS_DTOK or DF_CORPUS_JSONL */
    uint32_t version;          /* .dtok version (0 for JSONL) */
    uint64_t n_docs;           /* documents held (after skipping empty ones) */
    uint64_t n_tokens;
    uint64_t n_loss_tokens;    /* tokens with mask 1 */
    uint32_t max_id;           /* largest id (0 when there are no tokens) */
    uint64_t max_doc_len;
    int has_mask;              /* some mask value is 0 (else the mask is all ones) */
    uint64_t n_empty_docs;     /* empty documents held (only a writer told to keep them) */
    uint64_t n_empty_skipped;  /* empty documents skipped (import/JSONL open) */
    uint64_t empty_lines[DF_CORPUS_EMPTY_LINES]; /* their first line numbers (JSONL) */
    uint64_t n_blank_lines;    /* whitespace-only lines skipped (JSONL) */
    uint64_t bytes_in;         /* bytes of input read (JSONL / import) or file size (.dtok) */
    int has_source_sha;
    uint8_t source_sha256[32]; /* SHA-256 of the input bytes the .dtok was imported from */
    uint8_t content_sha256[32];/* the fingerprint (see df_corpus_fingerprint) */
} df_corpus_stats;

/* ------------------------------------------------------------------ reading */

typedef struct df_corpus df_corpus;

/* Opens a .dtok or a JSONL file (see the top of this file). opts may be NULL. */
int df_corpus_open(const char *path, const df_corpus_opts *opts, df_corpus **out, df_err *e);

/* The same from memory (name: for messages and for the ".dtok" rule). A .dtok
 * buffer is used in place when 8-byte aligned (it must outlive the corpus),
 * else copied; JSONL is parsed into the corpus. */
int df_corpus_open_mem(const void *buf, size_t len, const char *name, const df_corpus_opts *opts,
                       df_corpus **out, df_err *e);

void df_corpus_close(df_corpus *c);

uint64_t df_corpus_n_docs(const df_corpus *c);
uint64_t df_corpus_n_tokens(const df_corpus *c);

/* Document i: *ids (len values) and *mask (len 0/1 bytes, or NULL meaning all
 * ones); pointers stay valid until df_corpus_close. i >= n_docs: -EINVAL. */
int df_corpus_doc(const df_corpus *c, uint64_t i, const uint32_t **ids, const uint8_t **mask,
                  uint64_t *len);

/* 1-based JSONL line of document i (0 for .dtok), for messages of later stages. */
uint64_t df_corpus_doc_line(const df_corpus *c, uint64_t i);

void df_corpus_stats_get(const df_corpus *c, df_corpus_stats *out);

/* The content fingerprint, 64 lower-case hex digits + NUL. */
void df_corpus_fingerprint(const df_corpus *c, char out[65]);

/* Recomputes the fingerprint from the tokens (opening a .dtok trusts the one
 * in its CRC-protected header; this is the slow, independent check). */
void df_corpus_fingerprint_compute(const df_corpus *c, uint8_t out[32]);

/* ------------------------------------------------------------------ writing */

typedef struct df_corpus_writer df_corpus_writer;

/* Starts path.tmp (the final path appears only at finish). Memory use is a
 * few MiB whatever the corpus size: sections stream to disk. */
int df_corpus_writer_open(const char *path, df_corpus_writer **out, df_err *e);

/* Appends one document. mask may be NULL (all ones); values must be 0/1.
 * len 0 is stored as an empty document (the importer skips them before). */
int df_corpus_writer_add(df_corpus_writer *w, const uint32_t *ids, const uint8_t *mask,
                         uint64_t len, df_err *e);

/* Provenance stored in the header: SHA-256 of the input bytes (NULL: none)
 * and the number of empty documents the importer skipped. */
void df_corpus_writer_set_source(df_corpus_writer *w, const uint8_t source_sha256[32],
                                 uint64_t n_empty_skipped);

/* Writes the header, fsyncs, renames path.tmp to path, fsyncs the directory;
 * then frees w (also on error, removing the temporary file). stats optional. */
int df_corpus_writer_finish(df_corpus_writer *w, df_corpus_stats *stats, df_err *e);

/* Discards everything written (removes path.tmp) and frees w. */
void df_corpus_writer_abort(df_corpus_writer *w);

/* ---------------------------------------------------------------- importing */

/* JSONL files (or "-" for stdin) -> one .dtok at out_path, streaming. opts:
 * vocab / max_len / strict_empty as for reading. stats (optional) gets the
 * summary; the source fingerprint is the SHA-256 of all input bytes in order. */
int df_corpus_import(const char *const *inputs, size_t n_inputs, const char *out_path,
                     const df_corpus_opts *opts, df_corpus_stats *stats, df_err *e);

#ifdef __cplusplus
}
#endif
#endif
