/* test_batch.c - the training data path (train/batch.h): RNG, packing,
 * anchors, labels, loss weights, features. Every input is non-zero and
 * distinct per token, so shifted or mixed-up outputs are caught. */
#include "batch.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { H = 6, NL = 4 };  /* hidden size and "cache" layers of the fixtures */

/* A synthetic document: ids 1000 + 7*doc + 3*i (all distinct), a mask,
 * and NL layers of BF16 rows whose values encode (layer, token, h). */
typedef struct tdoc {
    uint32_t n;
    uint32_t *ids;
    uint8_t *mask;
    uint16_t *layer[NL];
} tdoc;

static float feat_value(int l, int doc, uint32_t i, int h)
{
    return (float)(l + 1) * 64.0f + (float)doc * 0.5f + (float)(i % 16) * 0.125f + (float)h * 4.0f;
}

static tdoc mkdoc(int doc, uint32_t n, const uint8_t *mask)
{
    tdoc d = {.n = n};
    d.ids = malloc(n * sizeof *d.ids);
    d.mask = malloc(n);
    for (uint32_t i = 0; i < n; i++) {
        d.ids[i] = 1000u + 7u * (uint32_t)doc + 3u * i;
        d.mask[i] = mask ? mask[i] : 1;
    }
    for (int l = 0; l < NL; l++) {
        d.layer[l] = malloc((size_t)n * H * sizeof(uint16_t));
        for (uint32_t i = 0; i < n; i++)
            for (int h = 0; h < H; h++)
                d.layer[l][i * H + h] = df_f32_to_bf16(feat_value(l, doc, i, h));
    }
    return d;
}

static void freedoc(tdoc *d)
{
    free(d->ids);
    free(d->mask);
    for (int l = 0; l < NL; l++)
        free(d->layer[l]);
}

/* The document with features [layers[0], layers[1], ...] of the fixture. */
static df_batch_doc asdoc(const tdoc *t, uint64_t id, const int *layers, int K)
{
    df_batch_doc d = {.id = id, .n_tokens = t->n, .ids = t->ids, .loss_mask = t->mask};
    for (int k = 0; k < K; k++)
        d.layers[k] = t->layer[layers[k]];
    return d;
}

static const int all_layers[NL] = {0, 1, 2, 3};

static df_batch_config cfg(int S, int A, int bs)
{
    return (df_batch_config){.max_tokens = S,
                             .max_anchors = A,
                             .block_size = bs,
                             .mask_token_id = 99,
                             .vocab_size = 100000,
                             .hidden_size = H,
                             .n_features = 2,
                             .dtype = DF_DTYPE_BF16,
                             .gamma = 7.0,
                             .noise = 0};
}

/* Checks the invariants every finished row must satisfy. */
static void check_row_invariants(const df_batch *b)
{
    const df_batch_row *r = df_batch_get_row(b);
    const df_batch_config *c = df_batch_get_config(b);
    int bs = c->block_size;
    double wsum = 0;
    CHECK_EQ(r->n_blocks, c->max_anchors);
    CHECK_EQ(r->blocks.n_blocks, c->max_anchors);
    CHECK(r->blocks.anchor == r->anchor && r->blocks.doc_start == r->doc_start &&
          r->blocks.valid == r->valid);
    CHECK(r->n_valid <= r->n_candidates && r->n_valid <= c->max_anchors);
    for (int blk = 0; blk < r->n_blocks; blk++) {
        const int32_t *lab = r->labels + blk * bs, *bid = r->block_ids + blk * bs;
        const float *w = r->weights + blk * bs;
        CHECK_EQ(r->valid[blk], blk < r->n_valid);
        CHECK_EQ(lab[0], -1);
        CHECK(w[0] == 0.0f);
        for (int k = 1; k < bs; k++)
            CHECK_EQ(bid[k], c->mask_token_id);
        if (!r->valid[blk]) {
            for (int k = 0; k < bs; k++) {
                CHECK_EQ(lab[k], -1);
                CHECK(w[k] == 0.0f);
            }
            continue;
        }
        int p = r->anchor[blk];
        CHECK(p >= 0 && p < r->n_tokens);
        if (blk > 0)
            CHECK(r->anchor[blk - 1] < p);  /* sorted and distinct */
        /* p's document */
        int d = 0;
        while (r->doc_offset[d + 1] <= p)
            d++;
        int d0 = r->doc_offset[d], d1 = r->doc_offset[d + 1];
        CHECK_EQ(r->doc_start[blk], d0);
        CHECK_EQ(r->ctx_doc_start[p], d0);
        /* a candidate: p, p+1 in the loss, p+1 in the same document */
        CHECK(p + 1 < d1);
        CHECK(r->loss_mask[p] && r->loss_mask[p + 1]);
        CHECK_EQ(bid[0], r->ids[p]);
        for (int k = 0; k < bs; k++)
            CHECK_EQ(r->block_pos[blk * bs + k], r->pos[p] + k);
        for (int k = 1; k < bs; k++) {
            if (p + k < d1) {
                CHECK_EQ(lab[k], r->ids[p + k]);
                float want = r->loss_mask[p + k] ? (float)exp(-(double)(k - 1) / c->gamma) : 0.0f;
                CHECK(w[k] == want);
            } else {
                CHECK_EQ(lab[k], -1);
                CHECK(w[k] == 0.0f);
            }
            wsum += w[k];
        }
    }
    CHECK(fabs(wsum - r->weight_sum) <= 1e-9 * (1 + wsum));
}

static void test_rng(void)
{
    df_rng a, b, c;
    df_rng_seed(&a, 42, 0);
    df_rng_seed(&b, 42, 0);
    df_rng_seed(&c, 42, 1);
    int same_c = 0;
    for (int i = 0; i < 100; i++) {
        uint64_t x = df_rng_next(&a), y = df_rng_next(&b), z = df_rng_next(&c);
        CHECK(x == y);
        same_c += x == z;
    }
    CHECK_EQ(same_c, 0);
    /* save / restore reproduces the sequence, through the byte form too */
    uint8_t saved[32];
    df_rng_save(&a, saved);
    df_rng copy = a;
    uint64_t seq[50];
    for (int i = 0; i < 50; i++)
        seq[i] = df_rng_next(&a);
    df_rng r;
    df_err e;
    CHECK_OK(df_rng_load(&r, saved, &e), &e);
    for (int i = 0; i < 50; i++) {
        CHECK(df_rng_next(&r) == seq[i]);
        CHECK(df_rng_next(&copy) == seq[i]);
    }
    uint8_t zeros[32] = {0};
    CHECK_ERR(df_rng_load(&r, zeros, &e), -EINVAL, &e, "zeros");
    /* ranges */
    int hist[7] = {0};
    for (int i = 0; i < 70000; i++) {
        uint64_t v = df_rng_below(&a, 7);
        CHECK(v < 7);
        hist[v < 7 ? v : 0]++;
        float f = df_rng_float(&a);
        CHECK(f >= 0.0f && f < 1.0f);
    }
    for (int i = 0; i < 7; i++)
        CHECK(hist[i] > 9500 && hist[i] < 10500);
    CHECK_EQ(df_rng_below(&a, 1), 0);
}

/* One document, every token in the loss, all candidates taken (no
 * sampling): the label of block offset k is ids[p+k], not ids[p+k-1]. */
static void test_label_shift(void)
{
    df_err e;
    df_batch_config c = cfg(32, 64, 4);
    df_batch *b = df_batch_create(&c, &e);
    CHECK(b);
    tdoc t = mkdoc(1, 20, NULL);
    df_batch_doc d = asdoc(&t, 5, all_layers, 2);
    CHECK_EQ(df_batch_add(b, &d, NULL, &e), 1);
    CHECK_OK(df_batch_finish(b, NULL, &e), &e);
    const df_batch_row *r = df_batch_get_row(b);
    CHECK_EQ(r->n_tokens, 20);
    CHECK_EQ(r->n_candidates, 19);
    CHECK_EQ(r->n_valid, 19);
    for (int blk = 0; blk < 19; blk++) {
        CHECK_EQ(r->anchor[blk], blk);
        const int32_t *lab = r->labels + blk * 4;
        CHECK_EQ(r->block_ids[blk * 4], (int)t.ids[blk]);
        CHECK_EQ(lab[0], -1);
        for (int k = 1; k < 4; k++) {
            if (blk + k < 20) {
                CHECK_EQ(lab[k], (int)t.ids[blk + k]);
                CHECK(lab[k] != (int)t.ids[blk + k - 1]);  /* the classic off-by-one */
            } else {
                CHECK_EQ(lab[k], -1);
            }
        }
    }
    /* the last anchor (p = 18) has only k = 1 inside the document */
    CHECK_EQ(r->labels[18 * 4 + 1], (int)t.ids[19]);
    CHECK_EQ(r->labels[18 * 4 + 2], -1);
    CHECK(r->weights[18 * 4 + 2] == 0.0f);
    CHECK_EQ(r->block_pos[5 * 4 + 3], 8);
    CHECK_EQ(r->n_docs, 1);
    CHECK_EQ(r->doc_id[0], 5);
    check_row_invariants(b);
    freedoc(&t);
    df_batch_free(b);
}

/* Candidates exactly: loss_mask[p] && loss_mask[p+1], same document. */
static void test_candidates_and_docs(void)
{
    df_err e;
    df_batch_config c = cfg(64, 64, 5);
    df_batch *b = df_batch_create(&c, &e);
    /* doc A (len 8): mask 0 0 1 1 0 1 1 1 -> candidates 2, 5, 6 (7 is the last)
     * doc B (len 6): mask 1 0 1 1 1 0 -> candidates 8+2, 8+3 (8+0: next has mask 0)
     * doc C (len 3): mask 1 1 1 -> candidates 14, 15 */
    const uint8_t ma[8] = {0, 0, 1, 1, 0, 1, 1, 1}, mb[6] = {1, 0, 1, 1, 1, 0}, mc[3] = {1, 1, 1};
    tdoc A = mkdoc(0, 8, ma), B = mkdoc(1, 6, mb), C = mkdoc(2, 3, mc);
    df_batch_doc da = asdoc(&A, 10, all_layers, 2), db = asdoc(&B, 11, all_layers, 2),
                 dc = asdoc(&C, 12, all_layers, 2);
    CHECK_EQ(df_batch_add(b, &da, NULL, &e), 1);
    CHECK_EQ(df_batch_add(b, &db, NULL, &e), 1);
    CHECK_EQ(df_batch_add(b, &dc, NULL, &e), 1);
    CHECK_OK(df_batch_finish(b, NULL, &e), &e);
    const df_batch_row *r = df_batch_get_row(b);
    const int want[] = {2, 5, 6, 10, 11, 14, 15};
    CHECK_EQ(r->n_tokens, 17);
    CHECK_EQ(r->n_docs, 3);
    CHECK_EQ(r->n_candidates, 7);
    CHECK_EQ(r->n_valid, 7);
    CHECK_EQ(r->n_loss_tokens, 5 + 4 + 3);
    for (int i = 0; i < 7; i++)
        CHECK_EQ(r->anchor[i], want[i]);
    /* positions restart per document; doc starts */
    const int pos_want[17] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 0, 1, 2};
    for (int t = 0; t < 17; t++) {
        CHECK_EQ(r->pos[t], pos_want[t]);
        CHECK_EQ(r->ctx_doc_start[t], t < 8 ? 0 : t < 14 ? 8 : 14);
    }
    CHECK_EQ(r->doc_offset[0], 0);
    CHECK_EQ(r->doc_offset[1], 8);
    CHECK_EQ(r->doc_offset[2], 14);
    CHECK_EQ(r->doc_offset[3], 17);
    /* block of anchor 6 (doc A, last candidate): k=1 -> token 7, k>=2 past the end */
    const int32_t *lab = r->labels + 2 * 5;
    const float *w = r->weights + 2 * 5;
    CHECK_EQ(lab[1], (int)A.ids[7]);
    CHECK(w[1] == 1.0f);
    for (int k = 2; k < 5; k++) {
        CHECK_EQ(lab[k], -1);  /* never B's tokens */
        CHECK(w[k] == 0.0f);
    }
    CHECK_EQ(r->doc_start[2], 0);
    /* anchor 10 (doc B, pos 2): k=3 -> pos 5 has mask 0: label kept, weight 0 */
    lab = r->labels + 3 * 5;
    w = r->weights + 3 * 5;
    CHECK_EQ(r->doc_start[3], 8);
    CHECK_EQ(r->block_pos[3 * 5], 2);
    CHECK_EQ(lab[3], (int)B.ids[5]);
    CHECK(w[3] == 0.0f);
    CHECK(w[1] == 1.0f && w[2] == (float)exp(-1.0 / 7.0));
    CHECK_EQ(lab[4], -1);
    /* padding blocks */
    for (int blk = 7; blk < 64; blk++) {
        CHECK_EQ(r->valid[blk], 0);
        for (int k = 0; k < 5; k++) {
            CHECK_EQ(r->labels[blk * 5 + k], -1);
            CHECK(r->weights[blk * 5 + k] == 0.0f);
        }
    }
    CHECK(r->weight_sum > 0);
    check_row_invariants(b);
    freedoc(&A);
    freedoc(&B);
    freedoc(&C);
    df_batch_free(b);
}

/* df_batch_candidates and df_batch_set_anchors: the blocks of chosen anchors
 * equal the blocks df_batch_finish builds for the same anchors. */
static void test_set_anchors(void)
{
    df_err e;
    df_batch_config c3 = cfg(64, 3, 5), call = cfg(64, 64, 5);
    df_batch *b = df_batch_create(&c3, &e), *ref = df_batch_create(&call, &e);
    const uint8_t ma[8] = {0, 0, 1, 1, 0, 1, 1, 1}, mb[6] = {1, 0, 1, 1, 1, 0}, mc[3] = {1, 1, 1};
    tdoc A = mkdoc(0, 8, ma), B = mkdoc(1, 6, mb), C = mkdoc(2, 3, mc);
    df_batch_doc d[3] = {asdoc(&A, 10, all_layers, 2), asdoc(&B, 11, all_layers, 2),
                         asdoc(&C, 12, all_layers, 2)};
    df_rng rng;
    df_rng_seed(&rng, 3, 0);
    int32_t cand[16];
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(df_batch_add(b, &d[i], NULL, &e), 1);
        CHECK_EQ(df_batch_add(ref, &d[i], NULL, &e), 1);
    }
    CHECK_EQ(df_batch_candidates(b, cand, 16), -EINVAL); /* not finished */
    int32_t two[2] = {5, 10};
    CHECK_EQ(df_batch_set_anchors(b, two, 2, &e), -EINVAL);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    CHECK_OK(df_batch_finish(ref, NULL, &e), &e);
    const int want[] = {2, 5, 6, 10, 11, 14, 15};
    CHECK_EQ(df_batch_candidates(b, cand, 16), 7);
    for (int i = 0; i < 7; i++)
        CHECK_EQ(cand[i], want[i]);
    CHECK_EQ(df_batch_candidates(b, cand, 2), 7); /* counts past cap, writes 2 */
    /* bad lists change nothing */
    const df_batch_row *r = df_batch_get_row(b), *rr = df_batch_get_row(ref);
    int32_t a0 = r->anchor[0];
    int32_t notc[1] = {4}, desc[2] = {10, 5}, many[4] = {2, 5, 6, 10}, last[1] = {7};
    CHECK_EQ(df_batch_set_anchors(b, notc, 1, &e), -EINVAL);
    CHECK_EQ(df_batch_set_anchors(b, desc, 2, &e), -EINVAL);
    CHECK_EQ(df_batch_set_anchors(b, many, 4, &e), -EINVAL);
    CHECK_EQ(df_batch_set_anchors(b, last, 1, &e), -EINVAL); /* a document's last token */
    CHECK_EQ(r->anchor[0], a0);
    /* anchors 5, 10 (the reference's blocks 1 and 3), then padding */
    CHECK_OK(df_batch_set_anchors(b, two, 2, &e), &e);
    CHECK_EQ(r->n_valid, 2);
    const int rb[2] = {1, 3};
    double ws = 0;
    int nw = 0;
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(r->anchor[i], rr->anchor[rb[i]]);
        CHECK_EQ(r->doc_start[i], rr->doc_start[rb[i]]);
        CHECK_EQ(r->valid[i], 1);
        for (int k = 0; k < 5; k++) {
            CHECK_EQ(r->block_ids[i * 5 + k], rr->block_ids[rb[i] * 5 + k]);
            CHECK_EQ(r->block_pos[i * 5 + k], rr->block_pos[rb[i] * 5 + k]);
            CHECK_EQ(r->labels[i * 5 + k], rr->labels[rb[i] * 5 + k]);
            CHECK(r->weights[i * 5 + k] == rr->weights[rb[i] * 5 + k]);
            ws += r->weights[i * 5 + k];
            nw += r->weights[i * 5 + k] > 0;
        }
    }
    CHECK_EQ(r->valid[2], 0);
    for (int k = 0; k < 5; k++) {
        CHECK_EQ(r->labels[2 * 5 + k], -1);
        CHECK(r->weights[2 * 5 + k] == 0.0f);
    }
    CHECK(r->weight_sum == ws);
    CHECK_EQ(r->n_weighted, nw);
    check_row_invariants(b);
    CHECK_OK(df_batch_set_anchors(b, NULL, 0, &e), &e); /* no anchors: all padding */
    CHECK_EQ(r->n_valid, 0);
    CHECK(r->weight_sum == 0);
    freedoc(&A);
    freedoc(&B);
    freedoc(&C);
    df_batch_free(b);
    df_batch_free(ref);
}

static void test_no_candidates(void)
{
    df_err e;
    df_batch_config c = cfg(16, 4, 4);
    df_batch *b = df_batch_create(&c, &e);
    const uint8_t m[6] = {1, 0, 1, 0, 1, 0};
    tdoc A = mkdoc(3, 6, m), B = mkdoc(4, 1, NULL);  /* B: one token, no p+1 */
    df_batch_doc da = asdoc(&A, 1, all_layers, 2), db = asdoc(&B, 2, all_layers, 2);
    df_rng rng;
    df_rng_seed(&rng, 1, 0);
    df_rng before = rng;
    CHECK_EQ(df_batch_add(b, &da, &rng, &e), 1);
    CHECK_EQ(df_batch_add(b, &db, &rng, &e), 1);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    const df_batch_row *r = df_batch_get_row(b);
    CHECK_EQ(r->n_candidates, 0);
    CHECK_EQ(r->n_valid, 0);
    CHECK(r->weight_sum == 0.0);
    CHECK_EQ(r->n_weighted, 0);
    CHECK(!memcmp(&rng, &before, sizeof rng));  /* nothing to sample: no draws */
    for (int blk = 0; blk < 4; blk++)
        CHECK_EQ(r->valid[blk], 0);
    check_row_invariants(b);
    /* an empty row is all padding too */
    df_batch_reset(b);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    CHECK_EQ(r->n_tokens, 0);
    CHECK(r->weight_sum == 0.0);
    for (int t = 0; t < 16; t++) {
        CHECK_EQ(r->ctx_doc_start[t], 0);
        CHECK_EQ(r->loss_mask[t], 0);
    }
    check_row_invariants(b);
    freedoc(&A);
    freedoc(&B);
    df_batch_free(b);
}

/* A row of 4 docs x 11 tokens, all in the loss: 40 candidates, 10 anchors. */
static int sample_row(df_batch *b, tdoc *docs, df_rng *rng, int32_t *out)
{
    df_err e;
    df_batch_reset(b);
    for (int i = 0; i < 4; i++) {
        df_batch_doc d = asdoc(&docs[i], (uint64_t)i, all_layers, 2);
        if (df_batch_add(b, &d, rng, &e) != 1)
            return -1;
    }
    if (df_batch_finish(b, rng, &e) < 0)
        return -1;
    const df_batch_row *r = df_batch_get_row(b);
    memcpy(out, r->anchor, 10 * sizeof *out);
    return r->n_valid;
}

static void test_sampling(void)
{
    df_err e;
    df_batch_config c = cfg(44, 10, 3);
    df_batch *b = df_batch_create(&c, &e), *b2 = df_batch_create(&c, &e);
    tdoc docs[4];
    for (int i = 0; i < 4; i++)
        docs[i] = mkdoc(i, 11, NULL);
    df_rng rng, rng2;
    df_rng_seed(&rng, 7, 0);
    df_rng_seed(&rng2, 7, 0);
    enum { DRAWS = 20000 };
    long count[44] = {0};
    int32_t a[10], a2[10];
    int ok = 1;
    for (int it = 0; it < DRAWS && ok; it++) {
        ok = sample_row(b, docs, &rng, a) == 10;
        if (it == 0) {
            check_row_invariants(b);
            CHECK_EQ(df_batch_get_row(b)->n_candidates, 40);
        }
        for (int i = 0; i < 10; i++) {
            CHECK(a[i] % 11 != 10);  /* never a document's last token */
            if (i)
                CHECK(a[i - 1] < a[i]);
            count[a[i]]++;
        }
        if (it < 50) {  /* same seed, other builder: same anchors */
            CHECK_EQ(sample_row(b2, docs, &rng2, a2), 10);
            CHECK(!memcmp(a, a2, sizeof a));
        }
    }
    CHECK(ok);
    /* uniform over the 40 candidates: expected DRAWS*10/40 each */
    double expect = DRAWS * 10.0 / 40.0, chi2 = 0;
    for (int t = 0; t < 44; t++) {
        if (t % 11 == 10) {
            CHECK_EQ(count[t], 0);
            continue;
        }
        chi2 += (count[t] - expect) * (count[t] - expect) / expect;
    }
    /* 39 degrees of freedom: mean 39, p(chi2 > 90) ~ 1e-5. Without
     * replacement the variance is smaller than multinomial, so this is lax. */
    CHECK(chi2 < 90.0);
    if (chi2 >= 90.0)
        fprintf(stderr, "chi2 = %g\n", chi2);

    /* a different seed gives different anchors */
    df_rng_seed(&rng, 7, 0);
    df_rng_seed(&rng2, 8, 0);
    int differ = 0;
    for (int it = 0; it < 5; it++) {
        sample_row(b, docs, &rng, a);
        sample_row(b2, docs, &rng2, a2);
        differ += memcmp(a, a2, sizeof a) != 0;
    }
    CHECK(differ > 0);

    /* save / restore of the RNG reproduces a row exactly */
    uint8_t saved[32];
    df_rng_save(&rng, saved);
    sample_row(b, docs, &rng, a);
    df_rng r3;
    CHECK_OK(df_rng_load(&r3, saved, &e), &e);
    sample_row(b2, docs, &r3, a2);
    CHECK(!memcmp(a, a2, sizeof a));
    CHECK(!memcmp(&rng, &r3, sizeof rng));

    for (int i = 0; i < 4; i++)
        freedoc(&docs[i]);
    df_batch_free(b);
    df_batch_free(b2);
}

static void test_weights_gamma(void)
{
    df_err e;
    for (int g = 0; g < 3; g++) {
        double gamma = g == 0 ? 7.0 : g == 1 ? 2.5 : 0.0;  /* 0 -> default 7 */
        df_batch_config c = cfg(40, 2, 16);
        c.gamma = gamma;
        df_batch *b = df_batch_create(&c, &e);
        tdoc t = mkdoc(9, 40, NULL);
        df_batch_doc d = asdoc(&t, 0, all_layers, 2);
        df_rng rng;
        df_rng_seed(&rng, 3, 0);
        CHECK_EQ(df_batch_add(b, &d, &rng, &e), 1);
        CHECK_OK(df_batch_finish(b, &rng, &e), &e);
        const df_batch_row *r = df_batch_get_row(b);
        double gm = gamma > 0 ? gamma : 7.0;
        CHECK(df_batch_get_config(b)->gamma == gm);
        double sum = 0;
        for (int blk = 0; blk < 2; blk++) {
            int p = r->anchor[blk];
            CHECK(r->weights[blk * 16] == 0.0f);
            for (int k = 1; k < 16; k++) {
                float want = p + k < 40 ? (float)exp(-(double)(k - 1) / gm) : 0.0f;
                CHECK(r->weights[blk * 16 + k] == want);
                sum += want;
            }
            if (p + 1 < 40)
                CHECK(r->weights[blk * 16 + 1] == 1.0f);
        }
        CHECK(fabs(r->weight_sum - sum) < 1e-9);
        check_row_invariants(b);
        freedoc(&t);
        df_batch_free(b);
    }
}

/* Features: the requested layer subset, in the requested order; padding
 * rows 0 (also in a caller buffer full of garbage and after a longer row). */
static void test_features(void)
{
    df_err e;
    enum { S = 24 };
    df_batch_config c = cfg(S, 4, 4);
    c.n_features = 3;
    const int sel[3] = {3, 0, 2};  /* a subset, not in cache order */
    float *buf = malloc((size_t)S * 3 * H * sizeof(float));
    for (size_t i = 0; i < (size_t)S * 3 * H; i++)
        buf[i] = 12345.0f;
    c.features = buf;
    df_batch *b = df_batch_create(&c, &e);
    tdoc A = mkdoc(0, 10, NULL), B = mkdoc(1, 7, NULL);
    df_batch_doc da = asdoc(&A, 0, sel, 3), db = asdoc(&B, 1, sel, 3);
    df_rng rng;
    df_rng_seed(&rng, 4, 0);
    CHECK_EQ(df_batch_add(b, &da, &rng, &e), 1);
    CHECK_EQ(df_batch_add(b, &db, &rng, &e), 1);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    const df_batch_row *r = df_batch_get_row(b);
    CHECK(r->features == buf);
    for (int t = 0; t < S; t++)
        for (int k = 0; k < 3; k++)
            for (int h = 0; h < H; h++) {
                float got = buf[((size_t)t * 3 + k) * H + h];
                float want = 0;
                if (t < 10)
                    want = df_bf16_to_f32(A.layer[sel[k]][t * H + h]);
                else if (t < 17)
                    want = df_bf16_to_f32(B.layer[sel[k]][(t - 10) * H + h]);
                CHECK(got == want);
                if (t < 17)
                    CHECK(want != 0.0f);
            }
    /* a shorter row after a longer one: stale rows are cleared */
    df_batch_reset(b);
    CHECK_EQ(df_batch_add(b, &db, &rng, &e), 1);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    for (size_t i = 7 * 3 * H; i < (size_t)S * 3 * H; i++)
        CHECK(buf[i] == 0.0f);
    CHECK(buf[0] == df_bf16_to_f32(B.layer[3][0]));
    for (int t = 7; t < S; t++) {
        CHECK_EQ(r->pos[t], 0);
        CHECK_EQ(r->ctx_doc_start[t], 7);
        CHECK_EQ(r->ids[t], 0);
    }
    df_batch_free(b);

    /* the cache glue: drafter layer ids -> cache indices -> the same rows */
    df_cache_params cp;
    memset(&cp, 0, sizeof cp);
    cp.n_layers = NL;
    const int cache_ids[NL] = {1, 16, 31, 46};
    for (int i = 0; i < NL; i++)
        cp.layer_ids[i] = cache_ids[i];
    const int drafter_ids[3] = {46, 1, 31};
    int idx[3];
    uint64_t lm = 0;
    CHECK_OK(df_batch_map_layers(&cp, drafter_ids, 3, idx, &lm, &e), &e);
    CHECK(idx[0] == 3 && idx[1] == 0 && idx[2] == 2);
    CHECK(lm == ((1u << 3) | (1u << 0) | (1u << 2)));
    const int bad_ids[2] = {1, 61};
    CHECK_ERR(df_batch_map_layers(&cp, bad_ids, 2, idx, &lm, &e), -DF_EMISMATCH, &e, "61");
    df_cache_item it;
    memset(&it, 0, sizeof it);
    it.id = 77;
    it.n_tokens = A.n;
    it.ids = A.ids;
    it.loss_mask = A.mask;
    for (int l = 0; l < NL; l++)
        it.layers[l] = l == 1 ? NULL : A.layer[l];  /* layer 1 not streamed */
    CHECK_OK(df_batch_map_layers(&cp, drafter_ids, 3, idx, &lm, &e), &e);
    df_batch_doc d;
    df_batch_doc_from_item(&it, idx, 3, &d);
    CHECK(d.id == 77 && d.n_tokens == 10 && d.ids == A.ids && d.loss_mask == A.mask);
    CHECK(d.layers[0] == A.layer[3] && d.layers[1] == A.layer[0] && d.layers[2] == A.layer[2]);
    CHECK(d.layers[3] == NULL);

    freedoc(&A);
    freedoc(&B);
    free(buf);
}

static void test_noise(void)
{
    df_err e;
    df_batch_config c = cfg(32, 4, 4);
    c.noise = 0.05f;
    df_batch *b = df_batch_create(&c, &e), *b2 = df_batch_create(&c, &e);
    tdoc A = mkdoc(0, 31, NULL);
    df_batch_doc da = asdoc(&A, 0, all_layers, 2);
    df_rng rng, rng2;
    df_rng_seed(&rng, 11, 0);
    df_rng_seed(&rng2, 11, 0);
    CHECK_ERR(df_batch_add(b, &da, NULL, &e), -EINVAL, &e, "rng");
    CHECK_EQ(df_batch_add(b, &da, &rng, &e), 1);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    CHECK_EQ(df_batch_add(b2, &da, &rng2, &e), 1);
    CHECK_OK(df_batch_finish(b2, &rng2, &e), &e);
    const df_batch_row *r = df_batch_get_row(b), *r2 = df_batch_get_row(b2);
    double sum = 0, maxd = 0;
    int n = 0, nonzero = 0;
    for (int t = 0; t < 31; t++)
        for (int k = 0; k < 2; k++)
            for (int h = 0; h < H; h++) {
                size_t i = ((size_t)t * 2 + k) * H + h;
                float x = df_bf16_to_f32(A.layer[k][t * H + h]);
                double dlt = (double)r->features[i] - x;
                /* f32 rounding of x + d can add half an ulp of x */
                CHECK(fabs(dlt) <= 0.05 + fabs(x) * 0x1p-23);
                maxd = fmax(maxd, fabs(dlt));
                nonzero += dlt != 0;
                sum += dlt;
                n++;
                CHECK(r->features[i] == r2->features[i]);  /* deterministic */
            }
    CHECK(nonzero > n * 9 / 10);
    CHECK(maxd > 0.04);
    CHECK(fabs(sum / n) < 0.01);
    /* padding rows stay exactly 0 (no noise on padding) */
    for (size_t i = 31 * 2 * H; i < 32 * 2 * H; i++)
        CHECK(r->features[i] == 0.0f);
    df_batch_free(b);
    df_batch_free(b2);

    /* noise 0: exact copies, no RNG drawn */
    c.noise = 0;
    b = df_batch_create(&c, &e);
    df_rng_seed(&rng, 11, 0);
    df_rng before = rng;
    CHECK_EQ(df_batch_add(b, &da, &rng, &e), 1);
    CHECK(!memcmp(&rng, &before, sizeof rng));
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    r = df_batch_get_row(b);
    for (int t = 0; t < 31; t++)
        for (int k = 0; k < 2; k++)
            for (int h = 0; h < H; h++)
                CHECK(r->features[((size_t)t * 2 + k) * H + h] ==
                      df_bf16_to_f32(A.layer[k][t * H + h]));
    df_batch_free(b);
    freedoc(&A);
}

/* BF16 rows: the cache's bits without noise; with noise the F32 row rounded
 * (same RNG draws); padding exact zeros, also after a longer row. */
static void test_features_bf16(void)
{
    df_err e;
    enum { S = 32 };
    df_batch_config c = cfg(S, 4, 4), cf = c;
    c.out_dtype = DF_DTYPE_BF16;
    df_batch *b = df_batch_create(&c, &e), *bf = df_batch_create(&cf, &e);
    CHECK(b && bf);
    tdoc A = mkdoc(0, 31, NULL), B = mkdoc(1, 9, NULL);
    df_batch_doc da = asdoc(&A, 0, all_layers, 2), db = asdoc(&B, 1, all_layers, 2);
    df_rng rng;
    df_rng_seed(&rng, 5, 0);
    CHECK_EQ(df_batch_add(b, &da, &rng, &e), 1);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    const df_batch_row *r = df_batch_get_row(b);
    CHECK(r->features == NULL && r->features_bf16 != NULL);
    int same = 1;
    for (int t = 0; t < 31; t++)
        for (int k = 0; k < 2; k++)
            same &= !memcmp(r->features_bf16 + ((size_t)t * 2 + k) * H, A.layer[k] + t * H, H * 2);
    CHECK(same);
    df_batch_reset(b); /* shorter row: stale rows cleared */
    CHECK_EQ(df_batch_add(b, &db, &rng, &e), 1);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    int zero = 1;
    for (size_t i = 9 * 2 * H; i < (size_t)S * 2 * H; i++)
        zero &= r->features_bf16[i] == 0;
    CHECK(zero);
    df_batch_free(b);
    df_batch_free(bf);

    /* noise: the bf16 row is the f32 row (same draws) rounded to nearest even */
    c.noise = cf.noise = 3.0f; /* above bf16 resolution at these values (64..200) */
    b = df_batch_create(&c, &e);
    bf = df_batch_create(&cf, &e);
    df_rng r1, r2;
    df_rng_seed(&r1, 9, 0);
    df_rng_seed(&r2, 9, 0);
    CHECK_EQ(df_batch_add(b, &da, &r1, &e), 1);
    CHECK_EQ(df_batch_add(bf, &da, &r2, &e), 1);
    CHECK_OK(df_batch_finish(b, &r1, &e), &e);
    CHECK_OK(df_batch_finish(bf, &r2, &e), &e);
    const df_batch_row *rb = df_batch_get_row(b), *rf = df_batch_get_row(bf);
    int match = 1, changed = 0;
    for (size_t i = 0; i < (size_t)31 * 2 * H; i++) {
        match &= rb->features_bf16[i] == df_f32_to_bf16(rf->features[i]);
        changed += rb->features_bf16[i] != A.layer[(i / H) % 2][(i / (2 * H)) * H + i % H];
    }
    CHECK(match);
    CHECK(changed > 0);
    CHECK(!memcmp(&r1, &r2, sizeof r1));
    df_batch_free(b);
    df_batch_free(bf);
    /* bad output dtype */
    c.out_dtype = DF_DTYPE_F16;
    CHECK(df_batch_create(&c, &e) == NULL);
    CHECK_ERR(e.code, -EINVAL, &e, "F32 or BF16");
    freedoc(&A);
    freedoc(&B);
}

/* Packing protocol: "does not fit", truncation, errors. */
static void test_packing(void)
{
    df_err e;
    df_batch_config c = cfg(16, 8, 4);
    df_batch *b = df_batch_create(&c, &e);
    tdoc A = mkdoc(0, 10, NULL), B = mkdoc(1, 7, NULL), L = mkdoc(2, 40, NULL);
    df_batch_doc da = asdoc(&A, 0, all_layers, 2), db = asdoc(&B, 1, all_layers, 2),
                 dl = asdoc(&L, 2, all_layers, 2);
    df_rng rng;
    df_rng_seed(&rng, 5, 0);
    CHECK_EQ(df_batch_add(b, &da, &rng, &e), 1);
    df_rng before = rng;
    CHECK_EQ(df_batch_add(b, &db, &rng, &e), 0);  /* 10 + 7 > 16 */
    CHECK(!memcmp(&rng, &before, sizeof rng));
    const df_batch_row *r = df_batch_get_row(b);
    CHECK_EQ(r->n_tokens, 10);
    CHECK_EQ(r->n_docs, 1);
    CHECK_EQ(df_batch_add(b, &dl, &rng, &e), 0);   /* long doc: not into a non-empty row */
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    CHECK_ERR(df_batch_add(b, &db, &rng, &e), -EINVAL, &e, "finished");
    CHECK_ERR(df_batch_finish(b, &rng, &e), -EINVAL, &e, "finished");
    /* a long document alone: truncated to 16 tokens */
    df_batch_reset(b);
    CHECK_EQ(df_batch_add(b, &dl, &rng, &e), 1);
    CHECK_EQ(r->n_tokens, 16);
    CHECK_EQ(r->truncated, 24);
    CHECK_EQ(r->n_candidates, 15);  /* p = 15 has no p+1 inside the cut */
    CHECK_EQ(df_batch_add(b, &db, &rng, &e), 0);
    CHECK_OK(df_batch_finish(b, &rng, &e), &e);
    for (int blk = 0; blk < r->n_valid; blk++) {
        int p = r->anchor[blk];
        CHECK(p < 15);
        for (int k = 1; k < 4; k++)
            if (p + k >= 16)
                CHECK_EQ(r->labels[blk * 4 + k], -1);  /* ids past the cut are not labels */
    }
    check_row_invariants(b);
    /* an empty document is accepted and ignored */
    df_batch_reset(b);
    df_batch_doc empty = {.id = 9, .n_tokens = 0};
    CHECK_EQ(df_batch_add(b, &empty, &rng, &e), 1);
    CHECK_EQ(r->n_docs, 0);
    CHECK_EQ(r->truncated, 0);
    /* bad input */
    uint32_t saved_id = A.ids[3];
    A.ids[3] = 100000;  /* == vocab */
    CHECK_ERR(df_batch_add(b, &da, &rng, &e), -EINVAL, &e, "out of range");
    A.ids[3] = saved_id;
    CHECK_EQ(r->n_tokens, 0);
    df_batch_doc nolayer = da;
    nolayer.layers[1] = NULL;
    CHECK_ERR(df_batch_add(b, &nolayer, &rng, &e), -EINVAL, &e, "feature 1");
    df_batch_free(b);

    df_batch_config bad = cfg(16, 8, 1);
    CHECK(!df_batch_create(&bad, &e));
    bad = cfg(16, 8, 4);
    bad.mask_token_id = 100000;
    CHECK(!df_batch_create(&bad, &e));
    bad = cfg(16, 8, 4);
    bad.dtype = DF_DTYPE_I32;
    CHECK(!df_batch_create(&bad, &e));
    bad = cfg(16, 8, 4);
    bad.noise = -1;
    CHECK(!df_batch_create(&bad, &e));
    freedoc(&A);
    freedoc(&B);
    freedoc(&L);
}

/* Randomized rows against the invariants (mixed masks and lengths). */
static void test_random_rows(void)
{
    df_err e;
    df_batch_config c = cfg(64, 12, 6);
    df_batch *b = df_batch_create(&c, &e);
    uint64_t st = 99;
    df_rng rng;
    df_rng_seed(&rng, 17, 2);
    for (int row = 0; row < 200; row++) {
        df_batch_reset(b);
        tdoc docs[16];
        int nd = 0, added = 0;
        while (nd < 16) {
            uint32_t n = 1 + (uint32_t)(test_rand(&st) % 30);
            uint8_t m[32];
            for (uint32_t i = 0; i < n; i++)
                m[i] = test_rand(&st) % 3 != 0;
            docs[nd] = mkdoc(nd, n, m);
            df_batch_doc d = asdoc(&docs[nd], (uint64_t)nd, all_layers, 2);
            int rc = df_batch_add(b, &d, &rng, &e);
            nd++;
            if (rc != 1)
                break;
            added++;
        }
        CHECK(added >= 1);
        CHECK_OK(df_batch_finish(b, &rng, &e), &e);
        const df_batch_row *r = df_batch_get_row(b);
        CHECK_EQ(r->n_docs, added);
        /* recount candidates from the documents */
        int nc = 0;
        for (int i = 0; i < added; i++)
            for (uint32_t p = 0; p + 1 < docs[i].n; p++)
                nc += docs[i].mask[p] && docs[i].mask[p + 1];
        CHECK_EQ(r->n_candidates, nc);
        CHECK_EQ(r->n_valid, nc < 12 ? nc : 12);
        check_row_invariants(b);
        for (int i = 0; i < nd; i++)
            freedoc(&docs[i]);
    }
    df_batch_free(b);
}

int main(void)
{
    test_rng();
    test_label_shift();
    test_candidates_and_docs();
    test_set_anchors();
    test_no_candidates();
    test_sampling();
    test_weights_gamma();
    test_features();
    test_noise();
    test_features_bf16();
    test_packing();
    test_random_rows();
    return test_main_end();
}
