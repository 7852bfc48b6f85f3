/* dflash_ref.h - the DFlash drafter attention's references for
 * test_dflash_attn.c, in double precision and independent of kernels/cpu: a
 * problem (shapes, block table, random fp32 inputs in padded buffers), the
 * visibility rules of docs/DRAFTER.md, a naive forward with the whole mask
 * and a dense softmax, and the analytic backward on the same mask (with
 * magnitudes for the tolerances). Slow and simple on purpose. */
#ifndef DF_TEST_DFLASH_REF_H
#define DF_TEST_DFLASH_REF_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"
#include "train_ops.h"

/* the random stream every input is drawn from */
extern uint64_t dref_rng;

/* calloc or exit(2) (a test's allocation) */
void *dref_xmalloc(size_t n);
double *dref_dbuf(int64_t n);

/* An f32 buffer [rows, ld] and a view of columns [c0, c0 + cols). */
typedef struct mat {
    float *p;
    int64_t rows, ld;
} mat;
mat dref_mat(int64_t rows, int64_t ld);
df_tensor dref_view(const mat *m, int64_t c0, int64_t cols);
/* random normal values times scale (dref_rng) */
void dref_fill(mat *m, float scale);
float dref_get(const df_tensor *t, int64_t r, int64_t c);

typedef struct prob {
    int S, nb, bs, nq, nkv, D, W;
    int64_t rows;
    int32_t anchor[64], doc[64];
    uint8_t valid[64];
    df_dflash_blocks blk;
    float scale;
    mat qm, kcv, kbv;            /* kc|vc and kb|vb: column halves of one buffer */
    df_tensor q, kc, vc, kb, vb; /* views */
} prob;

typedef struct blkdef {
    int anchor, doc, valid;
} blkdef;
/* nb blocks from bd; inputs drawn with standard deviation qscale; scale 1 / sqrt(D) */
void dref_prob_init(prob *P, int S, int bs, int nq, int nkv, int D, int W, const blkdef *bd,
                    int nb, float qscale);
void dref_prob_free(prob *P);
/* Visibility, straight from docs/DRAFTER.md: key index < S is context position j;
 * key S + r is block row r (block r / bs, offset r % bs). */
int dref_visible(const prob *P, int64_t row, int64_t key);

/* Inputs as contiguous doubles (exact copies of the fp32 values). */
typedef struct dinp {
    double *x[5]; /* q, kc, vc, kb, vb */
    int64_t rows[5], cols[5];
} dinp;
void dref_dinp_init(dinp *X, const prob *P);
void dref_dinp_free(dinp *X);

typedef struct fref {
    double *out, *lse, *mag; /* out/mag [rows * nq*D], lse [rows * nq] */
    int *nvis;               /* [rows * nq] keys visible */
    double smax;             /* max over rows/keys of scale * sum|q k| */
} fref;
/* Dense masked softmax in double. */
void dref_forward(const prob *P, const dinp *X, fref *F);
void dref_fref_alloc(fref *F, const prob *P);
void dref_fref_free(fref *F);
/* L = sum(out * R) through dref_forward (F: its scratch) */
double dref_loss(const prob *P, const dinp *X, const double *R, fref *F);

/* Gradients of L = sum(out * R) wrt the five inputs, and their magnitudes. */
typedef struct gref {
    double *g[5], *m[5];
} gref;
void dref_gref_alloc(gref *G, const dinp *X);
void dref_gref_free(gref *G);
/* Analytic backward in double on the full mask; R = dout (double copy). */
void dref_backward(const prob *P, const dinp *X, const double *R, gref *G);

#endif
