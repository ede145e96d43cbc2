//! Typed launcher of the dispatch-layout kernel (`layout.cu`); host twin: [`crate::layout::host`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use crate::cuda::{assert_params_layout, fill_i32_cuda, to_i32, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::layout::host::{DispatchLayout, ExpertPlacement};

/// The cubin of `layout.cu`.
const FILE: &str = "layout/layout";
/// Threads per block (`kThreads` in `layout.cu`): one token each.
const THREADS: u32 = 256;
/// The most blocks a launch uses (a grid-stride loop covers more tokens).
const MAX_BLOCKS: usize = 1024;

/// Mirror of `struct LayoutParams` in `layout.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LayoutParams {
    topk_idx: CUdeviceptr,
    num_tokens_per_rank: CUdeviceptr,
    num_tokens_per_node: CUdeviceptr,
    num_tokens_per_expert: CUdeviceptr,
    is_token_in_rank: CUdeviceptr,
    num_tokens: i32,
    num_topk: i32,
    num_experts: i32,
    num_ranks: i32,
    num_nodes: i32,
    experts_per_rank: i32,
}
assert_params_layout!(
    LayoutParams,
    64;
    topk_idx = 0, num_tokens_per_rank = 8, num_tokens_per_node = 16, num_tokens_per_expert = 24,
    is_token_in_rank = 32, num_tokens = 40, num_topk = 44, num_experts = 48, num_ranks = 52,
    num_nodes = 56, experts_per_rank = 60,
);

// SAFETY: `LayoutParams` is `repr(C)`, plain data, and mirrors `LayoutParams` in layout.cu
// field by field (the size is asserted on both sides).
unsafe impl KernelParams for LayoutParams {}

/// The dispatch layout in device memory (the device form of [`DispatchLayout`]).
#[derive(Debug)]
pub struct DeviceDispatchLayout {
    /// `[R]` i32: tokens sent to each rank (a token counts once per rank).
    pub num_tokens_per_rank: CudaSlice<i32>,
    /// `[R / P]` i32: tokens sent to each node (a token counts once per node).
    pub num_tokens_per_node: CudaSlice<i32>,
    /// `[E]` i32: (token, expert) pairs per expert.
    pub num_tokens_per_expert: CudaSlice<i32>,
    /// `[T, R]` row-major, one byte each, 0 or 1: whether token `t` goes to rank `r`.
    pub is_token_in_rank: CudaSlice<u8>,
}

impl DeviceDispatchLayout {
    /// Allocates outputs for `num_tokens` tokens on `stream`, not initialised:
    /// [`get_dispatch_layout_cuda_into`] writes every element.
    pub fn alloc(
        stream: &Arc<CudaStream>,
        num_tokens: usize,
        placement: &ExpertPlacement,
    ) -> Result<Self> {
        // SAFETY: fresh allocations of plain integers (any bit pattern is a value), for the
        // layout launch to overwrite; nothing reads them before it.
        Ok(unsafe {
            Self {
                num_tokens_per_rank: stream.alloc(placement.num_ranks)?,
                num_tokens_per_node: stream.alloc(placement.num_nodes())?,
                num_tokens_per_expert: stream.alloc(placement.num_experts)?,
                is_token_in_rank: stream.alloc(num_tokens * placement.num_ranks)?,
            }
        })
    }

    /// Copies the layout to the host (synchronises `stream`).
    pub fn to_host(&self, stream: &Arc<CudaStream>) -> Result<DispatchLayout> {
        Ok(DispatchLayout {
            num_tokens_per_rank: stream.clone_dtoh(&self.num_tokens_per_rank)?,
            num_tokens_per_node: stream.clone_dtoh(&self.num_tokens_per_node)?,
            num_tokens_per_expert: stream.clone_dtoh(&self.num_tokens_per_expert)?,
            is_token_in_rank: stream
                .clone_dtoh(&self.is_token_in_rank)?
                .into_iter()
                .map(|b| b != 0)
                .collect(),
        })
    }
}

/// Computes the dispatch layout of `topk_idx` (`[num_tokens, num_topk]` i64, row-major, `-1` =
/// no expert) on `stream` into freshly allocated device buffers.
///
/// Same results as the host twin [`crate::layout::get_dispatch_layout`]. Expert ids are not
/// validated on the device (that would need a synchronisation): entries outside `[-1, E)` are
/// ignored.
pub fn get_dispatch_layout_cuda(
    stream: &Arc<CudaStream>,
    topk_idx: &impl DevicePtr<i64>,
    num_tokens: usize,
    num_topk: usize,
    placement: &ExpertPlacement,
) -> Result<DeviceDispatchLayout> {
    let mut out = DeviceDispatchLayout::alloc(stream, num_tokens, placement)?;
    get_dispatch_layout_cuda_into(stream, topk_idx, num_tokens, num_topk, placement, &mut out)?;
    Ok(out)
}

/// Like [`get_dispatch_layout_cuda`], writing every element of the caller's buffers `out`
/// (they need not be initialised).
pub fn get_dispatch_layout_cuda_into(
    stream: &CudaStream,
    topk_idx: &impl DevicePtr<i64>,
    num_tokens: usize,
    num_topk: usize,
    placement: &ExpertPlacement,
    out: &mut DeviceDispatchLayout,
) -> Result<()> {
    // Re-validate: `ExpertPlacement`'s fields are public.
    let placement = ExpertPlacement::new(
        placement.num_experts,
        placement.num_ranks,
        placement.gpus_per_node,
    )?;
    let entries = num_tokens.checked_mul(num_topk).ok_or_else(|| {
        Error::invalid("num_tokens", num_tokens, "num_tokens * num_topk overflows")
    })?;
    Error::check_len("topk_idx", entries, topk_idx.len())?;
    let r = placement.num_ranks;
    Error::check_len("num_tokens_per_rank", r, out.num_tokens_per_rank.len())?;
    Error::check_len(
        "num_tokens_per_node",
        placement.num_nodes(),
        out.num_tokens_per_node.len(),
    )?;
    Error::check_len(
        "num_tokens_per_expert",
        placement.num_experts,
        out.num_tokens_per_expert.len(),
    )?;
    Error::check_len(
        "is_token_in_rank",
        num_tokens * r,
        out.is_token_in_rank.len(),
    )?;

    // The kernel adds each block's counts to these.
    fill_i32_cuda(stream, &mut out.num_tokens_per_rank, 0)?;
    fill_i32_cuda(stream, &mut out.num_tokens_per_node, 0)?;
    fill_i32_cuda(stream, &mut out.num_tokens_per_expert, 0)?;
    if num_tokens == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "get_dispatch_layout")?;
    let blocks = num_tokens.div_ceil(THREADS as usize).min(MAX_BLOCKS);
    // One shared counter per expert, rank and node.
    let counters = placement.num_experts + r + placement.num_nodes();
    let shared = u32::try_from(counters * 4)
        .map_err(|_| Error::invalid("num_experts", placement.num_experts, "too many counters"))?;

    let (topk_ptr, _g0) = topk_idx.device_ptr(stream);
    let (rank_ptr, _g1) = out.num_tokens_per_rank.device_ptr_mut(stream);
    let (node_ptr, _g2) = out.num_tokens_per_node.device_ptr_mut(stream);
    let (expert_ptr, _g3) = out.num_tokens_per_expert.device_ptr_mut(stream);
    let (in_rank_ptr, _g4) = out.is_token_in_rank.device_ptr_mut(stream);
    let params = LayoutParams {
        topk_idx: topk_ptr,
        num_tokens_per_rank: rank_ptr,
        num_tokens_per_node: node_ptr,
        num_tokens_per_expert: expert_ptr,
        is_token_in_rank: in_rank_ptr,
        num_tokens: to_i32("num_tokens", num_tokens)?,
        num_topk: to_i32("num_topk", num_topk)?,
        num_experts: to_i32("num_experts", placement.num_experts)?,
        num_ranks: to_i32("num_ranks", r)?,
        num_nodes: to_i32("num_nodes", placement.num_nodes())?,
        experts_per_rank: to_i32("experts_per_rank", placement.experts_per_rank())?,
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    };
    // SAFETY: `params` matches the kernel's `LayoutParams`; every pointer comes from a live
    // cudarc slice of at least the checked length (topk: T*K, outputs: R, R/P, E, T*R), whose
    // guards (`_g*`) keep cudarc's stream ordering until after the launch is queued; the kernel
    // reads/writes only within those lengths.
    unsafe { kernel.launch(stream, cfg, params) }
}
