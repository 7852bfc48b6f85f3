// dflash_attn/common.cuh - what the DFlash attention's CUDA files share
// (dispatch.cu, simt.cu, mma_*.cu: every implementation; dflash_attn/wg_dkv.cu,
// dflash_attn/wg_dq.cu, dflash_attn/wg_fwd.cu: the wgmma context dK/dV, dQ
// and forward of impls WG2 and WG2F): the kernel parameters, the row-chunk
// and visibility helpers and the host entry points of the wgmma files.
// Internal: not part of the dflash_attn.h contract.
#ifndef DF_CUDA_DFLASH_ATTN_COMMON_CUH
#define DF_CUDA_DFLASH_ATTN_COMMON_CUH

#include <cuda.h> // CUtensorMap (the wgmma kernels' TMA maps; no libcuda link)
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

#include "../device.h" // df_cuda_portable_forced

namespace df_dflash {

// Rows of a row chunk (attn_internal.cuh's RQ): one block's bs x group rows of
// one kv head, at most CHUNK_ROWS of them per chunk.
constexpr int CHUNK_ROWS = 64;

struct Params {
    int S, nb, bs, W, nq, nkv, group, nch;
    float scale;
    const int32_t *anchor, *doc_start;
    const uint8_t *valid;
    const uint16_t *q, *kc, *vc, *kb, *vb, *out, *dout;
    uint16_t *o, *dq, *dkc, *dvc, *dkb, *dvb;
    float *lse;
    const float *lse_in;
    float *Di;
};

// Programmatic dependent launch (sm_90; no-ops elsewhere and in a grid
// launched without it). A kernel launched with launch_pdl(.., true) may start
// while the kernel before it in the stream still runs: it must pdl_wait()
// before it reads that kernel's (or an earlier one's) results or writes what
// they read, and before it exits, so that a grid's end still means every
// grid before it has ended. pdl_trigger() lets the next grid launch once
// every CTA of this one has run it (or ended): the next grid's CTAs then take
// the SMs this grid's last wave leaves free and wait there, so a kernel
// boundary costs no launch latency and no ramp.
__device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// fn<<<grid, block, smem, st>>>(args), as a programmatic dependent of the
// stream's previous kernel when pdl
static inline cudaError_t launch_pdl(const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                     bool pdl, void **args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = st;
    cfg.attrs = at, cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelExC(&cfg, fn, args);
}

// fn's dynamic shared memory limit (smem bytes) and, where carve, the
// largest shared-memory carveout, set once per kernel and device (done: one
// flag per device, the caller's static array of 64): WG3 launches its
// kernels with these every call, and the driver calls would otherwise sit
// between a backward's start and its first kernel. Racing first calls set
// the same values. (Nothing here resets the device: cudaDeviceReset would
// need them set again.)
static inline cudaError_t func_smem_once(const void *fn, size_t smem, bool carve, signed char *done)
{
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    const bool known = e == cudaSuccess && dev >= 0 && dev < 64;
    if (known && done[dev])
        return cudaSuccess;
    e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess && carve)
        e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess && known)
        done[dev] = 1;
    return e;
}

// Impl WG3's stored dS (dflash_attn/wg_dqs.cu; a kernel argument of its own,
// after the others, where used: Params and every other kernel's arguments
// do not hold it): the context dS^T tiles the context dK/dV pass stores (ds,
// DS_TILE_BYTES per (block b, 128-key tile t of its span, kv head g), slot
// (b maxt + t - lo0 / 128) nkv + g, or with off (args.ds_off, the spans as
// they are) (off[b] - off[b0] + t - lo0 / 128) nkv + g (b0: the block
// range's first, below); maxt = dqs_max_tiles: the most tiles a span can
// meet), and the block tiles' (dsb, DS_BLK_BYTES per (block, kv head),
// written by the block pass, blk_wg_kernel).
// ctr: the dQ kernel's item counters (dqs_kernel; one per block range, up to
// DS_MAX_RANGES in the 256 bytes), zeroed by the block pass. pdl (host side):
// WG3's kernels after the first are launched as programmatic dependents
// (launch_pdl).
// part (may be NULL): the context dK/dV pass's fp32 split partials, which
// dqs_kernel's reducer warps then sum into dkc / dvc in place of
// dkv_reduce_kernel (the same sums, the same bits).
struct DsBuf {
    uint16_t *ds, *dsb;
    int *ctr;
    const float *part;
    const int *off; // (may be NULL) block b's first tile slot, in place of b maxt (args.ds_off)
    int maxt, pdl;
    // Block ranges (args.ds_ranges; off set): the context dK/dV pass and the
    // dQ pass run once per range of blocks [b0, b1), the store holding that
    // range's tiles only (slots from off[b] - off[b0]). The
    // dK/dV pass's CTAs take the items of their tile's list that fall in the
    // range and add their sums to the fp32 partials of the previous range
    // (first: none), dK unscaled until the last range (dK, dV within fp32
    // rounding of one range; dQ the same bits); ctr is the range's own dQ counter.
    int b0, b1, first, last;
    // host: the ranges' bounds (nranges + 1 block indices; NULL: one range)
    const int *bounds;
    int nranges;
};

// impl WG3's stored dS^T: one context tile's is 128 keys x 64 rows of bf16,
// [key][row] rows of 128 bytes in the 128-byte swizzle (the wgmma
// MN-major A layout; keys 64 h .. 64 h + 63 in half h, written by warpgroup
// h of the context dK/dV pass); a block tile's the same for 16 keys.
constexpr int DS_TILE_BYTES = 128 * 64 * 2, DS_BLK_BYTES = 16 * 64 * 2;
constexpr int DS_MAX_RANGES = 64; // block ranges of the stored dS (DsBuf), one counter each

// Context keys visible to row qo of a valid block: [lo, anchor).
__device__ __forceinline__ int ctx_lo(int anc, int ds, int W, int qo)
{
    int lo = ds;
    if (W > 0 && anc + qo - (W - 1) > lo)
        lo = anc + qo - (W - 1);
    return lo < anc ? lo : anc;
}

// Row r of chunk ch of block b, kv head g: (global row, head) or valid = false.
// 2^x in one MUFU op, every kernel's softmax exponential (flush-to-zero: the P
// that matter are far from denormal; 2^-inf = 0 is how masked elements become
// 0 without a branch). exp2f would add a range check and two scalings.
__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

struct RowId {
    int grow, h, qo;
    bool ok;
};
__device__ __forceinline__ RowId row_id(const Params &p, int b, int g, int ch, int lr)
{
    RowId id;
    int r = ch * CHUNK_ROWS + lr;
    id.ok = r < p.bs * p.group;
    int qo = id.ok ? r / p.group : 0, hh = id.ok ? r % p.group : 0;
    id.qo = qo;
    id.grow = b * p.bs + qo;
    id.h = g * p.group + hh;
    return id;
}

// The keys row id sees in a key tile, [klo, khi): a context tile, [rlo (its
// ctx_lo), anc); the block tile, the block's bs keys, or on a sliding layer
// (W > 0) the first qo + 1 of them; none where ok is false (rows past the
// chunk, rows without lse). The wgmma forward's and dQ pass's masks.
__device__ __forceinline__ void row_key_range(const Params &p, const RowId &id, int rlo, bool ok, bool isctx,
                                              int anc, int &klo, int &khi)
{
    int qo1 = id.qo + 1;
    klo = isctx ? rlo : 0;
    khi = isctx ? anc : (p.W == 0 || qo1 > p.bs ? p.bs : qo1);
    khi = ok ? khi : INT_MIN;
}

// ---- dflash_attn/wg_dkv.cu (impls DF_CUDA_DFLASH_IMPL_WG2, _WG2F: the context dK/dV) ----
// Key tile and split count of the context dK/dV partials: MMA4's (TK4, NSPL),
// so the tile lists, their order, the partial buffer and the split reduction
// are MMA4's (mma_bwd.cu asserts the match). Two splits: half the
// partials' memory of four (67 MB at the 27B shape) and a shorter
// reduction; four and eight splits were tried and were slower (docs/log/).
constexpr int WG_TILE_KEYS = 128, WG_NSPL = 2;

// Whether the current device runs the wgmma context dK/dV kernel for p and
// head dim D: compute capability 9.0 and the kernel built for it (sm_90a),
// enough opt-in shared memory, a block's query rows (bs x nq x D elements)
// addressable in 32 bits. false: the caller runs MMA4's kernel.
bool dkv_wg_usable(const Params &p, int D);

// The context dK/dV pass: nct key tiles of WG_TILE_KEYS keys, CTAs in the
// order order[] (LPT rank -> tile), each (tile, kv head, split) summing the
// items of its split into the fp32 partials part (MMA4's layout). cnt / lst:
// tile_list_kernel's lists. km (may be NULL): kv_maps_make's maps of this
// call, whose q / dout maps (qd_on) are used instead of encoding them again.
// Returns 0 or -EIO (launch error).
struct KvMaps;
// dsb (may be NULL: WG2 / WG2F): WG3's buffers, the dS^T to store (the TQ
// instantiation only: -EINVAL where it would not run).
int dkv_wg_launch(const Params &p, int D, cudaStream_t st, float *part, const int *cnt,
                  const int *lst, const int *order, int nct, const KvMaps *km, const DsBuf *dsb);

// ---- dflash_attn/wg_dq.cu, dflash_attn/wg_fwd.cu (impls DF_CUDA_DFLASH_IMPL_WG2, _WG2F) ----
// The K / V tensor maps of the forward and the dQ pass (TMA): context kc, vc
// [S, nkv D] and block kb, vb [nb bs, nkv D], bf16 rows, boxes of 64 dims x
// WG_KV_BOX keys (the block maps: x 16 keys when block_size <= 16) in the
// 128-byte swizzle, the shared tiles' layout (dflash_attn/wg.cuh); rows past
// a tensor's end read as zeros. Passed to the kernels as __grid_constant__.
constexpr int WG_KV_BOX = 64;
struct KvMaps {
    CUtensorMap kc, vc, kb, vb;
    // q, dout as 3-D tensors [nb bs queries][nq heads][D], boxes of one row
    // chunk (bs queries x group heads x 64 dims; the chunk's rows, query-
    // major, in the 128-byte swizzle): made when bs x group == 64 (qd_on 1;
    // dout only where given), for the forward's Q and the dQ pass's Q, dO
    CUtensorMap q, dout;
    int q_on, qd_on;
};
// A bf16 tensor of rank dimensions (dims innermost first; strides: bytes
// between consecutive indices of dims 1 ..) as a TMA map of box boxes in
// the 128-byte swizzle (box[0] x 2 bytes <= 128), reads past its ends
// giving zeros: 0, or -EOPNOTSUPP (no cuTensorMapEncodeTiled in the driver,
// base not 16-byte aligned, or the encoder refused). dflash_attn/wg_fwd.cu.
int tma_map_bf16(CUtensorMap *m, const void *base, int rank, const uint64_t *dims,
                 const uint64_t *strides, const uint32_t *box);
// A [nb bs queries][nq heads][D] bf16 tensor (q, dout, out) as a 3-D map
// whose box is one row chunk: bs queries x group heads x 64 dims, landing as
// the chunk's rows (query-major, head-minor) in the 128-byte swizzle. Only
// meaningful when bs x group == 64. 0 or -EOPNOTSUPP (tma_map_bf16's).
int chunk_map_bf16(CUtensorMap *m, const void *base, const Params &p, int D);
// The same for an fp32 tensor, unswizzled (box[0] x 4 bytes a multiple of 16).
int tma_map_f32(CUtensorMap *m, const void *base, int rank, const uint64_t *dims, const uint64_t *strides,
                const uint32_t *box);
// p's maps for head dim D into *m: 0, or -EOPNOTSUPP (the driver has no
// cuTensorMapEncodeTiled, a base address is not 16-byte aligned, or the
// encoder refused): the caller then runs MMA4's kernels.
int kv_maps_make(const Params &p, int D, KvMaps *m);
// Whether the current device runs the wgmma dQ kernel (dq_wg_usable; fold:
// its WG2F instantiation) / the wgmma forward (fwd_wg_usable) for head dim
// D: compute capability 9.0, the kernel built for sm_90a, enough opt-in
// shared memory. false: the caller runs MMA4's kernel (dq_mma2_kernel /
// fwd_r32_kernel).
bool dq_wg_usable(int D, bool fold);
bool fwd_wg_usable(int D);
// The dQ pass: items (block, kv head, row chunk), p.nb * p.nkv * p.nch of
// them, blocks last to first, on a persistent grid. fold false (WG2): needs
// p.Di filled (di_kernel). fold true (WG2F; needs p.nch == 1, else -EINVAL):
// also writes p.Di (di_kernel's values, bitwise) and the block-key
// gradients dkb, dvb (dkv_mma2_kernel's block tiles are then not run). ctr:
// one int of device scratch, the items' counter (zeroed on st, then used by
// the kernel). 0, -EINVAL or -EIO.
int dq_wg_launch(const Params &p, int D, cudaStream_t st, bool fold, const KvMaps &maps, int *ctr);
// The forward (out, lse): one CTA per (block, kv head, row chunk), K / V by
// TMA. 0, -EIO, or -EOPNOTSUPP when the tensor maps cannot be made (nothing
// launched: the caller runs MMA4's forward).
int fwd_wg_launch(const Params &p, int D, cudaStream_t st);

// ---- dflash_attn/wg_blk.cu, dflash_attn/wg_dqs.cu (impl DF_CUDA_DFLASH_IMPL_WG3) ----
// WG3's block pass, lean (one CTA per (block, kv head)): Di, the block-key
// dK / dV, the block tiles' dS^T into dsb.dsb; needs bs <= 16 and
// maps.qd_on. blk_wg_usable: the device runs it for head dim D. 0 or -EIO.
bool blk_wg_usable(int D);
int blk_wg_launch(const Params &p, int D, cudaStream_t st, const KvMaps &maps, const DsBuf &dsb);
// Whether the context dK/dV pass would take its TMA-fed (TQ) instantiation
// for p (bs x group == 64, group a power of two >= 4, its maps made; km as
// dkv_wg_launch's): WG3's stored dS^T exists only there.
bool dkv_wg_tq(const Params &p, int D, const KvMaps *km);
// Whether the current device runs the dQ-from-stored-dS kernel for head dim D.
bool dqs_usable(int D);
// dq = (sum over the stored context dS tiles of dS K + the block tile's dS
// K_b) x scale, per (block, kv head) in key order: deterministic; and, where
// dsb.part, dkc / dvc from the split partials. Needs dsb filled (the block
// pass, the context dK/dV pass), maps' kc / kb. 0 or -EIO.
int dqs_launch(const Params &p, int D, cudaStream_t st, const KvMaps &maps, const DsBuf &dsb);
// The most 128-key tiles a block's context span can meet (DsBuf.maxt): S keys
// wide at most, and window - 1 on a sliding layer.
int dqs_max_tiles(int S, int window);

} // namespace df_dflash

#endif
