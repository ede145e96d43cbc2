//! What the notify steps of the two normal modes share
//! ([`crate::intranode::notify_dispatch_cuda`], and `crate::internode::notify_cuda` with the
//! `nvshmem` feature): the routing a fresh dispatch exchanges, checked and turned into params
//! fields ([`Routing`]), and the host's read of the receive counts the kernels leave in
//! host-mapped counters ([`poll_recv_counts`]).

use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, DevicePtr, SyncOnDrop};

use crate::cuda::to_i32;
use crate::error::{Error, Result};
use crate::intranode::MAX_LOCAL_EXPERTS;
use crate::memory::HostMappedI32;

/// Extra time the host waits for the counts beyond the device timeout, so that the device's
/// error record (naming the late rank) arrives first.
pub const HOST_GRACE: Duration = Duration::from_secs(2);

/// The routing of this rank that a fresh dispatch's notify step exchanges, borrowed from a
/// launcher's arguments (`T` tokens, `R` ranks, `E` experts).
pub(crate) struct Routing<'r, 'a> {
    /// `[R]` tokens this rank sends to each rank.
    pub num_tokens_per_rank: &'r CudaView<'a, i32>,
    /// `[E]` (token, expert) pairs this rank sends to each expert.
    pub num_tokens_per_expert: &'r CudaView<'a, i32>,
    /// `[T, R]` 0/1 bytes.
    pub is_token_in_rank: &'r CudaView<'a, u8>,
    /// `T`.
    pub num_tokens: usize,
    /// `E`.
    pub num_experts: usize,
    /// Per-expert receive counts are rounded up to a multiple of this.
    pub expert_alignment: usize,
}

/// The params fields of a [`Routing`]: its device pointers and sizes.
pub(crate) struct RoutingParams {
    pub num_tokens_per_rank: CUdeviceptr,
    pub num_tokens_per_expert: CUdeviceptr,
    pub is_token_in_rank: CUdeviceptr,
    pub num_tokens: i32,
    pub num_experts: i32,
    pub expert_alignment: i32,
}

impl<'r> Routing<'r, '_> {
    /// Checks the routing for `num_ranks` ranks (`E` a positive multiple of `R` with at most
    /// [`MAX_LOCAL_EXPERTS`] per rank, an alignment of at least 1, the views' lengths) and
    /// returns the local experts `L = E / R`.
    pub fn check(&self, num_ranks: usize) -> Result<usize> {
        let (r, e) = (num_ranks, self.num_experts);
        if e == 0 || e % r != 0 {
            return Err(Error::invalid(
                "num_experts",
                e,
                format!("must be a positive multiple of num_ranks = {r}"),
            ));
        }
        let l = e / r;
        if l > MAX_LOCAL_EXPERTS {
            return Err(Error::invalid(
                "num_experts",
                e,
                format!("num_experts / num_ranks must be <= {MAX_LOCAL_EXPERTS}"),
            ));
        }
        if self.expert_alignment == 0 {
            return Err(Error::invalid("expert_alignment", 0, "must be at least 1"));
        }
        Error::check_len("num_tokens_per_rank", r, self.num_tokens_per_rank.len())?;
        Error::check_len("num_tokens_per_expert", e, self.num_tokens_per_expert.len())?;
        Error::check_len(
            "is_token_in_rank",
            self.num_tokens * r,
            self.is_token_in_rank.len(),
        )?;
        Ok(l)
    }

    /// The params fields on `stream`, with the guards that keep cudarc's stream ordering
    /// (hold them until the launch is queued; they borrow the views, not `self`).
    pub fn params<'s>(&self, stream: &'s CudaStream) -> Result<(RoutingParams, [SyncOnDrop<'s>; 3])>
    where
        'r: 's,
    {
        let (ntpr, g0) = DevicePtr::device_ptr(self.num_tokens_per_rank, stream);
        let (ntpe, g1) = DevicePtr::device_ptr(self.num_tokens_per_expert, stream);
        let (itir, g2) = DevicePtr::device_ptr(self.is_token_in_rank, stream);
        let params = RoutingParams {
            num_tokens_per_rank: ntpr,
            num_tokens_per_expert: ntpe,
            is_token_in_rank: itir,
            num_tokens: to_i32("num_tokens", self.num_tokens)?,
            num_experts: to_i32("num_experts", self.num_experts)?,
            expert_alignment: to_i32("expert_alignment", self.expert_alignment)?,
        };
        Ok((params, [g0, g1, g2]))
    }
}

/// What the notify step of a fresh dispatch tells this rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvCounts {
    /// Rows of `recv_x`.
    pub num_recv_tokens: usize,
    /// Rows from each source rank.
    pub per_source: Vec<usize>,
    /// Aligned rows per local expert.
    pub per_expert: Vec<usize>,
}

/// Reads the receive counts a fresh dispatch's notify kernel writes to host-mapped counters
/// (set to `-1` before its launch): word 0 of `recv_counter` (rows received, written after
/// the rest), words `1..=num_ranks` (rows per source), and words `0..num_local_experts` of
/// `expert_counter` (aligned rows per local expert). Waits for each polled word to turn
/// non-negative, running `check` (the caller's look at the device's error record) between
/// reads; once `timeout +` [`HOST_GRACE`] has passed since the first read, returns
/// `timed_out(waited)`.
pub fn poll_recv_counts<E>(
    recv_counter: &HostMappedI32,
    expert_counter: &HostMappedI32,
    num_ranks: usize,
    num_local_experts: usize,
    timeout: Duration,
    mut check: impl FnMut() -> std::result::Result<(), E>,
    timed_out: impl Fn(Duration) -> E,
) -> std::result::Result<RecvCounts, E> {
    let start = Instant::now();
    let mut poll = |counter: &HostMappedI32, i: usize| loop {
        let v = counter.get(i);
        if v >= 0 {
            return Ok(v as usize);
        }
        check()?;
        if start.elapsed() > timeout + HOST_GRACE {
            return Err(timed_out(start.elapsed()));
        }
        std::thread::yield_now();
    };
    let num_recv_tokens = poll(recv_counter, 0)?;
    let per_source = (0..num_ranks)
        .map(|s| recv_counter.get(1 + s).max(0) as usize)
        .collect();
    let per_expert = (0..num_local_experts)
        .map(|e| poll(expert_counter, e))
        .collect::<std::result::Result<Vec<_>, E>>()?;
    Ok(RecvCounts {
        num_recv_tokens,
        per_source,
        per_expert,
    })
}
