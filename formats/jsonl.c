/* jsonl.c - see jsonl.h for the contract. */
#include "jsonl.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sha256.h"

/* ---------------------------------------------------------------- buffers */

void df_jsonl_doc_init(df_jsonl_doc *d)
{
    memset(d, 0, sizeof *d);
}

void df_jsonl_doc_free(df_jsonl_doc *d)
{
    free(d->ids);
    free(d->mask);
    memset(d, 0, sizeof *d);
}

/* Grows *buf to hold at least need elements of size sz (doubling, so appends
 * are amortized O(1)). Returns 0 or -ENOMEM. */
static int grow(void **buf, size_t *cap, size_t need, size_t sz)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : 1024;
    while (nc < need) {
        if (nc > SIZE_MAX / 2 / sz)
            return -ENOMEM;
        nc *= 2;
    }
    void *p = realloc(*buf, nc * sz);
    if (!p)
        return -ENOMEM;
    *buf = p;
    *cap = nc;
    return 0;
}

/* ----------------------------------------------------------------- parser */

typedef struct {
    const char *s, *end;
    const char *file;
    uint64_t line;
    df_err *e;
} parser;

__attribute__((format(printf, 4, 5))) static int perr(const parser *x, const char *at, int code,
                                                      const char *fmt, ...)
{
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return df_errf(x->e, code, "%s:%llu:%zu: %s", x->file, (unsigned long long)x->line,
                   (size_t)(at - x->s) + 1, what);
}

/* A short, printable description of the byte at p for messages. */
static const char *show(const parser *x, const char *p, char buf[16])
{
    if (p >= x->end)
        return "end of line";
    unsigned char c = (unsigned char)*p;
    if (c >= 0x20 && c < 0x7f)
        snprintf(buf, 16, "'%c'", c);
    else
        snprintf(buf, 16, "byte 0x%02x", c);
    return buf;
}

static inline const char *skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n'))
        p++;
    return p;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Scans a string starting at the opening quote *pp. When key != NULL the
 * decoded ASCII text is stored there (keycap bytes incl. NUL; longer or
 * non-ASCII text is marked with *key_ok = 0, since it cannot be one of ours). */
static int scan_string(const parser *x, const char **pp, char *key, size_t keycap, int *key_ok)
{
    const char *p = *pp + 1, *end = x->end;
    size_t kn = 0;
    int ok = 1;
    char tmp[16];
    for (;;) {
        if (p >= end)
            return perr(x, *pp, -DF_ECORRUPT, "unterminated string");
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            break;
        if (c < 0x20)
            return perr(x, p, -DF_ECORRUPT, "control character (%s) inside a string",
                        show(x, p, tmp));
        int dc = c; /* decoded character, or -1 for non-ASCII */
        if (c == '\\') {
            if (p + 1 >= end)
                return perr(x, p, -DF_ECORRUPT, "unterminated escape");
            char esc = p[1];
            switch (esc) {
            case '"': case '\\': case '/': dc = esc; p += 2; break;
            case 'b': dc = '\b'; p += 2; break;
            case 'f': dc = '\f'; p += 2; break;
            case 'n': dc = '\n'; p += 2; break;
            case 'r': dc = '\r'; p += 2; break;
            case 't': dc = '\t'; p += 2; break;
            case 'u': {
                if (end - p < 6)
                    return perr(x, p, -DF_ECORRUPT, "truncated \\u escape");
                int v = 0;
                for (int i = 2; i < 6; i++) {
                    int h = hexval(p[i]);
                    if (h < 0)
                        return perr(x, p, -DF_ECORRUPT, "bad \\u escape (needs 4 hex digits)");
                    v = v * 16 + h;
                }
                dc = v < 0x80 ? v : -1;
                p += 6;
                break;
            }
            default:
                return perr(x, p, -DF_ECORRUPT, "bad escape \\%s",
                            show(x, p + 1, tmp));
            }
        } else {
            if (c >= 0x80)
                dc = -1;
            p++;
        }
        if (key) {
            if (dc < 0 || kn + 1 >= keycap)
                ok = 0;
            else
                key[kn++] = (char)dc;
        }
    }
    if (key) {
        key[ok ? kn : 0] = 0;
        *key_ok = ok;
    }
    *pp = p + 1;
    return 0;
}

/* Scans a JSON number with the full grammar -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?
 * (only for skipped values: token ids take the fast path below). */
static int scan_number(const parser *x, const char **pp)
{
    const char *p = *pp, *end = x->end, *start = p;
    if (p < end && *p == '-')
        p++;
    if (p >= end || *p < '0' || *p > '9')
        return perr(x, start, -DF_ECORRUPT, "malformed number");
    if (*p == '0') {
        p++;
    } else {
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9')
            return perr(x, start, -DF_ECORRUPT, "malformed number (digit expected after '.')");
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || *p < '0' || *p > '9')
            return perr(x, start, -DF_ECORRUPT, "malformed number (digit expected in exponent)");
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    *pp = p;
    return 0;
}

static int match_lit(const char *p, const char *end, const char *lit, size_t n)
{
    return (size_t)(end - p) >= n && memcmp(p, lit, n) == 0;
}

/* Skips any JSON value at *pp (after whitespace), checking its syntax. */
static int skip_value(const parser *x, const char **pp, int depth)
{
    const char *p = skip_ws(*pp, x->end), *end = x->end;
    char tmp[16];
    int rc;
    if (p >= end)
        return perr(x, p, -DF_ECORRUPT, "value expected, found end of line");
    switch (*p) {
    case '"':
        if ((rc = scan_string(x, &p, NULL, 0, NULL)) < 0)
            return rc;
        break;
    case 't':
        if (!match_lit(p, end, "true", 4))
            return perr(x, p, -DF_ECORRUPT, "bad literal (true?)");
        p += 4;
        break;
    case 'f':
        if (!match_lit(p, end, "false", 5))
            return perr(x, p, -DF_ECORRUPT, "bad literal (false?)");
        p += 5;
        break;
    case 'n':
        if (!match_lit(p, end, "null", 4))
            return perr(x, p, -DF_ECORRUPT, "bad literal (null?)");
        p += 4;
        break;
    case '[':
    case '{': {
        char open = *p, close = open == '[' ? ']' : '}';
        if (depth >= DF_JSONL_MAX_DEPTH)
            return perr(x, p, -DF_ECORRUPT, "nesting deeper than %d", DF_JSONL_MAX_DEPTH);
        p = skip_ws(p + 1, end);
        if (p < end && *p == close) {
            p++;
            break;
        }
        for (;;) {
            if (open == '{') {
                p = skip_ws(p, end);
                if (p >= end || *p != '"')
                    return perr(x, p, -DF_ECORRUPT, "object key (string) expected, found %s",
                                show(x, p, tmp));
                if ((rc = scan_string(x, &p, NULL, 0, NULL)) < 0)
                    return rc;
                p = skip_ws(p, end);
                if (p >= end || *p != ':')
                    return perr(x, p, -DF_ECORRUPT, "':' expected, found %s", show(x, p, tmp));
                p++;
            }
            if ((rc = skip_value(x, &p, depth + 1)) < 0)
                return rc;
            p = skip_ws(p, end);
            if (p < end && *p == ',') {
                p++;
                continue;
            }
            if (p < end && *p == close) {
                p++;
                break;
            }
            return perr(x, p, -DF_ECORRUPT, "',' or '%c' expected, found %s", close,
                        show(x, p, tmp));
        }
        break;
    }
    default:
        if (*p == '-' || (*p >= '0' && *p <= '9')) {
            if ((rc = scan_number(x, &p)) < 0)
                return rc;
            break;
        }
        return perr(x, p, -DF_ECORRUPT, "value expected, found %s", show(x, p, tmp));
    }
    *pp = p;
    return 0;
}

/* Reports why the element at p is not a token id. */
static int bad_id(const parser *x, const char *p, size_t idx)
{
    char tmp[16];
    if (p < x->end && *p == '-')
        return perr(x, p, -DF_ECORRUPT, "input_ids[%zu]: negative token id", idx);
    if (p < x->end && (*p == '"' || *p == 't' || *p == 'f' || *p == 'n' || *p == '[' || *p == '{'))
        return perr(x, p, -DF_ECORRUPT, "input_ids[%zu]: not an integer (%s)", idx,
                    show(x, p, tmp));
    return perr(x, p, -DF_ECORRUPT, "input_ids[%zu]: token id expected, found %s", idx,
                show(x, p, tmp));
}

/* The hot loop: an array of unsigned decimal integers < limit (<= 2^32). */
static int parse_ids(const parser *x, const char **pp, uint64_t limit, df_jsonl_doc *d)
{
    const char *p = *pp + 1, *end = x->end;
    char tmp[16];
    size_t n = 0;
    p = skip_ws(p, end);
    if (p < end && *p == ']') {
        d->len = 0;
        *pp = p + 1;
        return 0;
    }
    for (;;) {
        const char *start = p;
        if (p >= end || (unsigned)(*p - '0') > 9)
            return bad_id(x, p, n);
        uint64_t v = (uint64_t)(*p++ - '0');
        if (v == 0 && p < end && (unsigned)(*p - '0') <= 9)
            return perr(x, start, -DF_ECORRUPT, "input_ids[%zu]: leading zero", n);
        while (p < end && (unsigned)(*p - '0') <= 9) {
            v = v * 10 + (uint64_t)(*p++ - '0');
            if (v > 0xFFFFFFFFull) /* checked per digit, so v never overflows */
                return perr(x, start, -DF_ECORRUPT, "input_ids[%zu]: id does not fit 32 bits", n);
        }
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
            return perr(x, start, -DF_ECORRUPT,
                        "input_ids[%zu]: not an integer (fraction/exponent)", n);
        if (v >= limit)
            return perr(x, start, -DF_EMISMATCH, "input_ids[%zu]: id %llu >= vocab size %llu", n,
                        (unsigned long long)v, (unsigned long long)limit);
        if (n >= d->ids_cap && grow((void **)&d->ids, &d->ids_cap, n + 1, sizeof *d->ids) < 0)
            return perr(x, start, -ENOMEM, "out of memory for %zu token ids", n + 1);
        d->ids[n++] = (uint32_t)v;
        if (p < end && *p == ',') { /* common case: "1,2,3" */
            p = skip_ws(p + 1, end);
            continue;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == ']')
            break;
        return perr(x, p, -DF_ECORRUPT, "input_ids: ',' or ']' expected, found %s",
                    show(x, p, tmp));
    }
    d->len = n;
    *pp = p + 1;
    return 0;
}

static int parse_mask(const parser *x, const char **pp, df_jsonl_doc *d)
{
    const char *p = *pp + 1, *end = x->end;
    char tmp[16];
    size_t n = 0;
    p = skip_ws(p, end);
    if (p < end && *p == ']') {
        d->mask_len = 0;
        *pp = p + 1;
        return 0;
    }
    for (;;) {
        const char *start = p;
        uint8_t v;
        if (p < end && (*p == '0' || *p == '1')) {
            v = (uint8_t)(*p++ - '0');
            if (p < end && ((unsigned)(*p - '0') <= 9 || *p == '.' || *p == 'e' || *p == 'E'))
                return perr(x, start, -DF_ECORRUPT, "loss_mask[%zu]: only 0, 1, true, false allowed",
                            n);
        } else if (match_lit(p, end, "true", 4)) {
            v = 1;
            p += 4;
        } else if (match_lit(p, end, "false", 5)) {
            v = 0;
            p += 5;
        } else {
            return perr(x, start, -DF_ECORRUPT,
                        "loss_mask[%zu]: only 0, 1, true, false allowed, found %s", n,
                        show(x, p, tmp));
        }
        if (n >= d->mask_cap && grow((void **)&d->mask, &d->mask_cap, n + 1, 1) < 0)
            return perr(x, start, -ENOMEM, "out of memory for %zu mask values", n + 1);
        d->mask[n++] = v;
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == ']')
            break;
        return perr(x, p, -DF_ECORRUPT, "loss_mask: ',' or ']' expected, found %s",
                    show(x, p, tmp));
    }
    d->mask_len = n;
    *pp = p + 1;
    return 0;
}

int df_jsonl_parse_line(const char *line, size_t n, const char *file, uint64_t line_no,
                        uint64_t id_limit, df_jsonl_doc *d, df_err *e)
{
    parser x = {line, line + n, file ? file : "<jsonl>", line_no, e};
    const char *p = skip_ws(line, x.end), *end = x.end;
    const char *ids_at = NULL, *mask_at = NULL;
    char tmp[16];
    int rc;
    if (id_limit == 0 || id_limit > 0x100000000ull)
        id_limit = 0x100000000ull;
    d->len = 0;
    d->mask_len = 0;
    d->has_mask = 0;
    if (p >= end)
        return 1;
    if (*p != '{')
        return perr(&x, p, -DF_ECORRUPT, "'{' expected at the start of a document, found %s",
                    show(&x, p, tmp));
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}') {
        p++;
    } else {
        for (;;) {
            char key[16];
            int key_ok;
            const char *key_at = p;
            if (p >= end || *p != '"')
                return perr(&x, p, -DF_ECORRUPT, "object key (string) expected, found %s",
                            show(&x, p, tmp));
            if ((rc = scan_string(&x, &p, key, sizeof key, &key_ok)) < 0)
                return rc;
            p = skip_ws(p, end);
            if (p >= end || *p != ':')
                return perr(&x, p, -DF_ECORRUPT, "':' expected after a key, found %s",
                            show(&x, p, tmp));
            p = skip_ws(p + 1, end);
            if (key_ok && !strcmp(key, "input_ids")) {
                if (ids_at)
                    return perr(&x, key_at, -DF_ECORRUPT, "duplicate key input_ids");
                ids_at = key_at;
                if (p >= end || *p != '[')
                    return perr(&x, p, -DF_ECORRUPT, "input_ids: array expected, found %s",
                                show(&x, p, tmp));
                if ((rc = parse_ids(&x, &p, id_limit, d)) < 0)
                    return rc;
            } else if (key_ok && !strcmp(key, "loss_mask")) {
                if (mask_at)
                    return perr(&x, key_at, -DF_ECORRUPT, "duplicate key loss_mask");
                mask_at = key_at;
                if (match_lit(p, end, "null", 4)) { /* null = no mask = all ones */
                    p += 4;
                } else {
                    if (p >= end || *p != '[')
                        return perr(&x, p, -DF_ECORRUPT,
                                    "loss_mask: array (or null) expected, found %s",
                                    show(&x, p, tmp));
                    if ((rc = parse_mask(&x, &p, d)) < 0)
                        return rc;
                    d->has_mask = 1;
                }
            } else {
                if ((rc = skip_value(&x, &p, 1)) < 0)
                    return rc;
            }
            p = skip_ws(p, end);
            if (p < end && *p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            if (p < end && *p == '}') {
                p++;
                break;
            }
            return perr(&x, p, -DF_ECORRUPT, "',' or '}' expected, found %s", show(&x, p, tmp));
        }
    }
    p = skip_ws(p, end);
    if (p < end)
        return perr(&x, p, -DF_ECORRUPT,
                    "unexpected %s after the document (one JSON object per line)",
                    show(&x, p, tmp));
    if (!ids_at)
        return perr(&x, line, -DF_ECORRUPT, "missing key input_ids");
    if (d->has_mask && d->mask_len != d->len)
        return perr(&x, mask_at, -DF_ECORRUPT, "loss_mask has %zu values but input_ids has %zu",
                    d->mask_len, d->len);
    return 0;
}

/* ----------------------------------------------------------------- reader */

struct df_jsonl_reader {
    int fd;          /* -1 for memory */
    int close_fd;
    char *buf;       /* owned, or the caller's memory */
    size_t cap;      /* allocated bytes (0 for memory) */
    size_t start;    /* first byte of the unread data */
    size_t fill;     /* end of valid data */
    size_t scan;     /* where to resume searching for '\n' */
    int eof;
    uint64_t line_no;
    uint64_t consumed;
    df_sha256_ctx *sha;
    char name[256];
};

static int reader_new(const char *name, void *sha, df_jsonl_reader **out, df_err *e)
{
    df_jsonl_reader *r = calloc(1, sizeof *r);
    *out = r;
    if (!r)
        return df_errf(e, -ENOMEM, "%s: out of memory", name);
    r->fd = -1;
    r->sha = sha;
    snprintf(r->name, sizeof r->name, "%s", name);
    return 0;
}

int df_jsonl_reader_open(const char *path, void *sha, df_jsonl_reader **out, df_err *e)
{
    *out = NULL;
    int is_stdin = !strcmp(path, "-");
    df_jsonl_reader *r = NULL;
    int rc = reader_new(is_stdin ? "<stdin>" : path, sha, &r, e);
    if (rc < 0)
        return rc;
    if (is_stdin) {
        r->fd = 0;
    } else {
        r->fd = open(path, O_RDONLY | O_CLOEXEC);
        if (r->fd < 0) {
            rc = df_errf(e, -errno, "%s: cannot open: %s", path, strerror(errno));
            free(r);
            return rc;
        }
        r->close_fd = 1;
#ifdef POSIX_FADV_SEQUENTIAL
        posix_fadvise(r->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
    }
    r->cap = 4u << 20; /* big reads: a syscall per 4 MiB is noise */
    r->buf = malloc(r->cap);
    if (!r->buf) {
        df_jsonl_reader_close(r);
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    }
    *out = r;
    return 0;
}

int df_jsonl_reader_open_mem(const void *buf, size_t n, const char *name, void *sha,
                             df_jsonl_reader **out, df_err *e)
{
    *out = NULL;
    df_jsonl_reader *r = NULL;
    int rc = reader_new(name ? name : "<memory>", sha, &r, e);
    if (rc < 0)
        return rc;
    r->buf = (char *)buf; /* never written: memory readers do not refill */
    r->fill = n;
    r->eof = 1;
    if (sha && n)
        df_sha256_update(sha, buf, n);
    *out = r;
    return 0;
}

/* Moves the pending bytes to the front, grows if the buffer is full, reads more. */
static int reader_fill(df_jsonl_reader *r, df_err *e)
{
    if (r->start > 0) {
        memmove(r->buf, r->buf + r->start, r->fill - r->start);
        r->fill -= r->start;
        r->scan -= r->start;
        r->start = 0;
    }
    if (r->fill == r->cap) {
        if (r->cap >= DF_JSONL_MAX_LINE)
            return df_errf(e, -DF_ECORRUPT, "%s:%llu: line longer than %llu bytes", r->name,
                           (unsigned long long)r->line_no + 1,
                           (unsigned long long)DF_JSONL_MAX_LINE);
        size_t nc = r->cap * 2;
        char *nb = realloc(r->buf, nc);
        if (!nb)
            return df_errf(e, -ENOMEM, "%s:%llu: out of memory for a %zu-byte line", r->name,
                           (unsigned long long)r->line_no + 1, nc);
        r->buf = nb;
        r->cap = nc;
    }
    for (;;) {
        ssize_t got = read(r->fd, r->buf + r->fill, r->cap - r->fill);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return df_errf(e, -errno, "%s: read failed at byte %llu: %s", r->name,
                           (unsigned long long)(r->consumed + r->fill), strerror(errno));
        if (got == 0) {
            r->eof = 1;
        } else {
            if (r->sha)
                df_sha256_update(r->sha, r->buf + r->fill, (size_t)got);
            r->fill += (size_t)got;
        }
        return 0;
    }
}

int df_jsonl_reader_next(df_jsonl_reader *r, const char **line, size_t *len, uint64_t *line_no,
                         df_err *e)
{
    for (;;) {
        if (r->scan < r->fill) {
            char *nl = memchr(r->buf + r->scan, '\n', r->fill - r->scan);
            if (nl) {
                size_t ln = (size_t)(nl - (r->buf + r->start));
                *line = r->buf + r->start;
                *len = ln;
                *line_no = ++r->line_no;
                r->consumed += ln + 1;
                r->start += ln + 1;
                r->scan = r->start;
                return 1;
            }
            r->scan = r->fill;
        }
        if (r->eof) {
            if (r->start < r->fill) { /* last line without '\n' */
                *line = r->buf + r->start;
                *len = r->fill - r->start;
                *line_no = ++r->line_no;
                r->consumed += *len;
                r->start = r->scan = r->fill;
                return 1;
            }
            return 0;
        }
        int rc = reader_fill(r, e);
        if (rc < 0)
            return rc;
    }
}

uint64_t df_jsonl_reader_bytes(const df_jsonl_reader *r)
{
    return r->consumed;
}

const char *df_jsonl_reader_name(const df_jsonl_reader *r)
{
    return r->name;
}

void df_jsonl_reader_close(df_jsonl_reader *r)
{
    if (!r)
        return;
    if (r->close_fd && r->fd >= 0)
        close(r->fd);
    if (r->cap)
        free(r->buf);
    free(r);
}
