//! Captured steps: a [`MoeLayer`] step recorded in a CUDA graph and replayed with new tokens
//! (no host work per kernel, no host synchronisation).
//!
//! - [`MoeLayer::capture_decode`] gives a [`StepGraph`] of a low-latency step of a fixed token
//!   count that the caller replays, [`MoeLayer::capture_prefill`] one of a normal-mode step
//!   (with worst-case dispatch outputs, so that no step reads a count on the host);
//! - [`MoeLayer::forward_decode`] keeps one captured step per power-of-two token count inside
//!   the layer and replays the smallest that fits (single-rank layers; see its docs).

use std::sync::{Arc, PoisonError};

use candle_core::{DType, Tensor};
use ep_runtime::graph::{capture, warm_up};

use super::captured_step::CapturedStep;

use crate::error::{Error, Result};
use crate::layer::MoeLayer;
use crate::step::Mode;

/// Captures `layer`'s step in `mode` (low-latency or normal) over `num_tokens` tokens of
/// `dtype` (after two eager runs, so that modules, workspaces and buffers exist before the
/// capture).
fn capture_step(
    layer: &MoeLayer,
    mode: Mode,
    num_tokens: usize,
    dtype: DType,
) -> Result<CapturedStep> {
    let dev = layer.router().weight().device().clone();
    if !dev.is_cuda() {
        return Err(Error::invalid(
            "device",
            format!("{dev:?}"),
            "captured steps need a layer on a CUDA device",
        ));
    }
    let max = match mode {
        Mode::LowLatency => layer.options().low_latency_max_tokens,
        _ => capturable_normal_tokens(layer)?,
    };
    if num_tokens == 0 || num_tokens > max {
        let bound = match mode {
            Mode::LowLatency => "low_latency_max_tokens",
            _ => "normal_max_tokens_per_rank",
        };
        return Err(Error::invalid(
            "num_tokens",
            num_tokens,
            format!("must be in 1..={bound} = {max}"),
        ));
    }
    let h = layer.router().hidden_size();
    let input = Tensor::zeros((num_tokens, h), dtype, &dev)?;
    warm_up(&dev, || {
        for _ in 0..2 {
            layer
                .forward_with_mode(&input, mode)
                .map_err(ep_runtime::Error::Candle)?;
        }
        Ok(())
    })?;
    let (graph, output) = capture(&dev, || {
        let out = layer
            .forward_with_mode(&input, mode)
            .map_err(ep_runtime::Error::Candle)?;
        join_comm_stream(layer, &dev)?;
        Ok(out)
    })?;
    Ok(CapturedStep {
        mode,
        input,
        output,
        graph,
    })
}

/// Makes candle's stream wait for everything queued on the buffer's communication stream: a
/// capture must end with every stream it forked joined, and a normal step leaves work there
/// after its last join (the stream-ordered frees of the dispatch's outputs, dropped with its
/// handle).
fn join_comm_stream(layer: &MoeLayer, dev: &candle_core::Device) -> ep_runtime::Result<()> {
    #[cfg(feature = "cuda")]
    if let (Some(comm), candle_core::Device::Cuda(d)) = (layer.buffer().comm_stream(), dev) {
        let done = comm.record_event(None)?;
        d.cuda_stream().wait(&done)?;
    }
    let _ = (layer, dev);
    Ok(())
}

/// The most tokens a captured normal-mode step of `layer` may take: one that reads nothing on
/// the host, so across ranks only with worst-case dispatch outputs
/// ([`crate::MoeLayerOptions::normal_max_tokens_per_rank`]), and not as low-latency chunks.
fn capturable_normal_tokens(layer: &MoeLayer) -> Result<usize> {
    let opts = layer.options();
    let ranks = layer.buffer().topology().num_ranks;
    if layer.prefill_in_low_latency_chunks() {
        return Err(Error::invalid(
            "mode",
            "Normal",
            "a normal step run as low-latency chunks agrees on their count on the host: not capturable",
        ));
    }
    match opts.normal_max_tokens_per_rank {
        Some(max) => Ok(max),
        // One rank without fp8 rows sends nothing (no dispatch, no host read).
        None if ranks == 1 && !opts.fp8_dispatch => Ok(usize::MAX),
        None => Err(Error::invalid(
            "normal_max_tokens_per_rank",
            "None",
            "a captured normal step needs worst-case dispatch outputs (the exact dispatch reads \
             its received count on the host)",
        )),
    }
}

/// A step (router -> dispatch -> grouped GEMMs -> combine, plus the shared experts) of one
/// [`MoeLayer`] for a fixed number of tokens, captured once and replayed.
///
/// Built by [`MoeLayer::capture_decode`] (low-latency mode) or [`MoeLayer::capture_prefill`]
/// (normal mode). Every replay reads the tokens from [`input`]
/// (written by [`replay`] or by the caller), runs the same kernels on the same buffers, and
/// leaves the result in [`output`]. With several ranks the step is a collective: every rank
/// captures its own graph at the same time and all replay in lockstep.
///
/// [`input`]: StepGraph::input
/// [`output`]: StepGraph::output
/// [`replay`]: StepGraph::replay
#[derive(Debug)]
pub struct StepGraph<'l> {
    layer: &'l MoeLayer,
    step: CapturedStep,
}

/// The name [`StepGraph`] had when only decode steps were captured.
pub type DecodeGraph<'l> = StepGraph<'l>;

impl MoeLayer {
    /// Captures a low-latency step over `num_tokens` tokens of `dtype` (1 ..=
    /// `low_latency_max_tokens`). Runs the step eagerly twice first (kernel modules, GEMM
    /// workspace and low-latency buffers are created outside the capture), then captures it.
    /// CUDA layers only; a collective like `forward`.
    pub fn capture_decode(&self, num_tokens: usize, dtype: DType) -> Result<StepGraph<'_>> {
        Ok(StepGraph {
            layer: self,
            step: capture_step(self, Mode::LowLatency, num_tokens, dtype)?,
        })
    }

    /// Captures a normal-mode step over `num_tokens` tokens of `dtype`, as
    /// [`MoeLayer::capture_decode`] does a low-latency one. Across ranks the layer needs
    /// [`MoeLayerOptions::normal_max_tokens_per_rank`](crate::MoeLayerOptions::normal_max_tokens_per_rank)
    /// (`num_tokens` at most that): its dispatches then size their outputs for the worst case
    /// and read nothing on the host; the exact dispatch's read of the received count cannot be
    /// captured. Device errors of a replay (a worst case too small, a peer's timeout) are
    /// reported by the buffer's next eager op. CUDA layers only; a collective like `forward`.
    pub fn capture_prefill(&self, num_tokens: usize, dtype: DType) -> Result<StepGraph<'_>> {
        Ok(StepGraph {
            layer: self,
            step: capture_step(self, Mode::Normal, num_tokens, dtype)?,
        })
    }

    /// [`MoeLayer::forward_decode`] on a CUDA build (see there).
    pub(crate) fn forward_decode_captured(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        let t: usize = dims[..dims.len().saturating_sub(1)].iter().product();
        let single = self.buffer().topology().num_ranks == 1;
        if t == 0 || !single || !x.device().is_cuda() || dims.len() < 2 {
            return self.forward_with_mode(x, Mode::LowLatency);
        }
        let h = dims[dims.len() - 1];
        let size = t
            .next_power_of_two()
            .min(self.options().low_latency_max_tokens);
        if size < t {
            // Over the low-latency limit: the eager path gives the error.
            return self.forward_with_mode(x, Mode::LowLatency);
        }
        let step = self.decode_step(size, x.dtype())?;
        let x2 = x.reshape((t, h))?;
        step.input.slice_set(&x2, 0, 0)?;
        step.replay(self.buffer())?;
        step.output.narrow(0, 0, t)?.copy()?.reshape(dims)
    }

    /// The captured step for `size` tokens of `dtype`, capturing it on first use.
    fn decode_step(&self, size: usize, dtype: DType) -> Result<Arc<CapturedStep>> {
        let graphs = self.decode_graphs();
        let mut steps = graphs.steps.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, s)) = steps.iter().find(|(k, _)| *k == (size, dtype)) {
            return Ok(s.clone());
        }
        let step = Arc::new(capture_step(self, Mode::LowLatency, size, dtype)?);
        steps.push(((size, dtype), step.clone()));
        Ok(step)
    }
}

impl StepGraph<'_> {
    /// The `[T, H]` tensor every replay reads its tokens from.
    pub fn input(&self) -> &Tensor {
        &self.step.input
    }

    /// The `[T, H]` tensor every replay writes its result to (valid once the replay has run on
    /// candle's stream; overwritten by the next replay).
    pub fn output(&self) -> &Tensor {
        &self.step.output
    }

    /// Replays the step on the tokens of [`StepGraph::input`] as they are now; a low-latency
    /// step then reports, without waiting, a rank the device masked during an earlier replay
    /// (see `Buffer::low_latency_poll`).
    pub fn replay_in_place(&self) -> Result<()> {
        self.step.replay(self.layer.buffer())
    }

    /// Copies `x` (`[T, H]`, the capture's shape and dtype) into the input, replays, and
    /// returns a copy of the output (so it stays valid after later replays).
    pub fn replay(&self, x: &Tensor) -> Result<Tensor> {
        let input = &self.step.input;
        if x.dims() != input.dims() || x.dtype() != input.dtype() {
            return Err(Error::invalid(
                "x",
                format!("{:?} {:?}", x.dtype(), x.dims()),
                format!(
                    "must be {:?} {:?} like the captured step",
                    input.dtype(),
                    input.dims()
                ),
            ));
        }
        if !x.device().same_device(input.device()) {
            return Err(Error::invalid(
                "x",
                format!("a tensor on {:?}", x.device()),
                format!("must be on {:?}", input.device()),
            ));
        }
        input.slice_set(x, 0, 0)?;
        self.replay_in_place()?;
        Ok(self.step.output.copy()?)
    }
}
