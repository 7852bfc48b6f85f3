/* model.h - a target model (qwen3 dense, qwen3_5 hybrid) built from an HF
 * folder (config.json + safetensors), running its forward pass on a
 * backend over packed documents and handing back chosen hidden states.
 *
 * Hidden-state indices follow HF's output_hidden_states: 0 = the
 * embeddings, i in 1..L-1 = the residual stream after layer i-1 (no norm),
 * L = the final-normed output of layer L-1. A DFlash feature layer l is
 * index l + 1. The forward stops after the highest index asked for, so
 * extraction never runs layers it does not store.
 *
 * Weights are checked when the model is opened: every tensor the forward
 * needs must exist with the shape the config implies and a float dtype;
 * errors name the tensor and the file. Multimodal qwen3_5 checkpoints load
 * their text part (model.language_model.*); model.visual.* and mtp.* are
 * ignored; lm_head is never loaded (extraction needs none).
 */
#ifndef DF_MODEL_H
#define DF_MODEL_H

#include <stdint.h>

#include "err.h"
#include "hfconfig.h"
#include "ops.h"

typedef struct df_model df_model;

int df_model_open(const char *dir, df_backend *be, df_model **out, df_err *e);
/* A model of the config's shape (a folder holding config.json, or the
 * file) with random weights drawn on the backend (df_backend_fill_uniform,
 * seeded by seed and each tensor's name): benchmarks of shapes whose
 * checkpoint is not at hand, and CPU/GPU comparisons. */
int df_model_open_random(const char *config, df_backend *be, uint64_t seed, df_model **out,
                         df_err *e);
void df_model_close(df_model *m);

const df_model_config *df_model_get_config(const df_model *m);

/* Runs the forward over T tokens of n_seq packed documents (cu_seqlens
 * [n_seq + 1], positions restart at 0 in each document) and writes hidden
 * state hs_index[i] to out[i] as [T, hidden] of out_dtype (BF16 or F32),
 * host memory (pinned memory from df_backend_host_alloc copies fastest).
 * The backend computes in its activation dtype (F32 on the CPU, BF16 on
 * CUDA: HF's bf16 numerics). */
int df_model_forward(df_model *m, const uint32_t *ids, const int32_t *cu_seqlens, int n_seq,
                     int64_t T, const int *hs_index, int n_out, df_dtype out_dtype,
                     void *const *out, df_err *e);

/* Projection on the device (a projected cache, docs/FORMAT-basis.md): after
 * df_model_set_projection(P [R x D] row-major f32, D = K hidden), each
 * df_model_forward_projected writes z = P x [T, R] BF16 to host z (pinned
 * memory copies fastest) for the n_out = K feature layers hs_index, in place
 * of the K hidden states. P is held as two BF16 halves (hi + lo, ~16 bits
 * of mantissa) and z is summed in FP32 and rounded once: the host's
 * df_basis_project_bf16 to within FP32 accumulation. BF16 backends only
 * (CUDA): -ENOTSUP on the CPU backend, which projects on the host. Costs
 * 4 R D flops and 4 D bytes of device memory per token (the features twice)
 * beside the forward's. */
int df_model_set_projection(df_model *m, const float *P, int R, int D, df_err *e);
int df_model_forward_projected(df_model *m, const uint32_t *ids, const int32_t *cu_seqlens,
                               int n_seq, int64_t T, const int *hs_index, int n_out, uint16_t *z,
                               df_err *e);

#endif
