// ep-kernels: host library (CUTLASS)
//
// The grouped bf16 GEMM for many rows per expert (prefill, normal mode): 128 x 256 tiles,
// two consumer warpgroups sharing each tile (cooperative), clusters of two CTAs along N that
// share the A tile by TMA multicast. See grouped_gemm_sm90.cuh.
#include "grouped_gemm_sm90.cuh"

EP_GROUPED_GEMM_BF16(wide, 128, 256, 64, 1, 2,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, false)
