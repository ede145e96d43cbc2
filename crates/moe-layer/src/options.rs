//! [`MoeLayerOptions`]: how a [`crate::MoeLayer`] runs, and [`SharedPlacement`].

use crate::step::Mode;
use ep_runtime::Reduction;

/// Where the shared experts run in low-latency mode (CUDA layers with grouped GEMMs; other
/// layers always run them as their own MLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SharedPlacement {
    /// `Grouped` in the steps of at most [`ep_kernels::gemm::GEMV_ROWS_PER_PASS`] rows expected
    /// per expert (a decode token or two per rank: the tile-less kernel), and at one rank, where
    /// there is no dispatch to hide the shared MLP behind, in those of at most
    /// [`SHARED_GROUPED_MAX_ROWS_ONE_RANK`] tokens (its extra groups then fill the tiles at the
    /// cost of their weight bytes); `Overlap` in the others. The default.
    #[default]
    Auto,
    /// As their own MLP on the compute stream while the dispatch travels. With the tiled
    /// GEMMs (more rows per expert) this measured as fast as `Grouped` or faster
    /// (`docs/benchmarks.md`, "The MoE layer").
    Overlap,
    /// As extra groups of the routed experts' grouped GEMMs (one launch reads every weight)
    /// when their inner width is a multiple of the routed experts'; else as `Overlap`. The
    /// shared MLP's gate_up is re-laid once into the grouped GEMMs' blocked layout (a copy that
    /// replaces the layer's shared MLP, whose blocks are then views; `down_proj` is copied into
    /// blocks when the shared MLP is wider than one routed expert), also under `Auto`.
    Grouped,
}

/// Most tokens of a one-rank low-latency step whose shared experts `SharedPlacement::Auto`
/// places in the grouped GEMMs: at 16, 32 and 64 tokens that measured faster than beside them,
/// fp8 and bf16 (`docs/benchmarks.md`, "The MoE layer (one GPU)"); at 128 not.
pub const SHARED_GROUPED_MAX_ROWS_ONE_RANK: usize = 64;

/// How a [`crate::MoeLayer`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeLayerOptions {
    /// The default mode of [`crate::MoeLayer::forward`].
    pub mode: Mode,
    /// Low-latency slots per rank (the `Auto` threshold, and the `num_max_dispatch_tokens_per_rank`
    /// of low-latency ops). The buffer must be sized for at least this many.
    pub low_latency_max_tokens: usize,
    /// Send tokens as fp8 e4m3 with 1x128 scales (hidden must be a multiple of 128).
    pub fp8_dispatch: bool,
    /// Per-expert receive counts of normal mode rounded up to a multiple of this (DeepEP's
    /// `expert_alignment`; default 1: the grouped GEMMs need no alignment).
    pub expert_alignment: usize,
    /// Where the shared experts run in low-latency mode.
    pub shared_placement: SharedPlacement,
    /// The grouped GEMMs' configuration in low-latency mode (CUDA); `None`: chosen from the
    /// rows a step expects per expert and the GPU's bandwidth per SM
    /// ([`ep_kernels::gemm::GemmTiles::for_masked_rows`]: which of the tile-less kernel and the
    /// 64 x 128 tiles is faster at one token depends on the GPU's bandwidth per SM).
    pub low_latency_tiles: Option<ep_kernels::gemm::GemmTiles>,
    /// How the low-latency combine reduces a token's expert outputs: per rank (the default:
    /// each expert rank sends one partial sum per token, so fewer bytes travel back; the
    /// dispatch carries the gate weights for it) or per expert (DeepEP's numbers: one row per
    /// (token, expert), summed once at home). The same bits at one rank.
    pub low_latency_reduction: Reduction,
    /// Two-batch overlap at more than one rank (SGLang's TBO): each rank splits its tokens into
    /// two micro-batches, and the second's dispatch travels while the first's experts compute,
    /// the first's combine while the second's compute (both modes; the shared experts run
    /// once, over all tokens, while the first dispatch travels). It hides transfers behind
    /// GEMMs, but each micro-batch's GEMMs read the local experts' weights again: it pays when
    /// the GEMMs are bound by their math (many rows per local expert), not by their weight
    /// reads. Every rank must use the same setting. Off by default (`docs/benchmarks.md`).
    pub two_batch_overlap: bool,
    /// Run normal-mode steps (prefill) as low-latency ops of at most `low_latency_max_tokens`
    /// tokens per rank each, one after another (every rank runs as many as the rank with the
    /// most tokens needs). Always on for a buffer without a normal mode (a CUDA buffer across
    /// nodes built without `BufferConfig::with_internode`); off by default elsewhere, where the
    /// normal mode moves large batches faster. Every rank must use the same setting.
    pub prefill_in_low_latency_chunks: bool,
    /// Normal mode across ranks on CUDA: queue the shared experts before the dispatch, with
    /// cuBLAS targeting the SMs the transfer's kernels leave (`Config::num_sms`), so that they
    /// also run while the host waits for the received count, and the transfer, queued after
    /// them on its high-priority stream, finds its SMs free. Off by default: it measured
    /// faster in most runs at moderate batches but not reliably at large ones
    /// (`docs/benchmarks.md`, "Shared experts beside the dispatch" and "The dispatch's
    /// host-side work").
    pub shared_before_dispatch: bool,
    /// Normal mode across ranks as a pipeline over this many groups of each rank's local
    /// experts (1, the default: off). Group `g + 1`'s dispatch and group `g - 1`'s combine
    /// travel while group `g`'s grouped GEMMs run, so that only the first dispatch and the
    /// last combine are left on the critical path. Unlike [`Self::two_batch_overlap`] it reads
    /// no weight twice and keeps every grouped GEMM's rows per expert; the price is bytes: a
    /// token whose experts on a rank fall in two groups travels there twice. It measured
    /// slower than the plain step: the GEMMs lose more to the transfers beside them than the
    /// transfers take.
    /// Between 1 and the experts per rank; not with `two_batch_overlap`. No effect in
    /// low-latency mode or at one rank. Every rank must use the same setting
    /// (`docs/benchmarks.md`, "Pipelined over expert groups").
    pub expert_groups: usize,
    /// The grid of normal mode's grouped GEMMs on CUDA ([`ep_kernels::gemm::GemmGrid`]);
    /// `None`: [`GemmGrid::PerTile`](ep_kernels::gemm::GemmGrid::PerTile) with more than one
    /// of [`Self::expert_groups`] across ranks, so that the transfers travelling beside the
    /// GEMMs take SMs from them only while they run; persistent otherwise. A per-tile grid is
    /// sized by the rows each local expert received (the dispatch's counts). Alone, neither
    /// grid measured faster everywhere (`docs/benchmarks.md`, "Pipelined over expert groups").
    pub normal_gemm_grid: Option<ep_kernels::gemm::GemmGrid>,
    /// Normal mode across ranks with worst-case outputs (DeepEP's `num_worst_tokens`): a bound
    /// on the tokens any rank sends in one normal-mode step, the same on every rank. With it,
    /// each dispatch sizes what it receives for `num_ranks` x this many rows instead of reading
    /// the received count on the host, so the host never waits for the GPU inside the step
    /// (it queues the shared experts, the GEMMs and the combine at once, and can run ahead to
    /// the next layer); a per-tile GEMM grid ([`Self::normal_gemm_grid`]) is then sized for
    /// every (token, slot) pair, not by the counts. When the step's busiest rank is known
    /// ([`crate::MoeLayer::forward_step`], or `Mode::Auto`, which learns it), a step over the
    /// bound runs with exact outputs on every rank instead (the same choice everywhere); with
    /// an explicit `Mode::Normal` a step with more tokens on this rank is refused before any
    /// kernel. With [`Self::shared_before_dispatch`] this left less of the step exposed beyond
    /// the busiest rank's compute than exact outputs (`docs/benchmarks.md`, "Worst-case
    /// outputs with the shared experts first").
    /// One node only. `None` (the default): exact outputs and one host read per dispatch.
    pub normal_max_tokens_per_rank: Option<usize>,
}

impl Default for MoeLayerOptions {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            low_latency_max_tokens: 128,
            fp8_dispatch: false,
            expert_alignment: 1,
            shared_placement: SharedPlacement::Auto,
            low_latency_tiles: None,
            low_latency_reduction: Reduction::PerRank,
            two_batch_overlap: false,
            prefill_in_low_latency_chunks: false,
            shared_before_dispatch: false,
            expert_groups: 1,
            normal_gemm_grid: None,
            normal_max_tokens_per_rank: None,
        }
    }
}
