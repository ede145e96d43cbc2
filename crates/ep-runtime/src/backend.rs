//! [`Backend`]: the seam between a [`Buffer`](crate::Buffer)'s public ops and the code that
//! moves its tensors.
//!
//! A buffer holds exactly one backend, chosen by its device when it is built:
//! - [`Backend::Host`]: CPU tensors; payloads go through the buffer's transport and the
//!   host twins of `ep-kernels` compute layouts and reductions (the op modules hold that code);
//! - `Backend::Cuda` (feature `cuda`): CUDA tensors; the kernels of `ep-kernels` over NVLink,
//!   on the buffer's communication stream ([`crate::cuda`]).
//!
//! The op modules (`layout`, `normal`, `low_latency`) check their arguments once, then call
//! the backend once. Backends see the buffer only through [`Group`] and return raw parts
//! (tensors, events, backend data), which the op modules assemble into the public outputs: so
//! no backend module imports the buffer or the public ops.

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

    /// The CUDA backend, for the normal-mode ops and the layout, which still branch on it
    /// (their CUDA code builds the public outputs itself).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Option<&crate::cuda::CudaBuffer> {
        match self {
            Self::Host => None,
            Self::Cuda(c) => Some(&**c),
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
