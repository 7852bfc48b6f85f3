/* cmd_corpus.c - `dflash corpus import|info|show`: JSONL -> .dtok, inspection.
 * Exit codes (cmds.h): 0 ok, 1 bad data or I/O, 2 bad usage. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmds.h"
#include "corpus.h"
#include "fsutil.h"
#include "hfconfig.h"
#include "opt.h"
#include "sha256.h"

static const char *IMPORT_HELP =
    "usage: dflash corpus import --out FILE.dtok [options] INPUT.jsonl... (- = stdin)\n"
    "\n"
    "Converts JSONL lines {\"input_ids\": [...], \"loss_mask\": [...]} (loss_mask optional:\n"
    "all ones) into one binary token shard (.dtok), checked and written atomically.\n"
    "\n"
    "  --out FILE        output .dtok (required; written as FILE.tmp, then renamed)\n"
    "  --vocab N         every token id must be < N\n"
    "  --model DIR       take N from DIR/config.json (vocab_size)\n"
    "  --max-len N       a document longer than N tokens is an error\n"
    "  --strict-empty    an empty document (input_ids []) is an error (default: skipped,\n"
    "                    counted and reported)\n"
    "  --quiet           no summary\n"
    "\n"
    "Without --vocab/--model ids are only checked to fit 32 bits.\n";

static const char *INFO_HELP =
    "usage: dflash corpus info FILE [--json]\n"
    "\n"
    "Validates a corpus (.dtok: header, sizes, offsets, every CRC; JSONL: every line) and\n"
    "prints its header and statistics. --json prints one JSON object.\n";

static const char *SHOW_HELP =
    "usage: dflash corpus show FILE --doc N [--json]\n"
    "\n"
    "Prints document N (0-based) of a .dtok or JSONL corpus: its token ids and loss mask.\n"
    "--json prints it as a JSONL line {\"input_ids\": [...], \"loss_mask\": [...]}.\n";

static void usage(FILE *f)
{
    fprintf(f, "usage: dflash corpus <import|info|show> [options]   (--help on each)\n\n"
               "  import   JSONL -> binary token shard (.dtok)\n"
               "  info     header and statistics of a .dtok or JSONL corpus\n"
               "  show     one document's ids and loss mask\n");
}

static int is_help(const char *a)
{
    return !strcmp(a, "--help") || !strcmp(a, "-h");
}

/* "--name VALUE" or "--name=VALUE": returns the value and advances *i, or NULL. */
static const char *opt_value(int argc, char **argv, int *i, const char *name, int *missing)
{
    size_t n = strlen(name);
    const char *a = argv[*i];
    if (strncmp(a, name, n) != 0)
        return NULL;
    if (a[n] == '=')
        return a + n + 1;
    if (a[n] != 0)
        return NULL;
    if (*i + 1 >= argc) {
        *missing = 1;
        return NULL;
    }
    return argv[++*i];
}

/* A numeric option in [min, max] (common/opt.h); on error prints the message naming
 * the option, the value and the range, for command cmd. */
static int opt_u64(const char *cmd, const char *name, const char *v, uint64_t min, uint64_t max,
                   uint64_t *out)
{
    df_err pe = {0};
    if (!df_opt_u64(name, v, min, max, out, &pe))
        return 0;
    fprintf(stderr, "dflash corpus %s: %s\n", cmd, pe.msg);
    return -1;
}

static void hex32(const uint8_t b[32], char out[65])
{
    df_sha256_hex(b, out);
}

static int cmd_import(int argc, char **argv)
{
    const char *out = NULL, *model = NULL;
    uint64_t vocab = 0, max_len = 0;
    int strict_empty = 0, quiet = 0, vocab_given = 0;
    const char **inputs = calloc((size_t)argc + 1, sizeof *inputs);
    size_t n_in = 0;
    int only_inputs = 0;
    if (!inputs)
        return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        int missing = 0;
        if (only_inputs || !strcmp(a, "-") || a[0] != '-') {
            inputs[n_in++] = a;
        } else if (!strcmp(a, "--")) {
            only_inputs = 1;
        } else if (is_help(a)) {
            fputs(IMPORT_HELP, stdout);
            free(inputs);
            return 0;
        } else if ((v = opt_value(argc, argv, &i, "--out", &missing))) {
            out = v;
        } else if ((v = opt_value(argc, argv, &i, "--model", &missing))) {
            model = v;
        } else if ((v = opt_value(argc, argv, &i, "--vocab", &missing))) {
            if (opt_u64("import", "--vocab", v, 1, 0x100000000ull, &vocab) < 0) {
                free(inputs);
                return 2;
            }
            vocab_given = 1;
        } else if ((v = opt_value(argc, argv, &i, "--max-len", &missing))) {
            if (opt_u64("import", "--max-len", v, 1, UINT32_MAX, &max_len) < 0) {
                free(inputs);
                return 2;
            }
        } else if (!strcmp(a, "--strict-empty")) {
            strict_empty = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else {
            fprintf(stderr, missing ? "dflash corpus import: %s needs a value\n"
                                    : "dflash corpus import: unknown option %s\n", a);
            fprintf(stderr, "(dflash corpus import --help for the options)\n");
            free(inputs);
            return 2;
        }
    }
    const char *why = !out ? "--out FILE.dtok is required"
                      : !n_in ? "no input files (give JSONL files, or - for stdin)"
                      : (vocab_given && model) ? "give --vocab or --model, not both"
                      : NULL;
    if (why) {
        fprintf(stderr, "dflash corpus import: %s\n(dflash corpus import --help for the options)\n",
                why);
        free(inputs);
        return 2;
    }
    df_err e = {0};
    if (model) {
        df_model_config mc;
        if (df_model_config_load(model, &mc, &e) < 0) {
            fprintf(stderr, "dflash corpus import: --model: %s\n", e.msg);
            free(inputs);
            return 1;
        }
        vocab = (uint64_t)mc.vocab_size;
    }
    df_corpus_opts o = {.vocab = vocab, .max_len = max_len, .strict_empty = strict_empty};
    df_corpus_stats st;
    double t0 = df_now();
    int rc = df_corpus_import(inputs, n_in, out, &o, &st, &e);
    double dt = df_now() - t0;
    free(inputs);
    if (rc < 0) {
        fprintf(stderr, "dflash corpus import: %s\n", e.msg);
        return 1;
    }
    if (!quiet) {
        char fp[65];
        hex32(st.content_sha256, fp);
        printf("imported %" PRIu64 " docs, %" PRIu64 " tokens (%" PRIu64 " loss tokens) -> %s\n",
               st.n_docs, st.n_tokens, st.n_loss_tokens, out);
        printf("  empty docs skipped: %" PRIu64, st.n_empty_skipped);
        for (uint64_t i = 0; i < st.n_empty_skipped && i < DF_CORPUS_EMPTY_LINES; i++)
            printf("%s%" PRIu64, i ? ", " : " (line ", st.empty_lines[i]);
        if (st.n_empty_skipped)
            printf("%s)", st.n_empty_skipped > DF_CORPUS_EMPTY_LINES ? ", ..." : "");
        printf("; blank lines: %" PRIu64 "\n", st.n_blank_lines);
        printf("  max id: %u%s; longest doc: %" PRIu64 " tokens; loss mask: %s\n", st.max_id,
               vocab ? "" : " (no --vocab: not checked against a vocabulary)", st.max_doc_len,
               st.has_mask ? "stored" : "all ones (not stored)");
        printf("  %.1f MB in %.3f s: %.1f MB/s, %.2f M tokens/s\n", (double)st.bytes_in / 1e6, dt,
               dt > 0 ? (double)st.bytes_in / 1e6 / dt : 0.0,
               dt > 0 ? (double)st.n_tokens / 1e6 / dt : 0.0);
        printf("  fingerprint: %s\n", fp);
    }
    return 0;
}

/* Shared by info and show: FILE plus a few options. */
typedef struct {
    const char *file;
    int json;
    int has_doc;
    uint64_t doc;
} view_args;

static int parse_view(int argc, char **argv, const char *cmd, const char *help, int want_doc,
                      view_args *va)
{
    memset(va, 0, sizeof *va);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        int missing = 0;
        if (is_help(a)) {
            fputs(help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            va->json = 1;
        } else if (want_doc && (v = opt_value(argc, argv, &i, "--doc", &missing))) {
            if (opt_u64(cmd, "--doc", v, 0, UINT64_MAX, &va->doc) < 0)
                return 2;
            va->has_doc = 1;
        } else if (a[0] != '-' && !va->file) {
            va->file = a;
        } else {
            fprintf(stderr,
                    missing ? "dflash corpus %s: %s needs a value\n"
                    : a[0] == '-' ? "dflash corpus %s: unknown option %s\n"
                                  : "dflash corpus %s: one FILE only (%s)\n",
                    cmd, a);
            return 2;
        }
    }
    if (!va->file || (want_doc && !va->has_doc)) {
        fprintf(stderr, "dflash corpus %s: %s\n%s", cmd,
                !va->file ? "FILE is required" : "--doc N is required", help);
        return 2;
    }
    return -1; /* go on */
}

static int cmd_info(int argc, char **argv)
{
    view_args va;
    int u = parse_view(argc, argv, "info", INFO_HELP, 0, &va);
    if (u >= 0)
        return u;
    df_err e = {0};
    df_corpus *c;
    double t0 = df_now();
    if (df_corpus_open(va.file, NULL, &c, &e) < 0) {
        fprintf(stderr, "dflash corpus info: %s\n", e.msg);
        return 1;
    }
    double dt = df_now() - t0;
    df_corpus_stats s;
    df_corpus_stats_get(c, &s);
    char fp[65], src[65] = "";
    df_corpus_fingerprint(c, fp);
    if (s.has_source_sha)
        hex32(s.source_sha256, src);
    double mean = s.n_docs ? (double)s.n_tokens / (double)s.n_docs : 0.0;
    const char *fmt = s.format == DF_CORPUS_DTOK ? "dtok" : "jsonl";
    if (va.json) {
        printf("{\"file\": \"");
        for (const char *p = va.file; *p; p++) { /* paths may hold quotes or backslashes */
            if (*p == '"' || *p == '\\')
                putchar('\\');
            putchar((unsigned char)*p < 0x20 ? '?' : *p);
        }
        printf("\", \"format\": \"%s\", \"version\": %u, \"docs\": %" PRIu64 ", \"tokens\": %" PRIu64
               ", \"loss_tokens\": %" PRIu64 ", \"max_id\": %u, \"max_doc_len\": %" PRIu64
               ", \"mean_doc_len\": %.3f, \"has_mask\": %s, \"empty_docs\": %" PRIu64
               ", \"empty_docs_skipped\": %" PRIu64 ", \"blank_lines\": %" PRIu64
               ", \"bytes\": %" PRIu64 ", \"fingerprint\": \"%s\", \"source_sha256\": %s%s%s}\n",
               fmt, s.version, s.n_docs, s.n_tokens, s.n_loss_tokens, s.max_id, s.max_doc_len,
               mean, s.has_mask ? "true" : "false", s.n_empty_docs, s.n_empty_skipped,
               s.n_blank_lines, s.bytes_in, fp, s.has_source_sha ? "\"" : "",
               s.has_source_sha ? src : "null", s.has_source_sha ? "\"" : "");
    } else {
        printf("file:          %s\n", va.file);
        if (s.format == DF_CORPUS_DTOK)
            printf("format:        dtok version %u (checked: header, offsets, CRCs, in %.3f s)\n",
                   s.version, dt);
        else
            printf("format:        jsonl (parsed in %.3f s)\n", dt);
        printf("documents:     %" PRIu64 "\n", s.n_docs);
        printf("tokens:        %" PRIu64 " (mean %.1f per doc, longest %" PRIu64 ")\n", s.n_tokens,
               mean, s.max_doc_len);
        printf("loss tokens:   %" PRIu64 " (%.1f%%)%s\n", s.n_loss_tokens,
               s.n_tokens ? 100.0 * (double)s.n_loss_tokens / (double)s.n_tokens : 0.0,
               s.has_mask ? "" : ", no loss mask: all ones");
        printf("max id:        %u\n", s.max_id);
        printf("empty docs:    %" PRIu64 " held, %" PRIu64 " skipped", s.n_empty_docs,
               s.n_empty_skipped);
        if (s.format == DF_CORPUS_JSONL)
            printf(", %" PRIu64 " blank lines", s.n_blank_lines);
        printf("\n");
        printf("bytes:         %" PRIu64 "\n", s.bytes_in);
        printf("fingerprint:   %s\n", fp);
        if (s.has_source_sha)
            printf("source sha256: %s\n", src);
    }
    df_corpus_close(c);
    return 0;
}

static int cmd_show(int argc, char **argv)
{
    view_args va;
    int u = parse_view(argc, argv, "show", SHOW_HELP, 1, &va);
    if (u >= 0)
        return u;
    df_err e = {0};
    df_corpus *c;
    if (df_corpus_open(va.file, NULL, &c, &e) < 0) {
        fprintf(stderr, "dflash corpus show: %s\n", e.msg);
        return 1;
    }
    uint64_t n = df_corpus_n_docs(c);
    if (va.doc >= n) {
        fprintf(stderr, "dflash corpus show: %s: --doc %" PRIu64 " is out of range (%" PRIu64
                " documents: 0..%" PRIu64 ")\n",
                va.file, va.doc, n, n ? n - 1 : 0);
        df_corpus_close(c);
        return 1;
    }
    const uint32_t *ids;
    const uint8_t *mask;
    uint64_t len;
    df_corpus_doc(c, va.doc, &ids, &mask, &len);
    uint64_t loss = len;
    if (mask) {
        loss = 0;
        for (uint64_t i = 0; i < len; i++)
            loss += mask[i];
    }
    if (!va.json) {
        printf("doc %" PRIu64 " of %" PRIu64, va.doc, n);
        if (df_corpus_doc_line(c, va.doc))
            printf(" (line %" PRIu64 ")", df_corpus_doc_line(c, va.doc));
        printf(": %" PRIu64 " tokens, %" PRIu64 " loss tokens%s\n", len, loss,
               mask ? "" : " (no mask: all ones)");
    }
    printf(va.json ? "{\"input_ids\": [" : "input_ids: [");
    for (uint64_t i = 0; i < len; i++)
        printf(i ? ", %u" : "%u", ids[i]);
    printf(va.json ? "], \"loss_mask\": [" : "]\nloss_mask: [");
    for (uint64_t i = 0; i < len; i++)
        printf(i ? ", %u" : "%u", mask ? mask[i] : 1u);
    printf(va.json ? "]}\n" : "]\n");
    df_corpus_close(c);
    return 0;
}

int cmd_corpus(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (is_help(argv[1]) || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "import"))
        return cmd_import(argc - 1, argv + 1);
    if (!strcmp(argv[1], "info"))
        return cmd_info(argc - 1, argv + 1);
    if (!strcmp(argv[1], "show"))
        return cmd_show(argc - 1, argv + 1);
    fprintf(stderr, "dflash corpus: unknown subcommand '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
