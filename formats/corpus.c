/* corpus.c - .dtok reader, JSONL-in-memory corpora, the importer, and the
 * content accounting (fingerprint, stats) every corpus shares. The .dtok
 * writer is corpus_writer.c. See corpus.h for the contract and
 * docs/FORMAT-tokens.md for the bytes. */
#include "corpus.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "corpus_internal.h"
#include "crc32c.h"
#include "fsutil.h"
#include "jsonl.h"
#include "le.h"
#include "log.h"
#include "mapguard.h"
#include "sha256.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the .dtok reader returns mmap'd little-endian arrays as-is: little-endian hosts only"
#endif


/* Appends " [doc N]"-style context to an existing message. */
__attribute__((format(printf, 2, 3))) static void err_append(df_err *e, const char *fmt, ...)
{
    if (!e)
        return;
    size_t n = strlen(e->msg);
    if (n + 1 >= sizeof e->msg)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg + n, sizeof e->msg - n, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------ content accounting */

/* The fingerprint is SHA-256 over: the 16 bytes "dflash.corpus.v1"; then per
 * document u64 LE length, its ids as u32 LE, its effective mask as one 0/1
 * byte per token (all ones when absent); then u64 LE n_docs. */
/* A block of ones, the effective mask of maskless documents (filled once). */
uint8_t df_corpus_ones[4096];
static pthread_once_t ones_once = PTHREAD_ONCE_INIT;
static void ones_fill(void)
{
    memset(df_corpus_ones, 1, sizeof df_corpus_ones);
}

void df_corpus_fp_init(df_sha256_ctx *s)
{
    pthread_once(&ones_once, ones_fill);
    df_sha256_init(s);
    df_sha256_update(s, "dflash.corpus.v1", 16);
}

void df_corpus_fp_doc(df_sha256_ctx *s, const uint32_t *ids, const uint8_t *mask, uint64_t len)
{
    uint8_t b[8];
    df_put64(b, len);
    df_sha256_update(s, b, 8);
    if (len == 0)
        return;
    df_sha256_update(s, ids, (size_t)len * 4);
    if (mask) {
        df_sha256_update(s, mask, (size_t)len);
    } else {
        for (uint64_t done = 0; done < len;) {
            size_t k = len - done < sizeof df_corpus_ones ? (size_t)(len - done)
                                                          : sizeof df_corpus_ones;
            df_sha256_update(s, df_corpus_ones, k);
            done += k;
        }
    }
}

void df_corpus_fp_final(df_sha256_ctx *s, uint64_t n_docs, uint8_t out[32])
{
    uint8_t b[8];
    df_put64(b, n_docs);
    df_sha256_update(s, b, 8);
    df_sha256_final(s, out);
}

/* Adds one document to the running stats. Returns the number of mask zeros. */
uint64_t df_corpus_account(df_corpus_stats *st, const uint32_t *ids, const uint8_t *mask,
                           uint64_t len)
{
    uint32_t mx = st->max_id;
    for (uint64_t i = 0; i < len; i++)
        mx = ids[i] > mx ? ids[i] : mx;
    uint64_t ones = len;
    if (mask) {
        ones = 0;
        for (uint64_t i = 0; i < len; i++)
            ones += mask[i];
    }
    st->max_id = mx;
    st->n_docs++;
    st->n_tokens += len;
    st->n_loss_tokens += ones;
    if (len > st->max_doc_len)
        st->max_doc_len = len;
    if (len == 0)
        st->n_empty_docs++;
    if (ones != len)
        st->has_mask = 1;
    return len - ones;
}

int df_corpus_mask_valid(const uint8_t *mask, uint64_t len, uint64_t *bad)
{
    uint8_t acc = 0;
    for (uint64_t i = 0; i < len; i++)
        acc |= mask[i];
    if (!(acc & 0xFE))
        return 1;
    for (uint64_t i = 0; i < len; i++)
        if (mask[i] > 1) {
            *bad = i;
            return 0;
        }
    return 1;
}

/* ----------------------------------------------------------------- reader */

struct df_corpus {
    char name[256];
    void *map;
    size_t map_len;
    void *copy;              /* aligned copy of a .dtok memory buffer */
    const uint32_t *ids;
    const uint8_t *mask;     /* NULL: all ones */
    const uint64_t *offs;    /* n_docs + 1 entries */
    uint64_t n_docs;
    /* JSONL-built corpora own their arrays */
    uint32_t *j_ids;
    uint8_t *j_mask;
    uint64_t *j_offs, *j_lines;
    size_t ids_cap, mask_cap, offs_cap, lines_cap;
    df_corpus_stats st;
};

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* First document holding token index t (offs non-decreasing, validated). */
static uint64_t doc_of_token(const uint64_t *offs, uint64_t n_docs, uint64_t t)
{
    uint64_t lo = 0, hi = n_docs; /* answer in [lo, hi) */
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (offs[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    while (lo + 1 < n_docs && offs[lo + 1] <= t) /* skip empty docs sharing the offset */
        lo++;
    return lo;
}

/* Checks opts (vocab, max_len, strict_empty) against a loaded corpus. */
static int check_opts(const df_corpus *c, const df_corpus_opts *o, df_err *e)
{
    if (!o)
        return 0;
    const df_corpus_stats *st = &c->st;
    if (o->vocab && st->n_tokens && st->max_id >= o->vocab) {
        uint64_t t = 0;
        uint64_t n_tok = c->offs[c->n_docs];
        while (t < n_tok && c->ids[t] < o->vocab)
            t++;
        uint64_t d = doc_of_token(c->offs, c->n_docs, t);
        if (c->j_lines)
            return df_errf(e, -DF_EMISMATCH, "%s:%llu: doc %llu: input_ids[%llu] = %u >= vocab size %llu",
                           c->name, (unsigned long long)c->j_lines[d], (unsigned long long)d,
                           (unsigned long long)(t - c->offs[d]), c->ids[t],
                           (unsigned long long)o->vocab);
        return df_errf(e, -DF_EMISMATCH,
                       "%s: doc %llu: token %llu = %u >= vocab size %llu (at byte %llu)", c->name,
                       (unsigned long long)d, (unsigned long long)(t - c->offs[d]), c->ids[t],
                       (unsigned long long)o->vocab,
                       (unsigned long long)(DF_DTOK_HEADER_BYTES + 4 * t));
    }
    if (o->max_len && st->max_doc_len > o->max_len) {
        uint64_t d = 0;
        while (c->offs[d + 1] - c->offs[d] <= o->max_len)
            d++;
        return df_errf(e, -E2BIG, "%s: doc %llu: %llu tokens, more than max_len %llu", c->name,
                       (unsigned long long)d, (unsigned long long)(c->offs[d + 1] - c->offs[d]),
                       (unsigned long long)o->max_len);
    }
    if (o->strict_empty && st->n_empty_docs) {
        uint64_t d = 0;
        while (c->offs[d + 1] != c->offs[d])
            d++;
        return df_errf(e, -DF_ECORRUPT, "%s: doc %llu is empty (strict_empty)", c->name,
                       (unsigned long long)d);
    }
    return 0;
}

#define CORRUPT(...) df_errf(e, -DF_ECORRUPT, __VA_ARGS__)

/* Validates a whole .dtok image (8-byte aligned) and points c at its sections. */
static int dtok_load(df_corpus *c, const uint8_t *b, size_t len, const df_corpus_opts *o,
                     df_err *e)
{
    const char *nm = c->name;
    int skip_crc = o && o->skip_crc;
    if (len < DF_DTOK_HEADER_BYTES)
        return CORRUPT("%s: truncated: %zu bytes, the .dtok header alone is %d", nm, len,
                       DF_DTOK_HEADER_BYTES);
    if (memcmp(b + H_MAGIC, DF_DTOK_MAGIC, 8) != 0)
        return CORRUPT("%s: not a .dtok file (bad magic at byte 0)", nm);
    uint32_t version = df_le32(b + H_VERSION);
    if (version != DF_DTOK_VERSION)
        return df_errf(e, -DF_EVERSION, "%s: .dtok version %u, this build reads version %d", nm,
                       version, DF_DTOK_VERSION);
    if (!skip_crc) {
        uint32_t want = df_le32(b + H_CRC), got = df_crc32c(0, b, H_CRC);
        if (want != got)
            return CORRUPT("%s: header checksum mismatch (bytes 0-%d: stored %08x, computed %08x)",
                           nm, H_CRC - 1, want, got);
    }
    if (df_le32(b + H_HDRBYTES) != DF_DTOK_HEADER_BYTES)
        return CORRUPT("%s: header size %u at byte %d, expected %d", nm, df_le32(b + H_HDRBYTES),
                       H_HDRBYTES, DF_DTOK_HEADER_BYTES);
    uint32_t flags = df_le32(b + H_FLAGS);
    if (flags & ~F_KNOWN)
        return CORRUPT("%s: unknown flags 0x%x at byte %d", nm, flags, H_FLAGS);
    for (int i = H_RESERVED1; i < H_CRC; i++)
        if (b[i])
            return CORRUPT("%s: reserved header byte %d is not zero", nm, i);
    if (df_le32(b + H_RESERVED0))
        return CORRUPT("%s: reserved header bytes %d-%d are not zero", nm, H_RESERVED0,
                       H_RESERVED0 + 3);
    if (!(flags & F_SOURCE_SHA))
        for (int i = 0; i < 32; i++)
            if (b[H_SOURCE_SHA + i])
                return CORRUPT("%s: source fingerprint set but its flag is not", nm);

    uint64_t n_docs = df_le64(b + H_N_DOCS), n_tok = df_le64(b + H_N_TOKENS);
    int has_mask = (flags & F_MASK) != 0;
    /* Bound the counts by the file size before any arithmetic can overflow. */
    if (n_tok > len / 4 || n_docs > len / 8)
        return CORRUPT("%s: header counts (%llu docs, %llu tokens) do not fit a %zu-byte file",
                       nm, (unsigned long long)n_docs, (unsigned long long)n_tok, len);
    uint64_t mask_off = DF_DTOK_HEADER_BYTES + align8(n_tok * 4);
    uint64_t offs_off = mask_off + (has_mask ? align8(n_tok) : 0);
    uint64_t file_bytes = offs_off + 8 * (n_docs + 1);
    struct {
        int at;
        uint64_t want;
        const char *what;
    } fields[] = {{H_TOKENS_OFF, DF_DTOK_HEADER_BYTES, "tokens offset"},
                  {H_MASK_OFF, mask_off, "mask offset"},
                  {H_OFFSETS_OFF, offs_off, "offset-table offset"},
                  {H_FILE_BYTES, file_bytes, "file size"}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        uint64_t got = df_le64(b + fields[i].at);
        if (got != fields[i].want)
            return CORRUPT("%s: %s %llu (header byte %d) disagrees with the counts (%llu)", nm,
                           fields[i].what, (unsigned long long)got, fields[i].at,
                           (unsigned long long)fields[i].want);
    }
    if (len != file_bytes)
        return CORRUPT("%s: file is %zu bytes, header says %llu (%s)", nm, len,
                       (unsigned long long)file_bytes,
                       len < file_bytes ? "truncated" : "trailing bytes");
    /* Padding between sections is zero, so two writers never differ in junk. */
    for (uint64_t i = DF_DTOK_HEADER_BYTES + n_tok * 4; i < mask_off; i++)
        if (b[i])
            return CORRUPT("%s: padding byte %llu is not zero", nm, (unsigned long long)i);
    if (has_mask)
        for (uint64_t i = mask_off + n_tok; i < offs_off; i++)
            if (b[i])
                return CORRUPT("%s: padding byte %llu is not zero", nm, (unsigned long long)i);

    const uint32_t *ids = (const uint32_t *)(b + DF_DTOK_HEADER_BYTES);
    const uint8_t *mask = has_mask ? b + mask_off : NULL;
    const uint64_t *offs = (const uint64_t *)(b + offs_off);
    if (!skip_crc) {
        struct {
            const void *p;
            uint64_t n;
            int at;
            uint64_t off;
            const char *what;
        } secs[] = {{ids, n_tok * 4, H_CRC_TOKENS, DF_DTOK_HEADER_BYTES, "tokens"},
                    {mask, has_mask ? n_tok : 0, H_CRC_MASK, mask_off, "loss mask"},
                    {offs, 8 * (n_docs + 1), H_CRC_OFFSETS, offs_off, "offset table"}};
        for (size_t i = 0; i < 3; i++) {
            uint32_t want = df_le32(b + secs[i].at);
            uint32_t got = secs[i].n ? df_crc32c(0, secs[i].p, (size_t)secs[i].n) : 0;
            if (want != got)
                return CORRUPT("%s: %s section (bytes %llu-%llu) checksum mismatch: stored %08x, "
                               "computed %08x",
                               nm, secs[i].what, (unsigned long long)secs[i].off,
                               (unsigned long long)(secs[i].off + secs[i].n), want, got);
        }
    }
    /* The offset table: starts at 0, never decreases, ends at n_tokens. */
    uint64_t max_len = 0, n_empty = 0;
    if (offs[0] != 0)
        return CORRUPT("%s: offset table (byte %llu): first offset %llu, must be 0", nm,
                       (unsigned long long)offs_off, (unsigned long long)offs[0]);
    for (uint64_t i = 0; i < n_docs; i++) {
        if (offs[i + 1] < offs[i] || offs[i + 1] > n_tok)
            return CORRUPT("%s: doc %llu: end offset %llu (byte %llu) is %s", nm,
                           (unsigned long long)i, (unsigned long long)offs[i + 1],
                           (unsigned long long)(offs_off + 8 * (i + 1)),
                           offs[i + 1] > n_tok ? "past the last token" : "before its start");
        uint64_t l = offs[i + 1] - offs[i];
        max_len = l > max_len ? l : max_len;
        n_empty += l == 0;
    }
    if (offs[n_docs] != n_tok)
        return CORRUPT("%s: offset table ends at %llu, header says %llu tokens", nm,
                       (unsigned long long)offs[n_docs], (unsigned long long)n_tok);
    /* Content: the header's stats must be the data's (mask bytes 0/1, max id, counts). */
    uint32_t mx = 0;
    for (uint64_t i = 0; i < n_tok; i++)
        mx = ids[i] > mx ? ids[i] : mx;
    uint64_t ones = n_tok;
    if (mask) {
        uint64_t bad;
        if (!df_corpus_mask_valid(mask, n_tok, &bad)) {
            uint64_t d = doc_of_token(offs, n_docs, bad);
            return CORRUPT("%s: doc %llu: loss mask value %u at token %llu (byte %llu), 0/1 only",
                           nm, (unsigned long long)d, mask[bad],
                           (unsigned long long)(bad - offs[d]),
                           (unsigned long long)(mask_off + bad));
        }
        ones = 0;
        for (uint64_t i = 0; i < n_tok; i++)
            ones += mask[i];
    }
    struct {
        int at;
        uint64_t want;
        const char *what;
    } stats[] = {{H_N_LOSS, ones, "loss-token count"},
                 {H_MAX_DOC_LEN, max_len, "longest document"},
                 {H_N_EMPTY, n_empty, "empty-document count"}};
    for (size_t i = 0; i < sizeof stats / sizeof stats[0]; i++)
        if (df_le64(b + stats[i].at) != stats[i].want)
            return CORRUPT("%s: header %s %llu (byte %d) disagrees with the data (%llu)", nm,
                           stats[i].what, (unsigned long long)df_le64(b + stats[i].at),
                           stats[i].at, (unsigned long long)stats[i].want);
    if (df_le32(b + H_MAX_ID) != mx)
        return CORRUPT("%s: header max id %u (byte %d) disagrees with the data (%u)", nm,
                       df_le32(b + H_MAX_ID), H_MAX_ID, mx);

    c->ids = ids;
    c->mask = mask;
    c->offs = offs;
    c->n_docs = n_docs;
    df_corpus_stats *st = &c->st;
    st->format = DF_CORPUS_DTOK;
    st->version = version;
    st->n_docs = n_docs;
    st->n_tokens = n_tok;
    st->n_loss_tokens = ones;
    st->max_id = mx;
    st->max_doc_len = max_len;
    st->has_mask = has_mask && ones != n_tok;
    st->n_empty_docs = n_empty;
    st->n_empty_skipped = df_le64(b + H_N_SKIPPED);
    st->bytes_in = len;
    st->has_source_sha = (flags & F_SOURCE_SHA) != 0;
    memcpy(st->source_sha256, b + H_SOURCE_SHA, 32);
    memcpy(st->content_sha256, b + H_CONTENT_SHA, 32);
    return check_opts(c, o, e);
}

/* ------------------------------------------------------------- JSONL input */

typedef int (*sink_fn)(void *ctx, const df_jsonl_doc *d, uint64_t line, df_err *e);

/* Reads every line of r, applies opts, hands each non-empty document to fn.
 * *doc numbers documents across several inputs. */
static int ingest(df_jsonl_reader *r, const df_corpus_opts *o, df_corpus_stats *st,
                  uint64_t *doc, df_jsonl_doc *d, sink_fn fn, void *ctx, df_err *e)
{
    const char *name = df_jsonl_reader_name(r);
    const char *line;
    size_t len;
    uint64_t line_no;
    int rc;
    uint64_t vocab = o ? o->vocab : 0;
    while ((rc = df_jsonl_reader_next(r, &line, &len, &line_no, e)) > 0) {
        rc = df_jsonl_parse_line(line, len, name, line_no, vocab, d, e);
        if (rc < 0) {
            err_append(e, " [doc %llu]", (unsigned long long)*doc);
            return rc;
        }
        if (rc == 1) {
            st->n_blank_lines++;
            continue;
        }
        if (d->len == 0) {
            if (o && o->strict_empty)
                return df_errf(e, -DF_ECORRUPT, "%s:%llu: empty document (input_ids is []) [doc %llu]",
                               name, (unsigned long long)line_no, (unsigned long long)*doc);
            if (st->n_empty_skipped < DF_CORPUS_EMPTY_LINES)
                st->empty_lines[st->n_empty_skipped] = line_no;
            st->n_empty_skipped++;
            continue;
        }
        if (o && o->max_len && d->len > o->max_len)
            return df_errf(e, -E2BIG, "%s:%llu: document has %zu tokens, more than max_len %llu [doc %llu]",
                           name, (unsigned long long)line_no, d->len,
                           (unsigned long long)o->max_len, (unsigned long long)*doc);
        if ((rc = fn(ctx, d, line_no, e)) < 0) {
            err_append(e, " (%s:%llu)", name, (unsigned long long)line_no);
            return rc;
        }
        (*doc)++;
    }
    st->bytes_in += df_jsonl_reader_bytes(r);
    return rc;
}

static void warn_empty(const char *name, const df_corpus_stats *st)
{
    if (!st->n_empty_skipped)
        return;
    char lines[160] = "";
    size_t n = 0;
    uint64_t k = st->n_empty_skipped < DF_CORPUS_EMPTY_LINES ? st->n_empty_skipped
                                                              : DF_CORPUS_EMPTY_LINES;
    for (uint64_t i = 0; i < k && n < sizeof lines; i++)
        n += (size_t)snprintf(lines + n, sizeof lines - n, "%s%llu", i ? ", " : "",
                              (unsigned long long)st->empty_lines[i]);
    df_log(DF_LOG_WARN, "%s: skipped %llu empty document(s) (input_ids []), line(s) %s%s", name,
           (unsigned long long)st->n_empty_skipped, lines,
           st->n_empty_skipped > k ? ", ..." : "");
}

typedef struct {
    df_corpus *c;
    df_sha256_ctx fp;
    uint64_t n_tok;
} mem_sink;

static int mem_add(void *ctx, const df_jsonl_doc *d, uint64_t line, df_err *e)
{
    mem_sink *m = ctx;
    df_corpus *c = m->c;
    uint64_t n = c->st.n_docs, t = m->n_tok;
    size_t need = (size_t)(t + d->len);
    if (need > c->ids_cap) {
        size_t nc = c->ids_cap ? c->ids_cap : 65536;
        while (nc < need)
            nc *= 2;
        uint32_t *p = realloc(c->j_ids, nc * 4);
        if (!p)
            return df_errf(e, -ENOMEM, "%s: out of memory for %zu tokens", c->name, nc);
        c->j_ids = p;
        c->ids_cap = nc;
    }
    if ((d->has_mask || c->j_mask) && need > c->mask_cap) {
        size_t nc = c->ids_cap;
        uint8_t *p = realloc(c->j_mask, nc);
        if (!p)
            return df_errf(e, -ENOMEM, "%s: out of memory for %zu mask bytes", c->name, nc);
        if (!c->j_mask) /* first masked doc: the earlier ones had all-ones masks */
            memset(p, 1, (size_t)t);
        c->j_mask = p;
        c->mask_cap = nc;
    }
    if (n + 2 > c->offs_cap) {
        size_t nc = c->offs_cap ? c->offs_cap * 2 : 4096;
        uint64_t *p = realloc(c->j_offs, nc * 8), *q;
        if (p)
            c->j_offs = p;
        q = p ? realloc(c->j_lines, nc * 8) : NULL;
        if (!q)
            return df_errf(e, -ENOMEM, "%s: out of memory for %zu documents", c->name, nc);
        c->j_lines = q;
        c->offs_cap = nc;
    }
    memcpy(c->j_ids + t, d->ids, d->len * 4);
    const uint8_t *mask = d->has_mask ? d->mask : NULL;
    if (c->j_mask) {
        if (mask)
            memcpy(c->j_mask + t, mask, d->len);
        else
            memset(c->j_mask + t, 1, d->len);
    }
    c->j_offs[0] = 0;
    c->j_offs[n + 1] = t + d->len;
    c->j_lines[n] = line;
    df_corpus_fp_doc(&m->fp, d->ids, mask, d->len);
    df_corpus_account(&c->st, d->ids, mask, d->len);
    m->n_tok += d->len;
    return 0;
}

static int jsonl_load(df_corpus *c, df_jsonl_reader *r, const df_corpus_opts *o, df_err *e)
{
    mem_sink m;
    memset(&m, 0, sizeof m);
    m.c = c;
    df_corpus_fp_init(&m.fp);
    df_jsonl_doc d;
    df_jsonl_doc_init(&d);
    uint64_t doc = 0;
    c->st.format = DF_CORPUS_JSONL;
    int rc = ingest(r, o, &c->st, &doc, &d, mem_add, &m, e);
    df_jsonl_doc_free(&d);
    if (rc < 0)
        return rc;
    if (!c->j_offs) { /* no documents at all */
        c->j_offs = calloc(1, 8);
        if (!c->j_offs)
            return df_errf(e, -ENOMEM, "%s: out of memory", c->name);
    }
    if (c->j_mask && !c->st.has_mask) { /* every mask was all ones: same as none */
        free(c->j_mask);
        c->j_mask = NULL;
    }
    df_corpus_fp_final(&m.fp, c->st.n_docs, c->st.content_sha256);
    c->ids = c->j_ids;
    c->mask = c->j_mask;
    c->offs = c->j_offs;
    c->n_docs = c->st.n_docs;
    warn_empty(c->name, &c->st);
    return check_opts(c, o, e);
}

/* ---------------------------------------------------------------- opening */

static df_corpus *corpus_new(const char *name)
{
    df_corpus *c = calloc(1, sizeof *c);
    if (c)
        snprintf(c->name, sizeof c->name, "%s", name);
    return c;
}

static int finish_open(df_corpus *c, int rc, df_corpus **out)
{
    if (rc < 0) {
        df_corpus_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

int df_corpus_open_mem(const void *buf, size_t len, const char *name, const df_corpus_opts *o,
                       df_corpus **out, df_err *e)
{
    *out = NULL;
    if (!name)
        name = "<memory>";
    df_corpus *c = corpus_new(name);
    if (!c)
        return df_errf(e, -ENOMEM, "%s: out of memory", name);
    int rc;
    if (ends_with(name, ".dtok") || (len >= 8 && !memcmp(buf, DF_DTOK_MAGIC, 8))) {
        const void *img = buf;
        if ((uintptr_t)buf % 8) { /* the sections are read as u32/u64 arrays */
            c->copy = malloc(len ? len : 1);
            if (!c->copy)
                return finish_open(c, df_errf(e, -ENOMEM, "%s: out of memory", name), out);
            memcpy(c->copy, buf, len);
            img = c->copy;
        }
        rc = dtok_load(c, img, len, o, e);
    } else {
        df_jsonl_reader *r;
        rc = df_jsonl_reader_open_mem(buf, len, name, NULL, &r, e);
        if (rc >= 0) {
            rc = jsonl_load(c, r, o, e);
            df_jsonl_reader_close(r);
        }
    }
    return finish_open(c, rc, out);
}

int df_corpus_open(const char *path, const df_corpus_opts *o, df_corpus **out, df_err *e)
{
    *out = NULL;
    df_corpus *c = corpus_new(path);
    if (!c)
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    int fd = df_open_regular(path, O_RDONLY, 0, e); /* a FIFO would block open(2) */
    if (fd < 0)
        return finish_open(c, fd, out);
    struct stat st;
    char magic[8];
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return finish_open(c, df_errf(e, -EINVAL, "%s: not a regular file", path), out);
    }
    int is_dtok = ends_with(path, ".dtok") ||
                  (st.st_size >= 8 && pread(fd, magic, 8, 0) == 8 && !memcmp(magic, DF_DTOK_MAGIC, 8));
    int rc;
    if (is_dtok) {
        size_t len = (size_t)st.st_size;
        if (len < DF_DTOK_HEADER_BYTES) {
            close(fd);
            return finish_open(c, dtok_load(c, (const uint8_t *)"", len, o, e), out);
        }
        void *m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        close(fd);
        if (m == MAP_FAILED)
            return finish_open(c, df_errf(e, -errno, "%s: mmap failed: %s", path, strerror(errno)),
                               out);
        c->map = m;
        c->map_len = len;
        (void)df_mapguard_add(m, len, path); /* a clear error if the file shrinks under us */
        rc = dtok_load(c, m, len, o, e);
    } else {
        close(fd);
        df_jsonl_reader *r;
        rc = df_jsonl_reader_open(path, NULL, &r, e);
        if (rc >= 0) {
            rc = jsonl_load(c, r, o, e);
            df_jsonl_reader_close(r);
        }
    }
    return finish_open(c, rc, out);
}

void df_corpus_close(df_corpus *c)
{
    if (!c)
        return;
    if (c->map) {
        df_mapguard_remove(c->map);
        munmap(c->map, c->map_len);
    }
    free(c->copy);
    free(c->j_ids);
    free(c->j_mask);
    free(c->j_offs);
    free(c->j_lines);
    free(c);
}

uint64_t df_corpus_n_docs(const df_corpus *c)
{
    return c->n_docs;
}

uint64_t df_corpus_n_tokens(const df_corpus *c)
{
    return c->st.n_tokens;
}

int df_corpus_doc(const df_corpus *c, uint64_t i, const uint32_t **ids, const uint8_t **mask,
                  uint64_t *len)
{
    if (i >= c->n_docs)
        return df_errf(NULL, -EINVAL, "doc out of range");
    uint64_t a = c->offs[i], b = c->offs[i + 1];
    *ids = c->ids + a;
    *mask = c->mask ? c->mask + a : NULL;
    *len = b - a;
    return 0;
}

uint64_t df_corpus_doc_line(const df_corpus *c, uint64_t i)
{
    return c->j_lines && i < c->n_docs ? c->j_lines[i] : 0;
}

void df_corpus_stats_get(const df_corpus *c, df_corpus_stats *out)
{
    *out = c->st;
}

void df_corpus_fingerprint(const df_corpus *c, char out[65])
{
    df_sha256_hex(c->st.content_sha256, out);
}

void df_corpus_fingerprint_compute(const df_corpus *c, uint8_t out[32])
{
    df_sha256_ctx s;
    df_corpus_fp_init(&s);
    for (uint64_t i = 0; i < c->n_docs; i++) {
        uint64_t a = c->offs[i], b = c->offs[i + 1];
        df_corpus_fp_doc(&s, c->ids + a, c->mask ? c->mask + a : NULL, b - a);
    }
    df_corpus_fp_final(&s, c->n_docs, out);
}

/* --------------------------------------------------------------- importer */

typedef struct {
    df_corpus_writer *w;
} file_sink;

static int file_add(void *ctx, const df_jsonl_doc *d, uint64_t line, df_err *e)
{
    file_sink *f = ctx;
    (void)line;
    return df_corpus_writer_add(f->w, d->ids, d->has_mask ? d->mask : NULL, d->len, e);
}

int df_corpus_import(const char *const *inputs, size_t n_inputs, const char *out_path,
                     const df_corpus_opts *o, df_corpus_stats *stats, df_err *e)
{
    df_corpus_stats st;
    memset(&st, 0, sizeof st);
    if (n_inputs == 0)
        return df_errf(e, -EINVAL, "%s: no input files", out_path);
    df_corpus_writer *w;
    int rc = df_corpus_writer_open(out_path, &w, e);
    if (rc < 0)
        return rc;
    df_sha256_ctx src;
    df_sha256_init(&src);
    df_jsonl_doc d;
    df_jsonl_doc_init(&d);
    file_sink f = {w};
    uint64_t doc = 0;
    for (size_t i = 0; i < n_inputs && rc >= 0; i++) {
        df_jsonl_reader *r;
        rc = df_jsonl_reader_open(inputs[i], &src, &r, e);
        if (rc < 0)
            break;
        df_corpus_stats fs; /* this file's view, merged below */
        memset(&fs, 0, sizeof fs);
        rc = ingest(r, o, &fs, &doc, &d, file_add, &f, e);
        if (rc >= 0)
            warn_empty(df_jsonl_reader_name(r), &fs);
        df_jsonl_reader_close(r);
        for (uint64_t k = 0; k < fs.n_empty_skipped && k < DF_CORPUS_EMPTY_LINES; k++)
            if (st.n_empty_skipped + k < DF_CORPUS_EMPTY_LINES)
                st.empty_lines[st.n_empty_skipped + k] = fs.empty_lines[k];
        st.n_empty_skipped += fs.n_empty_skipped;
        st.n_blank_lines += fs.n_blank_lines;
        st.bytes_in += fs.bytes_in;
    }
    df_jsonl_doc_free(&d);
    if (rc < 0) {
        df_corpus_writer_abort(w);
        return rc;
    }
    uint8_t sha[32];
    df_sha256_final(&src, sha);
    df_corpus_writer_set_source(w, sha, st.n_empty_skipped);
    df_corpus_stats ws;
    rc = df_corpus_writer_finish(w, &ws, e);
    if (rc < 0)
        return rc;
    /* the writer's content stats + the importer's view of the input */
    ws.n_empty_skipped = st.n_empty_skipped;
    memcpy(ws.empty_lines, st.empty_lines, sizeof ws.empty_lines);
    ws.n_blank_lines = st.n_blank_lines;
    ws.bytes_in = st.bytes_in;
    if (stats)
        *stats = ws;
    return 0;
}
