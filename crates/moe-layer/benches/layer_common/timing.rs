//! Event timing of the layer benchmarks on a CUDA stream.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Device;

use super::BoxError;

/// The CUDA stream of `dev` (a CUDA device).
pub fn stream_of(dev: &Device) -> Arc<CudaStream> {
    match dev {
        Device::Cuda(d) => d.cuda_stream(),
        _ => unreachable!("the benchmark runs on CUDA devices"),
    }
}

/// Two warm-up calls of `f`, then a synchronisation of `stream`.
pub fn warm_up(
    stream: &Arc<CudaStream>,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    for _ in 0..2 {
        f()?;
    }
    stream.synchronize()?;
    Ok(())
}

/// Milliseconds between events on `stream` around `calls` calls of `f`, waited for.
pub fn elapsed_ms(
    stream: &Arc<CudaStream>,
    calls: usize,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    let a = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..calls {
        f()?;
    }
    let b = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    b.synchronize()?;
    Ok(f64::from(a.elapsed_ms(&b)?))
}

/// Median milliseconds of `f` on `stream` (event-timed, after two warm-up calls).
pub fn time_ms(
    stream: &Arc<CudaStream>,
    iters: usize,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    warm_up(stream, f)?;
    let mut t = (0..iters.max(1))
        .map(|_| elapsed_ms(stream, 1, f))
        .collect::<Result<Vec<_>, _>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Milliseconds per call of `f` run `iters` times back to back on `stream` with one
/// synchronisation at the end (after two warm-up calls), as a model runs its layers: the host
/// enqueues ahead and, across ranks, the steps stay in step through their collectives instead
/// of each one starting from a synchronised, idle GPU.
pub fn time_b2b_ms(
    stream: &Arc<CudaStream>,
    iters: usize,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    warm_up(stream, f)?;
    Ok(elapsed_ms(stream, iters.max(1), f)? / iters.max(1) as f64)
}
