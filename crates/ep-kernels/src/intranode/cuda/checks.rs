//! Argument checks shared by the launchers of `notify`, `dispatch`, `combine` and the
//! copy-engine path.

use super::{Config, PeerBuffers};
use crate::cuda::Kernels;
use crate::error::{Error, Result};

/// Checks `config` and returns the ranks `R` of `buffers` and the channels `C` of `config`.
pub(super) fn ring_sizes(config: &Config, buffers: &PeerBuffers) -> Result<(usize, usize)> {
    config.validate()?;
    Ok((buffers.num_ranks(), config.num_channels()))
}

/// Checks the lengths of the `[R, R]` rank prefix matrix and the `[R, C]` channel prefix
/// matrix.
pub(super) fn check_prefix_matrices(
    r: usize,
    c: usize,
    rank_prefix_len: usize,
    channel_prefix_len: usize,
) -> Result<()> {
    Error::check_len("rank_prefix_matrix", r * r, rank_prefix_len)?;
    Error::check_len("channel_prefix_matrix", r * c, channel_prefix_len)
}

/// Errors unless the device of `kernels` has an SM for each of the `2 * C` blocks of the ring
/// kernels under `config` (they must all be resident).
pub(super) fn check_resident(config: &Config, kernels: &Kernels) -> Result<()> {
    if 2 * config.num_channels() > kernels.props().sm_count as usize {
        return Err(Error::invalid(
            "num_sms",
            config.num_sms,
            format!(
                "must be <= the device's {} SMs (all blocks must be resident)",
                kernels.props().sm_count
            ),
        ));
    }
    Ok(())
}

/// Checks the rows and routing of a dispatch's `$args` (a
/// [`DispatchArgs`](super::DispatchArgs) or a [`CeDispatchArgs`](super::CeDispatchArgs): the
/// same payload fields) for `$t` tokens sent and `$n` received among `$r` ranks and returns
/// their device pointers on `$stream`: [`dispatch_payload_ptrs`](super::payload::dispatch_payload_ptrs)
/// with `$shape` (the args' row shape) and the args' top-k and expert count.
macro_rules! args_payload_ptrs {
    ($stream:expr, $shape:expr, $args:expr, $t:expr, $n:expr, $r:expr) => {
        $crate::intranode::cuda::payload::dispatch_payload_ptrs(
            $stream,
            $shape,
            $crate::intranode::cuda::payload::PayloadCounts {
                num_tokens: $t,
                num_recv_tokens: $n,
                num_topk: $args.num_topk,
                num_experts: $args.num_experts,
                num_ranks: $r,
            },
            &$args.x,
            &$args.recv_x,
            $args.topk.as_ref(),
            $args.recv_topk.as_ref(),
        )
    };
}
pub(super) use args_payload_ptrs;
