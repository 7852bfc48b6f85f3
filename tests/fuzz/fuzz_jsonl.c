/* Fuzzes the JSONL line parser and both corpus openers on the same bytes:
 *   - df_jsonl_parse_line on the whole input (no NUL terminator to lean on);
 *   - df_corpus_open_mem as JSONL (line reader + parser + opts checks);
 *   - df_corpus_open_mem as .dtok, with and without CRCs (without, mutations
 *     reach the structural checks, which alone must keep access memory-safe).
 * A corpus that opens must hold what its stats say: every document readable,
 * lengths summing to n_tokens, mask bytes 0/1, ids below the vocab asked for. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "jsonl.h"
#include "knobs.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    df_knob_set(DF_KNOB_LOG, "error"); /* empty-document warnings would flood the output */
    return 0;
}

static void walk(df_corpus *c, const df_corpus_opts *o, int jsonl)
{
    df_corpus_stats st;
    df_corpus_stats_get(c, &st);
    uint64_t n = df_corpus_n_docs(c), tok = 0, loss = 0;
    if (n != st.n_docs)
        abort();
    for (uint64_t i = 0; i < n; i++) {
        const uint32_t *ids;
        const uint8_t *mask;
        uint64_t len;
        if (df_corpus_doc(c, i, &ids, &mask, &len) != 0)
            abort();
        for (uint64_t t = 0; t < len; t++) {
            if (o->vocab && ids[t] >= o->vocab)
                abort();
            if (ids[t] > st.max_id)
                abort();
            if (mask && mask[t] > 1)
                abort();
            loss += mask ? mask[t] : 1;
        }
        if (o->max_len && len > o->max_len)
            abort();
        if (jsonl && len == 0)
            abort(); /* the JSONL opener skips empty documents */
        tok += len;
    }
    if (tok != st.n_tokens || loss != st.n_loss_tokens)
        abort();
    if (jsonl) { /* the stored fingerprint is the one computed from the tokens */
        uint8_t fp[32];
        df_corpus_fingerprint_compute(c, fp);
        if (memcmp(fp, st.content_sha256, 32))
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    char *buf = malloc(n ? n : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, n);
    df_err e;

    df_jsonl_doc d;
    df_jsonl_doc_init(&d);
    uint64_t limit = n ? (uint64_t)data[0] * 37 : 0; /* sometimes a vocab, sometimes none */
    int rc = df_jsonl_parse_line(buf, n, "fuzz", 1, limit, &d, &e);
    if (rc == 0) {
        for (size_t i = 0; i < d.len; i++)
            if ((limit && d.ids[i] >= limit) || (d.has_mask && d.mask[i] > 1))
                abort();
    } else if (rc == 1 && d.len != 0) {
        abort();
    }
    df_jsonl_doc_free(&d);

    df_corpus_opts opts[3] = {
        {0},
        {.vocab = limit, .max_len = n ? data[n - 1] : 0},
        {.skip_crc = 1},
    };
    static const char *names[2] = {"fuzz.jsonl", "fuzz.dtok"};
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 3; j++) {
            df_corpus *c = NULL;
            if (df_corpus_open_mem(buf, n, names[k], &opts[j], &c, &e) == 0) {
                df_corpus_stats st;
                df_corpus_stats_get(c, &st);
                walk(c, &opts[j], st.format == DF_CORPUS_JSONL);
                df_corpus_close(c);
            }
        }
    free(buf);
    return 0;
}
