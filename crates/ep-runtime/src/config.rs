//! Tuning knobs and buffer sizing.

use crate::error::{Error, Result};
use std::time::Duration;

/// Kernel tuning of the normal (high-throughput) mode, like DeepEP's `Config`.
///
/// `num_sms` SMs are used by dispatch/combine: half of them send, half receive, one
/// channel per pair. Tokens are sent in chunks (`num_max_send_tokens` in dispatch,
/// `num_max_combine_send_tokens` in combine) through per (channel, source) ring buffers of
/// `num_max_recv_tokens` tokens. A chunk left `None` is the one that measured fastest for the
/// buffer's rank count ([`ep_kernels::intranode::tuned_send_tokens`]; like DeepEP's
/// `get_dispatch_config` / `get_combine_config`), within the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// SMs used by the communication kernels (even, >= 2).
    pub num_sms: usize,
    /// Tokens per dispatch send chunk (`None`: tuned for the rank count).
    pub num_max_send_tokens: Option<usize>,
    /// Tokens per combine send chunk (`None`: tuned for the rank count).
    pub num_max_combine_send_tokens: Option<usize>,
    /// Capacity of each ring buffer, in tokens (>= every chunk).
    pub num_max_recv_tokens: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_sms: 24,
            num_max_send_tokens: None,
            num_max_combine_send_tokens: None,
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
        for (name, chunk) in [
            ("num_max_send_tokens", self.num_max_send_tokens),
            (
                "num_max_combine_send_tokens",
                self.num_max_combine_send_tokens,
            ),
        ] {
            match chunk {
                Some(0) => return Err(Error::invalid(name, 0, "must be >= 1")),
                Some(n) if n > self.num_max_recv_tokens => {
                    return Err(Error::invalid(
                        "num_max_recv_tokens",
                        self.num_max_recv_tokens,
                        format!("must be >= {name} = {n}"),
                    ))
                }
                _ => {}
            }
        }
        if self.num_max_recv_tokens == 0 {
            return Err(Error::invalid("num_max_recv_tokens", 0, "must be >= 1"));
        }
        Ok(())
    }

    /// Number of channels (contiguous token ranges), `num_sms / 2`.
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    /// The dispatch and combine chunks for `num_ranks` ranks: the set ones, else the tuned
    /// ones, at most the ring (the combine's at most the ring less `combine_reserve` tokens,
    /// the room its CUDA kernel keeps for a round of tokens).
    pub fn send_tokens(&self, num_ranks: usize, combine_reserve: usize) -> (usize, usize) {
        let (d, c) = ep_kernels::intranode::tuned_send_tokens(num_ranks);
        let ring = self.num_max_recv_tokens;
        (
            self.num_max_send_tokens.unwrap_or(d.min(ring)),
            self.num_max_combine_send_tokens
                .unwrap_or(c.min(ring.saturating_sub(combine_reserve)).max(1)),
        )
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

/// What the internode normal mode of a CUDA buffer across nodes is sized for (feature
/// `nvshmem`): its buffer on NVSHMEM's symmetric heap takes about
/// `(2 * nodes + ranks) * max_tokens_per_rank * 2 * hidden` bytes per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternodeSizing {
    /// Most tokens any rank dispatches in one normal-mode op.
    pub max_tokens_per_rank: usize,
    /// Largest hidden size.
    pub hidden: usize,
    /// Largest top-k.
    pub max_topk: usize,
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
    /// CUDA buffers across nodes: the internode normal mode's sizing; `None` leaves such a
    /// buffer without a normal mode (its low-latency ops still run).
    pub internode: Option<InternodeSizing>,
}

/// How a CUDA buffer's normal mode moves bytes between the GPUs of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NvlTransfer {
    /// Copy engines for 2 ranks, SM rings for more (what measured fastest for the layer, see
    /// `docs/benchmarks.md`: at 4 ranks the copy-engine path moves more bytes per second in
    /// `bench_intranode`, but the layer's steps measured no faster with it).
    #[default]
    Auto,
    /// SM kernels stream rows through per-(channel, peer) rings (DeepEP's design).
    SmRings,
    /// Contiguous per-peer blocks: the GPUs' copy engines move one peer's (the partner at
    /// distance `R/2`), SM warps streaming whole chunks move the others' (in the combine the
    /// copy engines also push the others' last chunks), and the SMs that pack and reduce touch
    /// only local memory; when the NVLink buffer holds the op, SM rings otherwise. The `num_sms` of [`BufferConfig::config`] is split between packing or
    /// reducing and the SM copies (`CeConfig::dispatch_for`, `dispatch_fp8_for` for fp8 rows,
    /// and `combine_for` in `ep-kernels`).
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
            internode: None,
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

    /// Enables the internode normal mode of CUDA buffers across nodes, for up to
    /// `max_tokens_per_rank` tokens per rank of up to `hidden` channels and `max_topk` experts
    /// (see [`InternodeSizing`]).
    pub fn with_internode(
        mut self,
        max_tokens_per_rank: usize,
        hidden: usize,
        max_topk: usize,
    ) -> Self {
        self.internode = Some(InternodeSizing {
            max_tokens_per_rank,
            hidden,
            max_topk,
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
        if let Some(n) = &self.internode {
            if n.max_tokens_per_rank == 0 {
                return Err(Error::invalid(
                    "internode.max_tokens_per_rank",
                    0,
                    "must be >= 1",
                ));
            }
            if n.hidden == 0 || n.hidden % 8 != 0 {
                return Err(Error::invalid(
                    "internode.hidden",
                    n.hidden,
                    "must be a positive multiple of 8",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    #[test]
    fn unset_chunks_are_the_tuned_ones_within_the_ring() {
        let c = Config::default();
        assert_eq!(c.send_tokens(2, 24), (24, 12));
        assert_eq!(c.send_tokens(3, 24), (32, 12));
        assert_eq!(c.send_tokens(4, 24), (36, 12));
        assert_eq!(c.send_tokens(8, 24), (16, 6));
        let small = Config {
            num_max_recv_tokens: 30,
            ..Config::default()
        };
        assert_eq!(small.send_tokens(4, 24), (30, 6), "clamped to the ring");
        let set = Config {
            num_max_send_tokens: Some(6),
            num_max_combine_send_tokens: Some(9),
            ..Config::default()
        };
        assert_eq!(set.send_tokens(4, 24), (6, 9), "set chunks are kept");
        set.validate().expect("valid");
    }

    #[test]
    fn bad_chunks_are_named() {
        let zero = Config {
            num_max_combine_send_tokens: Some(0),
            ..Config::default()
        };
        let e = zero.validate().expect_err("zero chunk").to_string();
        assert!(e.contains("num_max_combine_send_tokens"), "{e}");
        let big = Config {
            num_max_send_tokens: Some(300),
            ..Config::default()
        };
        let e = big
            .validate()
            .expect_err("chunk above the ring")
            .to_string();
        assert!(
            e.contains("num_max_recv_tokens") && e.contains("300"),
            "{e}"
        );
    }
}
