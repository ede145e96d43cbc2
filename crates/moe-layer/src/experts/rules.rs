//! Which path a shard's weights take, from their shapes, dtype and device alone: the bf16
//! grouped GEMMs (and the gate_up layout their SwiGLU epilogue reads), the fp8 grouped GEMMs,
//! and the shared experts' fp8 blocks beside them. One place for the rules, which the loaders
//! and the memory plan ([`crate::WeightBytes::planned`]) both apply.

use candle_core::{DType, Device};
use ep_kernels::gemm;

use super::mlp::GateUpLayout;
#[cfg(feature = "cuda")]
use crate::error::Error;
use crate::error::Result;

/// Whether `l` experts of `[2I, H]` weights of `dtype` on `device` run as device grouped GEMMs
/// (CUDA, bf16, `H` a multiple of 8, `I` of the gate_up block, at most `MAX_GROUPS` experts).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn grouped_shape_eligible(
    device: &Device,
    dtype: DType,
    l: usize,
    h: usize,
    i: usize,
) -> bool {
    device.is_cuda()
        && dtype == DType::BF16
        && h % 8 == 0
        && i % gemm::GATE_UP_BLOCK == 0
        && l <= gemm::MAX_GROUPS
}

/// The gate_up layout of a shard of `l` experts of `[2I, H]` on `device`: blocked where the
/// grouped GEMMs run (their SwiGLU epilogue reads it), else stacked.
pub(super) fn weight_layout(
    device: &Device,
    dtype: DType,
    l: usize,
    h: usize,
    i: usize,
) -> GateUpLayout {
    #[cfg(feature = "cuda")]
    if grouped_shape_eligible(device, dtype, l, h, i) {
        return GateUpLayout::Blocked;
    }
    let _ = (device, dtype, l, h, i);
    GateUpLayout::Stacked
}

/// Whether `l` fp8 experts of `[2I, H]` on `device` run on the fp8 grouped GEMMs (else they are
/// dequantized): CUDA, `H` and `I` multiples of 128 (whole scale blocks per projection),
/// at most 1024 local experts. A CUDA device without fp8 tensor cores (before sm_90) is an
/// error.
pub(super) fn fp8_eligible(device: &Device, l: usize, h: usize, i: usize) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        let props = *ep_kernels::cuda::Kernels::for_stream(&dev.cuda_stream())?.props();
        if props.compute_capability.0 < 9 {
            return Err(Error::invalid(
                "fp8 experts",
                format!(
                    "a GPU of compute capability {}.{}",
                    props.compute_capability.0, props.compute_capability.1
                ),
                "the fp8 grouped GEMMs need sm_90 (Hopper)",
            ));
        }
        return Ok(fp8_shapes_supported(l, h, i));
    }
    let _ = (device, l, h, i);
    Ok(false)
}

/// Whether the fp8 grouped GEMMs take `l` experts of hidden size `h` and inner width `i`
/// (`h` and `i` multiples of the 128-wide scale blocks: the rows' 1 x 128 casts need whole
/// groups; at most `MAX_GROUPS` groups).
pub(crate) fn fp8_shapes_supported(l: usize, h: usize, i: usize) -> bool {
    let block = ep_kernels::gemm::fp8::FP8_BLOCK;
    h % block == 0 && i % block == 0 && l <= ep_kernels::gemm::MAX_GROUPS
}

/// The blocks of the routed experts' width `i` that shared experts of width `i_s` run as
/// beside `l` fp8 routed experts (extra groups of their GEMMs), or `None` where they cannot
/// (their width not a multiple of `i`, or too many groups): the layer then runs their float MLP
/// only.
pub(crate) fn shared_fp8_blocks(l: usize, i: usize, i_s: usize) -> Option<usize> {
    (i > 0 && i_s % i == 0 && l + i_s / i <= ep_kernels::gemm::MAX_GROUPS).then_some(i_s / i)
}
