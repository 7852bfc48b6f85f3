/* lt_check.h - the benchmark tools' cuBLASLt status check: a failed call prints where and
 * the status, and ends the program (tools are programs: their main decides). */
#ifndef DF_TOOLS_LT_CHECK_H
#define DF_TOOLS_LT_CHECK_H

#include <cublasLt.h>
#include <stdio.h>
#include <stdlib.h>

#define LK(x)                                                                             \
    do {                                                                                  \
        cublasStatus_t st_ = (x);                                                         \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                               \
            fprintf(stderr, "%s:%d: cublasLt status %d\n", __FILE__, __LINE__, (int)st_); \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

#endif
