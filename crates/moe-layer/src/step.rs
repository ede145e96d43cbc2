//! What the ranks agree on for one step of a model: the communication [`Mode`] and, when known,
//! the most tokens any rank brings ([`Step`]), so that every layer of the step runs the same
//! collectives on every rank without asking the others again.

/// Which communication mode a forward pass uses. Every rank must use the same mode for the
/// same call (the ops are collectives).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// High-throughput dispatch/combine (prefill): exact-size buffers, a count exchange.
    Normal,
    /// Low-latency dispatch/combine (decode): fixed slots, no count exchange.
    LowLatency,
    /// Low-latency when the largest token count over all ranks is at most
    /// [`crate::MoeLayerOptions::low_latency_max_tokens`], normal otherwise. Through
    /// [`crate::MoeLayer::forward_with_mode`] it costs one small host all-gather per call to
    /// agree; a [`Step`] that knows the busiest rank's count costs none.
    #[default]
    Auto,
}

/// One step as every rank sees it before it runs: the mode of its MoE layers and the most
/// tokens any rank brings to them.
///
/// A layer needs the busiest rank's count wherever the ranks must run the same number of ops:
/// to resolve [`Mode::Auto`], and to split a normal-mode step into ops when the buffer bounds
/// them (across nodes, [`ep_runtime::Buffer::normal_mode_max_tokens`]) or when prefill runs
/// as low-latency chunks. [`crate::MoeLayer::forward_with_mode`] learns it with one host
/// all-gather per call, i.e. per layer; a model builds one `Step` per forward pass, from what
/// its scheduler already knows ([`Step::new`]) or with one all-gather
/// ([`crate::MoeLayer::plan_step`]), and passes it to every layer's
/// [`crate::MoeLayer::forward_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    mode: Mode,
    most_tokens: usize,
}

impl Step {
    /// A step in `mode` whose busiest rank has `most_tokens` tokens. Every rank must build
    /// the same step; a rank with more tokens than `most_tokens` is refused by the layer.
    pub fn new(mode: Mode, most_tokens: usize) -> Self {
        Self { mode, most_tokens }
    }

    /// The mode as given (`Auto` is resolved by the layer, against its own threshold).
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The most tokens any rank brings to this step.
    pub fn most_tokens(&self) -> usize {
        self.most_tokens
    }
}
