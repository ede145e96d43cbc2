// Masked block-scaled fp8 grouped GEMM for blocks of a few valid rows (decode): for every group
// g and valid row r < counts[g], d[g, r, :] = bf16(deq(a)[g, r, :] x deq(b[g])^T), the function
// of the CUTLASS fp8 GEMMs (fp8/grouped_gemm_fp8_sm90.cuh) and of the host twin
// `gemm::fp8::grouped_gemm_fp8`, shaped for the case where reading each active group's
// weights once is the whole cost. Launcher: src/gemm/fp8/cuda/grouped_gemv_fp8.rs, from
// `grouped_gemm_fp8_cuda` (src/gemm/fp8/cuda/mod.rs) with `GemmTiles::Gemv`.
//
// No tile and no shared memory for the operands: a warp owns 16 weight rows (output columns) and
// streams them from global memory in 16-byte vectors, four lanes covering 64 channels of a row;
// the group's valid rows are the 8 columns of the B operand of an e4m3 tensor-core MMA
// (mma.sync m16n8k32, f32 accumulation), so up to 8 rows cost one pass over the weights. The
// MMA's K order is a permutation of the channels: lane (g, t) hands it bytes t*16 .. t*16+15 of
// the 64-channel chunk for its A rows (g, g+8) and for its B column (row g of the activations),
// and the dot products do not depend on the order. Each 128-channel block is accumulated on
// its own, then promoted into the f32 sums with the weight block's scale times the row's scale
// (DeepSeek-V3's recipe: one promotion every 128 channels).
//
// Work: units of (active group, 16 weight rows) over the ordered list of the groups with rows
// (every block builds it from the counts), so empty groups' weights are never read and the
// grid is sized to the device. The schedule follows the units the counts make, not the launch's
// upper bound: the grid's W warps first take whole rounds of W units, one warp a unit; the
// units left over (fewer than W) are shared by teams of `split` warps of one block, `split`
// doubled (up to 8) while every team still fits on the grid and each warp keeps at least two
// pairs of scale blocks (`tail_split`; the host mirror is `gemm::fp8::gemv_tail_split`). So a
// decode step whose units barely exceed one round (DeepSeek-V3's gate_up with the shared
// expert: 9 x 256 units) finishes its last units on every warp instead of on a few, and one
// group with few output rows (a dense projection) splits K across the grid. A team's warps take
// every `split`-th pair of scale blocks of K and add their sums through shared memory (a named
// barrier per team) before the team's first warp writes them. More than 8 valid rows are taken
// in passes over the same weights (the next ones mostly from L2).
//
// Extra groups (g >= first_extra: the shared experts) take their weights from extra_b and, with
// extra_a, their rows from extra_a (every extra group the same rows), as the CUTLASS path.
// Counts are checked as there: a negative count, one above m_max, or an extra group's count
// above the rows of extra_a prints the entry and traps.
//
// Shapes (checked by the launcher): n a multiple of 16, k a multiple of 64 (a partial last scale
// block of 64 channels is allowed).

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / ep::kWarpSize;
constexpr int kRowsPerWarp = 16;                      // MMA M: weight rows (output columns)
constexpr int kTokensPerPass = 8;                     // MMA N: valid rows of the group
constexpr int kChunk = 64;                            // channels per lane quad and step
constexpr int kBlock = 128;                           // channels per scale
constexpr int kBlocksInFlight = 2;                    // scale blocks loaded ahead per lane
constexpr int kMaxGroups = 1024;
constexpr int kBlocksPerSm = 2;  // 128 registers a thread at most

}  // namespace

// Mirrors `GemvFp8Params` in src/gemm/fp8/cuda/grouped_gemv_fp8.rs.
struct GemvFp8Params {
    const uint8_t* a;        // [first_extra (or groups) * m_max, k] e4m3
    const float* sfa;        // [.., k / 128 rounded up]
    const uint8_t* b;        // [first_extra, n, k] e4m3
    const float* sfb;        // [first_extra, n / 128 rounded up, k / 128 rounded up]
    __nv_bfloat16* d;        // [groups * m_max, n]
    const int32_t* counts;   // [groups]
    const uint8_t* extra_a;  // [extra_a_rows, k] or null
    const float* extra_sfa;  // [extra_a_rows, k / 128 rounded up] or null
    const uint8_t* extra_b;  // [groups - first_extra, n, k] or null
    const float* extra_sfb;  // [groups - first_extra, n / 128 rounded up, k / 128 rounded up]
    int64_t extra_a_rows;
    int32_t groups;
    int32_t n;  // a multiple of 16
    int32_t k;  // a multiple of 64
    int32_t m_max;
    int32_t first_extra;  // == groups without extra groups
};
EP_CHECK_PARAMS_SIZE(GemvFp8Params, 112);  // 108 bytes of fields, 8-byte aligned

namespace {

// D (16 x 8, f32) += A (16 x 32 e4m3, row) x B (32 x 8 e4m3, col).
EP_DEVICE void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                        uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 64-channel chunk: weight vectors of rows g and g + 8, activation vector of row g.
EP_DEVICE void mma_chunk(float (&d)[4], const int4& w_lo, const int4& w_hi, const int4& x) {
    mma_e4m3(d, w_lo.x, w_hi.x, w_lo.y, w_hi.y, x.x, x.y);
    mma_e4m3(d, w_lo.z, w_hi.z, w_lo.w, w_hi.w, x.z, x.w);
}

// The active groups (count > 0) in group order into `active`; returns how many. Traps on a
// count the layout cannot hold.
EP_DEVICE int active_groups(const GemvFp8Params& p, int* active, int* warp_totals) {
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    int total = 0;
    for (int base = 0; base < p.groups; base += kThreads) {
        const int g = base + static_cast<int>(threadIdx.x);
        int c = 0;
        if (g < p.groups) {
            c = p.counts[g];
            if (c < 0) {
                printf("ep grouped gemv fp8: counts[%d] = %d is negative\n", g, c);
                __trap();
            }
            if (c > p.m_max) {
                printf("ep grouped gemv fp8: counts[%d] = %d exceeds m_max = %d\n", g, c, p.m_max);
                __trap();
            }
            if (g >= p.first_extra && p.extra_a != nullptr && c > p.extra_a_rows) {
                printf("ep grouped gemv fp8: counts[%d] = %d exceeds the %lld rows of extra_a\n", g,
                       c, static_cast<long long>(p.extra_a_rows));
                __trap();
            }
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, c > 0);
        if (lane == 0) {
            warp_totals[warp] = __popc(ballot);
        }
        __syncthreads();
        int before = total;
        for (int w = 0; w < warp; ++w) {
            before += warp_totals[w];
        }
        if (c > 0) {
            active[before + __popc(ballot & ((1u << lane) - 1u))] = g;
        }
        for (int w = 0; w < kWarps; ++w) {
            total += warp_totals[w];
        }
        __syncthreads();
    }
    return total;
}

// Waits for the `split` warps of team `team` (named barrier 1 + team; 0 is __syncthreads).
EP_DEVICE void team_sync(int team, int split) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(team + 1), "r"(split * ep::kWarpSize) : "memory");
}

// Doubles a team's warps (up to the block's) while `units` teams still fit on the grid's
// `warps` and each warp keeps at least two pairs of scale blocks of K. Mirrored by
// `gemm::fp8::gemv_tail_split` (src/gemm/fp8/mod.rs).
EP_DEVICE int tail_split(int64_t units, int k_blocks, int64_t warps) {
    int split = 1;
    while (split < kWarps && units * split * 2 <= warps && k_blocks >= 2 * split * 4) {
        split *= 2;
    }
    return split;
}

// Unit `unit` (of the active groups' units, `stripes` a group) by a team of kSplit warps, this
// warp being its `sub`-th (see the file comment). A template, so that the one-warp units of the
// whole rounds carry no split-K code. Uniform in a team: its warps take the same unit, counts
// and passes.
template <int kSplit>
EP_DEVICE void gemv_unit(const GemvFp8Params& p, const int* active, int64_t unit, int64_t stripes,
                         int team, int sub, float (*partial)[4][ep::kWarpSize]) {
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int gid = lane >> 2;  // MMA row group: weight rows gid, gid + 8; activation row gid
    const int tid = lane & 3;   // 16-byte vector of the 64-channel chunk
    const int k_blocks = (p.k + kBlock - 1) / kBlock;
    const int n_blocks = (p.n + kBlock - 1) / kBlock;
    const int g = active[unit / stripes];
    const int row0 = static_cast<int>(unit % stripes) * kRowsPerWarp;
    const int count = p.counts[g];
    const bool extra = g >= p.first_extra;
    const int64_t wg = extra ? g - p.first_extra : g;
    const uint8_t* w_base = (extra ? p.extra_b : p.b) + wg * p.n * p.k;
    const float* sw_base = (extra ? p.extra_sfb : p.sfb) +
                           (wg * n_blocks + row0 / kBlock) * static_cast<int64_t>(k_blocks);
    const bool own_rows = !(extra && p.extra_a != nullptr);
    const uint8_t* x_base = own_rows ? p.a + static_cast<int64_t>(g) * p.m_max * p.k : p.extra_a;
    const float* sx_base = own_rows ? p.sfa + static_cast<int64_t>(g) * p.m_max * k_blocks
                                    : p.extra_sfa;
    const int4* w_lo = reinterpret_cast<const int4*>(w_base + static_cast<int64_t>(row0 + gid) * p.k);
    const int4* w_hi =
        reinterpret_cast<const int4*>(w_base + static_cast<int64_t>(row0 + gid + 8) * p.k);
    for (int r0 = 0; r0 < count; r0 += kTokensPerPass) {
        const int rows = min(kTokensPerPass, count - r0);
        // This lane's activation row (B column gid); rows past `rows` read zeros.
        const bool has_x = gid < rows;
        const int4* x = reinterpret_cast<const int4*>(x_base + static_cast<int64_t>(r0 + gid) * p.k);
        // This lane's output columns of D: rows 2 * tid and 2 * tid + 1 of the pass.
        const int ra = 2 * tid;
        const int rb = 2 * tid + 1;
        const float* sxa = sx_base + static_cast<int64_t>(r0 + min(ra, rows - 1)) * k_blocks;
        const float* sxb = sx_base + static_cast<int64_t>(r0 + min(rb, rows - 1)) * k_blocks;
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int kb0 = sub * kBlocksInFlight; kb0 < k_blocks; kb0 += kSplit * kBlocksInFlight) {
            // Load every vector of the next scale blocks first (bytes in flight), then multiply.
            int4 wl[kBlocksInFlight][2], wh[kBlocksInFlight][2], xv[kBlocksInFlight][2];
#pragma unroll
            for (int u = 0; u < kBlocksInFlight; ++u) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int chunk = (kb0 + u) * (kBlock / kChunk) + c;
                    const bool in = chunk * kChunk < p.k;
                    const int v = chunk * (kChunk / 16) + tid;
                    const int4 zero = make_int4(0, 0, 0, 0);
                    wl[u][c] = in ? ep::ld_nc_no_alloc(w_lo + v) : zero;
                    wh[u][c] = in ? ep::ld_nc_no_alloc(w_hi + v) : zero;
                    xv[u][c] = (in && has_x) ? __ldg(x + v) : zero;
                }
            }
#pragma unroll
            for (int u = 0; u < kBlocksInFlight; ++u) {
                const int kb = kb0 + u;
                if (kb >= k_blocks) {
                    break;
                }
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_chunk(part, wl[u][0], wh[u][0], xv[u][0]);
                mma_chunk(part, wl[u][1], wh[u][1], xv[u][1]);
                const float sw = __ldg(sw_base + kb);
                const float sa = sw * __ldg(sxa + kb);
                const float sb = sw * __ldg(sxb + kb);
                sum[0] = fmaf(part[0], sa, sum[0]);  // weight row gid, pass row ra
                sum[1] = fmaf(part[1], sb, sum[1]);  // weight row gid, pass row rb
                sum[2] = fmaf(part[2], sa, sum[2]);  // weight row gid + 8, pass row ra
                sum[3] = fmaf(part[3], sb, sum[3]);  // weight row gid + 8, pass row rb
            }
        }
        if constexpr (kSplit > 1) {
            if (sub != 0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    partial[warp][i][lane] = sum[i];
                }
            }
            team_sync(team, kSplit);
            if (sub == 0) {
#pragma unroll
                for (int s = 1; s < kSplit; ++s) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        sum[i] += partial[warp + s][i][lane];
                    }
                }
            }
            team_sync(team, kSplit);  // `partial` is written again by the next pass
            if (sub != 0) {
                continue;
            }
        }
        const int64_t out0 = static_cast<int64_t>(g) * p.m_max + r0;
        if (ra < rows) {
            p.d[(out0 + ra) * p.n + row0 + gid] = ep::f32_to_bf16(sum[0]);
            p.d[(out0 + ra) * p.n + row0 + gid + 8] = ep::f32_to_bf16(sum[2]);
        }
        if (rb < rows) {
            p.d[(out0 + rb) * p.n + row0 + gid] = ep::f32_to_bf16(sum[1]);
            p.d[(out0 + rb) * p.n + row0 + gid + 8] = ep::f32_to_bf16(sum[3]);
        }
    }
}

// The units left after the whole rounds, `first .. first + count`, by teams of kSplit warps.
template <int kSplit>
EP_DEVICE void gemv_tail(const GemvFp8Params& p, const int* active, int64_t first, int64_t count,
                         int64_t stripes, float (*partial)[4][ep::kWarpSize]) {
    constexpr int teams = kWarps / kSplit;
    const int team = ep::warp_id() / kSplit;
    const int sub = ep::warp_id() % kSplit;
    const int64_t all_teams = static_cast<int64_t>(gridDim.x) * teams;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * teams + team; t < count; t += all_teams) {
        gemv_unit<kSplit>(p, active, first + t, stripes, team, sub, partial);
    }
}

}  // namespace

EP_KERNEL void __launch_bounds__(kThreads, kBlocksPerSm)
    grouped_gemv_fp8(const __grid_constant__ GemvFp8Params p) {
    __shared__ int active[kMaxGroups];
    __shared__ int warp_totals[kWarps];
    __shared__ float partial[kWarps][4][ep::kWarpSize];  // split-K sums of a team's warps
    const int num_active = active_groups(p, active, warp_totals);
    const int64_t stripes = p.n / kRowsPerWarp;
    const int64_t units = static_cast<int64_t>(num_active) * stripes;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    // Whole rounds: one warp a unit.
    const int64_t whole = units / warps * warps;
    for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarps + ep::warp_id(); unit < whole;
         unit += warps) {
        gemv_unit<1>(p, active, unit, stripes, 0, 0, nullptr);
    }
    // The rest: teams sharing K.
    const int64_t rest = units - whole;
    switch (tail_split(rest, (p.k + kBlock - 1) / kBlock, warps)) {
        case 1:
            gemv_tail<1>(p, active, whole, rest, stripes, partial);
            break;
        case 2:
            gemv_tail<2>(p, active, whole, rest, stripes, partial);
            break;
        case 4:
            gemv_tail<4>(p, active, whole, rest, stripes, partial);
            break;
        default:
            gemv_tail<8>(p, active, whole, rest, stripes, partial);
            break;
    }
}
