//! The state a shard keeps for its device grouped GEMMs: their workspace (created on first use
//! and reused; its lock keeps one forward at a time per shard, as the setup tables of a GEMM
//! must not be overwritten before it has run) and the grid of the routed rows' GEMMs.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use ep_kernels::gemm::{GemmGrid, GroupedGemmWorkspace};

use crate::error::Result;

/// Per-[`super::Experts`] state of the device path.
#[derive(Debug, Default)]
pub(crate) struct GroupedState {
    workspace: Mutex<Option<GroupedGemmWorkspace>>,
    /// The grid of the routed rows' GEMMs (normal mode; the masked ones stay persistent).
    routed_grid: Mutex<GemmGrid>,
}

impl GroupedState {
    /// Sets the grid of the routed rows' GEMMs ([`GemmGrid`]).
    pub(crate) fn set_routed_grid(&self, grid: GemmGrid) {
        *self
            .routed_grid
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = grid;
    }

    pub(crate) fn routed_grid(&self) -> GemmGrid {
        *self
            .routed_grid
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The workspace, created on first use for the experts' number of groups.
pub(crate) fn workspace<'a>(
    state: &'a GroupedState,
    stream: &Arc<CudaStream>,
    groups: usize,
) -> Result<MutexGuard<'a, Option<GroupedGemmWorkspace>>> {
    let mut g = state
        .workspace
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if g.as_ref().is_none_or(|w| w.max_groups() < groups) {
        *g = Some(GroupedGemmWorkspace::new(stream, groups)?);
    }
    Ok(g)
}
