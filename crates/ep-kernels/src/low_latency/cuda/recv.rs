//! What the low-latency launchers read and write besides the buffer: the wire format of a
//! dispatch, the phases of a launch, and the receive-side outputs, owned
//! ([`LowLatencyRecv`]) or lent to one launch as views ([`LowLatencyRecvMut`],
//! [`LowLatencyRecvRef`]).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut, SyncOnDrop};
use float8::F8E4M3;
use half::bf16;

use super::layout::{LowLatencyLayout, LL_RECORD_WORDS};
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

/// The outputs of a low-latency dispatch on one rank, and the handle its combine needs.
///
/// Rows of expert `l` from source `s` are packed at
/// `recv_layout_range[l, s, 0] .. + recv_layout_range[l, s, 1]`. The receive phase writes every
/// element of `recv_count`, `recv_layout_range` and `recv_src_info` (`-1` past
/// `recv_count[l]`), so they need no initialisation; rows of `recv_x`, `recv_x_scales` and
/// `recv_src_topk` past `recv_count[l]` are not written.
#[derive(Debug)]
pub struct LowLatencyRecv {
    /// The payload format these buffers are sized for.
    pub format: LowLatencyFormat,
    /// `[L, R*M, H]` fp8 bytes or bf16 (see [`Self::recv_x_bf16`], [`Self::recv_x_fp8`]).
    pub recv_x: CudaSlice<u8>,
    /// `[L, R*M, H / 128]` f32 scales (fp8 only; with [`LowLatencyFormat::Bf16`] never
    /// touched, and any length is accepted).
    pub recv_x_scales: CudaSlice<f32>,
    /// `[L]` tokens received per local expert.
    pub recv_count: CudaSlice<i32>,
    /// `[L, R*M]` the source token index of each packed row, `-1` past `recv_count[l]`.
    pub recv_src_info: CudaSlice<i32>,
    /// `[L, R*M]` the top-k position `k` of each packed row at its source.
    pub recv_src_topk: CudaSlice<i32>,
    /// `[L, R, 2]` `(offset, count)` of each source's rows per local expert.
    pub recv_layout_range: CudaSlice<i32>,
    /// The per-rank combine's records ([`RankRecords`]), written by dispatches that carry the
    /// top-k weights.
    pub ranks: RankRecords,
}

/// What a dispatch that carries the top-k weights leaves for a per-rank combine
/// ([`super::Reduction::PerRank`]) on a rank of a multi-rank buffer: per (source rank `s`,
/// source token `t`) a record of `LL_RECORD_WORDS` i32 words, `[R, M, LL_RECORD_WORDS]`: word 0
/// the row `j` of the token at its home (its rank's place among the token's distinct ranks;
/// `-1` when `s` sent no selection of `t` here, or `s` was inactive), word 1 the mask of the
/// token's `k` whose expert is here; from word 4 the packed row of `recv_x` of each `k` in the
/// mask, from word `4 + LL_MAX_TOPK` the token's weights (f32 bits). The receive phase writes
/// words 0-1 of every record, the rows of the mask's `k` and the weights of `k < num_topk`
/// (the combine reads no others). At one rank nothing is written: a per-rank combine there runs
/// per expert (the same bits).
#[derive(Debug)]
pub struct RankRecords {
    /// `[R, M, LL_RECORD_WORDS]`.
    pub rank_records: CudaSlice<i32>,
}

impl RankRecords {
    /// Allocates the records for `layout` on `stream` (zeroed).
    pub fn alloc(stream: &Arc<CudaStream>, layout: &LowLatencyLayout) -> Result<Self> {
        Ok(Self {
            rank_records: stream.alloc_zeros(Self::len(layout))?,
        })
    }

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
    /// Allocates the outputs for `layout` and `format` on `stream` (zeroed).
    pub fn alloc(
        stream: &Arc<CudaStream>,
        layout: &LowLatencyLayout,
        format: LowLatencyFormat,
    ) -> Result<Self> {
        let (l, rows) = (layout.num_local_experts(), layout.recv_rows_per_expert());
        let h = layout.hidden;
        Ok(Self {
            format,
            recv_x: stream.alloc_zeros(l * rows * h * format.bytes_per_channel())?,
            recv_x_scales: stream.alloc_zeros(l * rows * (h / FP8_GROUP))?,
            recv_count: stream.alloc_zeros(l)?,
            recv_src_info: stream.alloc_zeros(l * rows)?,
            recv_src_topk: stream.alloc_zeros(l * rows)?,
            recv_layout_range: stream.alloc_zeros(l * layout.num_ranks * 2)?,
            ranks: RankRecords::alloc(stream, layout)?,
        })
    }

    /// `recv_x` as bf16 (format [`LowLatencyFormat::Bf16`]).
    pub fn recv_x_bf16(&self) -> Result<CudaView<'_, bf16>> {
        if self.format != LowLatencyFormat::Bf16 {
            return Err(Error::invalid(
                "format",
                format!("{:?}", self.format),
                "must be Bf16",
            ));
        }
        // SAFETY: the bytes were allocated (2 per channel) for bf16 rows; every bit pattern is
        // a valid bf16; the length is the byte length / 2 and the allocation is 256-aligned.
        unsafe { self.recv_x.transmute::<bf16>(self.recv_x.len() / 2) }
            .ok_or_else(|| Error::invalid("recv_x", self.recv_x.len(), "too short for bf16"))
    }

    /// `recv_x` as fp8 e4m3 (formats [`LowLatencyFormat::Fp8`], `Fp8Ue8m0`).
    pub fn recv_x_fp8(&self) -> Result<CudaView<'_, F8E4M3>> {
        if !self.format.is_fp8() {
            return Err(Error::invalid(
                "format",
                format!("{:?}", self.format),
                "must be fp8",
            ));
        }
        // SAFETY: one byte per channel; every bit pattern is a valid F8E4M3.
        unsafe { self.recv_x.transmute::<F8E4M3>(self.recv_x.len()) }
            .ok_or_else(|| Error::invalid("recv_x", self.recv_x.len(), "too short for fp8"))
    }
}

/// The `recv_x` a dispatch writes, borrowed: raw bytes (as [`LowLatencyRecv`] holds them) or
/// typed rows (as a candle tensor of the runtime holds them).
#[derive(Debug)]
pub enum RecvXMut<'a> {
    /// fp8 bytes or bf16 byte pairs, as the format says.
    Bytes(CudaViewMut<'a, u8>),
    /// bf16 rows (format [`LowLatencyFormat::Bf16`]).
    Bf16(CudaViewMut<'a, bf16>),
    /// fp8 e4m3 rows (formats [`LowLatencyFormat::Fp8`], `Fp8Ue8m0`).
    Fp8(CudaViewMut<'a, F8E4M3>),
}

impl RecvXMut<'_> {
    /// The size in bytes.
    fn bytes(&self) -> usize {
        match self {
            Self::Bytes(v) => v.len(),
            Self::Bf16(v) => v.len() * 2,
            Self::Fp8(v) => v.len(),
        }
    }

    /// What the view holds, in words.
    fn kind(&self) -> &'static str {
        match self {
            Self::Bytes(_) => "byte",
            Self::Bf16(_) => "bf16",
            Self::Fp8(_) => "fp8",
        }
    }

    /// Whether typed rows match `format` (raw bytes match any).
    fn matches(&self, format: LowLatencyFormat) -> bool {
        match self {
            Self::Bytes(_) => true,
            Self::Bf16(_) => format == LowLatencyFormat::Bf16,
            Self::Fp8(_) => format.is_fp8(),
        }
    }

    pub(super) fn device_ptr_mut<'s>(
        &'s mut self,
        stream: &'s CudaStream,
    ) -> (CUdeviceptr, SyncOnDrop<'s>) {
        match self {
            Self::Bytes(v) => v.device_ptr_mut(stream),
            Self::Bf16(v) => v.device_ptr_mut(stream),
            Self::Fp8(v) => v.device_ptr_mut(stream),
        }
    }
}

/// The outputs of a low-latency dispatch, borrowed for [`dispatch_cuda`] (contents as in
/// [`LowLatencyRecv`]): views of memory owned elsewhere, e.g. by [`LowLatencyRecv`] (see its
/// `From` impl) or by the caller's tensors.
#[derive(Debug)]
pub struct LowLatencyRecvMut<'a> {
    /// The payload format the views are sized for.
    pub format: LowLatencyFormat,
    /// `[L, R*M, H]` received rows.
    pub recv_x: RecvXMut<'a>,
    /// `[L, R*M, H / 128]` f32 scales; required for fp8, unused (and may be `None`) for bf16.
    pub recv_x_scales: Option<CudaViewMut<'a, f32>>,
    /// `[L]` tokens received per local expert.
    pub recv_count: CudaViewMut<'a, i32>,
    /// `[L, R*M]` the source token index of each packed row, `-1` past `recv_count[l]`.
    pub recv_src_info: CudaViewMut<'a, i32>,
    /// `[L, R*M]` the top-k position `k` of each packed row at its source.
    pub recv_src_topk: CudaViewMut<'a, i32>,
    /// `[L, R, 2]` `(offset, count)` of each source's rows per local expert.
    pub recv_layout_range: CudaViewMut<'a, i32>,
    /// The per-rank combine's records; required when the dispatch carries the top-k weights.
    pub ranks: Option<RankRecordsMut<'a>>,
}

impl<'a> From<&'a mut LowLatencyRecv> for LowLatencyRecvMut<'a> {
    fn from(r: &'a mut LowLatencyRecv) -> Self {
        Self {
            format: r.format,
            recv_x: RecvXMut::Bytes(r.recv_x.as_view_mut()),
            recv_x_scales: Some(r.recv_x_scales.as_view_mut()),
            recv_count: r.recv_count.as_view_mut(),
            recv_src_info: r.recv_src_info.as_view_mut(),
            recv_src_topk: r.recv_src_topk.as_view_mut(),
            recv_layout_range: r.recv_layout_range.as_view_mut(),
            ranks: Some((&mut r.ranks).into()),
        }
    }
}

impl LowLatencyRecvMut<'_> {
    pub(super) fn check(&self, layout: &LowLatencyLayout) -> Result<()> {
        let (l, rows) = (layout.num_local_experts(), layout.recv_rows_per_expert());
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
            l * rows * h * self.format.bytes_per_channel(),
            self.recv_x.bytes(),
        )?;
        if self.format.is_fp8() {
            let got = self.recv_x_scales.as_ref().map_or(0, |s| s.len());
            Error::check_len("recv_x_scales", l * rows * (h / FP8_GROUP), got)?;
        }
        Error::check_len("recv_count", l, self.recv_count.len())?;
        LowLatencyRecvRef {
            recv_src_info: self.recv_src_info.as_view(),
            recv_src_topk: self.recv_src_topk.as_view(),
            recv_layout_range: self.recv_layout_range.as_view(),
            ranks: self.ranks.as_ref().map(|t| RankRecordsRef {
                rank_records: t.rank_records.as_view(),
            }),
        }
        .check(layout)
    }
}

/// What [`combine_cuda`] reads of its dispatch's outputs, borrowed (contents as in
/// [`LowLatencyRecv`]).
#[derive(Debug)]
pub struct LowLatencyRecvRef<'a> {
    /// `[L, R*M]` the source token index of each packed row.
    pub recv_src_info: CudaView<'a, i32>,
    /// `[L, R*M]` the top-k position `k` of each packed row at its source.
    pub recv_src_topk: CudaView<'a, i32>,
    /// `[L, R, 2]` `(offset, count)` of each source's rows per local expert.
    pub recv_layout_range: CudaView<'a, i32>,
    /// The per-rank combine's records; required by a per-rank combine on more than one rank
    /// (at one rank it runs per expert).
    pub ranks: Option<RankRecordsRef<'a>>,
}

impl<'a> From<&'a LowLatencyRecv> for LowLatencyRecvRef<'a> {
    fn from(r: &'a LowLatencyRecv) -> Self {
        Self {
            recv_src_info: r.recv_src_info.as_view(),
            recv_src_topk: r.recv_src_topk.as_view(),
            recv_layout_range: r.recv_layout_range.as_view(),
            ranks: Some((&r.ranks).into()),
        }
    }
}

impl LowLatencyRecvRef<'_> {
    pub(super) fn check(&self, layout: &LowLatencyLayout) -> Result<()> {
        let (l, rows) = (layout.num_local_experts(), layout.recv_rows_per_expert());
        Error::check_len("recv_src_info", l * rows, self.recv_src_info.len())?;
        Error::check_len("recv_src_topk", l * rows, self.recv_src_topk.len())?;
        Error::check_len(
            "recv_layout_range",
            l * layout.num_ranks * 2,
            self.recv_layout_range.len(),
        )?;
        match &self.ranks {
            Some(t) => t.check(layout),
            None => Ok(()),
        }
    }
}
