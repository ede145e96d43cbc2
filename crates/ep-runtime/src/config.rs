//! Tuning knobs and buffer sizing.

use crate::error::{Error, Result};
use std::time::Duration;

/// Kernel tuning of the normal (high-throughput) mode, like DeepEP's `Config`.
///
/// `num_sms` SMs are used by dispatch/combine: half of them send, half receive, one
/// channel per pair. Tokens are sent in chunks of `num_max_send_tokens` through per
/// (channel, source) ring buffers of `num_max_recv_tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// SMs used by the communication kernels (even, >= 2).
    pub num_sms: usize,
    /// Tokens per send chunk.
    pub num_max_send_tokens: usize,
    /// Capacity of each ring buffer, in tokens (>= `num_max_send_tokens`).
    pub num_max_recv_tokens: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_sms: 24,
            num_max_send_tokens: 6,
            num_max_recv_tokens: 256,
        }
    }
}

impl Config {
    /// Checks the invariants.
    pub fn validate(&self) -> Result<()> {
        if self.num_sms < 2 || self.num_sms % 2 != 0 {
            return Err(Error::invalid(
                "num_sms",
                self.num_sms,
                "must be even and >= 2",
            ));
        }
        if self.num_max_send_tokens == 0 {
            return Err(Error::invalid("num_max_send_tokens", 0, "must be >= 1"));
        }
        if self.num_max_recv_tokens < self.num_max_send_tokens {
            return Err(Error::invalid(
                "num_max_recv_tokens",
                self.num_max_recv_tokens,
                format!(
                    "must be >= num_max_send_tokens = {}",
                    self.num_max_send_tokens
                ),
            ));
        }
        Ok(())
    }

    /// Number of channels (contiguous token ranges), `num_sms / 2`.
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }
}

/// What a low-latency buffer is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowLatencySizing {
    /// Most tokens any rank dispatches in one low-latency op.
    pub max_tokens_per_rank: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Number of routed experts.
    pub num_experts: usize,
}

/// How a [`crate::Buffer`] is built.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferConfig {
    /// How long any wait for a peer may take before it fails naming the peer.
    pub timeout: Duration,
    /// Normal-mode kernel tuning.
    pub config: Config,
    /// Low-latency sizing; `None` disables the low-latency ops.
    pub low_latency: Option<LowLatencySizing>,
    /// Bytes of the NVLink buffer of each rank (CUDA buffers, normal mode); `None` sizes it
    /// for rows of up to [`BufferConfig::DEFAULT_NVL_HIDDEN`] channels and top-k up to
    /// [`BufferConfig::DEFAULT_NVL_TOPK`] under [`BufferConfig::config`], and for the
    /// copy-engine path with up to [`BufferConfig::DEFAULT_NVL_TOKENS`] tokens per rank.
    pub num_nvl_bytes: Option<usize>,
    /// CUDA buffers: how normal-mode dispatch and combine move bytes over NVLink.
    pub nvl_transfer: NvlTransfer,
}

/// How a CUDA buffer's normal mode moves bytes between the GPUs of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NvlTransfer {
    /// Copy engines for 2 ranks, SM rings for more (what measured fastest on H200s, see
    /// `docs/benchmarks.md`).
    #[default]
    Auto,
    /// SM kernels stream rows through per-(channel, peer) rings (DeepEP's design).
    SmRings,
    /// Contiguous per-peer blocks: the GPUs' copy engines move one peer's (the partner at
    /// distance `R/2`), SM warps streaming whole chunks move the others', and the SMs that pack
    /// and reduce touch only local memory; when the NVLink buffer holds the op, SM rings
    /// otherwise. The `num_sms` of [`BufferConfig::config`] is split between packing or
    /// reducing and the SM copies (`CeConfig::dispatch_for` / `combine_for` in `ep-kernels`).
    CopyEngine,
}

impl NvlTransfer {
    /// Whether `num_ranks` ranks use the copy-engine path (when their buffers hold the op).
    pub fn uses_copy_engine(self, num_ranks: usize) -> bool {
        match self {
            NvlTransfer::Auto => num_ranks <= 2,
            NvlTransfer::SmRings => false,
            NvlTransfer::CopyEngine => true,
        }
    }
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            config: Config::default(),
            low_latency: None,
            num_nvl_bytes: None,
            nvl_transfer: NvlTransfer::Auto,
        }
    }
}

impl BufferConfig {
    /// Hidden size the NVLink buffer is sized for when [`BufferConfig::num_nvl_bytes`] is
    /// `None` (DeepSeek-V3's 7168).
    pub const DEFAULT_NVL_HIDDEN: usize = 7168;
    /// Top-k the NVLink buffer is sized for when [`BufferConfig::num_nvl_bytes`] is `None`.
    pub const DEFAULT_NVL_TOPK: usize = 16;
    /// Tokens per rank the NVLink buffer is sized for (copy-engine path) when
    /// [`BufferConfig::num_nvl_bytes`] is `None`.
    pub const DEFAULT_NVL_TOKENS: usize = 4096;

    /// Chooses the normal-mode NVLink transfer of CUDA buffers.
    pub fn with_nvl_transfer(mut self, transfer: NvlTransfer) -> Self {
        self.nvl_transfer = transfer;
        self
    }

    /// Sets the NVLink buffer size of CUDA buffers (see [`BufferConfig::num_nvl_bytes`]).
    pub fn with_nvl_bytes(mut self, bytes: usize) -> Self {
        self.num_nvl_bytes = Some(bytes);
        self
    }

    /// Enables the low-latency ops for up to `max_tokens_per_rank` tokens per rank.
    pub fn with_low_latency(
        mut self,
        max_tokens_per_rank: usize,
        hidden: usize,
        num_experts: usize,
    ) -> Self {
        self.low_latency = Some(LowLatencySizing {
            max_tokens_per_rank,
            hidden,
            num_experts,
        });
        self
    }

    /// Sets the peer timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Checks the invariants.
    pub fn validate(&self) -> Result<()> {
        self.config.validate()?;
        if self.timeout.is_zero() {
            return Err(Error::invalid("timeout", "0s", "must be positive"));
        }
        if let Some(ll) = &self.low_latency {
            if ll.max_tokens_per_rank == 0 {
                return Err(Error::invalid("max_tokens_per_rank", 0, "must be >= 1"));
            }
            if ll.hidden == 0 {
                return Err(Error::invalid("hidden", 0, "must be >= 1"));
            }
            if ll.num_experts == 0 {
                return Err(Error::invalid("num_experts", 0, "must be >= 1"));
            }
        }
        Ok(())
    }
}
