//! Low-latency mode on CUDA tensors: the low-latency kernels over NVLink peer pointers, with
//! send / receive phases, device-side buffer-set parity and the device active-ranks mask.
//! This file holds the mode's state and mask tracking; the ops are in `ll_ops.rs`.
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

use super::common::{self, gather_records, kernel_err, lock};
use super::memory::{PeerMap, PeerRecord};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::group::Group;
use crate::topology::Topology;
use candle_core::cuda_backend::CudaDevice;
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaEvent, CudaStream};
use ep_kernels::low_latency::{self as kll, LowLatencyBuffer, LowLatencyLayout};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The low-latency buffer of a CUDA buffer, mapped on every rank.
///
/// The device masks a peer that times out (and the op completes without it). The host learns
/// of it without waiting: the receive kernel of every op leaves the device mask in host-mapped
/// memory ([`LowLatencyBuffer::active_ranks_mirror`]) and the op ends with an event; the next
/// op (or [`LowLatencyCuda::check`]) reads the mirror once the event has completed and
/// reports newly masked ranks then.
#[derive(Debug)]
pub(super) struct LlState {
    /// Peers' buffers mapped here (dropped before `buffer`; `None` for a buffer on NVSHMEM's
    /// heap, which NVSHMEM maps).
    _peers: Option<PeerMap>,
    pub(super) buffer: LowLatencyBuffer,
    /// `(max_tokens_per_rank, hidden, num_experts)` the layout is for.
    key: (usize, usize, usize),
    /// The mask as last written to / read from the device.
    known_mask: Vec<bool>,
    /// The end of the last op whose receive kernel wrote the mask mirror (`None` while one is
    /// in flight whose end is not recorded yet, or while capturing).
    pub(super) mask_event: Option<Arc<CudaEvent>>,
}

/// The low-latency mode of a CUDA buffer: its streams (shared with the normal mode), its
/// buffer (built for the sizing the ops use) and the tracking of the device mask.
#[derive(Debug)]
pub(crate) struct LowLatencyCuda {
    pub(super) dev: CudaDevice,
    /// candle's stream (the caller's compute stream).
    pub(super) compute: Arc<CudaStream>,
    /// The communication stream.
    pub(super) comm: Arc<CudaStream>,
    pub(super) num_ranks: usize,
    /// This rank's place (rank, nodes).
    topo: Topology,
    pub(super) timeout: Duration,
    /// Serialises the buffer's ops (shared with the normal mode).
    pub(super) op: Arc<Mutex<()>>,
    /// The buffer (`None` until the first op, or when the buffer was built without a sizing).
    pub(super) state: Mutex<Option<LlState>>,
    /// Across nodes: the NVSHMEM instance the buffer's memory and puts go through.
    #[cfg(feature = "nvshmem")]
    nvshmem: Option<Arc<nvshmem_sys::Nvshmem>>,
}

impl LowLatencyCuda {
    /// The mode of rank `topo` on `dev`'s streams; its buffer is built by [`Self::build`] or
    /// by the first op.
    pub(super) fn new(
        dev: &CudaDevice,
        comm: &Arc<CudaStream>,
        topo: Topology,
        timeout: Duration,
        op: Arc<Mutex<()>>,
    ) -> Self {
        Self {
            dev: dev.clone(),
            compute: dev.cuda_stream(),
            comm: comm.clone(),
            num_ranks: topo.num_ranks,
            topo,
            timeout,
            op,
            state: Mutex::new(None),
            #[cfg(feature = "nvshmem")]
            nvshmem: None,
        }
    }

    /// Builds the buffers on NVSHMEM's heap through `nv` (across nodes), or as usual (`None`).
    #[cfg(feature = "nvshmem")]
    pub(super) fn with_nvshmem(self, nv: Option<Arc<nvshmem_sys::Nvshmem>>) -> Self {
        Self {
            nvshmem: nv,
            ..self
        }
    }

    /// Allocates, zeroes and maps the low-latency buffers of every rank for `(m, h, e)` (a
    /// collective), replacing the current ones.
    pub(super) fn build(&self, group: &dyn Group, m: usize, h: usize, e: usize) -> Result<()> {
        let mut g = lock(&self.state);
        *g = None;
        *g = Some(self.new_state(group, m, h, e)?);
        Ok(())
    }

    fn new_state(&self, group: &dyn Group, m: usize, h: usize, e: usize) -> Result<LlState> {
        let r = self.num_ranks;
        let layout = LowLatencyLayout::new(m, h, r, e)?;
        #[cfg(feature = "nvshmem")]
        if let Some(nv) = &self.nvshmem {
            // Collective over NVSHMEM's PEs (every rank builds in the same order).
            let topo = self.topo;
            let mut buffer =
                LowLatencyBuffer::new_nvshmem(&self.comm, layout, nv, |q| topo.same_node(q))?;
            buffer.set_timeout(self.timeout);
            return Ok(LlState {
                _peers: None,
                buffer,
                key: (m, h, e),
                known_mask: vec![true; r],
                mask_event: None,
            });
        }
        let mut buffer = LowLatencyBuffer::new(&self.comm, layout, self.topo.rank)?;
        buffer.set_timeout(self.timeout);
        let ctx = self.comm.context().clone();
        // `LowLatencyBuffer::new` allocates device memory (never NVSHMEM's heap).
        let mem = buffer.memory().ok_or_else(|| {
            Error::Unsupported("a low-latency buffer on NVSHMEM's heap has no IPC handle".into())
        })?;
        let own = PeerRecord::of(mem, ctx.ordinal())?;
        let records = gather_records(group, own)?;
        let peers = PeerMap::open(&ctx, &records, self.topo.rank, |i| i)?;
        // SAFETY: `peers` maps every rank's low-latency buffer of this layout into this
        // context (IPC or peer pointers, own entry = own base); it is kept in `LlState` next to
        // `buffer` and dropped after it.
        unsafe { buffer.connect(&self.comm, peers.ptrs()) }?;
        Ok(LlState {
            _peers: Some(peers),
            buffer,
            key: (m, h, e),
            known_mask: vec![true; r],
            mask_event: None,
        })
    }

    /// Whether an op's send call also runs its receive phase (one `Both` launch instead of two).
    pub(super) fn fuse_phases(&self) -> bool {
        self.num_ranks == 1
    }

    /// Makes the communication stream wait for candle's stream.
    pub(super) fn begin(&self) -> Result<()> {
        common::begin(&self.compute, &self.comm, None)
    }

    /// Makes sure the low-latency buffer is laid out for `(m, h, e)` (rebuilding it, a
    /// collective, if not) and that the device mask matches the group's.
    pub(super) fn state_for<'a>(
        &'a self,
        group: &dyn Group,
        m: usize,
        h: usize,
        e: usize,
    ) -> Result<MutexGuard<'a, Option<LlState>>> {
        let mut g = lock(&self.state);
        if g.as_ref().is_none_or(|s| s.key != (m, h, e)) {
            *g = None;
            *g = Some(self.new_state(group, m, h, e)?);
        }
        let st = g.as_mut().expect("set above");
        let host = group.active_ranks();
        if host != st.known_mask {
            st.buffer.set_active_ranks(&self.comm, &host)?;
            st.known_mask = host;
        }
        Ok(g)
    }

    /// Ends an op on the communication stream (in synchronous mode candle's stream waits for
    /// it); its event also tells when the mask mirror the op's receive kernel wrote is
    /// readable.
    pub(super) fn end_op(&self, st: &mut LlState, async_finish: bool) -> Result<EventOverlap> {
        let ev = common::finish_event(&self.compute, &self.comm, async_finish)?;
        // An event recorded while capturing a CUDA graph cannot be queried afterwards: a
        // captured step's replays are tracked by `note_replay` instead.
        st.mask_event = if self.capturing()? {
            None
        } else {
            Some(ev.clone())
        };
        Ok(EventOverlap::from_cuda(ev))
    }

    /// Whether a CUDA graph is being captured on candle's stream or the communication stream
    /// (a capture starts on candle's stream; the communication stream joins it only once the
    /// op begins, after the send call has polled the previous op's mask).
    fn capturing(&self) -> Result<bool> {
        use CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as NONE;
        Ok(!matches!(self.compute.capture_status()?, NONE)
            || !matches!(self.comm.capture_status()?, NONE))
    }

    /// After a replay of a captured low-latency step was launched on candle's stream: records
    /// the event whose completion makes the step's mask copy readable.
    pub(crate) fn note_replay(&self) -> Result<()> {
        let mut g = lock(&self.state);
        if let Some(st) = g.as_mut() {
            st.mask_event = Some(Arc::new(self.compute.record_event(None)?));
        }
        Ok(())
    }

    /// [`Self::poll_mask`] outside an op.
    pub(crate) fn poll(&self, group: &dyn Group) -> Result<()> {
        let mut g = lock(&self.state);
        match g.as_mut() {
            Some(st) => self.poll_mask(group, st, "low-latency op"),
            None => Ok(()),
        }
    }

    /// Reports ranks the device masked in the previous op, without waiting: reads the
    /// host-mapped mask mirror of that op if its event has completed (else nothing is known
    /// yet; [`Self::check`] waits). Call it before launching a receive kernel, which rewrites
    /// the mirror. Newly masked ranks are masked in `group` too; the first is the error
    /// (returned by the op that looked, after it completed on every rank).
    pub(super) fn poll_mask(&self, group: &dyn Group, st: &mut LlState, what: &str) -> Result<()> {
        // Querying an event is not allowed while a graph is being captured; the captured
        // step's replays are polled afterwards.
        if self.capturing()? {
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
        self.report_mask(group, st, dev, what)
    }

    /// Compares a mask read from the device with the known one (see [`Self::poll_mask`]).
    fn report_mask(
        &self,
        group: &dyn Group,
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
            group.mask_rank(p)?;
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
    pub(crate) fn check(&self, group: &dyn Group) -> Result<()> {
        let _op = lock(&self.op);
        let mut g = lock(&self.state);
        let Some(st) = g.as_mut() else {
            return Ok(());
        };
        let dev = st.buffer.active_ranks(&self.comm)?;
        self.report_mask(group, st, dev, "low-latency op")
    }

    /// Resets the low-latency buffer's sequencing, counters, signals and flags on every rank
    /// (a collective, with a host barrier before and after).
    pub(crate) fn clean_buffer(&self, group: &dyn Group) -> Result<()> {
        let _op = lock(&self.op);
        group.all_gather(&[])?;
        {
            let g = lock(&self.state);
            if let Some(st) = g.as_ref() {
                self.begin()?;
                kll::clean_buffer_cuda(&self.comm, &st.buffer, false)
                    .map_err(|e| kernel_err(e, self.timeout))?;
                self.comm.synchronize()?;
            }
        }
        group.all_gather(&[])?;
        Ok(())
    }
}
