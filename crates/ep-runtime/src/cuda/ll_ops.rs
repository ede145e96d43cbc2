//! The low-latency ops on CUDA tensors: dispatch and combine, each a send call and a receive
//! call (see `low_latency.rs` for the stream work of each). They return raw parts (tensors, an
//! event, the handle's device data) that the `low_latency` op module assembles.

use super::common::{kernel_err, lock};
use super::ll_recv::{into_outputs, CudaLlDispatchData, DispatchOutputs};
use super::low_latency::{LlState, LowLatencyCuda};
use super::tensor::{alloc_uninit, wrap, DeviceTensor};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::group::Group;
use candle_core::{DType, Tensor};
use cudarc::driver::CudaSlice;
use ep_kernels::layout::ExpertPlacement;
use ep_kernels::low_latency::{
    self as kll, LowLatencyBuffer, LowLatencyFormat, LowLatencyRecv, Phases, Reduction,
};
use half::bf16;
use std::sync::Arc;

/// How the receive phase of a pending low-latency op runs.
enum RecvPhase {
    /// A `Recv` launch at the hook (which polls the previous op's mask first).
    Launch,
    /// Already run by the send call's `Both` launch (one rank: nothing travels, so nothing is
    /// worth overlapping); holds that call's poll of the previous op's mask.
    Fused(Result<()>),
}

/// Sizes of a low-latency dispatch, from the shared checks (no routing: it stays on the
/// device).
pub(crate) struct LlHostPlan {
    pub placement: ExpertPlacement,
    pub max_tokens: usize,
    pub hidden: usize,
}

/// A low-latency dispatch whose send phase is on the stream.
pub(crate) struct LlDispatchPending {
    /// The receive buffers (tensors once the receive phase is on the stream).
    recv: LowLatencyRecv,
    x: Tensor,
    topk: Tensor,
    /// `[T, K]` f32 when the dispatch carries the weights (per-rank combines).
    weights: Option<Tensor>,
    num_tokens: usize,
    num_topk: usize,
    /// The rows' hidden size (`x` travels padded to whole 128-channel groups).
    hidden: usize,
    async_finish: bool,
    recv_phase: RecvPhase,
}

/// What a CUDA low-latency dispatch returns (the op module makes the public output of it).
pub(crate) struct LlDispatched {
    /// `[L, R*M, H]` bf16 or fp8.
    pub recv_x: Tensor,
    /// `[L, R*M, H / 128]` f32 (fp8 only).
    pub recv_x_scales: Option<Tensor>,
    /// `[L]` i32.
    pub recv_count: Tensor,
    /// `[L, R*M]` i32.
    pub src_info: Tensor,
    /// What the handle keeps for the combine.
    pub data: Arc<CudaLlDispatchData>,
    /// The end of the dispatch.
    pub event: EventOverlap,
}

/// The sizes of the dispatch a combine answers (from its handle).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LlCombineDims {
    /// Tokens of this rank, top-k, hidden.
    pub num_tokens: usize,
    pub num_topk: usize,
    pub hidden: usize,
    /// Slots per (expert, source) and routed experts the buffer is laid out for.
    pub max_tokens: usize,
    pub num_experts: usize,
}

/// A low-latency combine whose send phase is on the stream.
pub(crate) struct LlCombinePending {
    data: Arc<CudaLlDispatchData>,
    /// The sizes as the buffer lays them out (hidden padded).
    dims: LlCombineDims,
    /// The rows' hidden size.
    hidden: usize,
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    reduction: Reduction,
    out: CudaSlice<bf16>,
    user_out: Option<Tensor>,
    async_finish: bool,
    recv_phase: RecvPhase,
}

/// What a CUDA low-latency combine returns.
pub(crate) struct LlCombined {
    /// `[T, H]` bf16 (the caller's `out` tensor if one was given).
    pub combined_x: Tensor,
    /// The end of the combine.
    pub event: EventOverlap,
}

/// The hidden size the low-latency buffer lays rows out with: `h` rounded up to whole 128-channel
/// groups (the fp8 messages' scale groups). Rows of another `h` travel zero-padded (bf16 only:
/// fp8 needs whole groups) and come out cut back to `h`.
fn padded_hidden(h: usize) -> usize {
    h.div_ceil(ep_kernels::FP8_GROUP) * ep_kernels::FP8_GROUP
}

/// `x` with its last dimension zero-padded to `hp` (contiguous), or `x` itself.
fn pad_hidden(x: &Tensor, hp: usize) -> Result<Tensor> {
    let h = *x.dims().last().unwrap_or(&0);
    if h == hp {
        return Ok(x.clone());
    }
    Ok(x.pad_with_zeros(x.rank() - 1, 0, hp - h)?.contiguous()?)
}

/// `x` cut back to `h` channels along its last dimension (contiguous), or `x` itself.
fn cut_hidden(x: Tensor, h: usize) -> Result<Tensor> {
    if x.dims().last() == Some(&h) {
        return Ok(x);
    }
    Ok(x.narrow(x.rank() - 1, 0, h)?.contiguous()?)
}

fn check_bf16(x: &Tensor) -> Result<()> {
    if x.dtype() != DType::BF16 {
        return Err(Error::DType {
            arg: "x",
            expected: "bf16 (CUDA buffers)",
            got: x.dtype(),
        });
    }
    Ok(())
}

impl LowLatencyCuda {
    /// The phases of an op's send call, and how its receive call runs; with fused phases, the
    /// previous op's mask is polled first (the launch rewrites its mirror).
    fn send_phases(&self, group: &dyn Group, st: &mut LlState, what: &str) -> (Phases, RecvPhase) {
        if self.fuse_phases() {
            let prior = self.poll_mask(group, st, what);
            st.mask_event = None;
            (Phases::Both, RecvPhase::Fused(prior))
        } else {
            (Phases::Send, RecvPhase::Launch)
        }
    }

    /// The receive call of a pending op (the caller holds the op lock): the previous op's mask
    /// polled for `what` and `launch` (the receive phase) with the state, unless the send call's
    /// fused launch ran both (then its poll's result), and the op's end. Returns the mask poll's
    /// result and the end event.
    fn recv_call(
        &self,
        group: &dyn Group,
        recv_phase: RecvPhase,
        what: &str,
        async_finish: bool,
        launch: impl FnOnce(&LlState) -> Result<()>,
    ) -> Result<(Result<()>, EventOverlap)> {
        let mut g = lock(&self.state);
        let st = g.as_mut().ok_or_else(|| {
            Error::invalid("low_latency", "None", "the low-latency buffer is gone")
        })?;
        let masked = match recv_phase {
            RecvPhase::Fused(prior) => prior,
            RecvPhase::Launch => {
                // The previous op's mask first (the launch overwrites its mirror).
                let prior = self.poll_mask(group, st, what);
                launch(st)?;
                prior
            }
        };
        let event = self.end_op(st, async_finish)?;
        Ok((masked, event))
    }

    /// Launches `phases` of the low-latency dispatch of `x` (`[t, H]` bf16) routed by
    /// `topk_idx` (`[t, k]` i64) into `recv`, carrying `weights` (`[t, k]` f32) when given.
    #[allow(clippy::too_many_arguments)]
    fn launch_dispatch(
        &self,
        buffer: &LowLatencyBuffer,
        recv: &mut LowLatencyRecv,
        x: &Tensor,
        topk_idx: &Tensor,
        weights: Option<&Tensor>,
        t: usize,
        k: usize,
        phases: Phases,
    ) -> Result<()> {
        let x_d = DeviceTensor::new("x", x)?;
        let i_d = DeviceTensor::new("topk_idx", topk_idx)?;
        let w_d = weights
            .map(|w| DeviceTensor::new("topk_weights", w))
            .transpose()?;
        let w_v = w_d.as_ref().map(|w| w.view::<f32>()).transpose()?;
        let (x_v, i_v) = (x_d.view::<bf16>()?, i_d.view::<i64>()?);
        kll::dispatch_cuda(
            &self.comm,
            buffer,
            &x_v,
            &i_v,
            w_v.as_ref(),
            t,
            k,
            recv.format(),
            phases,
            recv,
        )
        .map_err(|e| kernel_err(e, self.timeout))
    }

    /// Launches `phases` of the low-latency combine of `x` (`[T, H]` bf16) with its routing
    /// `topk_idx` and `topk_weights` into `out` (`[T, H]`), answering the dispatch that made
    /// `data`; the sizes are `dims`'.
    #[allow(clippy::too_many_arguments)]
    fn launch_combine(
        &self,
        buffer: &LowLatencyBuffer,
        data: &CudaLlDispatchData,
        x: &Tensor,
        topk_idx: &Tensor,
        topk_weights: &Tensor,
        dims: LlCombineDims,
        phases: Phases,
        reduction: Reduction,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (t, k, hid) = (dims.num_tokens, dims.num_topk, dims.hidden);
        let x_d = DeviceTensor::new("x", x)?;
        let i_d = DeviceTensor::new("topk_idx", topk_idx)?;
        let w_d = DeviceTensor::new("topk_weights", topk_weights)?;
        let (x_v, i_v, w_v) = (x_d.view::<bf16>()?, i_d.view()?, w_d.view()?);
        data.with_views(|recv| {
            kll::combine_cuda(
                &self.comm,
                buffer,
                &x_v,
                recv,
                &i_v,
                &w_v,
                t,
                k,
                phases,
                reduction,
                &mut out.slice_mut(0..t * hid),
            )
        })?
        .map_err(|e| kernel_err(e, self.timeout))
    }

    /// The send phase of a low-latency dispatch (arguments already checked).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dispatch_send(
        &self,
        group: &dyn Group,
        x: &Tensor,
        topk_idx: &Tensor,
        topk_weights: Option<&Tensor>,
        num_topk: usize,
        use_fp8: bool,
        use_ue8m0: bool,
        async_finish: bool,
        plan: LlHostPlan,
    ) -> Result<LlDispatchPending> {
        check_bf16(x)?;
        let (t, hidden, m) = (x.dims2()?.0, plan.hidden, plan.max_tokens);
        let h = padded_hidden(hidden);
        let x = &pad_hidden(x, h)?;
        let e = plan.placement.num_experts;
        let _op = lock(&self.op);
        let mut g = self.state_for(group, m, h, e)?;
        let st = g.as_mut().expect("built by state_for");
        let format = match (use_fp8, use_ue8m0) {
            (false, _) => LowLatencyFormat::Bf16,
            (true, false) => LowLatencyFormat::Fp8,
            (true, true) => LowLatencyFormat::Fp8Ue8m0,
        };
        // Allocated on the compute stream (candle's), before the communication stream joins
        // it: the frees then land on the compute stream too, which keeps a captured step's
        // streams joined and orders frees after the kernels without event tracking.
        let weights = topk_weights.map(Tensor::contiguous).transpose()?;
        let layout = st.buffer.layout();
        let mut recv = LowLatencyRecv::alloc(&self.compute, layout, format, weights.is_some())?;
        let (phases, recv_phase) = self.send_phases(group, st, "low_latency_dispatch");
        self.begin()?;
        self.launch_dispatch(
            &st.buffer,
            &mut recv,
            x,
            topk_idx,
            weights.as_ref(),
            t,
            num_topk,
            phases,
        )?;
        Ok(LlDispatchPending {
            recv,
            x: x.clone(),
            topk: topk_idx.clone(),
            weights,
            num_tokens: t,
            num_topk,
            hidden,
            async_finish,
            recv_phase,
        })
    }

    /// The receive phase of a low-latency dispatch.
    pub(crate) fn dispatch_recv(
        &self,
        group: &dyn Group,
        pending: LlDispatchPending,
    ) -> Result<LlDispatched> {
        let LlDispatchPending {
            mut recv,
            x,
            topk,
            weights,
            num_tokens,
            num_topk,
            hidden,
            async_finish,
            recv_phase,
        } = pending;
        let _op = lock(&self.op);
        let what = "low_latency_dispatch";
        let (masked, event) = self.recv_call(group, recv_phase, what, async_finish, |st| {
            self.launch_dispatch(
                &st.buffer,
                &mut recv,
                &x,
                &topk,
                weights.as_ref(),
                num_tokens,
                num_topk,
                Phases::Recv,
            )
        })?;
        let DispatchOutputs {
            recv_x,
            recv_x_scales,
            recv_count,
            src_info,
            data,
        } = into_outputs(recv, &self.dev)?;
        let recv_x = cut_hidden(recv_x, hidden)?;
        masked.map(|()| LlDispatched {
            recv_x,
            recv_x_scales,
            recv_count,
            src_info,
            data: Arc::new(data),
            event,
        })
    }

    /// The send phase of a low-latency combine of the dispatch that made `data` (arguments
    /// already checked; `data` is `None` for a handle made by a CPU buffer, an error).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn combine_send(
        &self,
        group: &dyn Group,
        x: &Tensor,
        topk_idx: &Tensor,
        topk_weights: &Tensor,
        data: Option<&Arc<CudaLlDispatchData>>,
        dims: LlCombineDims,
        reduction: Reduction,
        out: Option<&Tensor>,
        async_finish: bool,
    ) -> Result<LlCombinePending> {
        check_bf16(x)?;
        let data = data.ok_or_else(|| {
            Error::HandleMismatch("the low-latency handle was made by a CPU buffer".into())
        })?;
        if reduction == Reduction::PerRank && !data.has_rank_records() {
            return Err(Error::HandleMismatch(
                "a per-rank combine needs a dispatch that carried topk_weights \
                 (LowLatencyDispatchArgs::weights)"
                    .into(),
            ));
        }
        let hidden = dims.hidden;
        let dims = LlCombineDims {
            hidden: padded_hidden(hidden),
            ..dims
        };
        let x = &pad_hidden(x, dims.hidden)?;
        let (t, hid) = (dims.num_tokens, dims.hidden);
        let _op = lock(&self.op);
        let mut g = self.state_for(group, dims.max_tokens, hid, dims.num_experts)?;
        let st = g.as_mut().expect("built by state_for");
        // Allocated on the compute stream before the join (see `dispatch_send`); not zeroed:
        // the receive phase writes every element of every token.
        let mut o = alloc_uninit::<bf16>(&self.compute, t * hid)?;
        let (phases, recv_phase) = self.send_phases(group, st, "low_latency_combine");
        self.begin()?;
        self.launch_combine(
            &st.buffer,
            data,
            x,
            topk_idx,
            topk_weights,
            dims,
            phases,
            reduction,
            &mut o,
        )?;
        Ok(LlCombinePending {
            data: data.clone(),
            dims,
            hidden,
            x: x.clone(),
            topk_idx: topk_idx.clone(),
            topk_weights: topk_weights.clone(),
            reduction,
            out: o,
            user_out: out.cloned(),
            async_finish,
            recv_phase,
        })
    }

    /// The receive phase of a low-latency combine.
    pub(crate) fn combine_recv(
        &self,
        group: &dyn Group,
        pending: LlCombinePending,
    ) -> Result<LlCombined> {
        let LlCombinePending {
            data,
            dims,
            hidden,
            x,
            topk_idx,
            topk_weights,
            reduction,
            mut out,
            user_out,
            async_finish,
            recv_phase,
        } = pending;
        let (t, hid) = (dims.num_tokens, dims.hidden);
        let _op = lock(&self.op);
        let what = "low_latency_combine";
        let (masked, event) = self.recv_call(group, recv_phase, what, async_finish, |st| {
            self.launch_combine(
                &st.buffer,
                &data,
                &x,
                &topk_idx,
                &topk_weights,
                dims,
                Phases::Recv,
                reduction,
                &mut out,
            )
        })?;
        let combined = cut_hidden(wrap(out, (t, hid), &self.dev), hidden)?;
        let combined_x = match user_out {
            Some(o) => {
                o.slice_set(&combined, 0, 0)?;
                o
            }
            None => combined,
        };
        masked.map(|()| LlCombined { combined_x, event })
    }
}
