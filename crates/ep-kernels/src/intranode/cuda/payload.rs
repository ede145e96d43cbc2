//! What a dispatch moves (rows, scales, routing) and what a combine returns along (weights):
//! the argument types and their checks, shared by the SM-ring and copy-engine launchers.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, SyncOnDrop};

use crate::cuda::check_align;
use crate::error::{Error, Result};
use crate::FP8_GROUP;

/// The token rows of a dispatch: bf16, or fp8 e4m3 bytes with per-128-channel f32 scales.
#[derive(Debug)]
pub enum Payload<'a> {
    /// `[T, H]` bf16 rows (`H % 8 == 0`).
    Bf16(CudaView<'a, half::bf16>),
    /// `[T, H]` e4m3 rows (`H % 128 == 0`) and their `[T, H / 128]` scales.
    Fp8 {
        /// The quantised rows.
        x: CudaView<'a, float8::F8E4M3>,
        /// The scales.
        scales: CudaView<'a, f32>,
    },
}

/// Receive buffers matching a [`Payload`].
#[derive(Debug)]
pub enum RecvPayload<'a> {
    /// `[N, H]` bf16.
    Bf16(CudaViewMut<'a, half::bf16>),
    /// `[N, H]` e4m3 and `[N, H / 128]` scales.
    Fp8 {
        /// The rows.
        x: CudaViewMut<'a, float8::F8E4M3>,
        /// The scales.
        scales: CudaViewMut<'a, f32>,
    },
}

/// Routing of the tokens being dispatched: global expert ids (`-1` = none) and weights.
#[derive(Debug)]
pub struct TopK<'a> {
    /// `[T, K]` i64.
    pub idx: CudaView<'a, i64>,
    /// `[T, K]` f32.
    pub weights: CudaView<'a, f32>,
}

/// Receive buffers of the routing: local expert ids (`-1` = not on this rank) and weights (0
/// where the id is `-1`), as [`crate::intranode::localize_topk`].
#[derive(Debug)]
pub struct RecvTopK<'a> {
    /// `[N, K]` i64.
    pub idx: CudaViewMut<'a, i64>,
    /// `[N, K]` f32.
    pub weights: CudaViewMut<'a, f32>,
}

/// The device address of `v` on `stream` (0 without a view) and the view's stream guard.
pub(super) fn opt_device_ptr<'a, T, V: DevicePtr<T>>(
    v: Option<&'a V>,
    stream: &'a CudaStream,
) -> (CUdeviceptr, Option<SyncOnDrop<'a>>) {
    match v {
        Some(v) => {
            let (p, g) = v.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// Row layout of a dispatch payload, from [`dispatch_row_shape`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowShape {
    /// Hidden size `H`.
    pub(crate) hidden: usize,
    /// Bytes of one row: `H` (fp8) or `2 * H` (bf16).
    pub(crate) row_bytes: usize,
    /// f32 scales per row `S`: `H / FP8_GROUP` (fp8) or 0 (bf16).
    pub(crate) scales: usize,
}

/// Checks `hidden` suits the payload kind of `x` (a positive multiple of 8 for bf16, of
/// [`FP8_GROUP`] for fp8) and returns the row layout.
pub(crate) fn dispatch_row_shape(x: &Payload<'_>, hidden: usize) -> Result<RowShape> {
    let is_fp8 = matches!(x, Payload::Fp8 { .. });
    let granule = if is_fp8 { FP8_GROUP } else { 8 };
    if hidden == 0 || hidden % granule != 0 {
        return Err(Error::invalid(
            "hidden",
            hidden,
            format!("must be a positive multiple of {granule} for this payload"),
        ));
    }
    let (row_bytes, scales) = if is_fp8 {
        (hidden, hidden / FP8_GROUP)
    } else {
        (hidden * 2, 0)
    };
    Ok(RowShape {
        hidden,
        row_bytes,
        scales,
    })
}

/// Counts a dispatch payload is checked against by [`dispatch_payload_ptrs`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct PayloadCounts {
    /// Tokens `T` this rank sends.
    pub(crate) num_tokens: usize,
    /// Tokens `N` this rank receives.
    pub(crate) num_recv_tokens: usize,
    /// Top-k `K` (0 without routing).
    pub(crate) num_topk: usize,
    /// Experts `E` (checked only with routing).
    pub(crate) num_experts: usize,
    /// Ranks `R` of the node.
    pub(crate) num_ranks: usize,
}

/// Raw device pointers of a dispatch's rows and routing (0 where absent), from
/// [`dispatch_payload_ptrs`]. Holds the views' stream guards: keep it alive until every launch
/// and copy that uses the pointers is queued.
#[derive(Debug)]
pub(crate) struct DispatchPayloadPtrs<'a> {
    /// `[T, H]` rows to send.
    pub(crate) x: CUdeviceptr,
    /// `[T, S]` scales to send (fp8 only).
    pub(crate) x_scales: CUdeviceptr,
    /// `[T, K]` expert ids (with routing only).
    pub(crate) topk_idx: CUdeviceptr,
    /// `[T, K]` weights (with routing only).
    pub(crate) topk_weights: CUdeviceptr,
    /// `[N, H]` received rows.
    pub(crate) recv_x: CUdeviceptr,
    /// `[N, S]` received scales (fp8 only).
    pub(crate) recv_x_scales: CUdeviceptr,
    /// `[N, K]` localised expert ids (with routing only).
    pub(crate) recv_topk_idx: CUdeviceptr,
    /// `[N, K]` received weights (with routing only).
    pub(crate) recv_topk_weights: CUdeviceptr,
    /// `E / R` with routing, 0 without (the kernels' `experts_per_rank`).
    pub(crate) experts_per_rank: usize,
    _guards: [Option<SyncOnDrop<'a>>; 8],
}

impl DispatchPayloadPtrs<'_> {
    /// Checks `x` and `recv_x` are 16-byte aligned (the kernels move rows in 16-byte units).
    pub(crate) fn check_row_align(&self) -> Result<()> {
        for (name, p) in [("x", self.x), ("recv_x", self.recv_x)] {
            check_align(name, p, 16)?;
        }
        Ok(())
    }
}

/// Checks the rows and routing of a dispatch and returns their device pointers on `stream`
/// (`shape` is [`dispatch_row_shape`] of `x`).
///
/// `x` must hold `T * H` elements (and `T * S` scales for fp8); `recv_x` must be of the same
/// payload kind and hold `N * H` (and `N * S`); `topk` and `recv_topk` must both be given or
/// both be absent: with them `K` must be in `[1, 1024]`, `topk` hold `T * K` ids and weights,
/// `recv_topk` `N * K`, and `E` be a positive multiple of `R`; without them `K` must be 0.
/// Pointers are taken only once every check has passed.
pub(crate) fn dispatch_payload_ptrs<'a>(
    stream: &'a CudaStream,
    shape: RowShape,
    counts: PayloadCounts,
    x: &'a Payload<'_>,
    recv_x: &'a RecvPayload<'_>,
    topk: Option<&'a TopK<'_>>,
    recv_topk: Option<&'a RecvTopK<'_>>,
) -> Result<DispatchPayloadPtrs<'a>> {
    let RowShape {
        hidden: h, scales, ..
    } = shape;
    let PayloadCounts {
        num_tokens: t,
        num_recv_tokens: n,
        num_topk: k,
        num_experts,
        num_ranks: r,
    } = counts;
    let is_fp8 = match x {
        Payload::Bf16(x) => {
            Error::check_len("x", t * h, x.len())?;
            false
        }
        Payload::Fp8 { x, scales: xs } => {
            Error::check_len("x", t * h, x.len())?;
            Error::check_len("x_scales", t * scales, xs.len())?;
            true
        }
    };
    match recv_x {
        RecvPayload::Bf16(rx) if !is_fp8 => {
            Error::check_len("recv_x", n * h, rx.len())?;
        }
        RecvPayload::Fp8 { x: rx, scales: rs } if is_fp8 => {
            Error::check_len("recv_x", n * h, rx.len())?;
            Error::check_len("recv_x_scales", n * scales, rs.len())?;
        }
        _ => {
            return Err(Error::invalid(
                "recv_x",
                "a different payload kind",
                "must be bf16 iff x is bf16 (fp8 iff x is fp8)",
            ))
        }
    }
    match (topk, recv_topk) {
        (Some(tk), Some(rt)) => {
            if k == 0 || k > 1024 {
                return Err(Error::invalid(
                    "num_topk",
                    k,
                    "must be in [1, 1024] with topk",
                ));
            }
            Error::check_len("topk_idx", t * k, tk.idx.len())?;
            Error::check_len("topk_weights", t * k, tk.weights.len())?;
            Error::check_len("recv_topk_idx", n * k, rt.idx.len())?;
            Error::check_len("recv_topk_weights", n * k, rt.weights.len())?;
            if num_experts == 0 || num_experts % r != 0 {
                return Err(Error::invalid(
                    "num_experts",
                    num_experts,
                    format!("must be a positive multiple of num_ranks = {r}"),
                ));
            }
        }
        (None, None) => {
            if k != 0 {
                return Err(Error::invalid("num_topk", k, "must be 0 without topk"));
            }
        }
        _ => {
            return Err(Error::invalid(
                "recv_topk",
                "given without topk (or the reverse)",
                "topk and recv_topk must both be given or both be None",
            ))
        }
    }
    let ((x_ptr, gx), (xs_ptr, gxs)) = match x {
        Payload::Bf16(x) => (opt_device_ptr(Some(x), stream), (0, None)),
        Payload::Fp8 { x, scales } => (
            opt_device_ptr(Some(x), stream),
            opt_device_ptr(Some(scales), stream),
        ),
    };
    let ((rx_ptr, grx), (rxs_ptr, grxs)) = match recv_x {
        RecvPayload::Bf16(rx) => (opt_device_ptr(Some(rx), stream), (0, None)),
        RecvPayload::Fp8 { x: rx, scales } => (
            opt_device_ptr(Some(rx), stream),
            opt_device_ptr(Some(scales), stream),
        ),
    };
    let (ti_ptr, gti) = opt_device_ptr(topk.map(|tk| &tk.idx), stream);
    let (tw_ptr, gtw) = opt_device_ptr(topk.map(|tk| &tk.weights), stream);
    let (rti_ptr, grti) = opt_device_ptr(recv_topk.map(|rt| &rt.idx), stream);
    let (rtw_ptr, grtw) = opt_device_ptr(recv_topk.map(|rt| &rt.weights), stream);
    Ok(DispatchPayloadPtrs {
        x: x_ptr,
        x_scales: xs_ptr,
        topk_idx: ti_ptr,
        topk_weights: tw_ptr,
        recv_x: rx_ptr,
        recv_x_scales: rxs_ptr,
        recv_topk_idx: rti_ptr,
        recv_topk_weights: rtw_ptr,
        experts_per_rank: if k > 0 { num_experts / r } else { 0 },
        _guards: [gx, gxs, grx, grxs, gti, gtw, grti, grtw],
    })
}

/// Raw device pointers of a combine's optional top-k weights (0 where absent), from
/// [`combine_weights_ptrs`]. Holds the views' stream guards: keep it alive until every launch
/// and copy that uses the pointers is queued.
#[derive(Debug)]
pub(crate) struct CombineWeightsPtrs<'a> {
    /// `[N, K]` weights returned along the rows.
    pub(crate) topk_weights: CUdeviceptr,
    /// `[T, K]` sums of the returned weights.
    pub(crate) combined_topk_weights: CUdeviceptr,
    _guards: [Option<SyncOnDrop<'a>>; 2],
}

/// Checks the optional top-k weights of a combine of `num_recv_tokens` rows (`N`) into
/// `num_tokens` tokens (`T`) and returns their device pointers on `stream`.
///
/// `topk_weights` and `combined_topk_weights` must both be given or both be absent: with them
/// `num_topk` (`K`) must be in `[1, 1024]`, `topk_weights` hold `N * K` and
/// `combined_topk_weights` `T * K` elements; without them `K` must be 0. Pointers are taken
/// only once every check has passed.
pub(crate) fn combine_weights_ptrs<'a>(
    stream: &'a CudaStream,
    topk_weights: Option<&'a CudaView<'_, f32>>,
    combined_topk_weights: Option<&'a CudaViewMut<'_, f32>>,
    num_recv_tokens: usize,
    num_tokens: usize,
    num_topk: usize,
) -> Result<CombineWeightsPtrs<'a>> {
    let k = num_topk;
    match (topk_weights, combined_topk_weights) {
        (Some(w), Some(cw)) => {
            if k == 0 || k > 1024 {
                return Err(Error::invalid(
                    "num_topk",
                    k,
                    "must be in [1, 1024] with topk_weights",
                ));
            }
            Error::check_len("topk_weights", num_recv_tokens * k, w.len())?;
            Error::check_len("combined_topk_weights", num_tokens * k, cw.len())?;
        }
        (None, None) => {
            if k != 0 {
                return Err(Error::invalid(
                    "num_topk",
                    k,
                    "must be 0 without topk_weights",
                ));
            }
        }
        _ => {
            return Err(Error::invalid(
                "combined_topk_weights",
                "given without topk_weights (or the reverse)",
                "both or neither",
            ))
        }
    }
    let (w_ptr, gw) = opt_device_ptr(topk_weights, stream);
    let (cw_ptr, gcw) = opt_device_ptr(combined_topk_weights, stream);
    Ok(CombineWeightsPtrs {
        topk_weights: w_ptr,
        combined_topk_weights: cw_ptr,
        _guards: [gw, gcw],
    })
}
