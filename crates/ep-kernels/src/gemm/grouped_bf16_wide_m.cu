// ep-kernels: host library (CUTLASS)
//
// The grouped bf16 GEMM for groups of many M tiles (prefill at >= 512 rows per expert):
// 128 x 256 cooperative tiles, clusters of two CTAs along M sharing the B tile (the weights)
// by TMA multicast. See grouped_gemm_sm90.cuh.
#include "grouped_gemm_sm90.cuh"

EP_GROUPED_GEMM_BF16(wide_m, 128, 256, 64, 2, 1,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, false)
