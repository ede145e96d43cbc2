// The SwiGLU epilogue of the experts' first grouped GEMM on Hopper: the gate_up GEMM's
// accumulators go straight to act = silu(gate) * up, [rows, I], so the [rows, 2I] gate_up
// product is never written, read back nor rounded to bf16.
//
// It pairs each gate column with its up column inside one thread's registers, which needs the
// gate_up weight in the blocked layout (`ep_kernels::gemm::GATE_UP_BLOCK`): per expert, rows
// 16b .. 16b + 7 are gate_proj rows 8b .. 8b + 7 and rows 16b + 8 .. 16b + 15 the up_proj rows
// 8b .. 8b + 7. A WGMMA accumulator tile gives each thread, for every group of 8 output
// columns, the columns 2q and 2q + 1 of rows r and r + 8 (four registers, q = lane % 4), and
// the groups follow each other in the fragment. So the four registers of group 2p (gate) and
// the four of group 2p + 1 (up) of one thread hold matching gate and up values, and the thread
// writes act columns 8p' + 2q, 8p' + 2q + 1 of its two rows as two bf16 pairs (p' counting the
// pairs of groups across the whole problem). Any tile whose N is a multiple of 16 keeps a pair
// of groups in one tile.
//
// The stores go from registers to global memory (no shared memory, no TMA): a quad of threads
// writes 16 contiguous bytes of a row, and the epilogue writes half the bytes the plain GEMM's
// would. Rows past the group's count and columns past N are not written.
//
// The class has the interface of CUTLASS's operator-style ptr-array epilogues (wrapped in
// `Sm90TmaWarpSpecializedAdapter`, schedule `PtrArrayNoSmemWarpSpecialized`), so the ptr-array
// warp-specialized kernels run it after each tile's mainloop.
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace ep::gemm {

template <class ElementD_, class StrideD_>
class SwigluEpilogueArray {
   public:
    using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
    using DispatchPolicy = EpilogueSchedule;
    using ElementAccumulator = float;
    using ElementCompute = float;
    using ElementScalar = float;
    using ElementOutput = ElementD_;
    using ElementD = ElementD_;
    using ElementC = void;  // no source operand
    using StrideD = StrideD_;
    using StrideC = StrideD_;
    using InternalStrideD = cute::remove_pointer_t<StrideD>;
    using InternalStrideC = InternalStrideD;
    using GmemTiledCopyC = void;
    using GmemTiledCopyD = void;
    // What CUTLASS's device adapter names as the epilogue's output operator; the SwiGLU of
    // operator() replaces it (never called).
    using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;
    static_assert(sizeof(ElementD) == 2, "the SwiGLU epilogue writes bf16 pairs");

    struct SharedStorage {};
    using TensorMapStorage = SharedStorage;

    struct Arguments {
        ElementD** ptr_D = nullptr;  // per group: act [count, n / 2]
        StrideD dD{};                // per group: the packed stride of act
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

    // N even is all the pairing needs from the shapes; the launcher checks N % 16 == 0.
    template <class ProblemShape>
    static bool can_implement(ProblemShape const&, Arguments const&) {
        return true;
    }

    CUTLASS_HOST_DEVICE explicit SwigluEpilogueArray(Params const& params) : params_(params) {}

    CUTLASS_DEVICE bool is_source_needed() { return false; }

    template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
              class FrgLayout, class TiledMma, class ResidueMNK>
    CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl,
                                   BlockShapeMNK blk_shape_mnk, BlockCoordMNKL blk_coord_mnkl,
                                   cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                   TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
        using namespace cute;
        static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
        // The WGMMA value mode: (2 adjacent columns, rows r and r + 8, groups of 8 columns).
        static_assert(decltype(size<0, 0>(FrgLayout{}))::value == 2 &&
                          decltype(size<0, 1>(FrgLayout{}))::value == 2 &&
                          decltype(size<0, 2>(FrgLayout{}))::value % 2 == 0,
                      "unexpected accumulator layout for the gate / up pairing");
        static_assert(decltype(size<1>(BlockShapeMNK{}))::value % 16 == 0,
                      "the tile's N must hold whole (gate, up) pairs of 8-column groups");

        const int m_total = get<0>(problem_shape_mnkl);
        const int n_total = get<1>(problem_shape_mnkl);  // 2I
        auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;

        // Problem coordinates of every accumulator of this thread.
        Tensor coords = make_identity_tensor(make_shape(m_total, n_total));
        Tensor tile = local_tile(coords, take<0, 2>(blk_shape_mnk), make_coord(m_coord, n_coord));
        Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(tile);
        CUTE_STATIC_ASSERT_V(size(thread_coords) == size(accumulators));

        auto* act = reinterpret_cast<__nv_bfloat16*>(params_.ptr_D[l_coord]);
        const int64_t ld = n_total / 2;
        constexpr int kValues = decltype(size(accumulators))::value;
        // Group pairs: 8 registers each, gate group first.
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kValues; i += 8) {
            CUTLASS_PRAGMA_UNROLL
            for (int half = 0; half < 2; ++half) {  // rows r, r + 8
                const int g = i + 2 * half;
                const auto coord = thread_coords(g);
                const int m = get<0>(coord);
                const int n = get<1>(coord);  // gate column, n % 16 < 8
                if (m < m_total && n < n_total) {
                    const float a0 = silu(accumulators(g)) * accumulators(g + 4);
                    const float a1 = silu(accumulators(g + 1)) * accumulators(g + 5);
                    const int64_t col = (n / 16) * 8 + n % 8;
                    *reinterpret_cast<__nv_bfloat162*>(act + m * ld + col) =
                        __floats2bfloat162_rn(a0, a1);
                }
            }
        }
    }

   private:
    CUTLASS_DEVICE static float silu(float x) { return x / (1.0f + expf(-x)); }

    Params params_;
};

}  // namespace ep::gemm
