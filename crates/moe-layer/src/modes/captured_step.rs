//! A captured step (the graph and the tensors it reads and writes) and the layer's cache of
//! them; how a layer captures one is `graph`.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};
use ep_runtime::graph::CapturedGraph;
use ep_runtime::Buffer;

use crate::error::Result;
use crate::step::Mode;

/// One captured step: its mode, the tensor it reads, the tensor it writes, the graph.
#[derive(Debug)]
pub(crate) struct CapturedStep {
    pub(super) mode: Mode,
    pub(super) input: Tensor,
    pub(super) output: Tensor,
    pub(super) graph: CapturedGraph,
}

impl CapturedStep {
    /// Replays on the input as it is now; for a low-latency step first reports, without
    /// waiting, a rank the device masked during an earlier replay (a normal-mode step's device
    /// errors are reported by the buffer's next eager op).
    pub(super) fn replay(&self, buffer: &Buffer) -> Result<()> {
        if self.mode != Mode::LowLatency {
            self.graph.launch()?;
            return Ok(());
        }
        buffer.low_latency_poll()?;
        self.graph.launch()?;
        buffer.low_latency_note_replay()?;
        Ok(())
    }
}

/// A captured step's key: token count and dtype.
type StepKey = (usize, DType);

/// The layer's captured steps by (token count, dtype), made on first use.
#[derive(Debug, Default)]
pub(crate) struct DecodeGraphs {
    pub(super) steps: Mutex<Vec<(StepKey, Arc<CapturedStep>)>>,
}
