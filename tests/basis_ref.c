/* basis_ref.c - brute-force references shared by test_basis and test_gpu_basis
 * (basis_ref.h). */
#include <math.h>
#include <stdlib.h>

#include "basis_ref.h"
#include "test.h"

/* n tokens, K layers of H: x = A s + noise, A random D x r, s with variances
 * 1/(j+1), layer k scaled by (k+1); K row-major [n x H] f32 layers in one
 * buffer (layer k at + k*n*H). */
float *basis_ref_features(uint64_t *rng, int64_t n, int K, int H, int r, double noise)
{
    int64_t D = (int64_t)K * H;
    float *A = malloc(sizeof(float) * (size_t)(D * r));
    float *x = malloc(sizeof(float) * (size_t)(n * D));
    for (int64_t i = 0; i < D * r; i++)
        A[i] = test_randn(rng);
    for (int64_t t = 0; t < n; t++) {
        double s[64];
        for (int j = 0; j < r; j++)
            s[j] = test_randn(rng) / sqrt(j + 1.0);
        for (int64_t d = 0; d < D; d++) {
            double v = noise * test_randn(rng);
            for (int j = 0; j < r; j++)
                v += A[d * r + j] * s[j];
            int64_t k = d / H, i = d % H;
            x[k * n * H + t * H + i] = (float)(v * (k + 1));
        }
    }
    free(A);
    return x;
}
double basis_ref_x(const float *x, int64_t n, int H, int64_t t, int64_t d)
{
    return x[(d / H) * n * H + t * H + d % H];
}
/* M = sum_t x_t x_t^T over rows [t0, t1) in double, full D x D */
double *basis_ref_moment(const float *x, int64_t n, int K, int H, int64_t t0, int64_t t1)
{
    int64_t D = (int64_t)K * H;
    double *M = calloc((size_t)(D * D), sizeof(double)), *row = malloc(sizeof(double) * (size_t)D);
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t d = 0; d < D; d++)
            row[d] = basis_ref_x(x, n, H, t, d);
        for (int64_t i = 0; i < D; i++)
            for (int64_t j = 0; j < D; j++)
                M[i * D + j] += row[i] * row[j];
    }
    free(row);
    return M;
}
/* Cyclic Jacobi: the eigenvalues of the symmetric n x n a (destroyed), descending. */
void basis_ref_eigvals(double *a, int n, double *w)
{
    for (int sweep = 0; sweep < 100; sweep++) {
        double off = 0, tot = 0;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                tot += a[i * n + j] * a[i * n + j];
                if (i != j)
                    off += a[i * n + j] * a[i * n + j];
            }
        if (off <= 1e-30 * tot)
            break;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = a[p * n + q];
                if (fabs(apq) < 1e-300)
                    continue;
                double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
                double t = (theta >= 0 ? 1 : -1) / (fabs(theta) + sqrt(theta * theta + 1));
                double c = 1 / sqrt(t * t + 1), s = t * c;
                for (int k = 0; k < n; k++) {
                    double akp = a[k * n + p], akq = a[k * n + q];
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for (int k = 0; k < n; k++) {
                    double apk = a[p * n + k], aqk = a[q * n + k];
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
    }
    for (int i = 0; i < n; i++)
        w[i] = a[i * n + i];
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (w[j] > w[i]) {
                double t = w[i];
                w[i] = w[j], w[j] = t;
            }
}
/* max |P P^T - I| */
double basis_ref_ortho_err(const df_basis *b)
{
    double worst = 0;
    for (int r = 0; r < b->R; r++)
        for (int s = 0; s < b->R; s++) {
            double d = 0;
            for (int i = 0; i < b->D; i++)
                d += (double)b->P[(int64_t)r * b->D + i] * b->P[(int64_t)s * b->D + i];
            worst = fmax(worst, fabs(d - (r == s)));
        }
    return worst;
}
