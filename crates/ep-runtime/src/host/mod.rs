//! The host backend: CPU tensors, whose payloads the buffer's transport moves and whose
//! layouts, plans and reductions the host twins of `ep-kernels` compute.
//!
//! Each op module calls in here from the `Host` arm of its match on the backend, with the
//! arguments it checked, and assembles the public outputs from what comes back (the raw parts
//! of `crate::backend`), as it does for CUDA buffers (`crate::cuda`). Nothing here imports
//! the op modules.

pub(crate) mod layout;
pub(crate) mod low_latency;

mod normal;
