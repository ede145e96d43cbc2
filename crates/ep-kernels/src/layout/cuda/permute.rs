//! Typed launcher of the row gather kernel (`permute.cu`); host twin:
//! [`crate::layout::permute::gather_rows`].

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use crate::cuda::{assert_params_layout, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::layout::permute::check_shapes;

/// The cubin of `permute.cu`.
const FILE: &str = "layout/permute";
/// Threads per block (`kThreads` in `permute.cu`); one warp per row.
const THREADS: u32 = 256;
/// Rows handled by one block per grid-stride step (`kWarpsPerBlock`).
const ROWS_PER_BLOCK: u64 = (THREADS / 32) as u64;
/// Resident blocks per SM the grid is capped at (grid-stride loops cover the rest).
const BLOCKS_PER_SM: u32 = 8;
/// Bytes of one vector access of the fast path.
const VECTOR_BYTES: u64 = 16;

/// Mirror of `struct GatherRowsParams` in `permute.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GatherRowsParams {
    src: CUdeviceptr,
    index: CUdeviceptr,
    dst: CUdeviceptr,
    num_rows: i64,
    row_bytes: i64,
    num_src_rows: i32,
    vectorized: i32,
}
assert_params_layout!(
    GatherRowsParams,
    48;
    src = 0, index = 8, dst = 16, num_rows = 24, row_bytes = 32, num_src_rows = 40,
    vectorized = 44,
);

// SAFETY: `repr(C)` plain data mirroring `GatherRowsParams` in permute.cu (size asserted on
// both sides).
unsafe impl KernelParams for GatherRowsParams {}

/// Gathers rows on `stream`: `dst[i, :] = src[index[i], :]` with `src: [S, row_len]`,
/// `index: [N]` i32 and `dst: [N, row_len]`, elements of any plain type `T` (bf16 for a
/// dispatch). Same result as the host twin [`crate::layout::permute::gather_rows`].
///
/// Rows whose size is a multiple of 16 bytes, with 16-byte aligned `src` and `dst` (whole
/// cudarc allocations, and views starting at a row boundary), are copied with 16-byte vector
/// accesses; anything else takes a byte-copy fallback. Indices are checked on the device: one
/// outside `[0, S)` traps, which fails the launch's stream (the context is then unusable).
pub fn gather_rows_cuda<T>(
    stream: &CudaStream,
    src: &impl DevicePtr<T>,
    index: &impl DevicePtr<i32>,
    row_len: usize,
    dst: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let num_src_rows = check_shapes(src.len(), index.len(), row_len, dst.len())?;
    let num_rows = index.len();
    if num_rows == 0 {
        return Ok(());
    }
    let row_bytes = row_len
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::invalid("row_len", row_len, "row bytes overflow"))?;
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "gather_rows")?;
    let (src_ptr, _gs) = src.device_ptr(stream);
    let (index_ptr, _gi) = index.device_ptr(stream);
    let (dst_ptr, _gd) = dst.device_ptr_mut(stream);
    let vectorized = row_bytes as u64 % VECTOR_BYTES == 0
        && src_ptr % VECTOR_BYTES == 0
        && dst_ptr % VECTOR_BYTES == 0;
    let params = GatherRowsParams {
        src: src_ptr,
        index: index_ptr,
        dst: dst_ptr,
        num_rows: i64::try_from(num_rows)
            .map_err(|_| Error::invalid("index", num_rows, "must have at most i64::MAX rows"))?,
        row_bytes: i64::try_from(row_bytes)
            .map_err(|_| Error::invalid("row_len", row_len, "row bytes must fit in an i64"))?,
        // Fits: checked by `check_shapes`.
        num_src_rows: num_src_rows as i32,
        vectorized: i32::from(vectorized),
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(
                num_rows as u64,
                ROWS_PER_BLOCK,
                kernels.props(),
                BLOCKS_PER_SM,
            ),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `GatherRowsParams`; `src` holds `num_src_rows * row_bytes`
    // bytes, `index` `num_rows` i32 and `dst` `num_rows * row_bytes` bytes (checked above);
    // the kernel reads `src` only at rows whose index it has checked to be in range, and uses
    // 16-byte accesses only when both bases and the row size are 16-byte multiples. `src` and
    // `dst` cannot overlap (one is borrowed shared, the other exclusively). The guards keep
    // cudarc's stream ordering until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
