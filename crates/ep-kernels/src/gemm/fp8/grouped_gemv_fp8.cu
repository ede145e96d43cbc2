// Masked block-scaled fp8 grouped GEMM for blocks of a few valid rows (decode): for every group
// g and valid row r < counts[g], d[g, r, :] = bf16(deq(a)[g, r, :] x deq(b[g])^T), the function
// of the CUTLASS fp8 GEMMs (fp8/grouped_gemm_fp8_sm90.cuh) and of the host twin
// `gemm::fp8::grouped_gemm_fp8`, shaped for the case where reading each active group's
// weights once is the whole cost. Launcher: src/gemm/fp8/cuda/grouped_gemv_fp8.rs, from
// `grouped_gemm_fp8_cuda` (src/gemm/fp8/cuda/mod.rs) with `GemmTiles::Gemv`.
//
// No tile and no shared memory for the operands: a warp owns 16 weight rows (output columns) and
// streams them from global memory in 16-byte vectors, four lanes covering 64 channels of a row
// (half a 128-byte line: the loads ask the L2 to fetch the whole line at the first request);
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
// grouped_gemv_swiglu_fp8 is the experts' gate_up GEMV with SwiGLU and the down GEMM's 1 x 128
// quantization fused (no pass between the GEMVs; host twin `gemm::fp8::grouped_gemm_swiglu_fp8`).
// The weight holds 128 gate rows and their 128 up rows in turn (`FP8_GATE_UP_BLOCK`), and a unit
// takes 8 act columns j0 .. j0 + 7: their gate rows as the MMA's rows g and their up rows as
// rows g + 8, so that each lane holds gate and up of the same (row, column) and computes
// act = silu(gate) * up from the f32 sums. The act values go to the f32 scratch `act`; the 16
// units of a 128-column block count their arrivals in `arrivals` (device-scope fence, then one
// atomic), and the warp that arrives last reads the block's act values back from L2 and writes
// their e4m3 values and scale as the per-token cast computes them, then zeroes the counter for
// the next launch.
//
// A decode step's two GEMVs overlap at the kernel boundary (programmatic dependent launch): the
// plain GEMV is launched as a dependent and grouped_gemv_swiglu_fp8 lets its dependents start at
// once, so the down GEMV's blocks start on the SMs the gate_up's blocks leave (at 128 registers
// a thread the two do not share an SM) while its last units and act quantizations run. They
// wait (griddepcontrol.wait, before any load) for the gate_up grid and its writes. Launched
// plainly, the wait returns at once; after another kernel, the blocks start as its blocks exit.
//
// Shapes (checked by the launcher): n a multiple of 16 (swiglu: of 256), k a multiple of 64 (a
// partial last scale block of 64 channels is allowed).

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
constexpr int kActPerUnit = kRowsPerWarp / 2;         // swiglu: act columns of a unit
constexpr int kUnitsPerActBlock = kBlock / kActPerUnit;  // swiglu: units of a scale block

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
    // grouped_gemv_swiglu_fp8 only (null otherwise; `d` is null there):
    float* act;           // [groups * m_max, n / 2] f32 scratch: silu(gate) * up
    uint8_t* q;           // [groups * m_max, n / 2] e4m3 act
    float* q_scales;      // [groups * m_max, n / 256]
    uint32_t* arrivals;   // [groups, n / 256] zero before a launch, zero after it
};
EP_CHECK_PARAMS_SIZE(GemvFp8Params, 144);  // 140 bytes of fields, 8-byte aligned

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

// silu(gate) * up as the one-pass SwiGLU (quantize_rows.cu) computes it.
EP_DEVICE float swiglu(float gate, float up) {
    return __fmul_rn(__fdividef(gate, 1.0f + __expf(-gate)), up);
}

// After a unit's act columns of group g are in `act`: counts the unit's arrival at its 128-column
// block `blk`, and the last of the block's units quantizes the block's `count` rows (see the file
// comment). Called by a whole warp. Not inlined: inlined into the units' loops it made ptxas
// spill there.
__device__ __noinline__ void arrive_and_quantize(const GemvFp8Params& p, int g, int blk,
                                                 int count) {
    const int lane = ep::lane_id();
    const int64_t half = p.n / 2;
    const int act_blocks = p.n / (2 * kBlock);
    uint32_t* arrival = p.arrivals + static_cast<int64_t>(g) * act_blocks + blk;
    __threadfence();  // this warp's act stores, before its arrival is seen
    __syncwarp();
    uint32_t before = 0;
    if (lane == 0) {
        before = atomicAdd(arrival, 1u);
    }
    before = __shfl_sync(0xffffffffu, before, 0);
    if (before != kUnitsPerActBlock - 1) {
        return;
    }
    if (lane == 0) {
        *arrival = 0;  // every unit of the block has arrived: ready for the next launch
    }
    __threadfence();  // the other units' act stores, before the loads below
    for (int r = 0; r < count; ++r) {
        const int64_t row = static_cast<int64_t>(g) * p.m_max + r;
        const int64_t at = row * half + blk * kBlock;
        // L2 loads (.cg): the other units' stores are not in this SM's L1.
        const float4 v = __ldcg(reinterpret_cast<const float4*>(p.act + at) + lane);
        float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
        for (int d = ep::kWarpSize / 2; d > 0; d >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
        }
        const float s = __fdiv_rn(fmaxf(amax, ep::kAmaxMin), ep::kE4m3Max);
        const uint32_t packed = static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(v.x, s))) |
                                static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(v.y, s))) << 8 |
                                static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(v.z, s))) << 16 |
                                static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(v.w, s))) << 24;
        reinterpret_cast<uint32_t*>(p.q + at)[lane] = packed;
        if (lane == 0) {
            p.q_scales[row * act_blocks + blk] = s;
        }
    }
}

// Unit `unit` (of the active groups' units, `stripes` a group) by a team of kSplit warps, this
// warp being its `sub`-th (see the file comment). A template, so that the one-warp units of the
// whole rounds carry no split-K code. Uniform in a team: its warps take the same unit, counts
// and passes. With SwiGLU (kSwiglu) it writes act columns and counts its arrival.
template <int kSplit, bool kSwiglu>
EP_DEVICE void gemv_unit(const GemvFp8Params& p, const int* active, int64_t unit, int64_t stripes,
                         int team, int sub, float (*partial)[4][ep::kWarpSize]) {
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int gid = lane >> 2;  // MMA row group: weight rows gid, gid + 8; activation row gid
    const int tid = lane & 3;   // 16-byte vector of the 64-channel chunk
    const int k_blocks = (p.k + kBlock - 1) / kBlock;
    const int n_blocks = (p.n + kBlock - 1) / kBlock;
    const int g = active[unit / stripes];
    const int stripe = static_cast<int>(unit % stripes);
    // The unit's weight rows: 16 from row0 (MMA rows g: row0 + g, g + 8: row0 + 8 + g), or with
    // SwiGLU the gate rows of act columns j0 .. j0 + 7 and their up rows 128 further.
    const int j0 = stripe * kActPerUnit;
    const int row0 = kSwiglu ? j0 / kBlock * 2 * kBlock + j0 % kBlock : stripe * kRowsPerWarp;
    const int hi_offset = kSwiglu ? kBlock : kRowsPerWarp / 2;
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
    const int4* w_hi = reinterpret_cast<const int4*>(
        w_base + static_cast<int64_t>(row0 + gid + hi_offset) * p.k);
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
                    wl[u][c] = in ? ep::ld_nc_no_alloc_l2_128(w_lo + v) : zero;
                    wh[u][c] = in ? ep::ld_nc_no_alloc_l2_128(w_hi + v) : zero;
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
                const float xa = __ldg(sxa + kb);
                const float xb = __ldg(sxb + kb);
                const float sa = sw * xa;
                const float sb = sw * xb;
                float sa_hi = sa;
                float sb_hi = sb;
                if constexpr (kSwiglu) {
                    const float sw_hi = __ldg(sw_base + k_blocks + kb);  // the up rows' block
                    sa_hi = sw_hi * xa;
                    sb_hi = sw_hi * xb;
                }
                sum[0] = fmaf(part[0], sa, sum[0]);     // MMA row gid, pass row ra
                sum[1] = fmaf(part[1], sb, sum[1]);     // MMA row gid, pass row rb
                sum[2] = fmaf(part[2], sa_hi, sum[2]);  // MMA row gid + 8, pass row ra
                sum[3] = fmaf(part[3], sb_hi, sum[3]);  // MMA row gid + 8, pass row rb
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
        if constexpr (kSwiglu) {
            const int64_t half = p.n / 2;
            if (ra < rows) {
                p.act[(out0 + ra) * half + j0 + gid] = swiglu(sum[0], sum[2]);
            }
            if (rb < rows) {
                p.act[(out0 + rb) * half + j0 + gid] = swiglu(sum[1], sum[3]);
            }
            continue;
        }
        if (ra < rows) {
            p.d[(out0 + ra) * p.n + row0 + gid] = ep::f32_to_bf16(sum[0]);
            p.d[(out0 + ra) * p.n + row0 + gid + 8] = ep::f32_to_bf16(sum[2]);
        }
        if (rb < rows) {
            p.d[(out0 + rb) * p.n + row0 + gid] = ep::f32_to_bf16(sum[1]);
            p.d[(out0 + rb) * p.n + row0 + gid + 8] = ep::f32_to_bf16(sum[3]);
        }
    }
    if constexpr (kSwiglu) {
        if (sub == 0) {
            arrive_and_quantize(p, g, j0 / kBlock, count);
        }
    }
}

// The units left after the whole rounds, `first .. first + count`, by teams of kSplit warps.
template <int kSplit, bool kSwiglu>
EP_DEVICE void gemv_tail(const GemvFp8Params& p, const int* active, int64_t first, int64_t count,
                         int64_t stripes, float (*partial)[4][ep::kWarpSize]) {
    constexpr int teams = kWarps / kSplit;
    const int team = ep::warp_id() / kSplit;
    const int sub = ep::warp_id() % kSplit;
    const int64_t all_teams = static_cast<int64_t>(gridDim.x) * teams;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * teams + team; t < count; t += all_teams) {
        gemv_unit<kSplit, kSwiglu>(p, active, first + t, stripes, team, sub, partial);
    }
}

// The kernels' body; `kSwiglu`: grouped_gemv_swiglu_fp8 (see the file comment).
template <bool kSwiglu>
EP_DEVICE void gemv(const GemvFp8Params& p) {
    __shared__ int active[kMaxGroups];
    __shared__ int warp_totals[kWarps];
    __shared__ float partial[kWarps][4][ep::kWarpSize];  // split-K sums of a team's warps
    if constexpr (kSwiglu) {
        // The down GEMV (a dependent launch) may start its blocks as this grid's blocks leave.
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    } else {
        // Before any load: returns once the kernel before this one (when this one is a
        // dependent launch) has finished and its writes are visible; at once otherwise.
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    const int num_active = active_groups(p, active, warp_totals);
    const int64_t stripes = p.n / kRowsPerWarp;  // with SwiGLU: (n / 2) / kActPerUnit
    const int64_t units = static_cast<int64_t>(num_active) * stripes;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    // Whole rounds: one warp a unit.
    const int64_t whole = units / warps * warps;
    for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarps + ep::warp_id(); unit < whole;
         unit += warps) {
        gemv_unit<1, kSwiglu>(p, active, unit, stripes, 0, 0, nullptr);
    }
    // The rest: teams sharing K.
    const int64_t rest = units - whole;
    switch (tail_split(rest, (p.k + kBlock - 1) / kBlock, warps)) {
        case 1:
            gemv_tail<1, kSwiglu>(p, active, whole, rest, stripes, partial);
            break;
        case 2:
            gemv_tail<2, kSwiglu>(p, active, whole, rest, stripes, partial);
            break;
        case 4:
            gemv_tail<4, kSwiglu>(p, active, whole, rest, stripes, partial);
            break;
        default:
            gemv_tail<8, kSwiglu>(p, active, whole, rest, stripes, partial);
            break;
    }
}

}  // namespace

EP_KERNEL void __launch_bounds__(kThreads, kBlocksPerSm)
    grouped_gemv_fp8(const __grid_constant__ GemvFp8Params p) {
    gemv<false>(p);
}

EP_KERNEL void __launch_bounds__(kThreads, kBlocksPerSm)
    grouped_gemv_swiglu_fp8(const __grid_constant__ GemvFp8Params p) {
    gemv<true>(p);
}
