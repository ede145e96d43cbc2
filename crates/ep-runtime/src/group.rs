//! [`Group`]: the collectives a backend needs from the rank group it serves.
//!
//! Backends are built and run under a [`Buffer`](crate::Buffer), but they see it only through
//! this trait, so that the backend modules never import the buffer or the public ops back.

use crate::error::Result;

/// The rank group of one buffer, as its backends see it: host collectives and the
/// low-latency active-ranks mask.
// Without `cuda` only the host backend uses the group, and only its all-gather.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) trait Group {
    /// Gathers `data` from every rank (index = rank); a collective.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Which ranks take part in low-latency ops (`false` = masked).
    fn active_ranks(&self) -> Vec<bool>;

    /// Masks `rank` out of the low-latency ops (it timed out on the device).
    fn mask_rank(&self, rank: usize) -> Result<()>;
}
