// SwiGLU over dense rows of a blocked gate_up product: act[r, j] = silu(h[r, gate(j)]) *
// h[r, up(j)], h = [rows, 2I] in the blocked column order of swiglu_epilogue_sm90.cuh
// (columns 16b .. 16b + 7 the gates of act columns 8b .. 8b + 7, the next 8 their ups), act =
// [rows, I]. For an MLP whose gate_up GEMM is a dense cuBLAS GEMM (a MoE layer's shared experts
// beside the dispatch): one pass instead of strided views. Launcher and host twin:
// src/gemm/cuda/swiglu_rows.rs (`swiglu_rows_bf16_cuda`), src/gemm/host.rs (`swiglu_rows`).
//
// One thread per block of 8 act columns: two 16-byte loads (its gates and its ups, contiguous)
// and one 16-byte store, in a grid-stride loop. silu in f32, one rounding, as the epilogue.

#include "common.cuh"

// Mirrors `SwigluRowsParams` in src/gemm/cuda/swiglu_rows.rs.
struct SwigluRowsParams {
    const __nv_bfloat16* h;  // [rows, 2 * inter]
    __nv_bfloat16* act;      // [rows, inter]
    int64_t rows;
    int64_t inter;  // a multiple of 8
};
EP_CHECK_PARAMS_SIZE(SwigluRowsParams, 32);

EP_KERNEL void swiglu_rows_bf16(const __grid_constant__ SwigluRowsParams p) {
    const int64_t blocks_per_row = p.inter / 8;
    const int64_t items = p.rows * blocks_per_row;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
         item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = item / blocks_per_row;
        const int64_t b = item % blocks_per_row;
        const int4* src = reinterpret_cast<const int4*>(p.h + row * 2 * p.inter + b * 16);
        const int4 gv = ep::ld_nc_no_alloc(src);
        const int4 uv = ep::ld_nc_no_alloc(src + 1);
        const __nv_bfloat16* g8 = reinterpret_cast<const __nv_bfloat16*>(&gv);
        const __nv_bfloat16* u8 = reinterpret_cast<const __nv_bfloat16*>(&uv);
        int4 ov;
        __nv_bfloat16* o8 = reinterpret_cast<__nv_bfloat16*>(&ov);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float g = ep::bf16_to_f32(g8[j]);
            o8[j] = ep::f32_to_bf16(g / (1.0f + expf(-g)) * ep::bf16_to_f32(u8[j]));
        }
        *reinterpret_cast<int4*>(p.act + row * p.inter + b * 8) = ov;
    }
}
