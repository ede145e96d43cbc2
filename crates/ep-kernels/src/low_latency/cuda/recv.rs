//! What the low-latency launchers read and write besides the buffer: the wire format of a
//! dispatch, the phases of a launch, and the receive-side outputs, owned by
//! [`LowLatencyRecv`] (the one owner of a dispatch's receive buffers, for the kernels' tests
//! and benchmarks as for the runtime, which hands them to tensors through
//! [`LowLatencyRecv::into_parts`]) and lent to one launch as views ([`LowLatencyRecvMut`],
//! [`LowLatencyRecvRef`]).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut, SyncOnDrop};
use float8::F8E4M3;
use half::bf16;

use super::layout::{LowLatencyLayout, RecvI32Block, LL_RECORD_WORDS};
use crate::cuda::alloc_uninit;
use crate::error::{Error, Result};
use crate::fp8::ScaleFormat;
use crate::FP8_GROUP;

/// What a dispatch sends per hidden channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LowLatencyFormat {
    /// bf16 as given: `recv_x` holds bf16.
    Bf16,
    /// fp8 e4m3 with one f32 scale per 128 channels, cast on the fly exactly as
    /// [`crate::fp8::quantize`]: `recv_x` holds fp8 and `recv_x_scales` the scales.
    #[default]
    Fp8,
    /// As [`LowLatencyFormat::Fp8`] with UE8M0 (power-of-two) scales.
    Fp8Ue8m0,
}

impl LowLatencyFormat {
    /// Bytes per hidden channel in `recv_x`.
    pub fn bytes_per_channel(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::Fp8 | Self::Fp8Ue8m0 => 1,
        }
    }

    /// Whether the payload is fp8.
    pub fn is_fp8(self) -> bool {
        !matches!(self, Self::Bf16)
    }

    /// The fp8 scale format (`Float` for bf16, where it is unused).
    pub fn scale_format(self) -> ScaleFormat {
        match self {
            Self::Fp8Ue8m0 => ScaleFormat::Ue8m0,
            _ => ScaleFormat::Float,
        }
    }
}

/// Which phases a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u32)]
pub enum Phases {
    /// Only send (returns at once once the data is on its way); a later `Recv` launch of the
    /// same kind completes the op.
    Send = 1,
    /// Only receive: completes the oldest pending `Send` of the same kind.
    Recv = 2,
    /// Send and receive in one launch.
    #[default]
    Both = 3,
}

/// `recv_x` of a dispatch, in the dtype its format says.
#[derive(Debug)]
pub enum RecvRows {
    /// bf16 rows (format [`LowLatencyFormat::Bf16`]).
    Bf16(CudaSlice<bf16>),
    /// fp8 e4m3 rows (formats [`LowLatencyFormat::Fp8`], `Fp8Ue8m0`).
    Fp8(CudaSlice<F8E4M3>),
}

/// The outputs of a low-latency dispatch on one rank, and the handle its combine needs: the
/// one owner of their memory, lending views to each launch (`From` impls of
/// [`LowLatencyRecvMut`] and [`LowLatencyRecvRef`]) until [`Self::into_parts`] hands the
/// allocations on.
///
/// Rows of expert `l` from source `s` are packed at
/// `recv_layout_range[l, s, 0] .. + recv_layout_range[l, s, 1]`. Allocated without
/// initialisation: the receive phase writes every element of `recv_count`,
/// `recv_layout_range` and `recv_src_info` (`-1` past `recv_count[l]`); rows of `recv_x`,
/// `recv_x_scales` and `recv_src_topk` past `recv_count[l]` are not written and hold whatever
/// the memory held. Three allocations (two for bf16): `recv_x`, its scales (fp8 only), and one
/// block of the `i32` outputs laid out as [`RecvI32Block`] says; and one more for the per-rank
/// combine's records when asked for.
#[derive(Debug)]
pub struct LowLatencyRecv {
    format: LowLatencyFormat,
    layout: LowLatencyLayout,
    /// `[L, R*M, H]`.
    recv_x: RecvRows,
    /// `[L, R*M, H / 128]` (fp8 only).
    recv_x_scales: Option<CudaSlice<f32>>,
    /// The `i32` outputs ([`RecvI32Block`]).
    block: CudaSlice<i32>,
    /// The per-rank combine's records, when allocated.
    ranks: Option<RankRecords>,
}

/// The allocations of a [`LowLatencyRecv`], handed on whole by [`LowLatencyRecv::into_parts`]
/// (contents as there).
#[derive(Debug)]
pub struct LowLatencyRecvParts {
    /// The payload format.
    pub format: LowLatencyFormat,
    /// The layout the buffers are sized for (`L`, `R*M`, `H`).
    pub layout: LowLatencyLayout,
    /// `[L, R*M, H]`.
    pub recv_x: RecvRows,
    /// `[L, R*M, H / 128]` (fp8 only).
    pub recv_x_scales: Option<CudaSlice<f32>>,
    /// The `i32` outputs, laid out as `RecvI32Block::new(&layout)` says.
    pub block: CudaSlice<i32>,
    /// The per-rank combine's records, when allocated.
    pub ranks: Option<RankRecords>,
}

/// What a dispatch that carries the top-k weights leaves for a per-rank combine
/// ([`super::Reduction::PerRank`]) on a rank of a multi-rank buffer: per (source rank `s`,
/// source token `t`) a record of `LL_RECORD_WORDS` i32 words, `[R, M, LL_RECORD_WORDS]`: word 0
/// the row `j` of the token at its home (its rank's place among the token's distinct ranks;
/// `-1` when `s` sent no selection of `t` here, or `s` was inactive), word 1 the mask of the
/// token's `k` whose expert is here; from word 4 the packed row of `recv_x` of each `k` in the
/// mask, from word `4 + LL_MAX_TOPK` the token's weights (f32 bits). The receive phase writes
/// words 0-1 of every record, the rows of the mask's `k` and the weights of `k < num_topk`
/// (the combine reads no others; the rest is unspecified). At one rank nothing is written: a
/// per-rank combine there runs per expert (the same bits).
#[derive(Debug)]
pub struct RankRecords {
    /// `[R, M, LL_RECORD_WORDS]`.
    pub rank_records: CudaSlice<i32>,
}

impl RankRecords {
    /// The words of the records of `layout`.
    pub fn len(layout: &LowLatencyLayout) -> usize {
        layout.num_ranks * layout.max_tokens_per_rank * LL_RECORD_WORDS
    }
}

/// [`RankRecords`] lent to a dispatch's receive phase.
#[derive(Debug)]
pub struct RankRecordsMut<'a> {
    /// `[R, M, LL_RECORD_WORDS]`.
    pub rank_records: CudaViewMut<'a, i32>,
}

/// [`RankRecords`] lent to a per-rank combine.
#[derive(Debug)]
pub struct RankRecordsRef<'a> {
    /// `[R, M, LL_RECORD_WORDS]`.
    pub rank_records: CudaView<'a, i32>,
}

impl<'a> From<&'a mut RankRecords> for RankRecordsMut<'a> {
    fn from(t: &'a mut RankRecords) -> Self {
        Self {
            rank_records: t.rank_records.as_view_mut(),
        }
    }
}

impl<'a> From<&'a RankRecords> for RankRecordsRef<'a> {
    fn from(t: &'a RankRecords) -> Self {
        Self {
            rank_records: t.rank_records.as_view(),
        }
    }
}

impl RankRecordsRef<'_> {
    pub(super) fn check(&self, layout: &LowLatencyLayout) -> Result<()> {
        Error::check_len(
            "rank_records",
            RankRecords::len(layout),
            self.rank_records.len(),
        )
    }
}

impl LowLatencyRecv {
    /// Allocates the outputs of a dispatch laid out as `layout` in `format` on `stream`
    /// (uninitialised; see the type), with the per-rank combine's records when `rank_records`
    /// (required by dispatches that carry the top-k weights). Frees are ordered on `stream`.
    pub fn alloc(
        stream: &Arc<CudaStream>,
        layout: &LowLatencyLayout,
        format: LowLatencyFormat,
        rank_records: bool,
    ) -> Result<Self> {
        let rows = layout.num_local_experts() * layout.recv_rows_per_expert();
        let h = layout.hidden;
        let (recv_x, recv_x_scales) = if format.is_fp8() {
            (
                RecvRows::Fp8(alloc_uninit(stream, rows * h)?),
                Some(alloc_uninit(stream, rows * (h / FP8_GROUP))?),
            )
        } else {
            (RecvRows::Bf16(alloc_uninit(stream, rows * h)?), None)
        };
        let block = alloc_uninit(stream, RecvI32Block::new(layout).total_len())?;
        let ranks = if rank_records {
            Some(RankRecords {
                rank_records: alloc_uninit(stream, RankRecords::len(layout))?,
            })
        } else {
            None
        };
        Ok(Self {
            format,
            layout: *layout,
            recv_x,
            recv_x_scales,
            block,
            ranks,
        })
    }

    /// The payload format the buffers are sized for.
    pub fn format(&self) -> LowLatencyFormat {
        self.format
    }

    /// The layout the buffers are sized for.
    pub fn layout(&self) -> &LowLatencyLayout {
        &self.layout
    }

    /// `recv_x` as bf16 (format [`LowLatencyFormat::Bf16`]).
    pub fn recv_x_bf16(&self) -> Result<CudaView<'_, bf16>> {
        match &self.recv_x {
            RecvRows::Bf16(s) => Ok(s.as_view()),
            RecvRows::Fp8(_) => Err(Error::invalid(
                "format",
                format!("{:?}", self.format),
                "must be Bf16",
            )),
        }
    }

    /// `recv_x` as fp8 e4m3 (formats [`LowLatencyFormat::Fp8`], `Fp8Ue8m0`).
    pub fn recv_x_fp8(&self) -> Result<CudaView<'_, F8E4M3>> {
        match &self.recv_x {
            RecvRows::Fp8(s) => Ok(s.as_view()),
            RecvRows::Bf16(_) => Err(Error::invalid(
                "format",
                format!("{:?}", self.format),
                "must be fp8",
            )),
        }
    }

    /// `recv_x` as its bytes (fp8 bytes, or bf16 byte pairs), whatever the format.
    pub fn recv_x_bytes(&self) -> CudaView<'_, u8> {
        let view = match &self.recv_x {
            // SAFETY: a byte view of the whole allocation of `2 * len` bytes; every byte is a
            // valid u8.
            RecvRows::Bf16(s) => unsafe { s.transmute::<u8>(2 * s.len()) },
            // SAFETY: as above, one byte per element.
            RecvRows::Fp8(s) => unsafe { s.transmute::<u8>(s.len()) },
        };
        view.expect("a byte view of the whole allocation fits it")
    }

    /// `[L, R*M, H / 128]` f32 scales (fp8 only).
    pub fn recv_x_scales(&self) -> Option<CudaView<'_, f32>> {
        self.recv_x_scales.as_ref().map(CudaSlice::as_view)
    }

    fn part(&self, range: Range<usize>) -> CudaView<'_, i32> {
        self.block.slice(range)
    }

    /// `[L]` tokens received per local expert.
    pub fn recv_count(&self) -> CudaView<'_, i32> {
        self.part(RecvI32Block::new(&self.layout).count())
    }

    /// `[L, R*M]` the source token index of each packed row, `-1` past `recv_count[l]`.
    pub fn recv_src_info(&self) -> CudaView<'_, i32> {
        self.part(RecvI32Block::new(&self.layout).src_info())
    }

    /// `[L, R*M]` the top-k position `k` of each packed row at its source.
    pub fn recv_src_topk(&self) -> CudaView<'_, i32> {
        self.part(RecvI32Block::new(&self.layout).src_topk())
    }

    /// `[L, R, 2]` `(offset, count)` of each source's rows per local expert.
    pub fn recv_layout_range(&self) -> CudaView<'_, i32> {
        self.part(RecvI32Block::new(&self.layout).layout_range())
    }

    /// The per-rank combine's records, when allocated.
    pub fn rank_records(&self) -> Option<&RankRecords> {
        self.ranks.as_ref()
    }

    /// Hands the allocations on (e.g. to tensors, once the receive phase is on the stream).
    pub fn into_parts(self) -> LowLatencyRecvParts {
        LowLatencyRecvParts {
            format: self.format,
            layout: self.layout,
            recv_x: self.recv_x,
            recv_x_scales: self.recv_x_scales,
            block: self.block,
            ranks: self.ranks,
        }
    }
}

/// The `recv_x` a dispatch writes, borrowed, in the dtype of its format.
#[derive(Debug)]
pub enum RecvXMut<'a> {
    /// bf16 rows (format [`LowLatencyFormat::Bf16`]).
    Bf16(CudaViewMut<'a, bf16>),
    /// fp8 e4m3 rows (formats [`LowLatencyFormat::Fp8`], `Fp8Ue8m0`).
    Fp8(CudaViewMut<'a, F8E4M3>),
}

impl RecvXMut<'_> {
    /// The size in bytes.
    fn bytes(&self) -> usize {
        match self {
            Self::Bf16(v) => v.len() * 2,
            Self::Fp8(v) => v.len(),
        }
    }

    /// Whether the rows match `format`.
    fn matches(&self, format: LowLatencyFormat) -> bool {
        match self {
            Self::Bf16(_) => format == LowLatencyFormat::Bf16,
            Self::Fp8(_) => format.is_fp8(),
        }
    }

    /// What the view holds, in words.
    fn kind(&self) -> &'static str {
        match self {
            Self::Bf16(_) => "bf16",
            Self::Fp8(_) => "fp8",
        }
    }

    pub(super) fn device_ptr_mut<'s>(
        &'s mut self,
        stream: &'s CudaStream,
    ) -> (CUdeviceptr, SyncOnDrop<'s>) {
        match self {
            Self::Bf16(v) => v.device_ptr_mut(stream),
            Self::Fp8(v) => v.device_ptr_mut(stream),
        }
    }
}

/// The address of the part `range` of an `i32` block at `base` (see [`RecvI32Block`]).
pub(super) fn block_part(base: CUdeviceptr, range: Range<usize>) -> CUdeviceptr {
    base + (range.start * std::mem::size_of::<i32>()) as CUdeviceptr
}

/// The outputs of a low-latency dispatch, borrowed for [`dispatch_cuda`](super::dispatch_cuda)
/// (contents as in [`LowLatencyRecv`], which lends them through its `From` impl).
#[derive(Debug)]
pub struct LowLatencyRecvMut<'a> {
    /// The payload format the views are sized for.
    pub format: LowLatencyFormat,
    /// `[L, R*M, H]` received rows.
    pub recv_x: RecvXMut<'a>,
    /// `[L, R*M, H / 128]` f32 scales; required for fp8, unused (and may be `None`) for bf16.
    pub recv_x_scales: Option<CudaViewMut<'a, f32>>,
    /// The `i32` outputs (`recv_count`, `recv_src_info`, `recv_src_topk`,
    /// `recv_layout_range`), laid out as [`RecvI32Block`] says for the buffer's layout.
    pub block: CudaViewMut<'a, i32>,
    /// The per-rank combine's records; required when the dispatch carries the top-k weights.
    pub ranks: Option<RankRecordsMut<'a>>,
}

impl<'a> From<&'a mut LowLatencyRecv> for LowLatencyRecvMut<'a> {
    fn from(r: &'a mut LowLatencyRecv) -> Self {
        Self {
            format: r.format,
            recv_x: match &mut r.recv_x {
                RecvRows::Bf16(s) => RecvXMut::Bf16(s.as_view_mut()),
                RecvRows::Fp8(s) => RecvXMut::Fp8(s.as_view_mut()),
            },
            recv_x_scales: r.recv_x_scales.as_mut().map(CudaSlice::as_view_mut),
            block: r.block.as_view_mut(),
            ranks: r.ranks.as_mut().map(RankRecordsMut::from),
        }
    }
}

impl LowLatencyRecvMut<'_> {
    pub(super) fn check(&self, layout: &LowLatencyLayout) -> Result<()> {
        let rows = layout.num_local_experts() * layout.recv_rows_per_expert();
        let h = layout.hidden;
        if !self.recv_x.matches(self.format) {
            return Err(Error::invalid(
                "recv_x",
                format!("{} rows", self.recv_x.kind()),
                format!("must hold {:?} rows", self.format),
            ));
        }
        Error::check_len(
            "recv_x",
            rows * h * self.format.bytes_per_channel(),
            self.recv_x.bytes(),
        )?;
        if self.format.is_fp8() {
            let got = self.recv_x_scales.as_ref().map_or(0, |s| s.len());
            Error::check_len("recv_x_scales", rows * (h / FP8_GROUP), got)?;
        }
        LowLatencyRecvRef {
            block: self.block.as_view(),
            ranks: self.ranks.as_ref().map(|t| RankRecordsRef {
                rank_records: t.rank_records.as_view(),
            }),
        }
        .check(layout)
    }
}

/// What [`combine_cuda`](super::combine_cuda) reads of its dispatch's outputs, borrowed
/// (contents as in [`LowLatencyRecv`], which lends them through its `From` impl; the runtime
/// takes them from the tensors that own them).
#[derive(Debug)]
pub struct LowLatencyRecvRef<'a> {
    /// The `i32` outputs, laid out as [`RecvI32Block`] says for the buffer's layout (the
    /// combine reads `recv_src_info`, `recv_src_topk` and `recv_layout_range`).
    pub block: CudaView<'a, i32>,
    /// The per-rank combine's records; required by a per-rank combine on more than one rank
    /// (at one rank it runs per expert).
    pub ranks: Option<RankRecordsRef<'a>>,
}

impl<'a> From<&'a LowLatencyRecv> for LowLatencyRecvRef<'a> {
    fn from(r: &'a LowLatencyRecv) -> Self {
        Self {
            block: r.block.as_view(),
            ranks: r.ranks.as_ref().map(RankRecordsRef::from),
        }
    }
}

impl LowLatencyRecvRef<'_> {
    pub(super) fn check(&self, layout: &LowLatencyLayout) -> Result<()> {
        Error::check_len(
            "block",
            RecvI32Block::new(layout).total_len(),
            self.block.len(),
        )?;
        match &self.ranks {
            Some(t) => t.check(layout),
            None => Ok(()),
        }
    }
}
