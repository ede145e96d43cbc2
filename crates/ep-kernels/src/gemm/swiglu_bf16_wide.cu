// ep-kernels: host library (CUTLASS)
//
// The experts' first grouped GEMM with SwiGLU in its epilogue, for many rows per expert
// (normal mode): the tiles of grouped_bf16_wide.cu, act = silu(gate) * up written straight
// from the accumulators. See swiglu_epilogue_sm90.cuh.
#include "grouped_gemm_sm90.cuh"

EP_GROUPED_GEMM_BF16(swiglu_wide, 128, 256, 64, 1, 2,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true)
