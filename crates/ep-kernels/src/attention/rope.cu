// Rotary position embedding of MLA's rope columns where they lie: for token t, head h and pair
// i of the `dim` columns from `first` of x[t, h, :] (`x_width` values a head),
//   out[t, h, a] = x_a * c - x_b * s,   out[t, h, b] = x_a * s + x_b * c,
// c = cos[t, i], s = sin[t, i], (a, b) = (2i, 2i + 1) interleaved or (i, i + dim / 2), in bf16
// operations as candle's rope kernels (the host twin rounds each product, then the sum; here
// ptxas may fuse one product into the sum). One thread a pair, grid-stride. Launcher and host
// twin: src/attention/cuda/rope.rs, src/attention/rope.rs.

#include "common.cuh"

// Mirrors `RopeParams` in src/attention/cuda/rope.rs.
struct RopeParams {
    const __nv_bfloat16* x;    // [tokens, heads, x_width]
    const __nv_bfloat16* cos;  // [tokens, dim / 2]
    const __nv_bfloat16* sin;  // [tokens, dim / 2]
    __nv_bfloat16* out;        // [tokens, heads, dim]
    int64_t tokens;
    int64_t heads;
    int64_t x_width;
    int64_t first;
    int64_t dim;
    int32_t interleave;
    int32_t pad_;
};
EP_CHECK_PARAMS_SIZE(RopeParams, 80);

EP_KERNEL void mla_rope_bf16(const __grid_constant__ RopeParams p) {
    const int64_t half_dim = p.dim / 2;
    const int64_t pairs = p.tokens * p.heads * half_dim;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < pairs;
         k += stride) {
        const int64_t row = k / half_dim;  // t * heads + h
        const int64_t i = k - row * half_dim;
        const int64_t t = row / p.heads;
        const int64_t a = p.interleave != 0 ? 2 * i : i;
        const int64_t b = p.interleave != 0 ? 2 * i + 1 : i + half_dim;
        const __nv_bfloat16* x = p.x + row * p.x_width + p.first;
        const __nv_bfloat16 xa = x[a];
        const __nv_bfloat16 xb = x[b];
        const __nv_bfloat16 c = p.cos[t * half_dim + i];
        const __nv_bfloat16 s = p.sin[t * half_dim + i];
        __nv_bfloat16* o = p.out + row * p.dim;
        // bf16 operations as candle's rope kernels spell them (`a * c - b * s`): ptxas may
        // contract a product into the sum (one rounding), as it does in candle's kernel, whose
        // values the model's accuracy tests were measured on.
        o[a] = __hsub(__hmul(xa, c), __hmul(xb, s));
        o[b] = __hadd(__hmul(xa, s), __hmul(xb, c));
    }
}
