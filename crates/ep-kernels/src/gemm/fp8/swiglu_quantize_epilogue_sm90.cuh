// The fp8 experts' gate_up GEMM with SwiGLU and the down GEMM's 1 x 128 quantization in its
// epilogue: from the f32 accumulators straight to act = silu(gate) * up in e4m3 with one f32
// scale per row per 128 columns of act, so that the [rows, 2I] gate_up product is never
// written, read back nor rounded to bf16, and no separate pass runs (quantize_rows.cu's
// `swiglu_quantize_fp8` stays for the masked and GEMV paths, and from 512 rows per expert:
// `gemm::fp8::swiglu_in_epilogue` in Rust says why).
//
// The pairing. The gate_up weight is in the scale-block layout (`GateUpLayout::ScaleBlocks`,
// `gemm::fp8::FP8_GATE_UP_BLOCK` in Rust): per expert, 128-row blocks of gate_proj and up_proj rows
// in turn, so that rows 256p .. 256p + 127 are gate rows 128p .. and the next 128 the matching up
// rows, each block with its own 128 x 128 weight scales. With 128 x 128 tiles and clusters of two
// CTAs along N, the two CTAs of a cluster compute the same rows' tiles n = 2p (gate) and 2p + 1
// (up): thread t of one holds, for the same rows and columns, the gate values whose up values
// thread t of the other holds (one tiled MMA, one partition). The pair swaps halves through
// distributed shared memory: every thread holds two rows (r and r + 8 of its warp's 16); the gate
// CTA finishes rows r, the up CTA rows r + 8. Each thread stores the 32 values of the row it does
// not finish into its partner thread's slot in the peer CTA and reads the partner's 32 values of
// its own row from its slot, so every warp of both CTAs does the same share of the SwiGLU work, and
// a row's 128 act columns stay in one quad of lanes (its amax needs no second swap).
//
// Hand-off, per warp: the stores are `st.async` into the peer's slot, each counting its bytes
// off the transaction count of the peer warp's `full` mbarrier, on which the receiving warp
// announces the bytes it expects (its own arrival); `empty`, in the sending CTA, takes the
// partner warp's 32 remote arrivals (release at cluster scope) once it has read its slot. A
// warp waits on its `empty` before it overwrites the peer's slot and, in `store_tail`, before
// its CTA may exit, and on its `full` before it reads, so neither CTA leaves while the other
// still touches its shared memory. The barriers are initialised in the constructor, which the
// kernel runs before its cluster-wide barrier.
//
// The quantization is the per-token cast's (quantize_rows.cu, `swiglu_quantize_fp8`):
// act = silu(g) * u with the hardware exponential and reciprocal, scale = max(amax, 1e-4) /
// 448 over the row's 128 act columns, e4m3 saturating round-to-nearest of act times the
// correctly rounded reciprocal of the scale (the cast divides: the two differ by at most one
// f32 ulp before the e4m3 rounding, so in an e4m3 value only on a rounding boundary). Rows
// past the group's count are not written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace ep::gemm {

// The values a thread holds in a 128 x 128 cooperative tile (64 x 128 per warpgroup), the
// half it swaps, and the warps of a CTA.
constexpr int kTileValues = 64;
constexpr int kSwapValues = kTileValues / 2;
constexpr int kTileWarps = 8;

struct SwigluQuantSharedStorage {
    // [float4 of the swapped values][thread]: a warp's stores and loads of one float4 are 512
    // contiguous bytes.
    alignas(16) float4 slots[kSwapValues / 4][kTileWarps * ep::kWarpSize];
    alignas(8) uint64_t full[kTileWarps];
    alignas(8) uint64_t empty[kTileWarps];
};

EP_DEVICE uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The address of the same shared-memory location in CTA `rank` of the cluster.
EP_DEVICE uint32_t peer_addr(uint32_t local, uint32_t rank) {
    uint32_t out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
    return out;
}

EP_DEVICE void peer_store4(uint32_t addr, float a, float b, float c, float d) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
}

// Stores 16 bytes into the peer's shared memory and, once they land, counts them off the
// transaction bytes of the peer's mbarrier `bar` (both cluster addresses).
EP_DEVICE void peer_store4_tx(uint32_t addr, uint32_t bar, float a, float b, float c, float d) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
        "[%5];" ::"r"(addr),
        "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
        : "memory");
}

// This CTA's own arrival on `bar`, announcing `bytes` more transaction bytes for its phase.
EP_DEVICE void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

EP_DEVICE void peer_arrive(uint32_t addr) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(addr)
                 : "memory");
}

EP_DEVICE void wait_parity(uint32_t addr, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" ::"r"(addr),
        "r"(parity)
        : "memory");
}

template <class StrideD_>
class SwigluQuantEpilogueArray {
   public:
    using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
    using DispatchPolicy = EpilogueSchedule;
    using ElementAccumulator = float;
    using ElementCompute = float;
    using ElementScalar = float;
    using ElementOutput = cutlass::bfloat16_t;  // only names the adapter's types
    using ElementD = cutlass::bfloat16_t;
    using ElementC = void;
    using StrideD = StrideD_;
    using StrideC = StrideD_;
    using InternalStrideD = cute::remove_pointer_t<StrideD>;
    using InternalStrideC = InternalStrideD;
    using GmemTiledCopyC = void;
    using GmemTiledCopyD = void;
    using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;

    using SharedStorage = SwigluQuantSharedStorage;
    using TensorMapStorage = SharedStorage;

    struct Arguments {
        uint8_t** ptr_q = nullptr;  // per group: act e4m3 [count, n / 2]
        float** ptr_s = nullptr;    // per group: act scales f32 [count, n / 256]
        StrideD dD{};               // unused (the plain epilogue's strides, kept for the kernel)
    };
    using Params = Arguments;

    template <class ProblemShape>
    static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                    void*) {
        return args;
    }

    template <class ProblemShape>
    static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
        return 0;
    }

    template <class ProblemShape>
    static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                                cudaStream_t,
                                                cutlass::CudaHostAdapter* = nullptr) {
        return cutlass::Status::kSuccess;
    }

    // The launcher checks n % 256 == 0 (whole gate / up block pairs).
    template <class ProblemShape>
    static bool can_implement(ProblemShape const&, Arguments const&) {
        return true;
    }

    CUTLASS_HOST_DEVICE explicit SwigluQuantEpilogueArray(Params const& params)
        : params_(params) {}

    CUTLASS_DEVICE bool is_source_needed() { return false; }

    template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
              class FrgLayout, class TiledMma, class ResidueMNK>
    CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl,
                                   BlockShapeMNK blk_shape_mnk, BlockCoordMNKL blk_coord_mnkl,
                                   cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                   TiledMma tiled_mma, ResidueMNK, int thread_idx, char* smem) {
        using namespace cute;
        static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
        static_assert(decltype(size<0>(BlockShapeMNK{}))::value == 128 &&
                          decltype(size<1>(BlockShapeMNK{}))::value == 128,
                      "the swap assumes 128 x 128 cooperative tiles");
        static_assert(decltype(size(accumulators))::value == kTileValues,
                      "64 accumulators a thread in a 128 x 128 tile");
        // The WGMMA value mode: (2 adjacent columns, rows r and r + 8, groups of 8 columns).
        static_assert(decltype(size<0, 0>(FrgLayout{}))::value == 2 &&
                          decltype(size<0, 1>(FrgLayout{}))::value == 2,
                      "unexpected accumulator layout");

        auto& ss = *reinterpret_cast<SharedStorage*>(smem);
        const int m_total = get<0>(problem_shape_mnkl);
        const int n_total = get<1>(problem_shape_mnkl);  // 2I
        auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
        const bool gate_cta = (n_coord % 2) == 0;
        const uint32_t peer = cute::block_rank_in_cluster() ^ 1u;
        const int warp = thread_idx / ep::kWarpSize;
        // Each tile takes one phase of the warp's barriers.
        const uint32_t phase = uses_ & 1u;
        ++uses_;
        warp_ = warp;

        // The gate CTA finishes rows r (value index bit 1 clear), the up CTA rows r + 8; the
        // row is a template argument so that every accumulator index is static.
        if (gate_cta) {
            finish<0>(ss, accumulators, tiled_mma, blk_shape_mnk, m_coord, n_coord, l_coord,
                      m_total, n_total, thread_idx, warp, peer, phase);
        } else {
            finish<1>(ss, accumulators, tiled_mma, blk_shape_mnk, m_coord, n_coord, l_coord,
                      m_total, n_total, thread_idx, warp, peer, phase);
        }
    }

   private:
    // Swaps the other row's values with the peer and finishes row `Mine`.
    template <int Mine, class Accumulators, class TiledMma, class BlockShapeMNK>
    CUTLASS_DEVICE void finish(SharedStorage& ss, Accumulators const& accumulators,
                               TiledMma tiled_mma, BlockShapeMNK blk_shape_mnk, int m_coord,
                               int n_coord, int l_coord, int m_total, int n_total, int thread_idx,
                               int warp, uint32_t peer, uint32_t phase) {
        using namespace cute;
        // Value i = c + 2h + 4j: column 8j + 2q + c of row r + 8h. The swapped values of group
        // pair (2v, 2v + 1) of the other row form float4 v.
        auto other_row = [](int v, int e) { return 8 * v + 4 * (e / 2) + 2 * (1 - Mine) + e % 2; };
        const uint32_t slot0 = peer_addr(smem_addr(&ss.slots[0][thread_idx]), peer);
        const int lane = thread_idx % ep::kWarpSize;
        float theirs[kSwapValues];
        CUTLASS_PRAGMA_UNROLL
        const uint32_t full = smem_addr(&ss.full[warp]);
        // Our own arrival on `full` announces the partner warp's bytes (its stores may land
        // before it: the transaction count goes below zero until then).
        if (lane == 0) {
            arrive_expect_tx(full, kSwapValues * 4 * ep::kWarpSize);
        }
        wait_parity(smem_addr(&ss.empty[warp]), phase ^ 1u);
        const uint32_t peer_full = peer_addr(full, peer);
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kSwapValues / 4; ++v) {
            peer_store4_tx(slot0 + v * kTileWarps * ep::kWarpSize * 16, peer_full,
                           accumulators(other_row(v, 0)), accumulators(other_row(v, 1)),
                           accumulators(other_row(v, 2)), accumulators(other_row(v, 3)));
        }
        wait_parity(full, phase);
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kSwapValues / 4; ++v) {
            const float4 x = ss.slots[v][thread_idx];
            theirs[4 * v] = x.x;
            theirs[4 * v + 1] = x.y;
            theirs[4 * v + 2] = x.z;
            theirs[4 * v + 3] = x.w;
        }
        peer_arrive(peer_addr(smem_addr(&ss.empty[warp]), peer));

        // act of the finished row: 2 columns of each of the 16 groups; theirs[] holds the
        // peer's values of this row in the same order (v, e) as it sent its other row.
        float act[kSwapValues];
        float amax = 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int x = 0; x < kSwapValues; ++x) {
            const int i = 8 * (x / 4) + 4 * ((x % 4) / 2) + 2 * Mine + x % 2;
            const float own = accumulators(i);
            const float g = Mine == 0 ? own : theirs[x];
            const float u = Mine == 0 ? theirs[x] : own;
            const float silu = __fdividef(g, 1.0f + __expf(-g));
            act[x] = __fmul_rn(silu, u);
            amax = fmaxf(amax, fabsf(act[x]));
        }
        // The row's 128 columns lie in the quad of lanes 4 * (lane / 4) .. + 3.
        amax = fmaxf(amax, __shfl_xor_sync(ep::kFullMask, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(ep::kFullMask, amax, 2));
        const float scale = __fdiv_rn(fmaxf(amax, ep::kAmaxMin), ep::kE4m3Max);
        const float inv = __frcp_rn(scale);

        // Problem coordinates of the finished row's values (the gate CTA's tile gives the
        // columns within the act block).
        Tensor coords = make_identity_tensor(make_shape(m_total, n_total));
        Tensor tile = local_tile(coords, take<0, 2>(blk_shape_mnk), make_coord(m_coord, n_coord));
        Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(tile);
        const int m = get<0>(thread_coords(2 * Mine));
        if (m < m_total) {
            const int64_t ld = n_total / 2;
            const int64_t block = n_coord / 2;  // the act columns' 128-block
            uint8_t* q = params_.ptr_q[l_coord] + m * ld + block * 128;
            CUTLASS_PRAGMA_UNROLL
            for (int x = 0; x < kSwapValues; x += 2) {
                const int i = 8 * (x / 4) + 4 * ((x % 4) / 2) + 2 * Mine;
                const int col = get<1>(thread_coords(i)) % 128;  // even: the pair's first
                const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(
                    make_float2(act[x] * inv, act[x + 1] * inv), __NV_SATFINITE, __NV_E4M3);
                *reinterpret_cast<__nv_fp8x2_storage_t*>(q + col) = pair;
            }
            if (thread_idx % 4 == 0) {
                params_.ptr_s[l_coord][m * (ld / 128) + block] = scale;
            }
        }
    }

   public:
    // Waits until the peer has read this warp's last values (the peer's CTA must not touch this
    // CTA's shared memory after it exits).
    CUTLASS_DEVICE void drain(SharedStorage& ss) {
        if (uses_ > 0) {
            wait_parity(smem_addr(&ss.empty[warp_]), (uses_ & 1u) ^ 1u);
        }
    }

   private:
    Params params_;
    uint32_t uses_ = 0;
    int warp_ = 0;
};

// CUTLASS's adapter for operator-style epilogues, plus what the swap needs: the barriers
// initialised by the constructor (before the kernel's cluster barrier) and a tail that waits
// for the peer's last reads.
template <class StrideD>
class SwigluQuantEpilogue
    : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
          SwigluQuantEpilogueArray<StrideD>> {
    using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
        SwigluQuantEpilogueArray<StrideD>>;

   public:
    // The swap's storage is the tile storage only (the adapter would reserve it twice).
    struct TensorMapStorage {};
    using typename Base::LoadPipeline;
    using typename Base::LoadPipelineState;
    using typename Base::StorePipeline;
    using typename Base::StorePipelineState;
    using typename Base::TensorStorage;

    CUTLASS_DEVICE SwigluQuantEpilogue(typename Base::Params const& params,
                                       TensorStorage& shared_tensors)
        : Base(params, shared_tensors), shared_(&shared_tensors) {
        if (threadIdx.x == 0) {
            for (int s = 0; s < kTileWarps; ++s) {
                asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(
                                 smem_addr(&shared_tensors.full[s])),
                             "r"(1));
                asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(
                                 smem_addr(&shared_tensors.empty[s])),
                             "r"(ep::kWarpSize));
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
    }

    CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                   StorePipelineState store_state) {
        this->drain(*shared_);
        return cute::make_tuple(load_state, store_state);
    }

    CUTLASS_DEVICE auto load_init(typename Base::Params const&, TensorMapStorage&, int32_t,
                                  int32_t) {
        return cute::make_tuple(nullptr);
    }

    CUTLASS_DEVICE auto store_init(typename Base::Params const&, TensorMapStorage&, int32_t,
                                   int32_t, int32_t) {
        return cute::make_tuple(nullptr);
    }

    template <bool IsLoad, class ProblemShapeMNKL>
    CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, typename Base::Params const&,
                                                  cute::TmaDescriptor const*, ProblemShapeMNKL,
                                                  int32_t, int32_t) {}

    template <bool IsLoad>
    CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, cute::TmaDescriptor const*,
                                                    int32_t) {}

   private:
    TensorStorage* shared_;
};

}  // namespace ep::gemm
