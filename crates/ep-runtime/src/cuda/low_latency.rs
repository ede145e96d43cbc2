//! Low-latency mode on CUDA tensors: the low-latency kernels over NVLink peer pointers, with
//! send / receive phases, device-side buffer-set parity and the device active-ranks mask.

use super::memory::{PeerMap, PeerRecord};
use super::tensor::{alloc, alloc_uninit, wrap, DeviceTensor};
use super::{gather_records, kernel_err, lock, CudaBuffer};
use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::low_latency::{LowLatencyCombineOutput, LowLatencyDispatchOutput, LowLatencyHandle};
use candle_core::{DType, Tensor};
use cudarc::driver::{CudaSlice, CudaStream};
use ep_kernels::intranode as ki;
use ep_kernels::low_latency::{
    self as kll, LowLatencyBuffer, LowLatencyFormat, LowLatencyLayout, LowLatencyRecv, Phases,
};
use ep_kernels::FP8_GROUP;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// The low-latency buffer of a CUDA [`Buffer`], mapped on every rank.
///
/// The device masks a peer that times out (and the op completes without it). The host learns
/// of it without waiting: every op ends with an asynchronous copy of the device mask into
/// host-mapped memory and an event; the next op (or [`Buffer::low_latency_check`]) reads that
/// copy once the event has completed and reports newly masked ranks then.
#[derive(Debug)]
pub(crate) struct LlState {
    /// Peers' buffers mapped here (dropped before `buffer`).
    _peers: PeerMap,
    buffer: LowLatencyBuffer,
    /// `(max_tokens_per_rank, hidden, num_experts)` the layout is for.
    key: (usize, usize, usize),
    /// The mask as last written to / read from the device.
    known_mask: Vec<bool>,
    /// Host-mapped copy of the device mask, written at the end of each op.
    mask_copy: ki::HostMappedI32,
    /// Recorded after the last op's mask copy.
    mask_event: Option<cudarc::driver::CudaEvent>,
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
            mask_copy: ki::HostMappedI32::new(&ctx, r, 1)?,
            mask_event: None,
        })
    }
}

/// Receive buffers of one low-latency dispatch whose `recv_x` (and, for fp8, `recv_x_scales`),
/// `recv_count` and `recv_src_info` memory is owned by the output tensors; the kernel-side
/// struct only aliases it.
#[derive(Debug)]
pub(crate) struct CudaLlDispatchData {
    recv: ManuallyDrop<LowLatencyRecv>,
    scales_aliased: bool,
    /// The tensors owning the aliased memory (kept alive as long as the alias).
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
            ..
        } = recv;
        // The aliases must not free memory the tensors own.
        let _ = recv_x.leak();
        let _ = recv_count.leak();
        let _ = recv_src_info.leak();
        if self.scales_aliased {
            let _ = recv_x_scales.leak();
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
    },
}

/// Sizes of a low-latency dispatch, from the shared checks (no routing: it stays on the
/// device).
pub(crate) struct LlHostPlan {
    pub placement: ep_kernels::layout::ExpertPlacement,
    pub max_tokens: usize,
    pub hidden: usize,
}

fn alias<T, U>(stream: &Arc<CudaStream>, s: &CudaSlice<T>, len: usize) -> CudaSlice<U> {
    use cudarc::driver::DevicePtr;
    let (ptr, _g) = s.device_ptr(stream);
    // SAFETY: `ptr` is a live allocation of `len * size_of::<U>()` bytes (the caller sizes
    // `len` from `s`'s byte length); the alias is never freed (`CudaLlDispatchData` leaks it)
    // and the owner is kept alive alongside it.
    unsafe { stream.upgrade_device_ptr::<U>(ptr, len) }
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

    /// Ends an op on the communication stream: copies the device mask to host-mapped memory
    /// and records an event (no wait).
    fn ll_end_op(&self, st: &mut LlState) -> Result<()> {
        st.buffer.copy_active_ranks(&self.comm, &st.mask_copy)?;
        // An event recorded while capturing a CUDA graph cannot be queried afterwards: a
        // captured step's replays are tracked by `low_latency_note_replay` instead.
        let capturing = !matches!(
            self.comm.capture_status()?,
            cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        );
        st.mask_event = if capturing {
            None
        } else {
            Some(self.comm.record_event(None)?)
        };
        Ok(())
    }

    /// After a replay of a captured low-latency step was launched on candle's stream: records
    /// the event whose completion makes the step's mask copy readable.
    pub(crate) fn low_latency_note_replay(&self) -> Result<()> {
        let mut g = lock(&self.ll);
        if let Some(st) = g.as_mut() {
            st.mask_event = Some(self.compute.record_event(None)?);
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
    /// host-mapped mask copy of that op if its event has completed (else nothing is known yet;
    /// [`Buffer::low_latency_check`] waits). Newly masked ranks are masked in `buf` too; the
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
        let dev: Vec<bool> = st.mask_copy.to_vec().iter().map(|&v| v != 0).collect();
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
        let g = self.ll_state(buf, m, h, e)?;
        let st = g.as_ref().expect("built by ll_state");
        let format = match (use_fp8, use_ue8m0) {
            (false, _) => LowLatencyFormat::Bf16,
            (true, false) => LowLatencyFormat::Fp8,
            (true, true) => LowLatencyFormat::Fp8Ue8m0,
        };
        // Every buffer of the op is allocated on the compute stream (candle's), before the
        // communication stream joins it: their frees then land on the compute stream too, which
        // keeps a captured step's streams joined and orders frees after the kernels without
        // event tracking.
        let cs = &self.compute;
        let rows = l * r * m;
        let groups = h / FP8_GROUP;
        // Rows past the counts are never read (documented as unspecified): no memset.
        let (recv_x_t, recv_x_u8) = if use_fp8 {
            let s = alloc_uninit::<float8::F8E4M3>(cs, rows * h)?;
            let a = alias::<_, u8>(cs, &s, rows * h);
            (wrap(s, (l, r * m, h), &self.dev), a)
        } else {
            let s = alloc_uninit::<half::bf16>(cs, rows * h)?;
            let a = alias::<_, u8>(cs, &s, rows * h * 2);
            (wrap(s, (l, r * m, h), &self.dev), a)
        };
        let scales = alloc_uninit::<f32>(cs, (rows * groups).max(1))?;
        let (recv_x_scales, scales_for_recv, scales_aliased) = if use_fp8 {
            let a = alias::<_, f32>(cs, &scales, rows * groups);
            (Some(wrap(scales, (l, r * m, groups), &self.dev)), a, true)
        } else {
            (None, scales, false)
        };
        // -1 in every row (no host copy: capturable in a CUDA graph).
        let mut src_info = alloc_uninit::<i32>(cs, rows)?;
        ep_kernels::cuda::fill_bytes_cuda(cs, &mut src_info, 0xff)?;
        let src_info_alias = alias::<_, i32>(cs, &src_info, rows);
        let src_info_t = wrap(src_info, (l, r * m), &self.dev);
        let recv_count = alloc::<i32>(cs, l)?;
        let recv_count_alias = alias::<_, i32>(cs, &recv_count, l);
        let recv_count_t = wrap(recv_count, l, &self.dev);
        let mut recv = LowLatencyRecv {
            format,
            recv_x: recv_x_u8,
            recv_x_scales: scales_for_recv,
            recv_count: recv_count_alias,
            recv_src_info: src_info_alias,
            recv_src_topk: alloc::<i32>(cs, rows)?,
            recv_layout_range: alloc::<i32>(cs, l * r * 2)?,
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
                Phases::Send,
                &mut recv,
            )
        };
        let mut owners = vec![recv_x_t.clone(), recv_count_t.clone(), src_info_t.clone()];
        owners.extend(recv_x_scales.iter().cloned());
        let data = Box::new(CudaLlDispatchData {
            recv: ManuallyDrop::new(recv),
            scales_aliased,
            _owners: owners,
        });
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
        } = pending
        else {
            unreachable!("a dispatch hook holds a dispatch")
        };
        let _op = lock(&self.op);
        let mut g = lock(&self.ll);
        let st = g.as_mut().ok_or_else(|| {
            Error::invalid("low_latency", "None", "the low-latency buffer is gone")
        })?;
        let comm = &self.comm;
        {
            let x_d = DeviceTensor::new("x", &x)?;
            let i_d = DeviceTensor::new("topk_idx", &topk)?;
            kll::dispatch_cuda(
                comm,
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
        }
        // The previous op's mask first (its copy is overwritten by this op's).
        let masked = self.ll_poll_mask(buf, st, "low_latency_dispatch");
        self.ll_end_op(st)?;
        let event = self.finish(async_finish)?;
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
        let g = self.ll_state(buf, h.max_tokens, hid, h.placement.num_experts)?;
        let st = g.as_ref().expect("built by ll_state");
        // Allocated on the compute stream before the join (see `ll_dispatch_send`).
        let mut o = alloc::<half::bf16>(&self.compute, t * hid)?;
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
                Phases::Send,
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
        let comm = &self.comm;
        {
            let x_d = DeviceTensor::new("x", &x)?;
            let i_d = DeviceTensor::new("topk_idx", &topk_idx)?;
            let w_d = DeviceTensor::new("topk_weights", &topk_weights)?;
            kll::combine_cuda(
                comm,
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
        }
        let masked = self.ll_poll_mask(buf, st, "low_latency_combine");
        self.ll_end_op(st)?;
        let event = self.finish(async_finish)?;
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
