// Grouped block-scaled FP8 GEMM on Hopper (sm_90a) for the routed experts of a MoE layer, in
// DeepSeek-V3's recipe: e4m3 activations with one f32 scale per row per 128 channels of K
// (1 x 128), e4m3 weights with one f32 scale per block of rows x 128 channels, f32
// accumulation promoted through the scales after every 128 channels of K (four WGMMA k-steps).
// D_g = (A_g * SFA_g) x (B_g * SFB_g)^T per group, bf16 out.
//
// Built on CUTLASS 3's ptr-array blockwise-scaling mainloop
// (`KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum`: TMA loads of
// the operands, the scales by cp.async in their own producer warp). As in
// grouped_gemm_sm90.cuh (whose layouts, extra groups and device checks this header shares),
// `setup_groups_fp8` writes every group's shape, operand and scale pointers, strides and scale
// layouts from the device row counts, so that the host never reads a count:
//
//   A   = e4m3 [rows, K] (contiguous or masked layout),  SFA = f32 [rows, ceil(K / 128)]
//   B   = e4m3 [groups, N, K],                           SFB = f32 [groups, ceil(N / 128),
//                                                                   ceil(K / 128)]
//   D   = bf16 [rows, N]
//
// Both scale tensors are K-major, row for row with their operand: SFA is what the fp8 dispatch
// sends with each token, SFB a checkpoint's `weight_scale_inv` (DeepSeek's [ceil(N / 128),
// ceil(K / 128)] per weight). The experts' gate_up weight is the gate_proj rows then the up_proj
// rows (I a multiple of 128, so that no scale block mixes them) in the order the caller chose;
// SwiGLU and the quantization of its output for the down GEMM follow in one pass
// (quantize_rows.cu), or, with the `SwigluQuant` configuration, run in the GEMM's epilogue
// (swiglu_quantize_epilogue_sm90.cuh: the weight in 128-row gate / up blocks in turn, D then
// the e4m3 act [rows, n / 2] and `d_scales` its f32 scales [rows, n / 256]).
//
// One translation unit per configuration instantiates `EP_GROUPED_GEMM_FP8(name, ...)`:
//   uint64_t ep_grouped_gemm_fp8_<name>_workspace(int32_t groups, int32_t sm_count);
//   int32_t  ep_grouped_gemm_fp8_<name>_run(const ep::gemm::GroupedGemmFp8Args*, cudaStream_t,
//                                            char* message, uint64_t message_len);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "../grouped_gemm_sm90.cuh"
#include "overlapped_promotion_sm90.cuh"
#include "swiglu_quantize_epilogue_sm90.cuh"

namespace ep::gemm {

// Channels of K, and rows of B, sharing one scale (Rust: `FP8_BLOCK`).
constexpr int kFp8ScaleBlock = 128;

// Mirrors `GroupedGemmFp8Args` in src/gemm/fp8/cuda/mod.rs.
struct GroupedGemmFp8Args {
    const void* a;           // e4m3 [rows, k]
    const float* sfa;        // f32 [rows, ceil(k / 128)]
    const void* b;           // e4m3 [groups, n, k]
    const float* sfb;        // f32 [groups, ceil(n / 128), ceil(k / 128)]
    void* d;                 // bf16 [rows, n]; SwigluQuant: e4m3 act [rows, n / 2]
    const int32_t* counts;   // [groups] valid rows per group, on the device
    void* workspace;
    uint64_t workspace_bytes;
    int64_t rows;
    int32_t groups;
    int32_t n;
    int32_t k;
    int32_t layout;          // kContiguous or kMasked
    int32_t m_max;
    int32_t alignment;
    int32_t sm_count;
    // Extra groups (masked layout only), as in GroupedGemmArgs, with their scales.
    int32_t first_extra;
    const void* extra_a;     // e4m3 [extra_a_rows, k] or null
    const float* extra_sfa;  // f32 [extra_a_rows, ceil(k / 128)] (null with extra_a)
    const void* extra_b;     // e4m3 [groups - first_extra, n, k] or null
    const float* extra_sfb;  // f32 [groups - first_extra, ceil(n / 128), ceil(k / 128)]
    int64_t extra_a_rows;
    float* d_scales;         // SwigluQuant: f32 [rows, n / 256]; else null
};
static_assert(sizeof(GroupedGemmFp8Args) == 152, "GroupedGemmFp8Args must match its Rust mirror");

// `kOverlapPromotion`: the math warpgroups overlap each k-tile's promotion with the next
// k-tile's WGMMAs (overlapped_promotion_sm90.cuh); otherwise CUTLASS's own loop.
// `SwigluQuant`: SwiGLU and the act quantization in the epilogue (EpilogueSchedule then only
// shapes the unused plain epilogue).
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool kOverlapPromotion, bool SwigluQuant>
struct GroupedGemmFp8 {
    using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
    using Shape3 = typename ProblemShape::UnderlyingProblemShape;
    using ElementAB = cutlass::float_e4m3_t;
    using ElementD = cutlass::bfloat16_t;
    using LayoutA = cutlass::layout::RowMajor;     // [M, K]
    using LayoutB = cutlass::layout::ColumnMajor;  // K x N stored as [N, K]
    using LayoutD = cutlass::layout::RowMajor;     // [M, N]
    static constexpr int kAlignAB = 16;            // 16 bytes of e4m3 (TMA)
    static constexpr int kAlignD = 8;              // 16 bytes of bf16

    using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
        1, kFp8ScaleBlock, kFp8ScaleBlock, cute::GMMA::Major::K, cute::GMMA::Major::K>;
    using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
    using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

    static constexpr bool kSwigluQuant = SwigluQuant;
    static_assert(!SwigluQuant || cute::size<1>(ClusterShape{}) == 2,
                  "the SwiGLU epilogue pairs the two CTAs of a cluster along N");

    using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, LayoutD*, kAlignD,
        ElementD, LayoutD*, kAlignD,
        EpilogueSchedule,
        cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
    using CollectiveEpilogue =
        cute::conditional_t<SwigluQuant, SwigluQuantEpilogue<typename PlainEpilogue::StrideD>,
                            PlainEpilogue>;

    using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
        ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB,
        float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<
            static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;
    using CollectiveMainloop =
        cute::conditional_t<kOverlapPromotion, OverlappedPromotionMainloop<BuiltMainloop>,
                            BuiltMainloop>;

    using Kernel =
        cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideD = typename Kernel::InternalStrideD;

    struct Tables {
        Shape3* shapes;
        const ElementAB** ptr_a;
        const ElementAB** ptr_b;
        const float** ptr_sfa;
        const float** ptr_sfb;
        ElementD** ptr_d;
        StrideA* stride_a;
        StrideB* stride_b;
        StrideD* stride_d;
        LayoutSFA* layout_sfa;
        LayoutSFB* layout_sfb;
        uint8_t** ptr_q;  // SwigluQuant: act per group
        float** ptr_s;    // SwigluQuant: act scales per group
        uint8_t* cutlass_workspace;
    };

    static uint64_t table_bytes(int groups) {
        const uint64_t g = static_cast<uint64_t>(groups);
        return section_bytes(g * sizeof(Shape3)) + 7 * section_bytes(g * sizeof(void*)) +
               section_bytes(g * sizeof(StrideA)) + section_bytes(g * sizeof(StrideB)) +
               section_bytes(g * sizeof(StrideD)) + section_bytes(g * sizeof(LayoutSFA)) +
               section_bytes(g * sizeof(LayoutSFB));
    }

    static Tables carve(void* workspace, int groups) {
        const uint64_t g = static_cast<uint64_t>(groups);
        uint8_t* p = static_cast<uint8_t*>(workspace);
        auto take = [&p](uint64_t bytes) {
            uint8_t* at = p;
            p += section_bytes(bytes);
            return at;
        };
        Tables t;
        t.shapes = reinterpret_cast<Shape3*>(take(g * sizeof(Shape3)));
        t.ptr_a = reinterpret_cast<const ElementAB**>(take(g * sizeof(void*)));
        t.ptr_b = reinterpret_cast<const ElementAB**>(take(g * sizeof(void*)));
        t.ptr_sfa = reinterpret_cast<const float**>(take(g * sizeof(void*)));
        t.ptr_sfb = reinterpret_cast<const float**>(take(g * sizeof(void*)));
        t.ptr_d = reinterpret_cast<ElementD**>(take(g * sizeof(void*)));
        t.stride_a = reinterpret_cast<StrideA*>(take(g * sizeof(StrideA)));
        t.stride_b = reinterpret_cast<StrideB*>(take(g * sizeof(StrideB)));
        t.stride_d = reinterpret_cast<StrideD*>(take(g * sizeof(StrideD)));
        t.layout_sfa = reinterpret_cast<LayoutSFA*>(take(g * sizeof(LayoutSFA)));
        t.layout_sfb = reinterpret_cast<LayoutSFB*>(take(g * sizeof(LayoutSFB)));
        t.ptr_q = reinterpret_cast<uint8_t**>(take(g * sizeof(void*)));
        t.ptr_s = reinterpret_cast<float**>(take(g * sizeof(void*)));
        t.cutlass_workspace = p;
        return t;
    }

    static typename Gemm::Arguments arguments(const Tables& t, int groups, int sm_count) {
        cutlass::KernelHardwareInfo hw;
        hw.device_id = 0;
        hw.sm_count = sm_count;
        typename Gemm::Arguments args{};
        args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
        args.problem_shape = {groups, t.shapes, nullptr};
        args.mainloop = {t.ptr_a,   t.stride_a,   t.ptr_b,   t.stride_b,
                         t.ptr_sfa, t.layout_sfa, t.ptr_sfb, t.layout_sfb};
        args.hw_info = hw;
        if constexpr (SwigluQuant) {
            args.epilogue.ptr_q = t.ptr_q;
            args.epilogue.ptr_s = t.ptr_s;
            args.epilogue.dD = t.stride_d;
        } else {
            args.epilogue = {{}, nullptr, t.stride_d, t.ptr_d, t.stride_d};
            args.epilogue.thread.alpha = 1.0f;
            args.epilogue.thread.beta = 0.0f;
        }
        return args;
    }

    static uint64_t workspace_bytes(int groups, int sm_count) {
        Tables t = carve(nullptr, groups);
        return table_bytes(groups) +
               section_bytes(Gemm::get_workspace_size(arguments(t, groups, sm_count)));
    }
};

// Every group's problem shape, operand and scale pointers, strides and scale layouts from the
// row counts: `setup_groups` of grouped_gemm_sm90.cuh with the scales beside the operands.
template <class G>
__global__ void __launch_bounds__(kSetupThreads) setup_groups_fp8(const GroupedGemmFp8Args args,
                                                                  const typename G::Tables t) {
    using Scan = cub::BlockScan<int64_t, kSetupThreads>;
    __shared__ typename Scan::TempStorage scan;
    int32_t count[kGroupsPerThread];
    int64_t start[kGroupsPerThread];
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
        const int g = threadIdx.x * kGroupsPerThread + i;
        count[i] = g < args.groups ? args.counts[g] : 0;
        if (count[i] < 0) {
            printf("ep grouped fp8 gemm: counts[%d] = %d is negative\n", g, count[i]);
            asm volatile("trap;");
        }
        if (args.layout == kMasked) {
            if (count[i] > args.m_max) {
                printf("ep grouped fp8 gemm: counts[%d] = %d exceeds m_max = %d\n", g, count[i],
                       args.m_max);
                asm volatile("trap;");
            }
            start[i] = static_cast<int64_t>(g) * args.m_max;
        } else {
            start[i] = (static_cast<int64_t>(count[i]) + args.alignment - 1) / args.alignment *
                       args.alignment;
        }
    }
    if (args.layout != kMasked) {
        Scan(scan).ExclusiveSum(start, start);
    }
    using E = typename G::ElementAB;
    using D = typename G::ElementD;
    const int64_t n = args.n;
    const int64_t k = args.k;
    const int64_t k_blocks = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
    const int64_t n_blocks = (n + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
    const int32_t d_cols = args.n;
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
        const int g = threadIdx.x * kGroupsPerThread + i;
        if (g >= args.groups) {
            break;
        }
        if (start[i] + count[i] > args.rows) {
            printf("ep grouped fp8 gemm: counts[0..=%d] need %lld rows of a, which has %lld\n", g,
                   static_cast<long long>(start[i] + count[i]), static_cast<long long>(args.rows));
            asm volatile("trap;");
        }
        const bool extra = g >= args.first_extra;
        const bool own_rows = extra && args.extra_a != nullptr;
        if (own_rows && count[i] > args.extra_a_rows) {
            printf("ep grouped fp8 gemm: counts[%d] = %d exceeds the %lld rows of extra_a\n", g,
                   count[i], static_cast<long long>(args.extra_a_rows));
            asm volatile("trap;");
        }
        const int64_t xg = g - args.first_extra;
        t.shapes[g] = typename G::Shape3{count[i], args.n, args.k};
        t.ptr_a[g] = own_rows ? static_cast<const E*>(args.extra_a)
                              : static_cast<const E*>(args.a) + start[i] * k;
        t.ptr_sfa[g] = own_rows ? args.extra_sfa : args.sfa + start[i] * k_blocks;
        t.ptr_b[g] = extra ? static_cast<const E*>(args.extra_b) + xg * n * k
                           : static_cast<const E*>(args.b) + static_cast<int64_t>(g) * n * k;
        t.ptr_sfb[g] = extra ? args.extra_sfb + xg * n_blocks * k_blocks
                             : args.sfb + static_cast<int64_t>(g) * n_blocks * k_blocks;
        t.ptr_d[g] = static_cast<D*>(args.d) + start[i] * d_cols;
        if constexpr (G::kSwigluQuant) {
            // act: n / 2 e4m3 columns a row, one scale per 128 of them.
            t.ptr_q[g] = static_cast<uint8_t*>(args.d) + start[i] * (n / 2);
            t.ptr_s[g] = args.d_scales + start[i] * (n / 256);
        }
        t.stride_a[g] =
            cutlass::make_cute_packed_stride(typename G::StrideA{}, {count[i], args.k, 1});
        t.stride_b[g] =
            cutlass::make_cute_packed_stride(typename G::StrideB{}, {args.n, args.k, 1});
        t.stride_d[g] =
            cutlass::make_cute_packed_stride(typename G::StrideD{}, {count[i], d_cols, 1});
        t.layout_sfa[g] =
            G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(count[i], args.n, args.k, 1));
        t.layout_sfb[g] =
            G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(count[i], args.n, args.k, 1));
    }
}

// Runs one grouped fp8 GEMM on `stream`: the setup kernel, then the CUTLASS kernel.
template <class G>
int32_t run_grouped_gemm_fp8(const GroupedGemmFp8Args* args, cudaStream_t stream, char* message,
                             uint64_t message_len) {
    if (args->groups <= 0 || args->groups > kMaxGroups) {
        return fail(message, message_len, 1, "groups", "must be in 1..=1024");
    }
    if (args->workspace_bytes < G::workspace_bytes(args->groups, args->sm_count)) {
        return fail(message, message_len, 2, "workspace", "smaller than the configuration needs");
    }
    if (G::kSwigluQuant &&
        (args->n % 256 != 0 || args->d_scales == nullptr || args->first_extra != args->groups)) {
        return fail(message, message_len, 7, "SwiGLU epilogue",
                    "needs n a multiple of 256, act scales and no extra groups");
    }
    const typename G::Tables t = G::carve(args->workspace, args->groups);
    setup_groups_fp8<G><<<1, kSetupThreads, 0, stream>>>(*args, t);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        return fail(message, message_len, 3, "setup_groups_fp8 launch", cudaGetErrorString(err));
    }
    typename G::Gemm gemm;
    const auto gemm_args = G::arguments(t, args->groups, args->sm_count);
    cutlass::Status status = gemm.can_implement(gemm_args);
    if (status != cutlass::Status::kSuccess) {
        return fail(message, message_len, 4, "CUTLASS can_implement", cutlassGetStatusString(status));
    }
    status = gemm.initialize(gemm_args, t.cutlass_workspace, stream);
    if (status != cutlass::Status::kSuccess) {
        return fail(message, message_len, 5, "CUTLASS initialize", cutlassGetStatusString(status));
    }
    status = gemm.run(stream);
    err = cudaGetLastError();
    if (status != cutlass::Status::kSuccess || err != cudaSuccess) {
        return fail(message, message_len, 6, "CUTLASS run",
                    err != cudaSuccess ? cudaGetErrorString(err) : cutlassGetStatusString(status));
    }
    return 0;
}

}  // namespace ep::gemm

// Defines the two C entry points of one fp8 configuration.
#define EP_GROUPED_GEMM_FP8(name, TILE_M, TILE_N, TILE_K, CLUSTER_M, CLUSTER_N, KERNEL, EPILOGUE, \
                            OVERLAP, SWIGLU_QUANT)                                              \
    using EpGroupedGemmFp8_##name = ep::gemm::GroupedGemmFp8<                                   \
        cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::Int<TILE_K>>,                   \
        cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>, KERNEL, EPILOGUE,     \
        OVERLAP, SWIGLU_QUANT>;                                                                 \
    extern "C" uint64_t ep_grouped_gemm_fp8_##name##_workspace(int32_t groups, int32_t sm_count) { \
        return EpGroupedGemmFp8_##name::workspace_bytes(groups, sm_count);                      \
    }                                                                                           \
    extern "C" int32_t ep_grouped_gemm_fp8_##name##_run(const ep::gemm::GroupedGemmFp8Args* args, \
                                                        cudaStream_t stream, char* message,     \
                                                        uint64_t message_len) {                 \
        return ep::gemm::run_grouped_gemm_fp8<EpGroupedGemmFp8_##name>(args, stream, message,   \
                                                                        message_len);           \
    }
