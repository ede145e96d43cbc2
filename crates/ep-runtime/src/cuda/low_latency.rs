//! Low-latency mode on CUDA tensors: the low-latency kernels over NVLink peer pointers, with
//! send / receive phases, device-side buffer-set parity and the device active-ranks mask.
//!
//! Stream work per op (one op = a send call and its receive hook, on `R` ranks):
//! - dispatch: on candle's stream, allocations of `recv_x`, of the scales (fp8 only) and of one
//!   `i32` block holding `src_info`, `recv_count`, the source top-k slots and the layout ranges
//!   (none zeroed or filled: the receive phase writes every element that is read, `-1` into
//!   `src_info` past the counts); the communication stream joins candle's (event record +
//!   wait); the send kernel, later the receive kernel (one `Both` launch at the send call when
//!   `R == 1`, where nothing has to travel); an event at the end (candle's stream waits on it
//!   unless `async_finish`), which is also the one the mask is polled with;
//! - combine: the same with one allocation (`combined_x`, unzeroed: every element is written).
//!
//! The kernels' receive phase leaves the device mask in host-mapped memory as it ends (no copy
//! on the stream).

use super::ll_recv::{CudaLlDispatchData, DispatchOutputs};
use super::memory::{PeerMap, PeerRecord};
use super::tensor::{alloc_uninit, wrap, DeviceTensor};
use super::{gather_records, kernel_err, lock, CudaBuffer};
use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::low_latency::{LowLatencyCombineOutput, LowLatencyDispatchOutput, LowLatencyHandle};
use candle_core::{DType, Tensor};
use cudarc::driver::{CudaEvent, CudaSlice};
use ep_kernels::low_latency::{
    self as kll, LowLatencyBuffer, LowLatencyFormat, LowLatencyLayout, Phases,
};
use std::sync::Arc;

/// The low-latency buffer of a CUDA [`Buffer`], mapped on every rank.
///
/// The device masks a peer that times out (and the op completes without it). The host learns
/// of it without waiting: the receive kernel of every op leaves the device mask in host-mapped
/// memory ([`LowLatencyBuffer::active_ranks_mirror`]) and the op ends with an event; the next
/// op (or [`Buffer::low_latency_check`]) reads the mirror once the event has completed and
/// reports newly masked ranks then.
#[derive(Debug)]
pub(crate) struct LlState {
    /// Peers' buffers mapped here (dropped before `buffer`).
    _peers: PeerMap,
    buffer: LowLatencyBuffer,
    /// `(max_tokens_per_rank, hidden, num_experts)` the layout is for.
    key: (usize, usize, usize),
    /// The mask as last written to / read from the device.
    known_mask: Vec<bool>,
    /// The end of the last op whose receive kernel wrote the mask mirror (`None` while one is
    /// in flight whose end is not recorded yet, or while capturing).
    mask_event: Option<Arc<CudaEvent>>,
}

impl LlState {
    /// Allocates, zeroes and maps the low-latency buffers of every rank (a collective).
    pub(crate) fn new(buf: &Buffer, cb: &CudaBuffer, m: usize, h: usize, e: usize) -> Result<Self> {
        let r = cb.num_ranks;
        let layout = LowLatencyLayout::new(m, h, r, e)?;
        let mut buffer = LowLatencyBuffer::new(&cb.comm, layout, cb.rank)?;
        buffer.set_timeout(cb.timeout);
        let ctx = cb.comm.context().clone();
        let own = PeerRecord::of_ptr(&ctx, buffer.base_ptr(), layout.total_bytes, ctx.ordinal())?;
        let records = gather_records(buf, own)?;
        let peers = PeerMap::open(&ctx, &records, cb.rank, |i| i)?;
        // SAFETY: `peers` maps every rank's low-latency buffer of this layout into this
        // context (IPC or peer pointers, own entry = own base); it is kept in `LlState` next to
        // `buffer` and dropped after it.
        unsafe { buffer.connect(&cb.comm, peers.ptrs()) }?;
        Ok(Self {
            _peers: peers,
            buffer,
            key: (m, h, e),
            known_mask: vec![true; r],
            mask_event: None,
        })
    }
}

/// How the receive phase of a pending low-latency op runs.
pub(crate) enum RecvPhase {
    /// A `Recv` launch at the hook (which polls the previous op's mask first).
    Launch,
    /// Already run by the send call's `Both` launch (one rank: nothing travels, so nothing is
    /// worth overlapping); holds that call's poll of the previous op's mask.
    Fused(Result<()>),
}

impl CudaBuffer {
    /// Whether an op's send call also runs its receive phase (one `Both` launch instead of two).
    fn fuse_phases(&self) -> bool {
        self.num_ranks == 1
    }
}

/// A low-latency op whose send phase is on the stream.
pub(crate) enum LlPending {
    /// A dispatch.
    Dispatch {
        /// The receive buffers (the output tensors own `recv_x`, scales, counts, sources).
        data: Box<CudaLlDispatchData>,
        recv_x: Tensor,
        recv_count: Tensor,
        src_info: Tensor,
        recv_x_scales: Option<Tensor>,
        x: Tensor,
        topk: Tensor,
        num_tokens: usize,
        num_topk: usize,
        format: LowLatencyFormat,
        /// The handle's host-side parts (from the shared checks).
        plan: LlHostPlan,
        async_finish: bool,
        recv_phase: RecvPhase,
    },
    /// A combine.
    Combine {
        handle: LowLatencyHandle,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        out: CudaSlice<half::bf16>,
        user_out: Option<Tensor>,
        async_finish: bool,
        recv_phase: RecvPhase,
    },
}

/// Sizes of a low-latency dispatch, from the shared checks (no routing: it stays on the
/// device).
pub(crate) struct LlHostPlan {
    pub placement: ep_kernels::layout::ExpertPlacement,
    pub max_tokens: usize,
    pub hidden: usize,
}

impl CudaBuffer {
    /// Makes sure the low-latency buffer is laid out for `(m, h, e)` (rebuilding it, a
    /// collective, if not) and that the device mask matches `buf`'s.
    fn ll_state<'a>(
        &'a self,
        buf: &Buffer,
        m: usize,
        h: usize,
        e: usize,
    ) -> Result<std::sync::MutexGuard<'a, Option<LlState>>> {
        let mut g = lock(&self.ll);
        if g.as_ref().is_none_or(|s| s.key != (m, h, e)) {
            *g = None;
            *g = Some(LlState::new(buf, self, m, h, e)?);
        }
        let st = g.as_mut().expect("set above");
        let host = buf.active_ranks();
        if host != st.known_mask {
            st.buffer.set_active_ranks(&self.comm, &host)?;
            st.known_mask = host;
        }
        Ok(g)
    }

    /// Ends an op on the communication stream ([`Self::finish`]); its event also tells when
    /// the mask mirror the op's receive kernel wrote is readable.
    fn ll_end_op(
        &self,
        st: &mut LlState,
        async_finish: bool,
    ) -> Result<crate::event::EventOverlap> {
        let ev = self.finish_event(async_finish)?;
        // An event recorded while capturing a CUDA graph cannot be queried afterwards: a
        // captured step's replays are tracked by `low_latency_note_replay` instead.
        let capturing = !matches!(
            self.comm.capture_status()?,
            cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        );
        st.mask_event = if capturing { None } else { Some(ev.clone()) };
        Ok(crate::event::EventOverlap::from_cuda(ev))
    }

    /// After a replay of a captured low-latency step was launched on candle's stream: records
    /// the event whose completion makes the step's mask copy readable.
    pub(crate) fn low_latency_note_replay(&self) -> Result<()> {
        let mut g = lock(&self.ll);
        if let Some(st) = g.as_mut() {
            st.mask_event = Some(Arc::new(self.compute.record_event(None)?));
        }
        Ok(())
    }

    /// [`Self::ll_poll_mask`] outside an op.
    pub(crate) fn low_latency_poll(&self, buf: &Buffer) -> Result<()> {
        let mut g = lock(&self.ll);
        match g.as_mut() {
            Some(st) => self.ll_poll_mask(buf, st, "low-latency op"),
            None => Ok(()),
        }
    }

    /// Reports ranks the device masked in the previous op, without waiting: reads the
    /// host-mapped mask mirror of that op if its event has completed (else nothing is known
    /// yet; [`Buffer::low_latency_check`] waits). Call it before launching a receive kernel,
    /// which rewrites the mirror. Newly masked ranks are masked in `buf` too; the
    /// first is the error (returned by the op that looked, after it completed on every rank).
    fn ll_poll_mask(&self, buf: &Buffer, st: &mut LlState, what: &str) -> Result<()> {
        // Querying an event is not allowed while a graph is being captured; the captured
        // step's replays are polled afterwards.
        if !matches!(
            self.comm.capture_status()?,
            cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        ) {
            return Ok(());
        }
        let done = match &st.mask_event {
            Some(ev) => ev.try_is_complete()?,
            None => false,
        };
        if !done {
            return Ok(());
        }
        let dev = st.buffer.active_ranks_mirror();
        self.ll_report_mask(buf, st, dev, what)
    }

    /// Compares a mask read from the device with the known one (see [`Self::ll_poll_mask`]).
    fn ll_report_mask(
        &self,
        buf: &Buffer,
        st: &mut LlState,
        dev: Vec<bool>,
        what: &str,
    ) -> Result<()> {
        let newly: Vec<usize> = (0..dev.len())
            .filter(|&p| st.known_mask[p] && !dev[p])
            .collect();
        st.known_mask = dev;
        for &p in &newly {
            tracing::warn!(
                rank = p,
                op = what,
                "peer timed out on the device; masking it"
            );
            buf.mask_rank(p)?;
        }
        match newly.first() {
            Some(&rank) => Err(Error::Timeout {
                rank,
                what: format!("{what} (device wait; the rank is now masked)"),
                waited: self.timeout,
            }),
            None => Ok(()),
        }
    }

    /// Waits for the last low-latency op and reports the ranks the device masked during it
    /// (synchronises the communication stream).
    pub(crate) fn low_latency_check(&self, buf: &Buffer) -> Result<()> {
        let _op = lock(&self.op);
        let mut g = lock(&self.ll);
        let Some(st) = g.as_mut() else {
            return Ok(());
        };
        let dev = st.buffer.active_ranks(&self.comm)?;
        self.ll_report_mask(buf, st, dev, "low-latency op")
    }

    /// The send phase of a low-latency dispatch (arguments already checked).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ll_dispatch_send(
        &self,
        buf: &Buffer,
        x: &Tensor,
        topk_idx: &Tensor,
        num_topk: usize,
        use_fp8: bool,
        use_ue8m0: bool,
        async_finish: bool,
        plan: LlHostPlan,
    ) -> Result<LlPending> {
        if x.dtype() != DType::BF16 {
            return Err(Error::DType {
                arg: "x",
                expected: "bf16 (CUDA buffers)",
                got: x.dtype(),
            });
        }
        let (t, h, m) = (x.dims2()?.0, plan.hidden, plan.max_tokens);
        let e = plan.placement.num_experts;
        let r = self.num_ranks;
        let l = e / r;
        let _op = lock(&self.op);
        let mut g = self.ll_state(buf, m, h, e)?;
        let st = g.as_mut().expect("built by ll_state");
        let format = match (use_fp8, use_ue8m0) {
            (false, _) => LowLatencyFormat::Bf16,
            (true, false) => LowLatencyFormat::Fp8,
            (true, true) => LowLatencyFormat::Fp8Ue8m0,
        };
        // Allocated on the compute stream (candle's), before the communication stream joins
        // it: the frees then land on the compute stream too, which keeps a captured step's
        // streams joined and orders frees after the kernels without event tracking.
        let outputs = DispatchOutputs::alloc(&self.compute, &self.dev, format, l, r, m, h)?;
        let DispatchOutputs {
            recv_x: recv_x_t,
            recv_x_scales,
            recv_count: recv_count_t,
            src_info: src_info_t,
            mut data,
        } = outputs;
        let (phases, recv_phase) = if self.fuse_phases() {
            // The launch rewrites the mask mirror: poll the previous op's first.
            let prior = self.ll_poll_mask(buf, st, "low_latency_dispatch");
            st.mask_event = None;
            (Phases::Both, RecvPhase::Fused(prior))
        } else {
            (Phases::Send, RecvPhase::Launch)
        };
        self.begin(None)?;
        let comm = &self.comm;
        let launched = {
            let x_d = DeviceTensor::new("x", x)?;
            let i_d = DeviceTensor::new("topk_idx", topk_idx)?;
            kll::dispatch_cuda(
                comm,
                &st.buffer,
                &x_d.view::<half::bf16>()?,
                &i_d.view::<i64>()?,
                t,
                num_topk,
                format,
                phases,
                &mut data.recv,
            )
        };
        launched.map_err(|e| kernel_err(e, self.timeout))?;
        Ok(LlPending::Dispatch {
            data,
            recv_x: recv_x_t,
            recv_count: recv_count_t,
            src_info: src_info_t,
            recv_x_scales,
            x: x.clone(),
            topk: topk_idx.clone(),
            num_tokens: t,
            num_topk,
            format,
            plan,
            async_finish,
            recv_phase,
        })
    }

    /// The receive phase of a low-latency dispatch.
    pub(crate) fn ll_dispatch_recv(
        &self,
        buf: &Buffer,
        pending: LlPending,
    ) -> Result<LowLatencyDispatchOutput> {
        let LlPending::Dispatch {
            mut data,
            recv_x,
            recv_count,
            src_info,
            recv_x_scales,
            x,
            topk,
            num_tokens,
            num_topk,
            format,
            plan,
            async_finish,
            recv_phase,
        } = pending
        else {
            unreachable!("a dispatch hook holds a dispatch")
        };
        let _op = lock(&self.op);
        let mut g = lock(&self.ll);
        let st = g.as_mut().ok_or_else(|| {
            Error::invalid("low_latency", "None", "the low-latency buffer is gone")
        })?;
        let masked = match recv_phase {
            RecvPhase::Fused(prior) => prior,
            RecvPhase::Launch => {
                // The previous op's mask first (the launch overwrites its mirror).
                let prior = self.ll_poll_mask(buf, st, "low_latency_dispatch");
                let x_d = DeviceTensor::new("x", &x)?;
                let i_d = DeviceTensor::new("topk_idx", &topk)?;
                kll::dispatch_cuda(
                    &self.comm,
                    &st.buffer,
                    &x_d.view::<half::bf16>()?,
                    &i_d.view::<i64>()?,
                    num_tokens,
                    num_topk,
                    format,
                    Phases::Recv,
                    &mut data.recv,
                )
                .map_err(|e| kernel_err(e, self.timeout))?;
                prior
            }
        };
        let event = self.ll_end_op(st, async_finish)?;
        drop(g);
        let m = plan.max_tokens;
        let inner = crate::low_latency::dispatch::LlHandleInner {
            buffer_id: self.buffer_id,
            placement: plan.placement,
            num_tokens,
            num_topk,
            hidden: plan.hidden,
            max_tokens: m,
            topk_idx: Vec::new(),
            slots: Vec::new(),
            send_counts: Vec::new(),
            src_info,
            layout_range: None,
            layout: None,
            cuda: Some(Arc::from(data)),
        };
        let out = LowLatencyDispatchOutput {
            recv_x,
            recv_x_scales,
            recv_count,
            handle: LowLatencyHandle {
                inner: Arc::new(inner),
            },
            event,
        };
        masked.map(|()| out)
    }

    /// The send phase of a low-latency combine (arguments already checked).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ll_combine_send(
        &self,
        buf: &Buffer,
        x: &Tensor,
        topk_idx: &Tensor,
        topk_weights: &Tensor,
        handle: &LowLatencyHandle,
        out: Option<&Tensor>,
        async_finish: bool,
    ) -> Result<LlPending> {
        if x.dtype() != DType::BF16 {
            return Err(Error::DType {
                arg: "x",
                expected: "bf16 (CUDA buffers)",
                got: x.dtype(),
            });
        }
        let h = &handle.inner;
        let data = h.cuda.as_ref().ok_or_else(|| {
            Error::HandleMismatch("the low-latency handle was made by a CPU buffer".into())
        })?;
        let (t, k, hid) = (h.num_tokens, h.num_topk, h.hidden);
        let _op = lock(&self.op);
        let mut g = self.ll_state(buf, h.max_tokens, hid, h.placement.num_experts)?;
        let st = g.as_mut().expect("built by ll_state");
        // Allocated on the compute stream before the join (see `ll_dispatch_send`); not zeroed:
        // the receive phase writes every element of every token.
        let mut o = alloc_uninit::<half::bf16>(&self.compute, t * hid)?;
        let (phases, recv_phase) = if self.fuse_phases() {
            // The launch rewrites the mask mirror: poll the previous op's first.
            let prior = self.ll_poll_mask(buf, st, "low_latency_combine");
            st.mask_event = None;
            (Phases::Both, RecvPhase::Fused(prior))
        } else {
            (Phases::Send, RecvPhase::Launch)
        };
        self.begin(None)?;
        let comm = &self.comm;
        {
            let x_d = DeviceTensor::new("x", x)?;
            let i_d = DeviceTensor::new("topk_idx", topk_idx)?;
            let w_d = DeviceTensor::new("topk_weights", topk_weights)?;
            kll::combine_cuda(
                comm,
                &st.buffer,
                &x_d.view::<half::bf16>()?,
                &data.recv,
                &i_d.view::<i64>()?,
                &w_d.view::<f32>()?,
                t,
                k,
                phases,
                &mut o.slice_mut(0..t * hid),
            )
            .map_err(|e| kernel_err(e, self.timeout))?;
        }
        Ok(LlPending::Combine {
            handle: handle.clone(),
            x: x.clone(),
            topk_idx: topk_idx.clone(),
            topk_weights: topk_weights.clone(),
            out: o,
            user_out: out.cloned(),
            async_finish,
            recv_phase,
        })
    }

    /// The receive phase of a low-latency combine.
    pub(crate) fn ll_combine_recv(
        &self,
        buf: &Buffer,
        pending: LlPending,
    ) -> Result<LowLatencyCombineOutput> {
        let LlPending::Combine {
            handle,
            x,
            topk_idx,
            topk_weights,
            mut out,
            user_out,
            async_finish,
            recv_phase,
        } = pending
        else {
            unreachable!("a combine hook holds a combine")
        };
        let h = &handle.inner;
        let data = h.cuda.as_ref().ok_or_else(|| {
            Error::HandleMismatch("the low-latency handle was made by a CPU buffer".into())
        })?;
        let (t, k, hid) = (h.num_tokens, h.num_topk, h.hidden);
        let _op = lock(&self.op);
        let mut g = lock(&self.ll);
        let st = g.as_mut().ok_or_else(|| {
            Error::invalid("low_latency", "None", "the low-latency buffer is gone")
        })?;
        let masked = match recv_phase {
            RecvPhase::Fused(prior) => prior,
            RecvPhase::Launch => {
                // The previous op's mask first (the launch overwrites its mirror).
                let prior = self.ll_poll_mask(buf, st, "low_latency_combine");
                let x_d = DeviceTensor::new("x", &x)?;
                let i_d = DeviceTensor::new("topk_idx", &topk_idx)?;
                let w_d = DeviceTensor::new("topk_weights", &topk_weights)?;
                kll::combine_cuda(
                    &self.comm,
                    &st.buffer,
                    &x_d.view::<half::bf16>()?,
                    &data.recv,
                    &i_d.view::<i64>()?,
                    &w_d.view::<f32>()?,
                    t,
                    k,
                    Phases::Recv,
                    &mut out.slice_mut(0..t * hid),
                )
                .map_err(|e| kernel_err(e, self.timeout))?;
                prior
            }
        };
        let event = self.ll_end_op(st, async_finish)?;
        drop(g);
        let combined = wrap(out, (t, hid), &self.dev);
        let combined_x = match user_out {
            Some(o) => {
                o.slice_set(&combined, 0, 0)?;
                o
            }
            None => combined,
        };
        masked.map(|()| LowLatencyCombineOutput { combined_x, event })
    }

    /// Resets the low-latency buffer's sequencing, counters, signals and flags on every rank
    /// (a collective, with a host barrier before and after).
    pub(crate) fn clean_low_latency_buffer(&self, buf: &Buffer) -> Result<()> {
        let _op = lock(&self.op);
        buf.host_all_gather(&[])?;
        {
            let g = lock(&self.ll);
            if let Some(st) = g.as_ref() {
                self.begin(None)?;
                kll::clean_buffer_cuda(&self.comm, &st.buffer, false)
                    .map_err(|e| kernel_err(e, self.timeout))?;
                self.comm.synchronize()?;
            }
        }
        buf.host_all_gather(&[])?;
        Ok(())
    }
}
