// ep-kernels: host library (CUTLASS)
//
// The experts' first grouped GEMM with SwiGLU in its epilogue, for groups of many M tiles
// (prefill at >= 512 rows per expert): the tiles of grouped_bf16_wide_m.cu, act =
// silu(gate) * up written straight from the accumulators. See swiglu_epilogue_sm90.cuh.
#include "grouped_gemm_sm90.cuh"

EP_GROUPED_GEMM_BF16(swiglu_wide_m, 128, 256, 64, 2, 1,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true)
