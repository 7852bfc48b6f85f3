/* cuda_check.h - the benchmark tools' CUDA error check: a failed runtime call
 * prints where, what and why, and ends the program (tools are programs:
 * their main decides, and every call is in it or its helpers). */
#ifndef DF_TOOLS_CUDA_CHECK_H
#define DF_TOOLS_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA_CK(x)                                                                                \
    do {                                                                                          \
        cudaError_t ck_err_ = (x);                                                                \
        if (ck_err_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                            \
                    cudaGetErrorString(ck_err_));                                                 \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

#endif
