// SwiGLU of the fp8 experts' gate_up products and its 1 x 128 fp8 quantization for the down
// GEMM, in one pass: for every row r and 128-column group of act,
//   act[c] = silu(gate[c]) * up[c]          (f32, from the bf16 products h = [gate | up])
//   scale  = max(max |act|, 1e-4) / 448,    q[c] = e4m3_satfinite_rn(act[c] / scale)
// as the per-token fp8 cast (fp8/fp8.cu) does. In a masked layout blockIdx.y is the group and
// only its first counts[group] rows are visited (a decode step's blocks are mostly empty). Host twin: `gemm::fp8::swiglu_quantize` (expf may differ from the host's exp in
// the last bit, so results agree to one e4m3 step); launcher: src/gemm/fp8/cuda.rs.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / ep::kWarpSize;
constexpr int kPerLane = ep::kFp8Group / ep::kWarpSize;  // 4

}  // namespace

// Mirrors `SwigluQuantizeParams` in src/gemm/fp8/cuda.rs.
struct SwigluQuantizeParams {
    const __nv_bfloat16* h;  // [rows, 2 * inter]: gate columns, then up columns; 8-byte aligned
    uint8_t* q;              // [rows, inter] e4m3, 4-byte aligned
    float* scales;           // [rows, inter / 128]
    const int32_t* counts;   // masked layout: [rows / m_max] valid rows per block; else null
    int64_t rows;
    int32_t inter;           // a multiple of 128
    int32_t m_max;           // masked layout: rows per block; else 0
};
EP_CHECK_PARAMS_SIZE(SwigluQuantizeParams, 48);

EP_KERNEL void __launch_bounds__(kThreads)
    swiglu_quantize_fp8(const __grid_constant__ SwigluQuantizeParams p) {
    const int lane = ep::lane_id();
    const int64_t groups_per_row = p.inter / ep::kFp8Group;
    // Rows this grid row visits: every row (contiguous), or group blockIdx.y's valid ones.
    int64_t first = 0;
    int64_t rows = p.rows;
    if (p.counts != nullptr) {
        first = static_cast<int64_t>(blockIdx.y) * p.m_max;
        rows = min(static_cast<int64_t>(__ldg(p.counts + blockIdx.y)),
                   static_cast<int64_t>(p.m_max));
    }
    const int64_t items = rows * groups_per_row;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
         item < items; item += warps) {
        const int64_t r = first + item / groups_per_row;
        const int64_t g = item % groups_per_row;
        const int64_t col = g * ep::kFp8Group + lane * kPerLane;
        const __nv_bfloat16* row = p.h + r * 2 * static_cast<int64_t>(p.inter);
        const uint2 graw = *reinterpret_cast<const uint2*>(row + col);
        const uint2 uraw = *reinterpret_cast<const uint2*>(row + p.inter + col);
        const __nv_bfloat162 g01 = *reinterpret_cast<const __nv_bfloat162*>(&graw.x);
        const __nv_bfloat162 g23 = *reinterpret_cast<const __nv_bfloat162*>(&graw.y);
        const __nv_bfloat162 u01 = *reinterpret_cast<const __nv_bfloat162*>(&uraw.x);
        const __nv_bfloat162 u23 = *reinterpret_cast<const __nv_bfloat162*>(&uraw.y);
        const float gate[kPerLane] = {__low2float(g01), __high2float(g01), __low2float(g23),
                                      __high2float(g23)};
        const float up[kPerLane] = {__low2float(u01), __high2float(u01), __low2float(u23),
                                    __high2float(u23)};
        float act[kPerLane];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const float silu = __fdiv_rn(gate[i], __fadd_rn(1.0f, expf(-gate[i])));
            act[i] = __fmul_rn(silu, up[i]);
            amax = fmaxf(amax, fabsf(act[i]));
        }
        amax = ep::warp_reduce_max(amax);
        const float scale = __fdiv_rn(fmaxf(amax, ep::kAmaxMin), ep::kE4m3Max);
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            packed |= static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(act[i], scale))) << (8 * i);
        }
        *reinterpret_cast<uint32_t*>(p.q + r * p.inter + col) = packed;
        if (lane == 0) {
            p.scales[r * groups_per_row + g] = scale;
        }
    }
}
