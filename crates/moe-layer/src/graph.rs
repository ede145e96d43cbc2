//! [`DecodeGraph`]: a low-latency [`MoeLayer`] step captured in a CUDA graph and replayed with
//! new tokens (no host work per kernel, no host synchronisation).

use candle_core::{DType, Tensor};
use ep_runtime::graph::{capture, CapturedGraph};

use crate::error::{Error, Result};
use crate::layer::{Mode, MoeLayer};

/// A decode step (router -> low-latency dispatch -> grouped GEMMs -> combine, plus the shared
/// experts) of one [`MoeLayer`] for a fixed number of tokens, captured once and replayed.
///
/// Built by [`MoeLayer::capture_decode`]. Every replay reads the tokens from [`input`]
/// (written by [`replay`] or by the caller), runs the same kernels on the same buffers, and
/// leaves the result in [`output`]. With several ranks the step is a collective: every rank
/// captures its own graph at the same time and all replay in lockstep.
///
/// [`input`]: DecodeGraph::input
/// [`output`]: DecodeGraph::output
/// [`replay`]: DecodeGraph::replay
#[derive(Debug)]
pub struct DecodeGraph<'l> {
    layer: &'l MoeLayer,
    input: Tensor,
    output: Tensor,
    graph: CapturedGraph,
}

impl MoeLayer {
    /// Captures a low-latency step over `num_tokens` tokens of `dtype` (1 ..=
    /// `low_latency_max_tokens`). Runs the step eagerly twice first (kernel modules, GEMM
    /// workspace and low-latency buffers are created outside the capture), then captures it.
    /// CUDA layers only; a collective like `forward`.
    pub fn capture_decode(&self, num_tokens: usize, dtype: DType) -> Result<DecodeGraph<'_>> {
        let dev = self.router().weight().device().clone();
        if !dev.is_cuda() {
            return Err(Error::invalid(
                "device",
                format!("{dev:?}"),
                "capture_decode needs a layer on a CUDA device",
            ));
        }
        let max = self.options().low_latency_max_tokens;
        if num_tokens == 0 || num_tokens > max {
            return Err(Error::invalid(
                "num_tokens",
                num_tokens,
                format!("must be in 1..=low_latency_max_tokens = {max}"),
            ));
        }
        let h = self.router().hidden_size();
        let input = Tensor::zeros((num_tokens, h), dtype, &dev)?;
        for _ in 0..2 {
            self.forward_with_mode(&input, Mode::LowLatency)?;
        }
        let (graph, output) = capture(&dev, || {
            self.forward_with_mode(&input, Mode::LowLatency)
                .map_err(ep_runtime::Error::Candle)
        })?;
        Ok(DecodeGraph {
            layer: self,
            input,
            output,
            graph,
        })
    }
}

impl DecodeGraph<'_> {
    /// The `[T, H]` tensor every replay reads its tokens from.
    pub fn input(&self) -> &Tensor {
        &self.input
    }

    /// The `[T, H]` tensor every replay writes its result to (valid once the replay has run on
    /// candle's stream; overwritten by the next replay).
    pub fn output(&self) -> &Tensor {
        &self.output
    }

    /// Replays the step on the tokens of [`DecodeGraph::input`] as they are now, then reports,
    /// without waiting, a rank the device masked during an earlier replay (see
    /// `Buffer::low_latency_poll`).
    pub fn replay_in_place(&self) -> Result<()> {
        self.layer.buffer().low_latency_poll()?;
        self.graph.launch()?;
        self.layer.buffer().low_latency_note_replay()?;
        Ok(())
    }

    /// Copies `x` (`[T, H]`, the capture's shape and dtype) into the input, replays, and
    /// returns a copy of the output (so it stays valid after later replays).
    pub fn replay(&self, x: &Tensor) -> Result<Tensor> {
        if x.dims() != self.input.dims() || x.dtype() != self.input.dtype() {
            return Err(Error::invalid(
                "x",
                format!("{:?} {:?}", x.dtype(), x.dims()),
                format!(
                    "must be {:?} {:?} like the captured step",
                    self.input.dtype(),
                    self.input.dims()
                ),
            ));
        }
        if !x.device().same_device(self.input.device()) {
            return Err(Error::invalid(
                "x",
                format!("a tensor on {:?}", x.device()),
                format!("must be on {:?}", self.input.device()),
            ));
        }
        self.input.slice_set(x, 0, 0)?;
        self.replay_in_place()?;
        Ok(self.output.copy()?)
    }
}
