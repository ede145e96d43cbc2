//! Capturing the work a closure enqueues on candle's stream into a replayable CUDA graph
//! (re-exported as `ep_runtime::graph`).
//!
//! Everything the closure launches on candle's stream, and on the streams that join it through
//! events (a buffer's communication stream and copy streams do), becomes one graph: replaying
//! it re-runs the same kernels on the same addresses with no host work per kernel. Memory the
//! closure allocates (candle and cudarc allocate stream-ordered) becomes graph memory: the
//! graph is instantiated with auto-free-on-launch, so each replay re-creates it at the same
//! addresses, and tensors the closure returns keep pointing at the latest replay's values.
//!
//! What breaks a capture (and fails it with an error, leaving nothing half-captured):
//! a device-to-host read or any synchronisation inside the closure, a host-to-device copy from
//! pageable memory, loading a kernel module for the first time (run the step once eagerly
//! first, through [`warm_up`]), and cudarc's cross-stream event tracking (waits on events
//! recorded before the capture), which [`capture`] turns off for its duration after
//! synchronising the device.
//!
//! candle's strided kernels (a transpose made contiguous, a broadcast operand) upload their
//! shape and strides from host memory at every call; a graph would record that copy by the
//! host address, and a replay would read memory freed long ago. [`warm_up`] and [`capture`]
//! run their closures under candle's CUDA-graph upload cache
//! (`CudaDevice::enable_cuda_graph_htod_cache`): an upload made while warming up stays on the
//! device for the life of the process, keyed by its bytes, and the same upload inside the
//! capture reads that copy; an upload the warm-up did not make fails the capture with candle's
//! "cache miss" error instead of corrupting replays.

use std::sync::Arc;

use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use crate::error::{Error, Result};

/// A captured graph, replayed on the stream it was captured from. Launches are serialised by
/// a lock (a CUDA graph object must not be used by two threads at once).
pub struct CapturedGraph {
    graph: std::sync::Mutex<CudaGraph>,
    stream: Arc<CudaStream>,
}

// SAFETY: the graph and its executable are driver handles of one context, usable from any
// thread that binds that context (every launch does, through cudarc); concurrent use is
// excluded by the mutex around them.
unsafe impl Send for CapturedGraph {}
// SAFETY: as above: `&self` methods only launch through the mutex.
unsafe impl Sync for CapturedGraph {}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("device", &self.stream.context().ordinal())
            .finish()
    }
}

impl CapturedGraph {
    /// Enqueues one replay on the capture's stream (candle's stream of its device).
    pub fn launch(&self) -> Result<()> {
        self.graph
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .launch()?;
        Ok(())
    }

    /// The stream replays run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

fn cuda_device(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(dev) => Ok(dev),
        other => Err(Error::invalid(
            "device",
            format!("{other:?}"),
            "CUDA graphs need a CUDA device",
        )),
    }
}

/// Runs `f` eagerly on `device` the way a step is run before [`capture`] takes it: kernel
/// modules load, workspaces are created, and every host-to-device upload candle makes (strided
/// layouts) is kept on the device for the capture to reuse (see the module docs). Run the exact
/// step to be captured, with the same shapes.
pub fn warm_up<T>(device: &Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _uploads = cuda_device(device)?.enable_cuda_graph_htod_cache();
    f()
}

/// Captures what `f` enqueues on `device`'s compute stream into a graph; returns it with `f`'s
/// result. Synchronises the device first. Nothing else may use the device while `f` runs.
/// Run the same step through [`warm_up`] first.
pub fn capture<T>(device: &Device, f: impl FnOnce() -> Result<T>) -> Result<(CapturedGraph, T)> {
    let dev = cuda_device(device)?;
    let stream = dev.cuda_stream();
    let ctx = stream.context().clone();
    ctx.bind_to_thread()?;
    ctx.synchronize()?;
    let tracking = ctx.is_event_tracking();
    // SAFETY: the device is idle (synchronised above), so no event-tracked use is pending;
    // during the capture every stream involved is ordered explicitly (the buffers join
    // candle's stream with events), and tracking is restored before returning.
    unsafe { ctx.disable_event_tracking() };
    let result = (|| {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let out = {
            let _uploads = dev.enable_cuda_graph_htod_cache();
            f()
        };
        // End the capture whatever `f` returned, so the stream is usable again.
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let out = out?;
        let graph = graph?.ok_or_else(|| {
            Error::invalid(
                "capture",
                "an empty capture",
                "the closure enqueued no work",
            )
        })?;
        ctx.check_err()?;
        Ok((
            CapturedGraph {
                graph: std::sync::Mutex::new(graph),
                stream: stream.clone(),
            },
            out,
        ))
    })();
    if tracking {
        // SAFETY: restores the context's previous setting; slices created during the capture
        // stay untracked, and their uses are ordered on candle's stream.
        unsafe { ctx.enable_event_tracking() };
    }
    result
}
