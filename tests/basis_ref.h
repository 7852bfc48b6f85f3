/* basis_ref.h - brute-force references for the projection basis' tests:
 * synthetic low-rank features, the second moment in double, Jacobi
 * eigenvalues, orthonormality. Slow and simple on purpose. */
#ifndef DF_TEST_BASIS_REF_H
#define DF_TEST_BASIS_REF_H

#include <stdint.h>

#include "basis.h"

/* n tokens, K layers of H: x = A s + noise, A random D x r (r <= 64), s with
 * variances 1/(j+1), layer k scaled by (k+1); K row-major [n x H] f32 layers
 * in one malloc'd buffer (layer k at + k*n*H); draws from *rng. */
float *basis_ref_features(uint64_t *rng, int64_t n, int K, int H, int r, double noise);
/* Feature d (layer d / H, channel d % H) of token t of such a buffer. */
double basis_ref_x(const float *x, int64_t n, int H, int64_t t, int64_t d);
/* M = sum over tokens [t0, t1) of x_t x_t^T in double, full D x D, malloc'd. */
double *basis_ref_moment(const float *x, int64_t n, int K, int H, int64_t t0, int64_t t1);
/* Cyclic Jacobi: the eigenvalues of the symmetric n x n a (destroyed) into w, descending. */
void basis_ref_eigvals(double *a, int n, double *w);
/* max |P P^T - I| */
double basis_ref_ortho_err(const df_basis *b);

#endif
