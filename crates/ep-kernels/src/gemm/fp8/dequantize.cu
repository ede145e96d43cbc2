// Block-scaled e4m3 weights to bf16: y[r, c] = bf16_rn(f32(q[r, c]) * scales[r / scale_rows,
// c / 128]), DeepSeek's `weight_dequant` with the rounding of the host twin
// (`gemm::fp8::dequantize_weight` then `bf16::from_f32`), bit for bit. For weights kept in bf16
// on the device (loaded once). Launcher: `dequantize_weight_cuda` in cuda/dequantize.rs.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;  // one 16-byte vector of e4m3

}  // namespace

// Mirrors `DequantizeWeightParams` in src/gemm/fp8/cuda/dequantize.rs.
struct DequantizeWeightParams {
    const uint8_t* q;       // [n, k], 16-byte aligned
    const float* scales;    // [ceil(n / scale_rows), scale_cols]
    __nv_bfloat16* out;     // [n, k], 16-byte aligned
    int64_t n;
    int64_t k;              // a multiple of 16
    int32_t scale_rows;
    int32_t scale_cols;     // ceil(k / 128)
};
EP_CHECK_PARAMS_SIZE(DequantizeWeightParams, 48);

EP_KERNEL void __launch_bounds__(kThreads)
    dequantize_weight_fp8(const __grid_constant__ DequantizeWeightParams p) {
    const int64_t vectors = p.n * p.k / kPerThread;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < vectors;
         v += static_cast<int64_t>(gridDim.x) * kThreads) {
        const int64_t first = v * kPerThread;
        const int64_t r = first / p.k;
        const int64_t c = first % p.k;
        const float scale =
            __ldg(p.scales + (r / p.scale_rows) * p.scale_cols + c / ep::kFp8Group);
        const uint4 raw = *reinterpret_cast<const uint4*>(p.q + first);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t out[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t w = words[i / 2] >> (16 * (i % 2));
            const float lo = __fmul_rn(ep::e4m3_to_f32(static_cast<uint8_t>(w)), scale);
            const float hi = __fmul_rn(ep::e4m3_to_f32(static_cast<uint8_t>(w >> 8)), scale);
            const __nv_bfloat162 pair =
                __halves2bfloat162(ep::f32_to_bf16(lo), ep::f32_to_bf16(hi));
            out[i] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        uint4* dst = reinterpret_cast<uint4*>(p.out + first);
        dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
        dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
}
