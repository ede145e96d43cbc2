// The consumer side of the block-scaled fp8 mainloop with its promotions overlapped: a
// mainloop collective that keeps CUTLASS's blockwise-scaling producer (TMA loads of the
// operands, cp.async of the scales, the same shared storage and pipeline) and replaces only
// `mma`, the math warpgroups' loop over K.
//
// Each 128-channel k-tile's WGMMAs write a fresh partial accumulator, which is then scaled by
// the tile's row and weight scales and added to the f32 result ("promotion"). CUTLASS's loop
// waits for a k-tile's WGMMAs to finish before promoting them and issues the next k-tile's only
// after the promotion, so the tensor cores idle while the warpgroup runs its FMAs. Here each
// warpgroup holds two partial accumulators: the next k-tile's WGMMAs are issued into one while
// the finished k-tile in the other is promoted, so the promotion runs under the next k-tile's
// matrix work. The numbers are the same as CUTLASS's: every k-tile is promoted once, in order,
// with the same scales; only the overlap differs. It costs one more accumulator in registers
// (three instead of two), which 128 x 128 cooperative tiles (64 values a thread each) afford.
//
// See docs/design.md ("Block-scaled FP8 experts").
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace ep::gemm {

template <class Base>
struct OverlappedPromotionMainloop : Base {
    using typename Base::ElementBlockScale;
    using typename Base::MainloopPipeline;
    using typename Base::Params;
    using typename Base::PipelineState;
    using typename Base::SmemLayoutA;
    using typename Base::SmemLayoutB;
    using typename Base::SmemLayoutSFA;
    using typename Base::SmemLayoutSFB;
    using typename Base::TensorStorage;
    using typename Base::TiledMma;
    using typename Base::TileShape;

    // The row scales vary along M (one per row), the weight scale is one per tile along N: the
    // recipe's 1 x 128 activations and 128 x 128 weights with tiles 128 wide in N.
    static_assert(Base::ScaleMsPerTile > 1 && Base::ScaleNsPerTile == 1,
                  "overlapped promotion: one row scale per row and one weight scale per tile in N");
    static_assert(Base::ScalePromotionInterval == 4,
                  "overlapped promotion: one promotion per k-tile (scale blocks of K as wide as it)");

    // The math warpgroups' loop over `k_tile_count` k-tiles: leaves the last k-tile's stage to
    // `mma_tail`, which releases it (the contract of the base collective).
    template <class FrgTensorC>
    CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                            FrgTensorC& accum, int k_tile_count, int thread_idx,
                            TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
        using namespace cute;
        static_assert(is_rmem<FrgTensorC>::value, "the accumulators must be in registers");

        Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
        Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
        // The scales in shared memory seen as (BLK_M, BLK_N, (BLK_K, PIPE)) tensors, broadcast
        // along the operand they do not vary with, so that they partition as the accumulators.
        Tensor sSFA = make_tensor(
            make_smem_ptr(shared_tensors.smem_SFA.data()),
            make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                                   make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                        make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                    make_stride(stride<1>(SmemLayoutSFA{}),
                                                stride<2>(SmemLayoutSFA{})))));
        Tensor sSFB = make_tensor(
            make_smem_ptr(shared_tensors.smem_SFB.data()),
            make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                                   make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                        make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                    make_stride(stride<1>(SmemLayoutSFB{}),
                                                stride<2>(SmemLayoutSFB{})))));

        constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
        Layout warp_group_threads =
            make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
        const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
        TiledMma tiled_mma;
        auto thread_mma = tiled_mma.get_slice(warp_group_threads(warp_group));

        Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);
        Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
        Tensor tCsA = thread_mma.partition_A(sA);  // (MMA, MMA_M, MMA_K, PIPE)
        Tensor tCsB = thread_mma.partition_B(sB);  // (MMA, MMA_N, MMA_K, PIPE)
        Tensor tCrA = thread_mma.make_fragment_A(tCsA);
        Tensor tCrB = thread_mma.make_fragment_B(tCsB);
        CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(accum));
        CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<2>(accum));

        // Two partial accumulators with their k-tile's scales (row scale times weight scale,
        // one per distinct row of the thread's values).
        Tensor part0 = make_fragment_like(accum);
        Tensor part1 = make_fragment_like(accum);
        Tensor scale0 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
        Tensor scale1 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
        Tensor scale_b = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

        clear(accum);
        warpgroup_fence_operand(accum);
        PipelineState smem_pipe_release = smem_pipe_read;

        // Waits for the next k-tile's stage, reads its scales and issues its WGMMAs into `part`
        // (starting from zero), without waiting for them.
        auto issue = [&](auto& part, auto& scale) {
            auto token = pipeline.consumer_try_wait(smem_pipe_read);
            pipeline.consumer_wait(smem_pipe_read, token);
            const int stage = smem_pipe_read.index();
            copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), scale);
            copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), scale_b);
            const ElementBlockScale b = scale_b(_0{});
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(filter_zeros(scale)); ++i) {
                filter_zeros(scale)(i) = filter_zeros(scale)(i) * b;
            }
            tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
            warpgroup_fence_operand(part);
            warpgroup_arrive();
            CUTLASS_PRAGMA_UNROLL
            for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
                cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
                tiled_mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            warpgroup_fence_operand(part);
            ++smem_pipe_read;
        };
        // Adds a finished k-tile's scaled partial products to the result.
        auto promote = [&](auto& part, auto& scale) {
            warpgroup_fence_operand(part);
            warpgroup_fence_operand(accum);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(accum); ++i) {
                accum(i) += part(i) * scale(i);
            }
            warpgroup_fence_operand(accum);
        };
        // The k-tile issued before the last one is done: its stage goes back to the producer.
        auto release_previous = [&]() {
            pipeline.consumer_release(smem_pipe_release);
            ++smem_pipe_release;
        };

        if (k_tile_count <= 0) {
            return;
        }
        issue(part0, scale0);
        int remaining = k_tile_count - 1;
        CUTLASS_PRAGMA_NO_UNROLL
        for (; remaining >= 2; remaining -= 2) {
            issue(part1, scale1);
            warpgroup_wait<1>();
            release_previous();
            promote(part0, scale0);
            issue(part0, scale0);
            warpgroup_wait<1>();
            release_previous();
            promote(part1, scale1);
        }
        if (remaining == 1) {
            issue(part1, scale1);
            warpgroup_wait<1>();
            release_previous();
            promote(part0, scale0);
            warpgroup_wait<0>();
            promote(part1, scale1);
        } else {
            warpgroup_wait<0>();
            promote(part0, scale0);
        }
    }
};

}  // namespace ep::gemm
