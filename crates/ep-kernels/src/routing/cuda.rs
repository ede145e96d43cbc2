//! Typed launchers of the routing kernel (`routing.cu`; host twin [`super::route_topk`]) and
//! of the gate kernel (`gate.cu`; host twin [`super::gate_logits`]).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::gate::gate_tile;
use super::{GateInput, GateShape, GroupScore, Scoring, TopkInput, TopkSpec};
use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::Result;

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
/// (`[T, K]` f32) on `stream`. Same result as the host twin [`super::route_topk`], bit for
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

/// The cubin of `gate.cu`.
const GATE_FILE: &str = "routing/gate";
/// Threads per block of the gate kernel (`kThreads`).
const GATE_THREADS: u32 = 256;
/// Resident blocks per SM the gate grid is capped at (it strides over the remaining tiles).
const GATE_BLOCKS_PER_SM: u32 = 4;

/// Mirror of `struct GateLogitsParams` in `gate.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GateLogitsParams {
    x: CUdeviceptr,
    weight: CUdeviceptr,
    logits: CUdeviceptr,
    num_tokens: i64,
    num_experts: i32,
    hidden: i32,
}
const _: () = assert!(std::mem::size_of::<GateLogitsParams>() == 40);
const _: () = assert!(std::mem::offset_of!(GateLogitsParams, num_tokens) == 24);
const _: () = assert!(std::mem::offset_of!(GateLogitsParams, hidden) == 36);

// SAFETY: `repr(C)` plain data mirroring `GateLogitsParams` in gate.cu (size asserted both
// sides, field offsets here).
unsafe impl KernelParams for GateLogitsParams {}

/// Computes the gate's logits `[T, E]` f32 = `x` (`[T, H]`, bf16 / f16 / f32) times
/// `weight^T` (`weight` `[E, H]` f32) on `stream`, accumulating in f32. Within the tolerance
/// stated in the GPU tests of the host twin [`super::gate_logits`] (which sums in f64); the
/// same on every run. Any `T` and `H` work; the fast path needs `H % 4 == 0` and `x`, `weight`
/// aligned to 4 elements, otherwise scalar loads are used. Nothing is read back to the host.
pub fn gate_logits_cuda<T: GateInput + DeviceRepr>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<f32>,
    shape: GateShape,
    logits: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let t = shape.check(true, x.len(), weight.len(), logits.len())?;
    if t == 0 {
        return Ok(());
    }
    let (e, h) = (shape.num_experts, shape.hidden);
    let kernels = Kernels::for_stream(stream)?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (w_ptr, _gw) = weight.device_ptr(stream);
    let (l_ptr, _gl) = logits.device_ptr_mut(stream);
    let elem = std::mem::size_of::<T>() as u64;
    let vector = h % 4 == 0 && x_ptr % (4 * elem) == 0 && w_ptr % 16 == 0;
    let sms = kernels.props().sm_count as usize;
    let (tc, eb) = match gate_tile(t, e, sms) {
        (1, _) if !vector => (1, 1),
        _ if !vector => (8, 1),
        tile => tile,
    };
    let name = format!(
        "gate_logits_{}_v{}_t{tc}e{eb}",
        T::NAME,
        if vector { 4 } else { 1 }
    );
    let kernel = kernels.kernel(GATE_FILE, &name)?;
    let tiles = (t.div_ceil(tc) * e.div_ceil(eb)) as u64;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(tiles, 1, kernels.props(), GATE_BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (GATE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = GateLogitsParams {
        x: x_ptr,
        weight: w_ptr,
        logits: l_ptr,
        num_tokens: t as i64,
        // Fit: `e <= MAX_EXPERTS` and `h <= i32::MAX` (checked by `shape.check`).
        num_experts: e as i32,
        hidden: h as i32,
    };
    // SAFETY: `params` matches `GateLogitsParams` and `name` picks the instance for `T`'s
    // element type; `x` holds `t * h` elements of `T`, `weight` `e * h` f32 and `logits`
    // `t * e` f32 (checked above), and the kernel reads and writes only inside those; the
    // 4-wide instances are chosen only when `h % 4 == 0` and both inputs are aligned to their
    // vector loads. The guards keep stream order until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
