//! Moving between candle CUDA tensors and cudarc slices: the one place where the crates above
//! the kernels borrow a tensor's device memory for a launch ([`DeviceTensor`]) and hand kernel
//! outputs back as tensors ([`wrap`]). Re-exported as `ep_runtime::device_tensor`.

use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{Shape, Storage, StorageRef, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr, ValidAsZeroBits};
use std::ops::Range;
use std::sync::Arc;

/// A contiguous CUDA tensor, borrowed for a launch: hold it while views of it are in use.
pub struct DeviceTensor<'a> {
    arg: &'static str,
    guard: StorageRef<'a>,
    range: Range<usize>,
}

impl<'a> DeviceTensor<'a> {
    /// Borrows `t`, which must be a contiguous CUDA tensor.
    pub fn new(arg: &'static str, t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cuda(_)) {
            return Err(Error::invalid(
                arg,
                format!("a tensor on {:?}", t.device()),
                "must be a CUDA tensor",
            ));
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(Error::invalid(
                arg,
                format!("a strided view of shape {:?}", t.dims()),
                "must be contiguous (call .contiguous() first)",
            ));
        };
        Ok(Self {
            arg,
            guard,
            range: start..end,
        })
    }

    /// The elements as a typed view (the dtype must be `T`'s).
    pub fn view<T: CudaDType + DeviceRepr>(&self) -> Result<CudaView<'_, T>> {
        let Storage::Cuda(s) = &*self.guard else {
            unreachable!("checked in DeviceTensor::new")
        };
        let slice = s.as_cuda_slice::<T>().map_err(|_| {
            Error::invalid(
                self.arg,
                format!("a {:?} tensor", s.dtype()),
                format!("expected {}", std::any::type_name::<T>()),
            )
        })?;
        Ok(slice.slice(self.range.clone()))
    }
}

/// Allocates `len` zeroed elements on `stream` (at least one, so empty outputs are valid
/// allocations; use [`exact`] for a view of exactly `len`).
pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    Ok(stream.alloc_zeros::<T>(len.max(1))?)
}

/// Wraps `slice` (at least `shape`'s element count) as a candle tensor of `dev`.
pub fn wrap<T: CudaDType>(
    slice: CudaSlice<T>,
    shape: impl Into<Shape>,
    dev: &CudaDevice,
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// Uninitialised device allocations for kernel outputs (one definition, in the launch layer).
pub use ep_kernels::cuda::alloc_uninit;

/// Hands `slice` (allocated on another stream) to `stream`: later stream-ordered work on the
/// slice itself (cudarc's copies of it, its free when dropped) then runs on `stream`. A
/// synchronous op's outputs are written on the communication stream but read on candle's, and
/// inside a captured graph (no event tracking) a copy queued on the communication stream would
/// not wait for the replay. The caller guarantees that `stream` already waits for every use
/// queued so far (a synchronous op's finish does).
pub(crate) fn hand_to<T>(slice: CudaSlice<T>, stream: &Arc<CudaStream>) -> CudaSlice<T> {
    let len = slice.len();
    let ptr = slice.leak();
    // SAFETY: `ptr` is a live allocation of `len` elements of `T` that `leak` released without
    // freeing (after making its old stream wait for its tracked uses); the new slice is its only
    // owner, and `stream` is ordered after every queued use (the caller's guarantee), so its
    // stream-ordered free on `stream` comes after them.
    unsafe { stream.upgrade_device_ptr(ptr, len) }
}
