// Grouped bf16 GEMM on Hopper (sm_90a) for the routed experts of a MoE layer: one GEMM per
// expert ("group"), D_g = A_g * B_g^T, with every group's row count read on the device.
//
// Built on CUTLASS 3's ptr-array warp-specialized kernels (TMA loads, WGMMA, a persistent
// grouped tile scheduler). CUTLASS takes per-group problem shapes, operand pointers and strides
// as device arrays; `setup_groups` below writes them from the expert row counts, on the same
// stream, right before the GEMM, so that the host never reads a count:
//
//   contiguous layout (normal mode, after dispatch and the expert-major permute):
//       A = [rows, K], group g's rows start at sum_{j<g} align_up(counts[j], alignment);
//   masked layout (low-latency mode, as the LL receive leaves them):
//       A = [groups, m_max, K], group g's rows start at g * m_max, counts[g] <= m_max valid.
//
//   B = [groups, N, K] (each expert's weight as stored by nn.Linear: out x in, K contiguous),
//   D = [rows, N] with the rows of A. Rows past a group's count are never read nor written.
//
// In the masked layout the last groups may be "extra" groups with their own weights and,
// optionally, their own input rows: a MoE layer's shared experts run in the same launch as the
// routed ones (their weights read in the same wave of tiles), over the layer's tokens.
//
// One translation unit per tile configuration and epilogue (plain, or SwiGLU for the experts'
// first GEMM: swiglu_epilogue_sm90.cuh) includes this header and instantiates
// `EP_GROUPED_GEMM_BF16(name, ...)`, which defines two C functions the Rust launcher
// (src/gemm/cuda/; declared in the module named for the source) calls:
//   uint64_t ep_grouped_gemm_bf16_<name>_workspace(int32_t groups, int32_t sm_count);
//   int32_t  ep_grouped_gemm_bf16_<name>_run(const ep::gemm::GroupedGemmArgs*, cudaStream_t,
//                                             char* message, uint64_t message_len);
// `run` returns 0 on success, else writes a message and returns a non-zero code.
//
// Bad device data (a negative count, a count above m_max, counts whose rows overrun A) cannot
// be checked by the host before launch without a device-to-host read: `setup_groups` prints
// which argument and value broke the rule and traps (the stream then fails).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "swiglu_epilogue_sm90.cuh"

namespace ep::gemm {

// Layout codes (Rust: `GroupLayout`).
constexpr int32_t kContiguous = 0;
constexpr int32_t kMasked = 1;
// Most groups one call takes (one block of `setup_groups` scans them all).
constexpr int kMaxGroups = 1024;

// Mirrors `GroupedGemmArgs` in src/gemm/cuda/mod.rs.
struct GroupedGemmArgs {
    const void* a;           // bf16 [rows, k]
    const void* b;           // bf16 [groups, n, k]
    void* d;                 // bf16 [rows, n]
    const int32_t* counts;   // [groups] valid rows per group, on the device
    void* workspace;         // `workspace_bytes` of device memory (see *_workspace)
    uint64_t workspace_bytes;
    int64_t rows;            // rows of a and d
    int32_t groups;
    int32_t n;
    int32_t k;
    int32_t layout;          // kContiguous or kMasked
    int32_t m_max;           // masked: rows per group block
    int32_t alignment;       // contiguous: group starts are multiples of it
    int32_t sm_count;        // CTAs to launch (persistent: the SMs the kernel may occupy)
    // Extra groups (masked layout only): groups first_extra.. take their weights from
    // extra_b ([groups - first_extra, n, k]) instead of b, and, when extra_a is set, their rows
    // from extra_a (the same extra_a_rows rows for every extra group) instead of their block of
    // a. first_extra == groups: none.
    int32_t first_extra;
    const void* extra_a;     // bf16 [extra_a_rows, k] or null
    const void* extra_b;     // bf16 [groups - first_extra, n, k] or null
    int64_t extra_a_rows;
};
static_assert(sizeof(GroupedGemmArgs) == 112, "GroupedGemmArgs must match its Rust mirror");

// Bytes of one table section, rounded up so that every section starts 128-byte aligned.
inline uint64_t section_bytes(uint64_t bytes) { return (bytes + 127) / 128 * 128; }

// `Swiglu`: the experts' first GEMM, B the gate_up weight in the blocked layout
// (swiglu_epilogue_sm90.cuh) and D = act [rows, n / 2] = silu(gate) * up; else D = [rows, n].
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool Swiglu>
struct GroupedGemmBf16 {
    using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
    using Shape3 = typename ProblemShape::UnderlyingProblemShape;
    using Element = cutlass::bfloat16_t;
    using LayoutA = cutlass::layout::RowMajor;     // [M, K]
    using LayoutB = cutlass::layout::ColumnMajor;  // K x N stored as [N, K]
    using LayoutD = cutlass::layout::RowMajor;     // [M, N]
    static constexpr int kAlign = 8;               // 16 bytes of bf16 (TMA)

    static constexpr bool kSwiglu = Swiglu;

    using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, LayoutD*, kAlign,      // no source C
        Element, LayoutD*, kAlign,   // D
        EpilogueSchedule,
        cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;
    using SwigluEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
        SwigluEpilogueArray<Element, typename PlainEpilogue::StrideD>>;
    using CollectiveEpilogue = cute::conditional_t<Swiglu, SwigluEpilogue, PlainEpilogue>;

    using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        Element, LayoutA*, kAlign,
        Element, LayoutB*, kAlign,
        float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<
            static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;

    using Kernel =
        cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideD = typename Kernel::InternalStrideD;

    // The per-group tables `setup_groups` fills, carved from the front of the workspace.
    struct Tables {
        Shape3* shapes;
        const Element** ptr_a;
        const Element** ptr_b;
        Element** ptr_d;
        StrideA* stride_a;
        StrideB* stride_b;
        StrideD* stride_d;
        uint8_t* cutlass_workspace;  // what CUTLASS itself needs
    };

    static uint64_t table_bytes(int groups) {
        const uint64_t g = static_cast<uint64_t>(groups);
        return section_bytes(g * sizeof(Shape3)) + 3 * section_bytes(g * sizeof(void*)) +
               section_bytes(g * sizeof(StrideA)) + section_bytes(g * sizeof(StrideB)) +
               section_bytes(g * sizeof(StrideD));
    }

    static Tables carve(void* workspace, int groups) {
        const uint64_t g = static_cast<uint64_t>(groups);
        uint8_t* p = static_cast<uint8_t*>(workspace);
        Tables t;
        t.shapes = reinterpret_cast<Shape3*>(p);
        p += section_bytes(g * sizeof(Shape3));
        t.ptr_a = reinterpret_cast<const Element**>(p);
        p += section_bytes(g * sizeof(void*));
        t.ptr_b = reinterpret_cast<const Element**>(p);
        p += section_bytes(g * sizeof(void*));
        t.ptr_d = reinterpret_cast<Element**>(p);
        p += section_bytes(g * sizeof(void*));
        t.stride_a = reinterpret_cast<StrideA*>(p);
        p += section_bytes(g * sizeof(StrideA));
        t.stride_b = reinterpret_cast<StrideB*>(p);
        p += section_bytes(g * sizeof(StrideB));
        t.stride_d = reinterpret_cast<StrideD*>(p);
        p += section_bytes(g * sizeof(StrideD));
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
        args.mainloop = {t.ptr_a, t.stride_a, t.ptr_b, t.stride_b};
        args.hw_info = hw;
        if constexpr (Swiglu) {
            args.epilogue.ptr_D = t.ptr_d;
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
        return table_bytes(groups) + section_bytes(Gemm::get_workspace_size(arguments(t, groups, sm_count)));
    }
};

// Writes every group's problem shape, operand pointers and strides from the row counts.
// One block of kSetupThreads threads, each owning kGroupsPerThread consecutive groups.
constexpr int kSetupThreads = 256;
constexpr int kGroupsPerThread = kMaxGroups / kSetupThreads;

template <class G>
__global__ void __launch_bounds__(kSetupThreads) setup_groups(const GroupedGemmArgs args,
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
            printf("ep grouped gemm: counts[%d] = %d is negative\n", g, count[i]);
            asm volatile("trap;");
        }
        if (args.layout == kMasked) {
            if (count[i] > args.m_max) {
                printf("ep grouped gemm: counts[%d] = %d exceeds m_max = %d\n", g, count[i],
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
    using E = typename G::Element;
    const int64_t n = args.n;
    const int64_t k = args.k;
    // Columns of d: the SwiGLU GEMM writes act, half of the gate_up width.
    const int32_t d_cols = G::kSwiglu ? args.n / 2 : args.n;
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
        const int g = threadIdx.x * kGroupsPerThread + i;
        if (g >= args.groups) {
            break;
        }
        if (start[i] + count[i] > args.rows) {  // rows of d (and of a, without extra_a)
            printf("ep grouped gemm: counts[0..=%d] need %lld rows of a, which has %lld\n", g,
                   static_cast<long long>(start[i] + count[i]), static_cast<long long>(args.rows));
            asm volatile("trap;");
        }
        const bool extra = g >= args.first_extra;
        if (extra && args.extra_a != nullptr && count[i] > args.extra_a_rows) {
            printf("ep grouped gemm: counts[%d] = %d exceeds the %lld rows of extra_a\n", g,
                   count[i], static_cast<long long>(args.extra_a_rows));
            asm volatile("trap;");
        }
        t.shapes[g] = typename G::Shape3{count[i], args.n, args.k};
        t.ptr_a[g] = extra && args.extra_a != nullptr
                         ? static_cast<const E*>(args.extra_a)
                         : static_cast<const E*>(args.a) + start[i] * k;
        t.ptr_b[g] = extra ? static_cast<const E*>(args.extra_b) +
                                 static_cast<int64_t>(g - args.first_extra) * n * k
                           : static_cast<const E*>(args.b) + static_cast<int64_t>(g) * n * k;
        t.ptr_d[g] = static_cast<E*>(args.d) + start[i] * d_cols;
        t.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {count[i], args.k, 1});
        t.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {args.n, args.k, 1});
        t.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {count[i], d_cols, 1});
    }
}

inline int32_t fail(char* message, uint64_t len, int32_t code, const char* what, const char* detail) {
    if (message != nullptr && len > 0) {
        snprintf(message, len, "%s: %s", what, detail);
    }
    return code;
}

// Runs one grouped GEMM on `stream`: the setup kernel, then the CUTLASS kernel.
template <class G>
int32_t run_grouped_gemm(const GroupedGemmArgs* args, cudaStream_t stream, char* message,
                         uint64_t message_len) {
    if (args->groups <= 0 || args->groups > kMaxGroups) {
        return fail(message, message_len, 1, "groups", "must be in 1..=1024");
    }
    if (args->workspace_bytes < G::workspace_bytes(args->groups, args->sm_count)) {
        return fail(message, message_len, 2, "workspace", "smaller than the configuration needs");
    }
    const typename G::Tables t = G::carve(args->workspace, args->groups);
    setup_groups<G><<<1, kSetupThreads, 0, stream>>>(*args, t);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        return fail(message, message_len, 3, "setup_groups launch", cudaGetErrorString(err));
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

// Defines the two C entry points of one configuration.
// SWIGLU: true for the SwiGLU epilogue (EPILOGUE then only shapes the unused plain one).
#define EP_GROUPED_GEMM_BF16(name, TILE_M, TILE_N, TILE_K, CLUSTER_M, CLUSTER_N, KERNEL, EPILOGUE, \
                             SWIGLU)                                                             \
    using EpGroupedGemm_##name = ep::gemm::GroupedGemmBf16<                                      \
        cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::Int<TILE_K>>,                    \
        cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>, KERNEL, EPILOGUE,     \
        SWIGLU>;                                                                                 \
    extern "C" uint64_t ep_grouped_gemm_bf16_##name##_workspace(int32_t groups, int32_t sm_count) { \
        return EpGroupedGemm_##name::workspace_bytes(groups, sm_count);                          \
    }                                                                                            \
    extern "C" int32_t ep_grouped_gemm_bf16_##name##_run(const ep::gemm::GroupedGemmArgs* args,  \
                                                         cudaStream_t stream, char* message,     \
                                                         uint64_t message_len) {                 \
        return ep::gemm::run_grouped_gemm<EpGroupedGemm_##name>(args, stream, message,           \
                                                                 message_len);                   \
    }
