/* culibs.c - cuBLASLt, cuBLAS and cuSOLVER opened on first use (dlopen), not
 * at program start.
 *
 * Why: the dynamic loader maps and relocates every linked library before
 * main; libcublasLt alone (~540 MB) takes ~0.5 s, so every `dflash` command,
 * `dflash dump` and `dflash cache plan` included, paid ~0.7 s for GEMM
 * libraries it never called (and the CLI tests, which run the binary
 * hundreds of times, paid minutes). Here each function the kernels use
 * from those libraries is defined with its header's exact prototype (the
 * compiler checks them against the declarations); the first call of any
 * function of a library opens it and each function looks its symbol up
 * once. The libraries are no longer on the link line.
 *
 * Where a library is found: its soname of the toolkit major version this
 * was built with (libcublasLt.so.13, ...) through the loader's search
 * (LD_LIBRARY_PATH, ld.so.cache), then in the build's toolkit library
 * directory (DF_CUDA_LIBDIR). If neither opens, one warning names the
 * library and dlerror's reason, and every call of that library returns
 * NOT_INITIALIZED, which the callers report as a GEMM / eigensolver error:
 * a program that needs no GEMM (the CPU backend, dump, cache commands) runs
 * on a machine without those libraries. Thread-safe (pthread_once per
 * library; the symbol pointers are atomics). */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cusolverDn.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "log.h"

#define DF_STR_(x) #x
#define DF_STR(x) DF_STR_(x)

#ifndef DF_CUDA_LIBDIR
#define DF_CUDA_LIBDIR ""
#endif

enum { LIB_LT, LIB_BLAS, LIB_SOLVER, NLIB };

static const char *const lib_soname[NLIB] = {
    "libcublasLt.so." DF_STR(CUBLAS_VER_MAJOR),
    "libcublas.so." DF_STR(CUBLAS_VER_MAJOR),
    "libcusolver.so." DF_STR(CUSOLVER_VER_MAJOR),
};
static void *lib_handle[NLIB];
static pthread_once_t lib_once[NLIB] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};

static void lib_load(int i)
{
    void *h = dlopen(lib_soname[i], RTLD_NOW | RTLD_LOCAL);
    if (!h && DF_CUDA_LIBDIR[0]) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", DF_CUDA_LIBDIR, lib_soname[i]);
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (!h)
        df_log(DF_LOG_WARN, "cuda: cannot open %s (%s): its calls fail", lib_soname[i], dlerror());
    lib_handle[i] = h;
}
static void load_lt(void) { lib_load(LIB_LT); }
static void load_blas(void) { lib_load(LIB_BLAS); }
static void load_solver(void) { lib_load(LIB_SOLVER); }
static void (*const lib_init[NLIB])(void) = {load_lt, load_blas, load_solver};

/* The symbol name of library lib, or NULL (a warning names it once per symbol). */
static void *lib_sym(int lib, const char *name)
{
    pthread_once(&lib_once[lib], lib_init[lib]);
    if (!lib_handle[lib])
        return NULL;
    void *f = dlsym(lib_handle[lib], name);
    if (!f)
        df_log(DF_LOG_WARN, "cuda: %s has no %s", lib_soname[lib], name);
    return f;
}

/* ret name params: the function, forwarding args to the library's symbol
 * of the same (macro-expanded: cublasCreate is cublasCreate_v2) name, or
 * returning fail where it cannot be loaded. */
#define LAZY(lib, ret, fail, name, params, args)                            \
    ret name params                                                         \
    {                                                                       \
        typedef ret(*fn_t) params;                                          \
        static fn_t fn;                                                     \
        fn_t f = __atomic_load_n(&fn, __ATOMIC_ACQUIRE);                    \
        if (!f) {                                                           \
            f = (fn_t)lib_sym(lib, DF_STR(name));                           \
            if (!f)                                                         \
                return fail;                                                \
            __atomic_store_n(&fn, f, __ATOMIC_RELEASE);                     \
        }                                                                   \
        return f args;                                                      \
    }

#define LT_FAIL CUBLAS_STATUS_NOT_INITIALIZED
#define SOLVER_FAIL CUSOLVER_STATUS_NOT_INITIALIZED

/* ---- cuBLASLt (kernels/cuda/gemm.cu, lmhead_ce.cu) ---- */
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtCreate, (cublasLtHandle_t * h), (h))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtDestroy, (cublasLtHandle_t h), (h))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulDescCreate,
     (cublasLtMatmulDesc_t * d, cublasComputeType_t ct, cudaDataType_t st), (d, ct, st))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t d), (d))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulDescSetAttribute,
     (cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *buf, size_t n), (d, a, buf, n))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatrixLayoutCreate,
     (cublasLtMatrixLayout_t * l, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld),
     (l, type, rows, cols, ld))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t l), (l))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * p), (p))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t p), (p))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulPreferenceSetAttribute,
     (cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a, const void *buf, size_t n),
     (p, a, buf, n))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulAlgoGetHeuristic,
     (cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
      cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref, int req,
      cublasLtMatmulHeuristicResult_t res[], int *ret),
     (h, op, a, b, c, d, pref, req, res, ret))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmulAlgoConfigGetAttribute,
     (const cublasLtMatmulAlgo_t *algo, cublasLtMatmulAlgoConfigAttributes_t a, void *buf, size_t n,
      size_t *written),
     (algo, a, buf, n, written))
LAZY(LIB_LT, cublasStatus_t, LT_FAIL, cublasLtMatmul,
     (cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A, cublasLtMatrixLayout_t Ad,
      const void *B, cublasLtMatrixLayout_t Bd, const void *beta, const void *C, cublasLtMatrixLayout_t Cd,
      void *D, cublasLtMatrixLayout_t Dd, const cublasLtMatmulAlgo_t *algo, void *ws, size_t wsn,
      cudaStream_t st),
     (h, op, alpha, A, Ad, B, Bd, beta, C, Cd, D, Dd, algo, ws, wsn, st))

/* ---- cuBLAS and cuSOLVER (kernels/cuda/basis_gpu.cu) ---- */
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasCreate, (cublasHandle_t * h), (h))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasDestroy, (cublasHandle_t h), (h))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasSetStream, (cublasHandle_t h, cudaStream_t st), (h, st))
LAZY(LIB_BLAS, const char *, "cuBLAS could not be opened", cublasGetStatusString, (cublasStatus_t s), (s))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasDgemm,
     (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const double *alpha,
      const double *A, int lda, const double *B, int ldb, const double *beta, double *C, int ldc),
     (h, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasGemmEx,
     (cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha,
      const void *A, cudaDataType At, int lda, const void *B, cudaDataType Bt, int ldb, const void *beta,
      void *C, cudaDataType Ct, int ldc, cublasComputeType_t ct, cublasGemmAlgo_t algo),
     (h, ta, tb, m, n, k, alpha, A, At, lda, B, Bt, ldb, beta, C, Ct, ldc, ct, algo))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasDsyrk,
     (cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t t, int n, int k, const double *alpha,
      const double *A, int lda, const double *beta, double *C, int ldc),
     (h, uplo, t, n, k, alpha, A, lda, beta, C, ldc))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasDsyr2k,
     (cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t t, int n, int k, const double *alpha,
      const double *A, int lda, const double *B, int ldb, const double *beta, double *C, int ldc),
     (h, uplo, t, n, k, alpha, A, lda, B, ldb, beta, C, ldc))
LAZY(LIB_BLAS, cublasStatus_t, LT_FAIL, cublasDdot,
     (cublasHandle_t h, int n, const double *x, int incx, const double *y, int incy, double *result),
     (h, n, x, incx, y, incy, result))

LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnCreate, (cusolverDnHandle_t * h), (h))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnDestroy, (cusolverDnHandle_t h), (h))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnSetStream, (cusolverDnHandle_t h, cudaStream_t st),
     (h, st))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnCreateParams, (cusolverDnParams_t * p), (p))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnDestroyParams, (cusolverDnParams_t p), (p))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnXsyevd_bufferSize,
     (cusolverDnHandle_t h, cusolverDnParams_t p, cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n,
      cudaDataType At, const void *A, int64_t lda, cudaDataType Wt, const void *W, cudaDataType ct,
      size_t *dev_bytes, size_t *host_bytes),
     (h, p, jobz, uplo, n, At, A, lda, Wt, W, ct, dev_bytes, host_bytes))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnXsyevd,
     (cusolverDnHandle_t h, cusolverDnParams_t p, cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n,
      cudaDataType At, void *A, int64_t lda, cudaDataType Wt, void *W, cudaDataType ct, void *dev_buf,
      size_t dev_bytes, void *host_buf, size_t host_bytes, int *info),
     (h, p, jobz, uplo, n, At, A, lda, Wt, W, ct, dev_buf, dev_bytes, host_buf, host_bytes, info))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnXsyevdx_bufferSize,
     (cusolverDnHandle_t h, cusolverDnParams_t p, cusolverEigMode_t jobz, cusolverEigRange_t range,
      cublasFillMode_t uplo, int64_t n, cudaDataType At, const void *A, int64_t lda, void *vl, void *vu,
      int64_t il, int64_t iu, int64_t *meig, cudaDataType Wt, const void *W, cudaDataType ct,
      size_t *dev_bytes, size_t *host_bytes),
     (h, p, jobz, range, uplo, n, At, A, lda, vl, vu, il, iu, meig, Wt, W, ct, dev_bytes, host_bytes))
LAZY(LIB_SOLVER, cusolverStatus_t, SOLVER_FAIL, cusolverDnXsyevdx,
     (cusolverDnHandle_t h, cusolverDnParams_t p, cusolverEigMode_t jobz, cusolverEigRange_t range,
      cublasFillMode_t uplo, int64_t n, cudaDataType At, void *A, int64_t lda, void *vl, void *vu, int64_t il,
      int64_t iu, int64_t *meig, cudaDataType Wt, void *W, cudaDataType ct, void *dev_buf, size_t dev_bytes,
      void *host_buf, size_t host_bytes, int *info),
     (h, p, jobz, range, uplo, n, At, A, lda, vl, vu, il, iu, meig, Wt, W, ct, dev_buf, dev_bytes, host_buf,
      host_bytes, info))
