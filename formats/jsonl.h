/* jsonl.h - the tokenized-corpus JSONL line parser and a streaming line reader.
 *
 * One line = one document:  {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
 *
 * Contract of df_jsonl_parse_line (hand-written for speed: the corpus can hold
 * billions of token ids, and a generic JSON tree costs an allocation per number):
 *   - the line is one JSON object; JSON whitespace (space, tab, CR, LF) is
 *     accepted anywhere JSON allows it, so a CRLF line end is fine;
 *   - "input_ids" (required): array of integers 0 <= id < 2^32, or < id_limit
 *     when id_limit > 0 (the vocabulary size). Negative numbers, fractions and
 *     exponents ("1.0", "1e3") are rejected, never rounded;
 *   - "loss_mask" (optional; absent or null = all ones): array of 0/1 or
 *     true/false, exactly as long as input_ids;
 *   - keys in any order; other keys are skipped whatever their value (strings,
 *     numbers, nested arrays/objects up to DF_JSONL_MAX_DEPTH levels), but their
 *     syntax is still checked; a repeated input_ids or loss_mask is an error;
 *   - nothing but whitespace after the closing brace.
 * A line of only whitespace is "blank": the parser returns 1 and the caller
 * decides (the corpus layer skips and counts blank lines).
 *
 * Errors return -DF_ECORRUPT (bad syntax or content) or -DF_EMISMATCH (an id
 * >= id_limit), with a message "FILE:LINE:COL: what", COL = 1-based byte
 * column, naming the array index for bad elements ("input_ids[17]").
 *
 * Buffers are caller-owned and grow as needed (df_jsonl_doc keeps its
 * capacity from line to line, so steady-state parsing does not allocate).
 */
#ifndef DF_JSONL_H
#define DF_JSONL_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DF_JSONL_MAX_DEPTH 64              /* nesting of skipped values */
#define DF_JSONL_MAX_LINE (1ull << 30)     /* longest line the reader accepts */

typedef struct df_jsonl_doc {
    uint32_t *ids;    /* len token ids */
    uint8_t *mask;    /* len values 0/1 when has_mask, else unspecified */
    size_t len;       /* number of input_ids */
    int has_mask;     /* 1 when the line had a non-null loss_mask */
    /* private: capacities (elements) and the parsed mask length */
    size_t ids_cap, mask_cap, mask_len;
} df_jsonl_doc;

/* A zeroed struct is a valid empty doc; _free releases the buffers. */
void df_jsonl_doc_init(df_jsonl_doc *d);
void df_jsonl_doc_free(df_jsonl_doc *d);

/* Parses line[0..n) (the newline excluded; it need not be NUL-terminated).
 * file/line_no only feed error messages. id_limit = 0: any u32 id.
 * Returns 0 (a document in d), 1 (blank line; d->len = 0) or a negative code. */
int df_jsonl_parse_line(const char *line, size_t n, const char *file, uint64_t line_no,
                        uint64_t id_limit, df_jsonl_doc *d, df_err *e);

/* Streaming line reader over a file, stdin ("-") or a memory buffer.
 * Lines end at '\n'; the last line may lack it. Bytes are read in large
 * chunks; a line longer than DF_JSONL_MAX_LINE is an error. */
typedef struct df_jsonl_reader df_jsonl_reader;

/* sha (optional, may be NULL): a df_sha256_ctx* (common/sha256.h) that every byte read is fed
 * to, in order (the source fingerprint of an import). */
int df_jsonl_reader_open(const char *path, void *sha, df_jsonl_reader **out, df_err *e);
/* The buffer must outlive the reader; name is used in messages. */
int df_jsonl_reader_open_mem(const void *buf, size_t n, const char *name, void *sha,
                             df_jsonl_reader **out, df_err *e);
/* Returns 1 with the next line in *line, *len (valid until the next call) and
 * its 1-based number in *line_no; 0 at end of input; negative on error. */
int df_jsonl_reader_next(df_jsonl_reader *r, const char **line, size_t *len,
                         uint64_t *line_no, df_err *e);
/* Bytes consumed so far. */
uint64_t df_jsonl_reader_bytes(const df_jsonl_reader *r);
/* The name used in messages ("<stdin>" for "-"). */
const char *df_jsonl_reader_name(const df_jsonl_reader *r);
void df_jsonl_reader_close(df_jsonl_reader *r);

#ifdef __cplusplus
}
#endif
#endif
