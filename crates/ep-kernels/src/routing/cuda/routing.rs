//! Typed launcher of the routing kernel (`routing.cu`; host twin
//! [`crate::routing::route_topk`]).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::Result;
use crate::routing::{GroupScore, Scoring, TopkInput, TopkSpec};

/// The cubin of `routing.cu`.
const FILE: &str = "routing/routing";
/// Threads per block (`kThreads`); one warp per token.
const THREADS: u32 = 128;
/// Resident blocks per SM the grid is capped at.
const BLOCKS_PER_SM: u32 = 8;

/// Mirror of `struct RouteTopkParams` in `routing.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RouteTopkParams {
    scores: CUdeviceptr,
    bias: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    num_tokens: i64,
    num_experts: i32,
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    group_score: i32,
    norm_topk_prob: i32,
    scaling: f32,
    input: i32,
}
const _: () = assert!(std::mem::size_of::<RouteTopkParams>() == 72);
const _: () = assert!(std::mem::offset_of!(RouteTopkParams, num_experts) == 40);
const _: () = assert!(std::mem::offset_of!(RouteTopkParams, scaling) == 64);

// SAFETY: `repr(C)` plain data mirroring `RouteTopkParams` in routing.cu (size asserted both
// sides, field offsets here).
unsafe impl KernelParams for RouteTopkParams {}

/// Routes the tokens of `scores` (`[T, E]` f32 scores, or logits as `input` says, on the
/// device) with optional `bias` (`[E]`) into `topk_idx` (`[T, K]` i64) and `topk_weights`
/// (`[T, K]` f32) on `stream`. Same result as the host twin [`crate::routing::route_topk`], bit for
/// bit. Nothing is read back to the host.
pub fn route_topk_cuda(
    stream: &Arc<CudaStream>,
    scores: &impl DevicePtr<f32>,
    input: TopkInput,
    bias: Option<&dyn DevicePtr<f32>>,
    spec: &TopkSpec,
    topk_idx: &mut impl DevicePtrMut<i64>,
    topk_weights: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    spec.check(true)?;
    let (e, k) = (spec.num_experts, spec.top_k);
    let t = spec.check_lengths(
        scores.len(),
        bias.map(|b| b.len()),
        topk_idx.len(),
        topk_weights.len(),
    )?;
    if t == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    // One instance per bound on the experts per lane of the token's warp (`ceil(E / 32)`).
    let name = match e.div_ceil(32) {
        0..=2 => "route_topk_r2",
        3..=4 => "route_topk_r4",
        5..=8 => "route_topk_r8",
        9..=16 => "route_topk_r16",
        _ => "route_topk_r32",
    };
    let kernel = kernels.kernel(FILE, name)?;
    let (s_ptr, _gs) = scores.device_ptr(stream);
    let bias_guard = bias.map(|b| b.device_ptr(stream));
    let (i_ptr, _gi) = topk_idx.device_ptr_mut(stream);
    let (w_ptr, _gw) = topk_weights.device_ptr_mut(stream);
    let grouped = spec.group_score != GroupScore::None && spec.n_group > 1;
    let params = RouteTopkParams {
        scores: s_ptr,
        bias: bias_guard.as_ref().map_or(0, |(p, _)| *p),
        topk_idx: i_ptr,
        topk_weights: w_ptr,
        num_tokens: t as i64,
        // Fit: bounded by `spec.check(true)`.
        num_experts: e as i32,
        top_k: k as i32,
        n_group: if grouped { spec.n_group as i32 } else { 1 },
        topk_group: if grouped { spec.topk_group as i32 } else { 1 },
        group_score: match spec.group_score {
            GroupScore::None => 0,
            GroupScore::Top2Sum => 1,
            GroupScore::Max => 2,
        },
        norm_topk_prob: i32::from(spec.norm_topk_prob),
        scaling: spec.scaling,
        input: match input {
            TopkInput::Scores => 0,
            TopkInput::Logits(Scoring::Sigmoid) => 1,
            TopkInput::Logits(Scoring::Softmax) => 2,
        },
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(
                t as u64,
                u64::from(THREADS / 32),
                kernels.props(),
                BLOCKS_PER_SM,
            ),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `RouteTopkParams`; `scores` holds `t * e` f32, `bias` (if any)
    // `e`, the outputs `t * k` (checked above); the kernel reads and writes only those rows;
    // `e <= 1024` (so `ceil(e / 32)` is within the chosen instance's bound) and
    // `k, n_group <= 32` fit its registers, shared arrays and lanes (checked by the spec). The
    // guards keep stream order until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
