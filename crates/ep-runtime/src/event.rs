//! Completion events of asynchronous ops.

use crate::error::Result;

/// The completion of a communication op, like DeepEP's `EventOverlap`.
///
/// With `async_finish`, an op returns before its work is done (on GPUs: enqueued on the
/// buffer's communication stream) and its outputs may only be used after [`EventOverlap::wait`]
/// (or [`EventOverlap::current_stream_wait`] on GPUs). On the host backend every op has
/// already finished when it returns, so the event is complete.
#[derive(Debug, Clone, Default)]
pub struct EventOverlap {
    inner: EventInner,
}

#[derive(Debug, Clone, Default)]
enum EventInner {
    #[default]
    Complete,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<cudarc::driver::CudaEvent>),
}

impl EventOverlap {
    /// An event that is already complete (host backend).
    pub fn complete() -> Self {
        Self::default()
    }

    /// Wraps a CUDA event recorded on the communication stream.
    #[cfg(feature = "cuda")]
    pub fn from_cuda(event: std::sync::Arc<cudarc::driver::CudaEvent>) -> Self {
        Self {
            inner: EventInner::Cuda(event),
        }
    }

    /// The current end of `device`'s compute stream (candle's stream): complete for the CPU.
    pub fn record(device: &candle_core::Device) -> Result<Self> {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => {
                let ev = d.cuda_stream().record_event(None)?;
                Ok(Self::from_cuda(std::sync::Arc::new(ev)))
            }
            _ => Ok(Self::complete()),
        }
    }

    /// Makes `device`'s compute stream (candle's stream) wait for this event (a no-op for the
    /// CPU and for complete events).
    pub fn compute_wait(&self, device: &candle_core::Device) -> Result<()> {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => self.stream_wait(&d.cuda_stream()),
            _ => self.wait(),
        }
    }

    /// Whether the work has finished.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.inner {
            EventInner::Complete => Ok(true),
            #[cfg(feature = "cuda")]
            EventInner::Cuda(e) => Ok(e.is_complete()),
        }
    }

    /// Blocks the host until the work has finished.
    pub fn wait(&self) -> Result<()> {
        match &self.inner {
            EventInner::Complete => Ok(()),
            #[cfg(feature = "cuda")]
            EventInner::Cuda(e) => Ok(e.synchronize()?),
        }
    }

    /// Makes `stream` wait for the work (no host blocking). A no-op for complete events.
    #[cfg(feature = "cuda")]
    pub fn stream_wait(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        match &self.inner {
            EventInner::Complete => Ok(()),
            EventInner::Cuda(e) => Ok(stream.wait(e)?),
        }
    }

    /// The CUDA event, if any.
    #[cfg(feature = "cuda")]
    pub fn cuda_event(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaEvent>> {
        match &self.inner {
            EventInner::Complete => None,
            EventInner::Cuda(e) => Some(e),
        }
    }
}
