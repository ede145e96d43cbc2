// Device helpers shared by the low-latency kernels (`src/low_latency/dispatch.cu` and
// `combine.cu`, the multi-rank protocol, and `src/low_latency/local.cu`, the one-rank path), so
// that both compute bit for bit the same values: the 1x128 fp8 cast fused into the dispatch (host
// twin: `src/fp8/host.rs`) and the weighted bf16 accumulation of the combine (host twin:
// `src/low_latency/host.rs`, `combine`).
#pragma once

#include "common.cuh"

namespace ep {
namespace ll {

// bf16 pair (low half first) to two floats (exact).
EP_DEVICE void unpack_bf16x2(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}

// Two floats to a bf16 pair (low half first), round to nearest even.
EP_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __halves2bfloat162(f32_to_bf16(lo), f32_to_bf16(hi));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Eight accumulators to eight bf16 (one 16-byte vector), round to nearest even.
EP_DEVICE int4 pack_bf16x8(const float (&acc)[8]) {
    return make_int4(static_cast<int>(pack_bf16x2(acc[0], acc[1])),
                     static_cast<int>(pack_bf16x2(acc[2], acc[3])),
                     static_cast<int>(pack_bf16x2(acc[4], acc[5])),
                     static_cast<int>(pack_bf16x2(acc[6], acc[7])));
}

// acc[c] += w * f32(bf16 channel c of v) for the 8 channels of one 16-byte vector, as a separate
// multiply and add (no FMA), like the host twin.
EP_DEVICE void accumulate_bf16x8(float (&acc)[8], const int4& v, float w) {
    const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                               static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        float lo, hi;
        unpack_bf16x2(words[c], lo, hi);
        acc[2 * c] = __fadd_rn(acc[2 * c], __fmul_rn(w, lo));
        acc[2 * c + 1] = __fadd_rn(acc[2 * c + 1], __fmul_rn(w, hi));
    }
}

// The 16 bf16 channels [g * 128 + sub * 16, +16) of `row` that lane `sub` of group `g` casts
// with `cast_e4m3_x16`, as two vectors. `row` is read through the non-coherent path: nothing
// may write it during the kernel.
EP_DEVICE void load_bf16x16(const __nv_bfloat16* row, int g, int sub, int4& a, int4& c) {
    const int4* src = reinterpret_cast<const int4*>(row + g * kFp8Group + sub * 16);
    a = ld_nc_no_alloc(src);
    c = ld_nc_no_alloc(src + 1);
}

// The 1x128 e4m3 cast of 16 channels `a, c` (from `load_bf16x16`), where the 8 lanes
// `sub = lane & 7` of an aligned lane octet hold the 128 channels of one group (their amax is
// reduced with shuffles). Every lane of the warp must call it; `valid` must be the same within
// each octet (false: `a, c` are ignored and the results are zeros).
// `scale_format` 0: scale = max(amax, kAmaxMin) / 448; 1: that scale rounded up to a power of
// two (UE8M0). Returns the 16 e4m3 bytes in `q` (channel order) and the group's scale.
EP_DEVICE void cast_e4m3_x16(const int4& a, const int4& c, bool valid, uint32_t scale_format,
                             int4& q, float& scale) {
    float v[16];
    float amax = 0.0f;
    if (valid) {
        const uint32_t w[8] = {static_cast<uint32_t>(a.x), static_cast<uint32_t>(a.y),
                               static_cast<uint32_t>(a.z), static_cast<uint32_t>(a.w),
                               static_cast<uint32_t>(c.x), static_cast<uint32_t>(c.y),
                               static_cast<uint32_t>(c.z), static_cast<uint32_t>(c.w)};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            unpack_bf16x2(w[i], v[2 * i], v[2 * i + 1]);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            amax = fmaxf(amax, fabsf(v[i]));
        }
    }
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 4));
    q = make_int4(0, 0, 0, 0);
    scale = 0.0f;
    if (valid) {
        scale = __fdiv_rn(fmaxf(amax, kAmaxMin), kE4m3Max);
        if (scale_format == 1) {
            scale = round_scale_ue8m0(scale);
        }
        uint32_t b[4] = {0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            b[i / 4] |= static_cast<uint32_t>(f32_to_e4m3(__fdiv_rn(v[i], scale))) << (8 * (i % 4));
        }
        q = make_int4(static_cast<int>(b[0]), static_cast<int>(b[1]), static_cast<int>(b[2]),
                      static_cast<int>(b[3]));
    }
}

}  // namespace ll
}  // namespace ep
