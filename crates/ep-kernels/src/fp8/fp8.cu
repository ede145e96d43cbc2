// Per-token 1x128 fp8 e4m3 casts. Host twin: `src/fp8/host.rs`; launchers: `src/fp8/cuda/fp8.rs`
// (`quantize_cuda`, `dequantize_cuda`).
//
// A group is 128 consecutive channels of one token; `[T, H]` holds `T * H / 128` groups laid
// out back to back, so both kernels simply walk groups. One warp per group, 4 channels per lane:
//   quantize:   amax = max |x| (warp reduction), scale = max(amax, 1e-4) / 448 (optionally
//               rounded up to a power of two), q = e4m3_satfinite_rn(x / scale);
//   dequantize: y = bf16_rn(f32(q) * scale).
// Division and multiplication are IEEE f32 (never build these with --use_fast_math /
// -prec-div=false): the host twin computes the very same operations, so results are
// bit-identical.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / ep::kWarpSize;
constexpr int kPerLane = ep::kFp8Group / ep::kWarpSize;  // 4
static_assert(kPerLane == 4, "the vector widths below assume 4 channels per lane");

}  // namespace

// Mirrors `QuantizeParams` in src/fp8/cuda/fp8.rs.
struct QuantizeParams {
    const __nv_bfloat16* x;  // [num_groups * 128], 8-byte aligned
    uint8_t* q;              // [num_groups * 128], 4-byte aligned
    float* scales;           // [num_groups]
    int64_t num_groups;
    uint32_t scale_format;   // 0: f32 amax / 448, 1: UE8M0 (rounded up to a power of two)
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(QuantizeParams, 40);

// Mirrors `DequantizeParams` in src/fp8/cuda/fp8.rs.
struct DequantizeParams {
    const uint8_t* q;       // [num_groups * 128], 4-byte aligned
    const float* scales;    // [num_groups]
    __nv_bfloat16* out;     // [num_groups * 128], 8-byte aligned
    int64_t num_groups;
};
EP_CHECK_PARAMS_SIZE(DequantizeParams, 32);

EP_KERNEL void __launch_bounds__(kThreads) quantize_fp8_1x128(const __grid_constant__ QuantizeParams p) {
    const int lane = ep::lane_id();
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
         g < p.num_groups; g += warps) {
        const int64_t base = g * ep::kFp8Group + lane * kPerLane;
        const uint2 raw = *reinterpret_cast<const uint2*>(p.x + base);
        const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
        const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
        const float v[kPerLane] = {__low2float(lo), __high2float(lo), __low2float(hi),
                                   __high2float(hi)};
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            amax = fmaxf(amax, fabsf(v[i]));
        }
        amax = ep::warp_reduce_max(amax);
        float scale = __fdiv_rn(fmaxf(amax, ep::kAmaxMin), ep::kE4m3Max);
        if (p.scale_format == 1) {
            scale = ep::round_scale_ue8m0(scale);
        }
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            packed |= static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(v[i], scale))) << (8 * i);
        }
        *reinterpret_cast<uint32_t*>(p.q + base) = packed;
        if (lane == 0) {
            p.scales[g] = scale;
        }
    }
}

EP_KERNEL void __launch_bounds__(kThreads) dequantize_fp8_1x128(const __grid_constant__ DequantizeParams p) {
    const int lane = ep::lane_id();
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
         g < p.num_groups; g += warps) {
        const int64_t base = g * ep::kFp8Group + lane * kPerLane;
        const uint32_t packed = *reinterpret_cast<const uint32_t*>(p.q + base);
        const float scale = __ldg(p.scales + g);
        float y[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            y[i] = __fmul_rn(ep::e4m3_to_f32(static_cast<uint8_t>(packed >> (8 * i))), scale);
        }
        const __nv_bfloat162 lo = __halves2bfloat162(ep::f32_to_bf16(y[0]), ep::f32_to_bf16(y[1]));
        const __nv_bfloat162 hi = __halves2bfloat162(ep::f32_to_bf16(y[2]), ep::f32_to_bf16(y[3]));
        uint2 raw;
        raw.x = *reinterpret_cast<const uint32_t*>(&lo);
        raw.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(p.out + base) = raw;
    }
}
