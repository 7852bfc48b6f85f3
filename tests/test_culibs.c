/* test_culibs.c - kernels/cuda/culibs.c: cuBLASLt, cuBLAS and cuSOLVER open on
 * first use and their calls reach the libraries. Runs without a GPU: each
 * check is a call the libraries answer on the host alone (a status string, a
 * matrix layout, a solver parameter object), so a library that failed to
 * open (our stubs' NOT_INITIALIZED) or a symbol not found fails here in CI,
 * not first on a GPU machine. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cusolverDn.h>
#include <string.h>

#include "test.h"

int main(void)
{
    /* cuBLAS: the library's own text (the stub's would be "cuBLAS could not be opened") */
    const char *s = cublasGetStatusString(CUBLAS_STATUS_SUCCESS);
    CHECK(s && strstr(s, "could not") == NULL && strlen(s) > 0);

    /* cuBLASLt: a layout created, its attribute read back, destroyed */
    cublasLtMatrixLayout_t l = NULL;
    CHECK_EQ(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, 48, 32, 64), CUBLAS_STATUS_SUCCESS);
    CHECK(l != NULL);
    if (l)
        CHECK_EQ(cublasLtMatrixLayoutDestroy(l), CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulPreference_t pref = NULL;
    CHECK_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
    size_t ws = 1 << 20;
    if (pref) {
        CHECK_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                      sizeof ws),
                 CUBLAS_STATUS_SUCCESS);
        CHECK_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
    }

    /* cuSOLVER: a parameter object */
    cusolverDnParams_t p = NULL;
    CHECK_EQ(cusolverDnCreateParams(&p), CUSOLVER_STATUS_SUCCESS);
    if (p)
        CHECK_EQ(cusolverDnDestroyParams(p), CUSOLVER_STATUS_SUCCESS);
    return test_main_end();
}
