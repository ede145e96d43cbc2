//! Low-latency mode on CUDA tensors: the low-latency kernels over NVLink peer pointers, with
//! send / receive phases, device-side buffer-set parity and the device active-ranks mask.

use super::memory::{PeerMap, PeerRecord};
use super::tensor::{alloc, wrap, DeviceTensor};
use super::{gather_records, kernel_err, lock, CudaBuffer};
use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::low_latency::{LowLatencyCombineOutput, LowLatencyDispatchOutput, LowLatencyHandle};
use candle_core::{DType, Tensor};
use cudarc::driver::{CudaSlice, CudaStream};
use ep_kernels::low_latency::{
    self as kll, LowLatencyBuffer, LowLatencyFormat, LowLatencyLayout, LowLatencyRecv, Phases,
    RecvLayout,
};
use ep_kernels::FP8_GROUP;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// The low-latency buffer of a CUDA [`Buffer`], mapped on every rank.
#[derive(Debug)]
pub(crate) struct LlState {
    /// Peers' buffers mapped here (dropped before `buffer`).
    _peers: PeerMap,
    buffer: LowLatencyBuffer,
    /// `(max_tokens_per_rank, hidden, num_experts)` the layout is for.
    key: (usize, usize, usize),
    /// The mask as last written to / read from the device.
    known_mask: Vec<bool>,
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
        buffer.connect(&cb.comm, peers.ptrs())?;
        Ok(Self {
            _peers: peers,
            buffer,
            key: (m, h, e),
            known_mask: vec![true; r],
        })
    }
}

/// Receive buffers of one low-latency dispatch whose `recv_x` (and, for fp8, `recv_x_scales`)
/// memory is owned by the output tensors; the kernel-side struct only aliases it.
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
            ..
        } = recv;
        // The aliases must not free memory the tensors own.
        let _ = recv_x.leak();
        if self.scales_aliased {
            let _ = recv_x_scales.leak();
        }
    }
}

/// A low-latency op whose send phase is on the stream.
pub(crate) enum LlPending {
    /// A dispatch.
    Dispatch {
        /// The receive buffers (the output tensors own `recv_x` / scales).
        data: Box<CudaLlDispatchData>,
        recv_x: Tensor,
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

/// Host-side parts of a low-latency handle, computed by the shared checks.
pub(crate) struct LlHostPlan {
    pub placement: ep_kernels::layout::ExpertPlacement,
    pub topk_idx: Vec<i64>,
    pub slots: Vec<i32>,
    pub send_counts: Vec<i32>,
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

    /// Reads the device mask after an op (synchronises the communication stream); ranks newly
    /// masked by a device timeout are masked in `buf` too and the first is the error.
    fn ll_check_mask(&self, buf: &Buffer, st: &mut LlState, what: &str) -> Result<()> {
        let dev = st.buffer.active_ranks(&self.comm)?;
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
        self.begin(None)?;
        let comm = &self.comm;
        let rows = l * r * m;
        let groups = h / FP8_GROUP;
        let (recv_x_t, recv_x_u8) = if use_fp8 {
            let s = alloc::<float8::F8E4M3>(comm, rows * h)?;
            let a = alias::<_, u8>(comm, &s, rows * h);
            (wrap(s, (l, r * m, h), &self.dev), a)
        } else {
            let s = alloc::<half::bf16>(comm, rows * h)?;
            let a = alias::<_, u8>(comm, &s, rows * h * 2);
            (wrap(s, (l, r * m, h), &self.dev), a)
        };
        let scales = alloc::<f32>(comm, rows * groups)?;
        let (recv_x_scales, scales_for_recv, scales_aliased) = if use_fp8 {
            let a = alias::<_, f32>(comm, &scales, rows * groups);
            (Some(wrap(scales, (l, r * m, groups), &self.dev)), a, true)
        } else {
            (None, scales, false)
        };
        let src_info = comm.clone_htod(&vec![-1i32; rows])?;
        let mut recv = LowLatencyRecv {
            format,
            recv_x: recv_x_u8,
            recv_x_scales: scales_for_recv,
            recv_count: comm.alloc_zeros(l)?,
            recv_src_info: src_info,
            recv_src_topk: comm.alloc_zeros(rows)?,
            recv_layout_range: comm.alloc_zeros(l * r * 2)?,
        };
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
        let mut owners = vec![recv_x_t.clone()];
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
        let r = self.num_ranks;
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
        let event = self.finish(async_finish)?;
        let masked = self.ll_check_mask(buf, st, "low_latency_dispatch");
        drop(g);
        let l = plan.placement.experts_per_rank();
        let m = plan.max_tokens;
        let ranges = comm.clone_dtoh(&data.recv.recv_layout_range)?;
        let mut counts = vec![0i32; l * r];
        for (i, c) in counts.iter_mut().enumerate() {
            *c = ranges[2 * i + 1];
        }
        let layout = RecvLayout::from_counts(counts, r);
        let packed: Vec<i64> = layout
            .offsets
            .iter()
            .zip(&layout.counts)
            .map(|(&o, &c)| ((o as i64) << 32) | c as i64)
            .collect();
        let dev = &self.dev;
        let recv_count = comm.clone_dtod(&data.recv.recv_count)?;
        let src_info = comm.clone_dtod(&data.recv.recv_src_info)?;
        let recv_count_host: Vec<usize> = layout.recv_count.iter().map(|&c| c as usize).collect();
        let inner = crate::low_latency::dispatch::LlHandleInner {
            buffer_id: self.buffer_id,
            placement: plan.placement,
            num_tokens,
            num_topk,
            hidden: plan.hidden,
            max_tokens: m,
            topk_idx: plan.topk_idx,
            slots: plan.slots,
            send_counts: plan.send_counts,
            src_info: wrap(src_info, (l, r * m), dev),
            layout_range: Tensor::from_vec(
                packed,
                (l, r),
                &candle_core::Device::Cuda(dev.clone()),
            )?,
            layout,
            cuda: Some(Arc::from(data)),
        };
        let out = LowLatencyDispatchOutput {
            recv_x,
            recv_x_scales,
            recv_count: wrap(recv_count, l, dev),
            recv_count_host,
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
        self.begin(None)?;
        let comm = &self.comm;
        let mut o = alloc::<half::bf16>(comm, t * hid)?;
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
        let event = self.finish(async_finish)?;
        let masked = self.ll_check_mask(buf, st, "low_latency_combine");
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
