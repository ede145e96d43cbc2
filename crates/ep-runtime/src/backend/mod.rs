//! [`Backend`]: the seam between a [`Buffer`](crate::Buffer)'s public ops and the code that
//! moves its tensors.
//!
//! A buffer holds exactly one backend, chosen by its device when it is built:
//! - [`Backend::Host`]: CPU tensors; payloads go through the buffer's transport and the host
//!   twins of `ep-kernels` compute layouts, plans and reductions (`crate::host`);
//! - `Backend::Cuda` (feature `cuda`): CUDA tensors; the kernels of `ep-kernels` over NVLink
//!   (and NVSHMEM across nodes), on the buffer's communication stream (`crate::cuda`).
//!
//! Each op of the op modules (`layout`, `normal`, `low_latency`) checks its arguments once,
//! hands the checked inputs (the types of this module) to its backend in one `match`, and
//! assembles the public outputs from the raw parts that come back: the same convention for
//! both backends and every op. The backends import these types and never the op modules.
//! The calls that need no op module's code are methods here. Backends see the rank group
//! only through [`Group`] (the host backend, being the transport's user, is written as
//! methods of the buffer).

pub(crate) mod ll_parts;
pub(crate) mod parts;

pub(crate) use ll_parts::*;
pub(crate) use parts::*;

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
