//! [`Backend`]: the seam between a [`Buffer`](crate::Buffer)'s public ops and the code that
//! moves its tensors.
//!
//! A buffer holds exactly one backend, chosen by its device when it is built:
//! - [`Backend::Host`]: CPU tensors; payloads go through the buffer's transport and the
//!   host twins of `ep-kernels` compute layouts and reductions (the op modules hold that code);
//! - `Backend::Cuda` (feature `cuda`): CUDA tensors; the kernels of `ep-kernels` over NVLink,
//!   on the buffer's communication stream ([`crate::cuda`]).
//!
//! Each op of the op modules (`layout`, `normal`, `low_latency`) checks its arguments once,
//! then matches on the backend once: the `Host` arm runs the op's host code (the layout's
//! `dispatch_layout_host`, the functions of `normal::host`, the host send and finish steps of
//! `low_latency`), the `Cuda` arm the op of `crate::cuda::CudaBuffer` (after any checks that
//! only CUDA buffers need). Low-latency dispatch also asks [`Backend::is_host`] whether to
//! plan on the host before that. The calls that need no op module's code are methods here. Backends see the buffer only
//! through [`Group`], so no backend module imports the buffer. The low-latency CUDA ops return
//! raw parts (tensors, events, backend data), which the op modules assemble into the public
//! outputs; the layout and normal-mode CUDA ops take the public arguments and build the public
//! outputs themselves (`crate::cuda::normal`).

use crate::error::Result;
use crate::group::Group;

/// The backend of one buffer.
#[derive(Debug)]
pub(crate) enum Backend {
    /// CPU tensors, moved by the transport.
    Host,
    /// CUDA tensors, moved by the NVLink kernels (boxed: the state is large and built once).
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaBuffer>),
}

impl Backend {
    /// Whether this is the host backend (which reads routing on the host and plans there).
    pub(crate) fn is_host(&self) -> bool {
        matches!(self, Self::Host)
    }

    /// Resets the low-latency buffers on every rank (a collective). The host backend keeps no
    /// such state, so there it only synchronises the ranks.
    pub(crate) fn clean_low_latency_buffer(&self, group: &dyn Group) -> Result<()> {
        match self {
            Self::Host => group.all_gather(&[]).map(|_| ()),
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => c.low_latency().clean_buffer(group),
        }
    }

    /// Waits for the last low-latency op and reports a rank the device masked during it (the
    /// host backend reports timeouts as they happen: `Ok`).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn low_latency_check(&self, group: &dyn Group) -> Result<()> {
        match self {
            Self::Host => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => c.low_latency().check(group),
        }
    }

    /// Reports, without waiting, a rank the device masked during the last low-latency op whose
    /// end is already visible (the host backend: `Ok`).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn low_latency_poll(&self, group: &dyn Group) -> Result<()> {
        match self {
            Self::Host => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => c.low_latency().poll(group),
        }
    }

    /// Notes that a replay of a captured low-latency step was launched (host backend: no-op).
    pub(crate) fn low_latency_note_replay(&self) -> Result<()> {
        match self {
            Self::Host => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => c.low_latency().note_replay(),
        }
    }

    /// Whether normal-mode dispatch and combine are available (not on a CUDA buffer across
    /// nodes built without `BufferConfig::with_internode`).
    pub(crate) fn has_normal_mode(&self) -> bool {
        match self {
            Self::Host => true,
            #[cfg(feature = "cuda")]
            Self::Cuda(c) => c.has_normal_mode(),
        }
    }

    /// The communication stream (`None` for the host backend).
    #[cfg(feature = "cuda")]
    pub(crate) fn comm_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        match self {
            Self::Host => None,
            Self::Cuda(c) => Some(c.comm_stream()),
        }
    }
}
