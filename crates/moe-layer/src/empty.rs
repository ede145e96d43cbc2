//! Zero-element tensors that never ask a device for a zero-byte allocation.
//!
//! CUDA refuses zero-byte allocations (`CUDA_ERROR_INVALID_VALUE`), and candle allocates the
//! output of every op, so on a GPU an op over an empty tensor fails. Ranks with no tokens are
//! normal in expert parallelism (every rank joins every collective), so the layer builds its
//! empty tensors as views of a one-row allocation and skips compute on them.

use candle_core::{DType, Device, Result, Shape, Tensor};

/// A tensor of `shape` (which must hold zero elements) on `dev`.
pub(crate) fn empty(shape: impl Into<Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
    let shape: Shape = shape.into();
    let dims = shape.dims().to_vec();
    debug_assert_eq!(shape.elem_count(), 0, "empty() is for zero-element shapes");
    if dev.is_cpu() || dims.is_empty() {
        return Tensor::zeros(dims, dtype, dev);
    }
    // Replace every zero dimension by 1, allocate, then narrow the first zero dimension to 0.
    let ones: Vec<usize> = dims.iter().map(|&d| d.max(1)).collect();
    let zero_dim = dims.iter().position(|&d| d == 0).unwrap_or(0);
    let t = Tensor::zeros(ones, dtype, dev)?.narrow(zero_dim, 0, 0)?;
    // Any other zero dimensions.
    dims.iter()
        .enumerate()
        .skip(zero_dim + 1)
        .filter(|(_, &d)| d == 0)
        .try_fold(t, |t, (i, _)| t.narrow(i, 0, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let t = empty((0, 7), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[0, 7]);
    }
}
