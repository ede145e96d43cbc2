//! The receive buffers of a low-latency dispatch on CUDA tensors: allocated unzeroed (the
//! receive kernel writes every element that is read), owned by the output tensors, aliased
//! for the kernels.

use super::tensor::{alloc_uninit, wrap};
use crate::error::Result;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Tensor;
use cudarc::driver::{CudaSlice, CudaStream};
use ep_kernels::low_latency::{LowLatencyFormat, LowLatencyRecv};
use ep_kernels::FP8_GROUP;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Receive buffers of one low-latency dispatch. All their memory is owned by tensors: `recv_x`
/// and (fp8) the scales by the output tensors, everything else by one `i32` block
/// ([`I32Block`]) whose views are `src_info` and `recv_count`; the kernel-side struct only
/// aliases it.
#[derive(Debug)]
pub(crate) struct CudaLlDispatchData {
    pub(super) recv: ManuallyDrop<LowLatencyRecv>,
    /// The tensors owning the aliased memory (kept alive as long as the aliases).
    _owners: Vec<Tensor>,
}

impl Drop for CudaLlDispatchData {
    fn drop(&mut self) {
        // SAFETY: `recv` is taken exactly once, here.
        let recv = unsafe { ManuallyDrop::take(&mut self.recv) };
        let LowLatencyRecv {
            recv_x,
            recv_x_scales,
            recv_count,
            recv_src_info,
            recv_src_topk,
            recv_layout_range,
            ..
        } = recv;
        // Every buffer is an alias: none may free memory the tensors own.
        let _ = recv_x.leak();
        let _ = recv_x_scales.leak();
        let _ = recv_count.leak();
        let _ = recv_src_info.leak();
        let _ = recv_src_topk.leak();
        let _ = recv_layout_range.leak();
    }
}

/// Where the `i32` outputs of one dispatch lie in their shared allocation (in elements; every
/// part starts 16-byte aligned: the combine kernel reads the ranges as pairs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct I32Block {
    /// `[L, R*M]` source token per row (the handle's `src_info`), at 0.
    src_info: usize,
    /// `[L]` rows per local expert (the output's `recv_count`).
    count: usize,
    /// `[L, R*M]` top-k position per row at its source.
    src_topk: usize,
    /// `[L, R, 2]` `(offset, count)` ranges.
    range: usize,
    /// Total elements.
    len: usize,
}

impl I32Block {
    fn new(l: usize, r: usize, m: usize) -> Self {
        let up = |v: usize| v.div_ceil(4) * 4;
        let rows = l * r * m;
        let count = up(rows);
        let src_topk = count + up(l);
        let range = src_topk + up(rows);
        Self {
            src_info: 0,
            count,
            src_topk,
            range,
            len: range + 2 * l * r,
        }
    }
}

impl CudaLlDispatchData {
    /// `[L, R]` i64 `offset << 32 | count` ranges from the kernel's `(offset, count)` pairs
    /// (a device-to-host read, on request only).
    pub(crate) fn layout_range(
        &self,
        l: usize,
        r: usize,
        dev: &candle_core::Device,
    ) -> Result<Tensor> {
        let stream = self.recv.recv_layout_range.stream().clone();
        let pairs = stream.clone_dtoh(&self.recv.recv_layout_range)?;
        let packed: Vec<i64> = pairs
            .chunks_exact(2)
            .take(l * r)
            .map(|p| ((p[0] as i64) << 32) | p[1] as i64)
            .collect();
        Ok(Tensor::from_vec(packed, (l, r), dev)?)
    }
}

/// The outputs of one dispatch: the tensors the caller gets, and the kernel-side view of the
/// same memory.
pub(super) struct DispatchOutputs {
    /// `[L, R*M, H]` bf16 or fp8.
    pub recv_x: Tensor,
    /// `[L, R*M, H / 128]` f32 (fp8 only).
    pub recv_x_scales: Option<Tensor>,
    /// `[L]` i32, a view of the `i32` block.
    pub recv_count: Tensor,
    /// `[L, R*M]` i32, a view of the `i32` block.
    pub src_info: Tensor,
    /// The kernels' aliases, and the owners of their memory.
    pub data: Box<CudaLlDispatchData>,
}

impl DispatchOutputs {
    /// Allocates the outputs of a dispatch into `L` local experts of `R * M` rows of `h`
    /// channels on `stream`, with no memset or fill: rows past the counts are never read
    /// (documented as unspecified), and the receive phase writes `recv_count`, the ranges and
    /// every `src_info` entry (`-1` past the counts). Three allocations (two for bf16).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn alloc(
        stream: &Arc<CudaStream>,
        dev: &CudaDevice,
        format: LowLatencyFormat,
        l: usize,
        r: usize,
        m: usize,
        h: usize,
    ) -> Result<Self> {
        let rows = l * r * m;
        let groups = h / FP8_GROUP;
        let (recv_x, recv_x_u8) = if format.is_fp8() {
            let s = alloc_uninit::<float8::F8E4M3>(stream, rows * h)?;
            let a = alias_at::<_, u8>(stream, &s, 0, rows * h);
            (wrap(s, (l, r * m, h), dev), a)
        } else {
            let s = alloc_uninit::<half::bf16>(stream, rows * h)?;
            let a = alias_at::<_, u8>(stream, &s, 0, rows * h * 2);
            (wrap(s, (l, r * m, h), dev), a)
        };
        let at = I32Block::new(l, r, m);
        let block = alloc_uninit::<i32>(stream, at.len)?;
        let (recv_x_scales, scales_alias) = if format.is_fp8() {
            let s = alloc_uninit::<f32>(stream, rows * groups)?;
            let a = alias_at::<_, f32>(stream, &s, 0, rows * groups);
            (Some(wrap(s, (l, r * m, groups), dev)), a)
        } else {
            // Never touched by a bf16 dispatch (the kernel writes scales for fp8 only).
            (None, alias_at::<_, f32>(stream, &block, 0, 1))
        };
        let recv = LowLatencyRecv {
            format,
            recv_x: recv_x_u8,
            recv_x_scales: scales_alias,
            recv_count: alias_at(stream, &block, at.count, l),
            recv_src_info: alias_at(stream, &block, at.src_info, rows),
            recv_src_topk: alias_at(stream, &block, at.src_topk, rows),
            recv_layout_range: alias_at(stream, &block, at.range, l * r * 2),
        };
        let block = wrap(block, at.len, dev);
        let src_info = block.narrow(0, at.src_info, rows)?.reshape((l, r * m))?;
        let recv_count = block.narrow(0, at.count, l)?;
        let mut owners = vec![recv_x.clone(), block];
        owners.extend(recv_x_scales.iter().cloned());
        Ok(Self {
            recv_x,
            recv_x_scales,
            recv_count,
            src_info,
            data: Box::new(CudaLlDispatchData {
                recv: ManuallyDrop::new(recv),
                _owners: owners,
            }),
        })
    }
}

/// `len` elements of `U` at element `offset` of `s`, as a slice that must never be freed
/// (`CudaLlDispatchData` leaks it; the owner of `s` is kept alive alongside it).
fn alias_at<T, U>(
    stream: &Arc<CudaStream>,
    s: &CudaSlice<T>,
    offset: usize,
    len: usize,
) -> CudaSlice<U> {
    use cudarc::driver::DevicePtr;
    let size = std::mem::size_of::<T>();
    assert!(
        offset * size + len * std::mem::size_of::<U>() <= s.len() * size,
        "alias of {len} elements at {offset} out of bounds of {} elements",
        s.len()
    );
    let view = s.slice(offset..);
    let (ptr, _g) = view.device_ptr(stream);
    // SAFETY: `ptr .. ptr + len * size_of::<U>()` lies inside the live allocation of `s`
    // (asserted above); the alias is never freed and the owner outlives it (see above).
    unsafe { stream.upgrade_device_ptr::<U>(ptr, len) }
}

#[cfg(test)]
mod tests {
    use super::I32Block;

    #[test]
    fn i32_block_parts_are_aligned_and_disjoint() {
        for (l, r, m) in [(1, 1, 1), (256, 1, 128), (3, 2, 5), (32, 8, 7)] {
            let b = I32Block::new(l, r, m);
            let rows = l * r * m;
            let parts = [
                (b.src_info, rows),
                (b.count, l),
                (b.src_topk, rows),
                (b.range, 2 * l * r),
            ];
            for (i, &(off, len)) in parts.iter().enumerate() {
                assert_eq!(off % 4, 0, "part {i} of {l}x{r}x{m} not 16-byte aligned");
                let end = parts.get(i + 1).map_or(b.len, |p| p.0);
                assert!(
                    off + len <= end,
                    "part {i} of {l}x{r}x{m} overlaps the next"
                );
            }
            assert_eq!(b.len, b.range + 2 * l * r);
        }
    }
}
