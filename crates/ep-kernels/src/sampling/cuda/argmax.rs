//! Launcher of `argmax.cu`. Host twin: [`crate::sampling::argmax_rows`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::cuda::{KernelParams, Kernels};
use crate::error::Result;
use crate::sampling::check_argmax;

/// The cubin of `argmax.cu`.
const FILE: &str = "sampling/argmax";
const THREADS: u32 = 256;
/// Fewest values a block's run holds (4 a thread).
const MIN_RUN: usize = 4 * THREADS as usize;
/// Blocks a launch aims at, per SM.
const BLOCKS_PER_SM: usize = 2;

/// Mirror of `struct ArgmaxParams` in `argmax.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ArgmaxParams {
    logits: CUdeviceptr,
    keys: CUdeviceptr,
    rows: i64,
    vocab: i64,
    chunk: i64,
    vec: i32,
    pad_: i32,
}
const _: () = assert!(std::mem::size_of::<ArgmaxParams>() == 48);

// SAFETY: `repr(C)` plain data mirroring `ArgmaxParams` in argmax.cu (size asserted both sides).
unsafe impl KernelParams for ArgmaxParams {}

/// Each row's key of its largest logit on `stream` (`logits` `[rows, vocab]` f32, `keys`
/// `[rows]`, zeroed here first); `crate::sampling::key_index` gives the index, the first
/// largest. Checked before launch: the sizes, at most `MAX_ARGMAX_ROWS` rows, `vocab < 2^32 - 1`.
pub fn argmax_rows_f32_cuda(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<f32>,
    rows: usize,
    vocab: usize,
    keys: &mut impl DevicePtrMut<u64>,
) -> Result<()> {
    launch(stream, "argmax_rows_f32", logits, rows, vocab, keys)
}

/// [`argmax_rows_f32_cuda`] on bf16 logits (a model's own dtype: no cast to f32 first; the
/// values compare as their f32 conversions, exactly).
pub fn argmax_rows_bf16_cuda(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<bf16>,
    rows: usize,
    vocab: usize,
    keys: &mut impl DevicePtrMut<u64>,
) -> Result<()> {
    launch(stream, "argmax_rows_bf16", logits, rows, vocab, keys)
}

/// The checks and launch of entry point `name` of `argmax.cu` over logits of its dtype `T`.
fn launch<T>(
    stream: &Arc<CudaStream>,
    name: &str,
    logits: &impl DevicePtr<T>,
    rows: usize,
    vocab: usize,
    keys: &mut impl DevicePtrMut<u64>,
) -> Result<()> {
    check_argmax(rows, vocab, logits.len())?;
    crate::error::Error::check_len("keys", rows, keys.len())?;
    if rows == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, name)?;
    stream.context().bind_to_thread()?;
    stream.memset_zeros(keys)?;
    let sms = kernels.props().sm_count.max(1) as usize;
    let runs = (BLOCKS_PER_SM * sms)
        .div_ceil(rows)
        .clamp(1, vocab.div_ceil(MIN_RUN));
    let (l_ptr, _gl) = logits.device_ptr(stream);
    // bf16 rows of whole 16-byte loads: runs of a multiple of 8 values, 8 a load.
    let vec = std::mem::size_of::<T>() == 2 && vocab % 8 == 0 && l_ptr % 16 == 0;
    let chunk = vocab.div_ceil(runs);
    let chunk = if vec {
        chunk.next_multiple_of(8)
    } else {
        chunk
    };
    let runs = vocab.div_ceil(chunk);
    let (k_ptr, _gk) = keys.device_ptr_mut(stream);
    let cfg = LaunchConfig {
        grid_dim: (runs as u32, rows as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = ArgmaxParams {
        logits: l_ptr,
        keys: k_ptr,
        rows: rows as i64,
        vocab: vocab as i64,
        chunk: chunk as i64,
        vec: i32::from(vec),
        pad_: 0,
    };
    // SAFETY: `params` matches `ArgmaxParams`; `logits` holds `rows * vocab` values of the
    // entry point's dtype `T` (f32 or bf16, paired by the two public launchers) and `keys`
    // `rows` u64 (checked above; `rows` fits the grid), their guards live until the launch is
    // queued; block (r, y) reads values `r * chunk ..` of row `y` below `vocab` and updates key
    // `y` atomically, after the zeroing queued before it on the same stream; with `vec` each
    // 16-byte load starts at a multiple of 8 values of a row of a multiple of 8 (aligned, and
    // inside the row: runs start at multiples of 8 and `end` is one too).
    unsafe { kernel.launch(stream, cfg, params) }
}
