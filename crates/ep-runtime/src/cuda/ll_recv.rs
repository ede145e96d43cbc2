//! The receive buffers of a low-latency dispatch on CUDA tensors. They are owned by
//! [`kll::LowLatencyRecv`] (allocated unzeroed on candle's stream) while the kernels write
//! them, then handed whole to the output tensors ([`into_outputs`]); the combine reads the
//! handle's part through views taken from the owning tensor at its launch
//! ([`CudaLlDispatchData::with_views`]). Each allocation has one owner at every moment and
//! nothing is leaked.

use super::tensor::{wrap, DeviceTensor};
use crate::error::Result;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Tensor;
use ep_kernels::low_latency::{
    self as kll, LowLatencyRecvParts, LowLatencyRecvRef, RankRecordsRef, RecvI32Block, RecvRows,
};
use ep_kernels::FP8_GROUP;

/// Hands the buffers of `recv` to tensors of `dev` (once the receive phase is on the stream).
pub(super) fn into_outputs(recv: kll::LowLatencyRecv, dev: &CudaDevice) -> Result<DispatchOutputs> {
    let LowLatencyRecvParts {
        layout,
        recv_x,
        recv_x_scales,
        block,
        ranks,
        ..
    } = recv.into_parts();
    let at = RecvI32Block::new(&layout);
    let (l, rpe, h) = (at.num_local_experts(), at.rows_per_expert(), layout.hidden);
    let recv_x = match recv_x {
        RecvRows::Bf16(s) => wrap(s, (l, rpe, h), dev),
        RecvRows::Fp8(s) => wrap(s, (l, rpe, h), dev),
    };
    let recv_x_scales = recv_x_scales.map(|s| wrap(s, (l, rpe, h / FP8_GROUP), dev));
    let block = wrap(block, at.total_len(), dev);
    let ranks = ranks.map(|r| {
        let len = r.rank_records.len();
        wrap(r.rank_records, len, dev)
    });
    let (count, src_info) = (at.count(), at.src_info());
    Ok(DispatchOutputs {
        recv_x,
        recv_x_scales,
        recv_count: block.narrow(0, count.start, count.len())?,
        src_info: block
            .narrow(0, src_info.start, src_info.len())?
            .reshape((l, rpe))?,
        data: CudaLlDispatchData { block, at, ranks },
    })
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
    at: RecvI32Block,
    ranks: Option<Tensor>,
}

impl CudaLlDispatchData {
    /// Runs `f` with views of the parts the combine kernel reads, borrowed from the block's
    /// tensor for as long as `f` runs.
    pub(super) fn with_views<R>(&self, f: impl FnOnce(LowLatencyRecvRef<'_>) -> R) -> Result<R> {
        let block = DeviceTensor::new("handle", &self.block)?;
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
            block: block.view::<i32>()?,
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
        let range = self.at.layout_range();
        let pairs = self
            .block
            .narrow(0, range.start, range.len())?
            .to_vec1::<i32>()?;
        let packed: Vec<i64> = pairs
            .chunks_exact(2)
            .map(|p| ((p[0] as i64) << 32) | p[1] as i64)
            .collect();
        Ok(Tensor::from_vec(
            packed,
            (self.at.num_local_experts(), self.at.num_ranks()),
            dev,
        )?)
    }
}
