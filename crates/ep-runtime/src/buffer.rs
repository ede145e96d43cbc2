//! [`Buffer`]: one rank's communication state, and the collectives the ops are built from.

use crate::backend::Backend;
use crate::bootstrap::Store;
use crate::config::BufferConfig;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::topology::Topology;
use crate::transport::{LocalTransport, TcpTransport, Transport};
use candle_core::{DType, Device, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// How often a waiting receive looks at the cancel flag ([`Buffer::cancel_collectives`]).
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// One rank's expert-parallel communication buffer, in the shape of DeepEP's `Buffer`.
///
/// It owns the rank's view of the group (its [`Topology`] and transport), the tuning and
/// sizing in [`BufferConfig`], the low-latency active-ranks mask, and the op sequence that
/// keeps the ranks' messages apart. The ops are
/// [`get_dispatch_layout`](Buffer::get_dispatch_layout), [`dispatch`](Buffer::dispatch),
/// [`combine`](Buffer::combine), [`low_latency_dispatch`](Buffer::low_latency_dispatch) and
/// [`low_latency_combine`](Buffer::low_latency_combine). Every rank must call the same ops in
/// the same order (they are collectives).
///
/// Tensors on the CPU go through the host backend: payloads are moved by the transport
/// (channels between threads, or TCP between processes). With the `cuda` feature, a buffer
/// built on a CUDA device moves CUDA tensors with the NVLink kernels of `ep-kernels` (one
/// node), on its own communication stream.
pub struct Buffer {
    pub(crate) topology: Topology,
    pub(crate) config: BufferConfig,
    pub(crate) id: u64,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) device: Device,
    seq: AtomicU64,
    active: Mutex<Vec<bool>>,
    /// Set by [`Buffer::cancel_collectives`]: receives fail at once until
    /// [`Buffer::resume_collectives`].
    cancelled: AtomicBool,
    /// What moves the tensors: the host backend, or the CUDA backend (NVLink buffers,
    /// streams) for buffers on a CUDA device.
    pub(crate) backend: Backend,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("topology", &self.topology)
            .field("device", &self.device)
            .field("config", &self.config)
            .finish()
    }
}

impl Buffer {
    /// A buffer over an existing transport. The transport's rank and size must match
    /// `topology`.
    pub fn new(
        transport: Arc<dyn Transport>,
        topology: Topology,
        config: BufferConfig,
        device: &Device,
    ) -> Result<Self> {
        config.validate()?;
        if transport.rank() != topology.rank || transport.num_ranks() != topology.num_ranks {
            return Err(Error::invalid(
                "transport",
                format!("rank {} of {}", transport.rank(), transport.num_ranks()),
                format!(
                    "must match topology rank {} of {}",
                    topology.rank, topology.num_ranks
                ),
            ));
        }
        #[cfg(not(feature = "cuda"))]
        if !device.is_cpu() {
            return Err(Error::Unsupported(format!(
                "device {device:?}: this build's buffers move CPU tensors only \
                 (build with the `cuda` feature for GPU buffers)"
            )));
        }
        #[cfg(feature = "cuda")]
        if !device.is_cpu() && !device.is_cuda() {
            return Err(Error::Unsupported(format!(
                "device {device:?}: buffers move CPU or CUDA tensors only"
            )));
        }
        #[allow(unused_mut)]
        let mut buffer = Self {
            topology,
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            transport,
            device: device.clone(),
            seq: AtomicU64::new(0),
            active: Mutex::new(vec![true; topology.num_ranks]),
            cancelled: AtomicBool::new(false),
            config,
            backend: Backend::Host,
        };
        // The CUDA backend is built through the buffer's host collectives.
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let cuda = crate::cuda::CudaBuffer::new(
                &buffer.device,
                buffer.topology,
                &buffer.config,
                &buffer,
            )?;
            buffer.backend = Backend::Cuda(Box::new(cuda));
        }
        Ok(buffer)
    }

    /// Resets the low-latency buffers (sequencing, counters, signals) on every rank, e.g.
    /// after other kernels used their memory or after a timeout. A collective. The host
    /// backend keeps no such state, so there it only synchronises the ranks.
    pub fn clean_low_latency_buffer(&self) -> Result<()> {
        self.backend.clean_low_latency_buffer(self)
    }

    /// Waits for the last low-latency op and fails naming the first rank the device masked
    /// during it (low-latency ops on CUDA buffers report a device timeout without waiting, one
    /// op later; this call reports it now). The host backend reports timeouts as they happen,
    /// so there this only returns `Ok`.
    pub fn low_latency_check(&self) -> Result<()> {
        self.backend.low_latency_check(self)
    }

    /// Reports, without waiting, a rank the device masked during the last low-latency op or
    /// replay whose completion the host can already see (`Ok` when none, or when nothing is
    /// known yet).
    pub fn low_latency_poll(&self) -> Result<()> {
        self.backend.low_latency_poll(self)
    }

    /// Tells a CUDA buffer that a replay of a captured step containing its low-latency ops was
    /// just launched on candle's stream (so that [`Buffer::low_latency_poll`] can see its
    /// outcome). A no-op for the host backend.
    pub fn low_latency_note_replay(&self) -> Result<()> {
        self.backend.low_latency_note_replay()
    }

    /// Whether normal-mode [`Buffer::dispatch`] / [`Buffer::combine`] are available now: always
    /// on CPU; for a CUDA buffer while no rank is masked (its normal mode refuses then), and
    /// across nodes (feature `nvshmem`) only with [`BufferConfig::with_internode`]. Without it,
    /// callers run the low-latency ops only (as `MoeLayer` does, in chunks).
    pub fn has_normal_mode(&self) -> bool {
        self.backend.has_normal_mode() && (self.device.is_cpu() || self.masked_ranks().is_empty())
    }

    /// Most tokens a rank may dispatch in one normal-mode op: across nodes, the
    /// `max_tokens_per_rank` of [`BufferConfig::internode`] (the internode buffer's size; CPU
    /// buffers report the same limit so that callers behave alike on both backends), `None`
    /// (no limit) on one node or without that sizing.
    pub fn normal_mode_max_tokens(&self) -> Option<usize> {
        if self.topology.num_nodes() > 1 {
            self.config.internode.map(|s| s.max_tokens_per_rank)
        } else {
            None
        }
    }

    /// The CUDA stream the buffer's communication kernels run on (`None` for CPU buffers).
    #[cfg(feature = "cuda")]
    pub fn comm_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        self.backend.comm_stream()
    }

    /// A group of one rank on `device` (CPU, or a CUDA device for a CUDA buffer): every op is
    /// local, and on CUDA the layer around it runs entirely on the GPU.
    pub fn single(device: &Device, config: BufferConfig) -> Result<Self> {
        let transport = LocalTransport::group(1)
            .pop()
            .ok_or_else(|| Error::invalid("num_ranks", 1, "a local group of one rank"))?;
        Self::new(Arc::new(transport), Topology::new(0, 1, 1)?, config, device)
    }

    /// `num_ranks` CPU ranks as threads of this process: element `i` is rank `i`'s buffer
    /// (move each into its own thread).
    pub fn local_group(
        num_ranks: usize,
        gpus_per_node: usize,
        config: BufferConfig,
    ) -> Result<Vec<Self>> {
        Topology::new(0, num_ranks, gpus_per_node)?;
        LocalTransport::group(num_ranks)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let topology = Topology::new(rank, num_ranks, gpus_per_node)?;
                Self::new(Arc::new(t), topology, config.clone(), &Device::Cpu)
            })
            .collect()
    }

    /// One process per rank: connects this rank to its peers through the bootstrap store
    /// (a TCP mesh for the host backend). Every rank must create its buffers in the same
    /// order.
    pub fn from_store(
        store: &Store,
        topology: Topology,
        config: BufferConfig,
        device: &Device,
    ) -> Result<Self> {
        if store.rank() != topology.rank || store.world_size() != topology.num_ranks {
            return Err(Error::invalid(
                "store",
                format!("rank {} of {}", store.rank(), store.world_size()),
                format!(
                    "must match topology rank {} of {}",
                    topology.rank, topology.num_ranks
                ),
            ));
        }
        // The store counts the all-gathers behind each connect, so buffers created in the
        // same order on every rank pair up under one group name.
        let transport = TcpTransport::connect(store, "ep-buffer", config.timeout)?;
        Self::new(Arc::new(transport), topology, config, device)
    }

    /// This rank's place in the group.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// The configuration the buffer was built with.
    pub fn config(&self) -> &BufferConfig {
        &self.config
    }

    /// The device whose tensors this buffer moves.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Which ranks take part in the collectives (`false` = masked: timed out or masked on
    /// purpose). Masked ranks are neither sent to nor waited for: in low-latency mode and in
    /// the host backend's normal mode their experts contribute zero; the host all-gathers skip
    /// them; normal mode on CUDA buffers refuses to run while a rank is masked.
    pub fn active_ranks(&self) -> Vec<bool> {
        self.active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Masks `rank` out of the collectives on purpose (see [`Buffer::active_ranks`]).
    pub fn mask_rank(&self, rank: usize) -> Result<()> {
        self.check_rank(rank)?;
        if rank == self.topology.rank {
            return Err(Error::invalid("rank", rank, "a rank cannot mask itself"));
        }
        self.active.lock().unwrap_or_else(|e| e.into_inner())[rank] = false;
        Ok(())
    }

    /// Marks every rank active again.
    pub fn reset_active_ranks(&self) {
        self.active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .for_each(|a| *a = true);
    }

    /// Cancels this rank's host collectives: a receive waiting now, and every later one, fails
    /// at once with [`Error::Cancelled`] (its peer is not masked) until
    /// [`Buffer::resume_collectives`]. Called when another rank has started a failure
    /// agreement ([`crate::Membership`]), so that no survivor waits out its timeout on a peer
    /// that has left the step to agree.
    pub fn cancel_collectives(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    /// Whether the host collectives are cancelled ([`Buffer::cancel_collectives`]).
    pub fn collectives_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Resumes the host collectives after a failure agreement: the ranks of `lost` masked,
    /// every other rank active again, and the next round numbered `next_round` (the same on
    /// every survivor, so that their messages match again whatever rounds each had run when
    /// the step broke off).
    pub fn resume_collectives(&self, lost: &[usize], next_round: u64) -> Result<()> {
        for &r in lost {
            self.check_rank(r)?;
            if r == self.topology.rank {
                return Err(Error::invalid("lost", r, "a rank cannot mask itself"));
            }
        }
        {
            let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
            active.iter_mut().for_each(|a| *a = true);
            lost.iter().for_each(|&r| active[r] = false);
        }
        self.seq.store(next_round, Ordering::Relaxed);
        self.cancelled.store(false, Ordering::Release);
        Ok(())
    }

    /// A receive from `peer` that gives up at `deadline` or as soon as the collectives are
    /// cancelled.
    fn recv_or_cancel(
        &self,
        peer: usize,
        tag: u64,
        deadline: Instant,
        what: &str,
    ) -> Result<Vec<u8>> {
        let started = Instant::now();
        loop {
            if self.collectives_cancelled() {
                return Err(Error::Cancelled {
                    what: format!("{what} (waiting for rank {peer})"),
                });
            }
            let slice = deadline.min(Instant::now() + CANCEL_POLL);
            match self.transport.recv(peer, tag, slice) {
                Err(Error::Timeout { .. }) if slice < deadline => continue,
                Err(Error::Timeout { rank, what, .. }) => {
                    return Err(Error::Timeout {
                        rank,
                        what,
                        waited: started.elapsed(),
                    })
                }
                r => return r,
            }
        }
    }

    /// The masked ranks, in order.
    pub(crate) fn masked_ranks(&self) -> Vec<usize> {
        self.active_ranks()
            .iter()
            .enumerate()
            .filter(|(_, &a)| !a)
            .map(|(r, _)| r)
            .collect()
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.topology.num_ranks {
            return Err(Error::invalid(
                "rank",
                rank,
                format!("must be < num_ranks = {}", self.topology.num_ranks),
            ));
        }
        Ok(())
    }

    /// Gathers a small control message from every rank (index = rank), e.g. a serving
    /// loop's per-step batch sizes. A collective: every active rank must call it. Masked ranks
    /// ([`Buffer::active_ranks`]) are skipped (their entries are empty); a rank that does not
    /// answer within the timeout is masked and named in the error.
    pub fn host_all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(self
            .gather_active(data)?
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect())
    }

    /// [`Buffer::host_all_gather`] with `None` for the masked ranks.
    fn gather_active(&self, data: &[u8]) -> Result<Vec<Option<Vec<u8>>>> {
        let n = self.topology.num_ranks;
        self.exchange_active("all_gather", (0..n).map(|_| Some(data.to_vec())).collect())
    }

    /// Sends `send[p]` to rank `p` (`None`: nothing) and returns what each rank sent this one
    /// (index = sender; `send[own rank]` comes back as is), e.g. expert weights that change
    /// rank. A collective: every rank must call it, in the same order as its other
    /// collectives; a peer that does not answer within the timeout is an error naming it.
    pub fn host_exchange(&self, send: Vec<Option<Vec<u8>>>) -> Result<Vec<Option<Vec<u8>>>> {
        let n = self.topology.num_ranks;
        if send.len() != n {
            return Err(Error::invalid(
                "send",
                format!("{} messages", send.len()),
                format!("needs one entry per rank ({n})"),
            ));
        }
        // Every peer hears from every rank (a bare marker for `None`), so each knows when the
        // exchange is complete. The marker goes last: added and taken off without copying the
        // payload.
        let me = self.topology.rank;
        let framed = send
            .into_iter()
            .enumerate()
            .map(|(p, m)| match (p == me, m) {
                (true, m) => m.map(|m| with_marker(m, 1)),
                (false, Some(m)) => Some(with_marker(m, 1)),
                (false, None) => Some(vec![0u8]),
            })
            .collect();
        let got = self.exchange_active("exchange", framed)?;
        Ok(got
            .into_iter()
            .map(|m| {
                let mut m = m?;
                (m.pop() == Some(1)).then_some(m)
            })
            .collect())
    }

    /// How many rounds of host messages this buffer has run: each all-gather, and each op of
    /// the host backend (CPU tensors). A CUDA op leaves it alone, so a serving loop can check
    /// that a step added no host collective beyond the ones it asked for.
    pub fn host_rounds(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// The largest `value` over all active ranks (a collective), e.g. to pick one mode for a
    /// step.
    pub fn max_over_ranks(&self, value: u64) -> Result<u64> {
        let all = self.gather_active(&value.to_le_bytes())?;
        all.iter()
            .enumerate()
            .filter_map(|(r, b)| b.as_ref().map(|b| (r, b)))
            .map(|(r, b)| {
                b.as_slice()
                    .try_into()
                    .map(u64::from_le_bytes)
                    .map_err(|_| Error::Protocol {
                        rank: r,
                        what: format!("expected 8 bytes, got {}", b.len()),
                    })
            })
            .try_fold(0u64, |m, v| Ok(m.max(v?)))
    }

    /// One round of point-to-point messages: `send[p]` goes to rank `p` (`None`: nothing),
    /// and every other rank's message is received. With `masking` (low-latency ops),
    /// inactive ranks are neither sent to nor waited for, and a peer that fails is marked
    /// inactive and its slot left `None`; the failures are pushed to `masking`'s vector
    /// instead of being returned. Otherwise the first failure (in rank order) is the error.
    pub(crate) fn exchange(
        &self,
        what: &str,
        send: Vec<Option<Vec<u8>>>,
        mut masking: Option<&mut Vec<Error>>,
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let posted = self.post(what, send, masking.as_deref_mut())?;
        self.complete(posted, masking)
    }

    /// One round of point-to-point messages among the active ranks: masked ranks are neither
    /// sent to nor waited for (their slots come back `None`), and a peer that fails is masked
    /// and named in the error (the round's other messages are still delivered, so the healthy
    /// peers finish the round too).
    pub(crate) fn exchange_active(
        &self,
        what: &str,
        send: Vec<Option<Vec<u8>>>,
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let mut fails = Vec::new();
        let got = self.exchange(what, send, Some(&mut fails))?;
        match fails.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(got),
        }
    }

    /// The send half of [`Buffer::exchange`].
    pub(crate) fn post(
        &self,
        what: &str,
        send: Vec<Option<Vec<u8>>>,
        mut masking: Option<&mut Vec<Error>>,
    ) -> Result<Posted> {
        let n = self.topology.num_ranks;
        let me = self.topology.rank;
        let tag = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut own = None;
        // A failed send does not stop the others: healthy peers must not wait for us (and
        // then blame us) because another peer is gone.
        let mut first_err = None;
        for (p, msg) in send.into_iter().enumerate() {
            let Some(msg) = msg else { continue };
            if p == me {
                own = Some(msg);
            } else if masking.is_none() || self.active_ranks()[p] {
                if let Err(e) = self.transport.send(p, tag, msg) {
                    match masking.as_deref_mut() {
                        Some(fails) => {
                            self.active.lock().unwrap_or_else(|e| e.into_inner())[p] = false;
                            fails.push(e);
                        }
                        None => {
                            tracing::error!(rank = p, op = what, "peer failed: {e}");
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        debug_assert!(n > me);
        Ok(Posted {
            tag,
            own,
            what: what.to_string(),
        })
    }

    /// The receive half of [`Buffer::exchange`].
    pub(crate) fn complete(
        &self,
        posted: Posted,
        mut masking: Option<&mut Vec<Error>>,
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let n = self.topology.num_ranks;
        let me = self.topology.rank;
        let mut out: Vec<Option<Vec<u8>>> = vec![None; n];
        out[me] = posted.own;
        let deadline = Instant::now() + self.config.timeout;
        for p in (0..n).filter(|&p| p != me) {
            if masking.is_some() && !self.active_ranks()[p] {
                continue;
            }
            match self.recv_or_cancel(p, posted.tag, deadline, &posted.what) {
                Ok(m) => out[p] = Some(m),
                // Not the peer's doing: it is not masked.
                Err(e @ Error::Cancelled { .. }) => return Err(e),
                Err(e) => match masking.as_deref_mut() {
                    Some(fails) => {
                        tracing::warn!(rank = p, op = %posted.what, "peer failed; masking it: {e}");
                        self.active.lock().unwrap_or_else(|e| e.into_inner())[p] = false;
                        fails.push(e);
                    }
                    None => {
                        tracing::error!(rank = p, op = %posted.what, "peer failed: {e}");
                        return Err(e);
                    }
                },
            }
        }
        Ok(out)
    }

    /// Checks that `t` lives on this buffer's device.
    pub(crate) fn check_device(&self, arg: &'static str, t: &Tensor) -> Result<()> {
        if !t.device().same_device(&self.device) {
            return Err(Error::invalid(
                arg,
                format!("a tensor on {:?}", t.device()),
                format!("must be on the buffer's device {:?}", self.device),
            ));
        }
        Ok(())
    }
}

impl Group for Buffer {
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.host_all_gather(data)
    }

    fn active_ranks(&self) -> Vec<bool> {
        Buffer::active_ranks(self)
    }

    fn mask_rank(&self, rank: usize) -> Result<()> {
        Buffer::mask_rank(self, rank)
    }
}

/// Messages of one exchange that were sent but not yet received.
#[derive(Debug)]
pub(crate) struct Posted {
    tag: u64,
    own: Option<Vec<u8>>,
    what: String,
}

/// Checks a tensor's shape against `expected` (`None` = any size in that dimension).
pub(crate) fn check_shape(arg: &'static str, t: &Tensor, expected: &[Option<usize>]) -> Result<()> {
    let dims = t.dims();
    let ok = dims.len() == expected.len()
        && dims
            .iter()
            .zip(expected)
            .all(|(d, e)| e.is_none_or(|e| e == *d));
    if ok {
        Ok(())
    } else {
        let words: Vec<String> = expected
            .iter()
            .map(|e| e.map_or("_".to_string(), |v| v.to_string()))
            .collect();
        Err(Error::Shape {
            arg,
            expected: format!("[{}]", words.join(", ")),
            got: dims.to_vec(),
        })
    }
}

/// Checks a tensor's dtype.
pub(crate) fn check_dtype(
    arg: &'static str,
    t: &Tensor,
    ok: &[DType],
    expected: &'static str,
) -> Result<()> {
    if ok.contains(&t.dtype()) {
        Ok(())
    } else {
        Err(Error::DType {
            arg,
            expected,
            got: t.dtype(),
        })
    }
}

/// `m` with the byte `marker` appended ([`Buffer::host_exchange`]).
fn with_marker(mut m: Vec<u8>, marker: u8) -> Vec<u8> {
    m.push(marker);
    m
}
