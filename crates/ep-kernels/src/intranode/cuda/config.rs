//! Launch configuration of the SM-ring dispatch and combine, and the NVLink buffer bytes it
//! needs.

use super::{PeerBuffers, RING_BASE};
use crate::error::{Error, Result};
use crate::intranode::ring_bytes::rings_buffer_bytes;
pub(super) use crate::intranode::ring_bytes::{combine_ring_bytes, dispatch_ring_bytes};

/// Most channels, `num_sms / 2` (`kMaxChannels`).
pub const MAX_CHANNELS: usize = 128;

/// Launch configuration of dispatch and combine.
///
/// `num_sms` SMs run `num_sms / 2` channels (one sending and one receiving block each); every
/// (channel, peer) pair has a ring of `num_max_recv_tokens` token slots in the receiver's NVLink
/// buffer, filled in chunks of up to `num_max_send_tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// SMs used (even, `2..=2 * MAX_CHANNELS`).
    pub num_sms: usize,
    /// Tokens a sender copies before publishing its tail (chunk size).
    pub num_max_send_tokens: usize,
    /// Ring capacity in tokens per (channel, peer).
    pub num_max_recv_tokens: usize,
}

impl Config {
    /// Checks the invariants: `num_sms` even in `[2, 2 * MAX_CHANNELS]`,
    /// `1 <= num_max_send_tokens <= num_max_recv_tokens`.
    pub fn new(
        num_sms: usize,
        num_max_send_tokens: usize,
        num_max_recv_tokens: usize,
    ) -> Result<Self> {
        if num_sms < 2 || num_sms % 2 != 0 || num_sms > 2 * MAX_CHANNELS {
            return Err(Error::invalid(
                "num_sms",
                num_sms,
                format!("must be even and in [2, {}]", 2 * MAX_CHANNELS),
            ));
        }
        if num_max_send_tokens == 0 {
            return Err(Error::invalid(
                "num_max_send_tokens",
                0,
                "must be at least 1",
            ));
        }
        if num_max_recv_tokens < num_max_send_tokens || num_max_recv_tokens > (1 << 20) {
            return Err(Error::invalid(
                "num_max_recv_tokens",
                num_max_recv_tokens,
                format!("must be in [num_max_send_tokens = {num_max_send_tokens}, 2^20]"),
            ));
        }
        Ok(Self {
            num_sms,
            num_max_send_tokens,
            num_max_recv_tokens,
        })
    }

    /// Tuned dispatch defaults for `num_ranks` ranks: 24 SMs, 256-token rings, the dispatch
    /// chunk of [`tuned_send_tokens`](crate::intranode::tuned_send_tokens).
    pub fn dispatch_default(num_ranks: usize) -> Self {
        Self {
            num_sms: 24,
            num_max_send_tokens: crate::intranode::tuned_send_tokens(num_ranks).0,
            num_max_recv_tokens: 256,
        }
    }

    /// Tuned combine defaults for `num_ranks` ranks: 24 SMs, 256-token rings, the combine
    /// chunk of [`tuned_send_tokens`](crate::intranode::tuned_send_tokens).
    pub fn combine_default(num_ranks: usize) -> Self {
        Self {
            num_sms: 24,
            num_max_send_tokens: crate::intranode::tuned_send_tokens(num_ranks).1,
            num_max_recv_tokens: 256,
        }
    }

    /// Number of channels, `num_sms / 2`.
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    pub(super) fn validate(&self) -> Result<()> {
        Self::new(
            self.num_sms,
            self.num_max_send_tokens,
            self.num_max_recv_tokens,
        )
        .map(|_| ())
    }
}

/// NVLink buffer bytes each rank needs for bf16 or fp8 dispatch and bf16 combine of rows of
/// `hidden` channels with `num_topk` experts per token among `num_ranks` ranks under `config`
/// (use the larger of the dispatch and combine configs' `num_sms` and ring sizes).
pub fn buffer_size_hint(
    hidden: usize,
    num_topk: usize,
    num_ranks: usize,
    config: &Config,
) -> usize {
    rings_buffer_bytes(
        hidden,
        num_topk,
        num_ranks,
        config.num_channels(),
        config.num_max_recv_tokens,
    )
}

/// Checks the NVLink buffers can hold `C * R` rings of `ring_bytes`.
pub(super) fn check_buffer(
    buffers: &PeerBuffers,
    channels: usize,
    ring_bytes: usize,
) -> Result<()> {
    let needed = RING_BASE + channels * buffers.num_ranks() * ring_bytes;
    if needed > buffers.bytes() {
        return Err(Error::invalid(
            "buffers",
            format!("{} bytes per rank", buffers.bytes()),
            format!("this op needs {needed} (see buffer_size_hint)"),
        ));
    }
    Ok(())
}
