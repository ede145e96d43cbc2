//! The receive buffers of a low-latency dispatch on CUDA tensors: allocated unzeroed (the
//! receive kernel writes every element that is read), owned by [`RecvSlices`] while the
//! kernels write them (they get mutable views), then handed to the output tensors; the
//! combine reads the handle's part through views taken from the owning tensor at its launch.
//! Each allocation has one owner at every moment and nothing is leaked.

use super::tensor::{alloc_uninit, wrap, DeviceTensor};
use crate::error::Result;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Tensor;
use cudarc::driver::CudaView;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ep_kernels::low_latency::{
    self as kll, LowLatencyBuffer, LowLatencyFormat, LowLatencyRecvMut, LowLatencyRecvRef, Phases,
    RankRecordsMut, RankRecordsRef, RecvXMut, LL_RECORD_WORDS,
};
use ep_kernels::FP8_GROUP;
use float8::F8E4M3;
use half::bf16;
use std::sync::Arc;

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
    /// `L`, `R * M` (rows per local expert), `R`.
    l: usize,
    rows_per_expert: usize,
    r: usize,
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
            l,
            rows_per_expert: r * m,
            r,
        }
    }

    /// Rows of all local experts.
    fn rows(&self) -> usize {
        self.l * self.rows_per_expert
    }
}

/// `recv_x` of a pending dispatch, in the dtype of the tensor it becomes.
#[derive(Debug)]
enum RecvRows {
    Bf16(CudaSlice<bf16>),
    Fp8(CudaSlice<F8E4M3>),
}

/// The receive buffers of one low-latency dispatch from its allocation until its receive phase
/// is on the stream: the owner of their memory, lending mutable views to each launch.
#[derive(Debug)]
pub(crate) struct RecvSlices {
    format: LowLatencyFormat,
    hidden: usize,
    /// `[L, R*M, H]`.
    recv_x: RecvRows,
    /// `[L, R*M, H / 128]` (fp8 only).
    scales: Option<CudaSlice<f32>>,
    /// The `i32` outputs, laid out as `at` says.
    block: CudaSlice<i32>,
    at: I32Block,
    /// The per-rank combine's records `[R, M, LL_RECORD_WORDS]` (dispatches that carry the
    /// top-k weights; see [`kll::RankRecords`]), unzeroed: the receive phase writes every word
    /// the combine reads.
    ranks: Option<CudaSlice<i32>>,
}

impl RecvSlices {
    /// Allocates the outputs of a dispatch into `L` local experts of `R * M` rows of `h`
    /// channels on `stream`, with no memset or fill: rows past the counts are never read
    /// (documented as unspecified), and the receive phase writes `recv_count`, the ranges and
    /// every `src_info` entry (`-1` past the counts). Three allocations (two for bf16), and one
    /// for the per-rank combine's records with `ranks`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn alloc(
        stream: &Arc<CudaStream>,
        format: LowLatencyFormat,
        l: usize,
        r: usize,
        m: usize,
        h: usize,
        ranks: bool,
    ) -> Result<Self> {
        let at = I32Block::new(l, r, m);
        let rows = at.rows();
        let (recv_x, scales) = if format.is_fp8() {
            (
                RecvRows::Fp8(alloc_uninit(stream, rows * h)?),
                Some(alloc_uninit(stream, rows * (h / FP8_GROUP))?),
            )
        } else {
            (RecvRows::Bf16(alloc_uninit(stream, rows * h)?), None)
        };
        Ok(Self {
            format,
            hidden: h,
            recv_x,
            scales,
            block: alloc_uninit(stream, at.len)?,
            at,
            ranks: if ranks {
                Some(alloc_uninit(stream, r * m * LL_RECORD_WORDS)?)
            } else {
                None
            },
        })
    }

    /// Launches `phases` of the dispatch kernel of `x: [t, H]` bf16 routed by
    /// `topk_idx: [t, k]` i64 into these buffers, carrying `topk_weights` (`[t, k]` f32; exactly
    /// when these were allocated with the rank records).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch(
        &mut self,
        stream: &CudaStream,
        buffer: &LowLatencyBuffer,
        x: &impl DevicePtr<bf16>,
        topk_idx: &impl DevicePtr<i64>,
        topk_weights: Option<&CudaView<'_, f32>>,
        t: usize,
        k: usize,
        phases: Phases,
    ) -> ep_kernels::Result<()> {
        let at = self.at;
        let rows = at.rows();
        // The block's parts in address order, each cut to its length (the rest is padding).
        let (mut info, mut rest) = self.block.split_at_mut(at.count);
        let (mut count, mut rest) = rest.split_at_mut(at.src_topk - at.count);
        let (mut topk, mut range) = rest.split_at_mut(at.range - at.src_topk);
        let out = LowLatencyRecvMut {
            format: self.format,
            recv_x: match &mut self.recv_x {
                RecvRows::Bf16(s) => RecvXMut::Bf16(s.as_view_mut()),
                RecvRows::Fp8(s) => RecvXMut::Fp8(s.as_view_mut()),
            },
            recv_x_scales: self.scales.as_mut().map(|s| s.as_view_mut()),
            recv_count: count.slice_mut(0..at.l),
            recv_src_info: info.slice_mut(0..rows),
            recv_src_topk: topk.slice_mut(0..rows),
            recv_layout_range: range.slice_mut(0..2 * at.l * at.r),
            ranks: None,
        };
        let out = LowLatencyRecvMut {
            ranks: self.ranks.as_mut().map(|r| RankRecordsMut {
                rank_records: r.as_view_mut(),
            }),
            ..out
        };
        kll::dispatch_cuda(
            stream,
            buffer,
            x,
            topk_idx,
            topk_weights,
            t,
            k,
            self.format,
            phases,
            out,
        )
    }

    /// Hands the buffers to tensors of `dev` (once the receive phase is on the stream).
    pub(super) fn into_outputs(self, dev: &CudaDevice) -> Result<DispatchOutputs> {
        let at = self.at;
        let (l, rpe, h) = (at.l, at.rows_per_expert, self.hidden);
        let recv_x = match self.recv_x {
            RecvRows::Bf16(s) => wrap(s, (l, rpe, h), dev),
            RecvRows::Fp8(s) => wrap(s, (l, rpe, h), dev),
        };
        let recv_x_scales = self.scales.map(|s| wrap(s, (l, rpe, h / FP8_GROUP), dev));
        let block = wrap(self.block, at.len, dev);
        let ranks = self.ranks.map(|r| {
            let len = r.len();
            wrap(r, len, dev)
        });
        Ok(DispatchOutputs {
            recv_x,
            recv_x_scales,
            recv_count: block.narrow(0, at.count, l)?,
            src_info: block.narrow(0, at.src_info, at.rows())?.reshape((l, rpe))?,
            data: CudaLlDispatchData { block, at, ranks },
        })
    }
}

/// The outputs of one dispatch as tensors.
pub(super) struct DispatchOutputs {
    /// `[L, R*M, H]` bf16 or fp8.
    pub recv_x: Tensor,
    /// `[L, R*M, H / 128]` f32 (fp8 only).
    pub recv_x_scales: Option<Tensor>,
    /// `[L]` i32, a view of the `i32` block.
    pub recv_count: Tensor,
    /// `[L, R*M]` i32, a view of the `i32` block.
    pub src_info: Tensor,
    /// What the handle keeps for the combine.
    pub data: CudaLlDispatchData,
}

/// What a low-latency handle made by a CUDA buffer keeps for its combine: the tensor owning
/// the dispatch's `i32` block (source rows, top-k positions, ranges), and the one owning the
/// per-rank combine's records when the dispatch carried the top-k weights.
#[derive(Debug)]
pub(crate) struct CudaLlDispatchData {
    block: Tensor,
    at: I32Block,
    ranks: Option<Tensor>,
}

impl CudaLlDispatchData {
    /// Runs `f` with views of the parts the combine kernel reads, borrowed from the block's
    /// tensor for as long as `f` runs.
    pub(super) fn with_views<R>(&self, f: impl FnOnce(LowLatencyRecvRef<'_>) -> R) -> Result<R> {
        let at = self.at;
        let rows = at.rows();
        let block = DeviceTensor::new("handle", &self.block)?;
        let all = block.view::<i32>()?;
        let rank_d = self
            .ranks
            .as_ref()
            .map(|t| DeviceTensor::new("handle rank records", t))
            .transpose()?;
        let ranks = match &rank_d {
            Some(t) => Some(RankRecordsRef {
                rank_records: t.view::<i32>()?,
            }),
            None => None,
        };
        Ok(f(LowLatencyRecvRef {
            recv_src_info: all.slice(at.src_info..at.src_info + rows),
            recv_src_topk: all.slice(at.src_topk..at.src_topk + rows),
            recv_layout_range: all.slice(at.range..at.range + 2 * at.l * at.r),
            ranks,
        }))
    }

    /// Whether the dispatch carried the top-k weights (a per-rank combine can answer it).
    pub(crate) fn has_rank_records(&self) -> bool {
        self.ranks.is_some()
    }

    /// `[L, R]` i64 `offset << 32 | count` ranges from the kernel's `(offset, count)` pairs
    /// (a device-to-host read, on request only), as a tensor of `dev`.
    pub(crate) fn layout_range(&self, dev: &candle_core::Device) -> Result<Tensor> {
        let at = self.at;
        let pairs = self
            .block
            .narrow(0, at.range, 2 * at.l * at.r)?
            .to_vec1::<i32>()?;
        let packed: Vec<i64> = pairs
            .chunks_exact(2)
            .map(|p| ((p[0] as i64) << 32) | p[1] as i64)
            .collect();
        Ok(Tensor::from_vec(packed, (at.l, at.r), dev)?)
    }
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
            assert_eq!(b.rows(), rows);
        }
    }
}
