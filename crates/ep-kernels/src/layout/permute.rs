//! Row gather ("permute"): `dst[i, :] = src[index[i], :]`, the packing step of a dispatch
//! built from collectives (gather the rows bound for each rank into one contiguous send
//! buffer). Kernel: `permute.cu`; typed launcher: [`gather_rows_cuda`]; host twin:
//! [`gather_rows`].

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};

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
const _: () = assert!(std::mem::size_of::<GatherRowsParams>() == 48);

// SAFETY: `repr(C)` plain data mirroring `GatherRowsParams` in permute.cu (size asserted on
// both sides).
unsafe impl KernelParams for GatherRowsParams {}

/// Checks the shapes shared by the kernel and its host twin; returns the number of source rows.
fn check_shapes(src_len: usize, index_len: usize, row_len: usize, dst_len: usize) -> Result<usize> {
    if row_len == 0 {
        return Err(Error::invalid("row_len", row_len, "must be positive"));
    }
    if src_len % row_len != 0 {
        return Err(Error::invalid(
            "src",
            format!("{src_len} elements"),
            format!("must be whole rows of row_len = {row_len}"),
        ));
    }
    let expected = index_len
        .checked_mul(row_len)
        .ok_or_else(|| Error::invalid("index", index_len, "index.len() * row_len overflows"))?;
    Error::check_len("dst", expected, dst_len)?;
    let num_src_rows = src_len / row_len;
    if i32::try_from(num_src_rows).is_err() {
        return Err(Error::invalid(
            "src",
            format!("{num_src_rows} rows"),
            "must have at most i32::MAX rows (indices are i32)",
        ));
    }
    Ok(num_src_rows)
}

/// Host twin of [`gather_rows_cuda`]: `dst[i * row_len..][..row_len] =
/// src[index[i] * row_len..][..row_len]` for every `i`.
///
/// Fails (before writing anything) if a shape is wrong or an index is outside
/// `[0, src.len() / row_len)`.
pub fn gather_rows<T: Copy>(src: &[T], index: &[i32], row_len: usize, dst: &mut [T]) -> Result<()> {
    let num_src_rows = check_shapes(src.len(), index.len(), row_len, dst.len())?;
    if let Some((i, &s)) = index
        .iter()
        .enumerate()
        .find(|(_, &s)| usize::try_from(s).map_or(true, |s| s >= num_src_rows))
    {
        return Err(Error::invalid(
            "index",
            format!("index[{i}] = {s}"),
            format!("must be in [0, {num_src_rows})"),
        ));
    }
    for (out, &s) in dst.chunks_exact_mut(row_len).zip(index) {
        let s = s as usize;
        out.copy_from_slice(&src[s * row_len..(s + 1) * row_len]);
    }
    Ok(())
}

/// Gathers rows on `stream`: `dst[i, :] = src[index[i], :]` with `src: [S, row_len]`,
/// `index: [N]` i32 and `dst: [N, row_len]`, elements of any plain type `T` (bf16 for a
/// dispatch). Same result as the host twin [`gather_rows`].
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_twin_gathers_rows_in_index_order() {
        let src: Vec<u16> = (0..12).collect(); // 4 rows of 3
        let mut dst = vec![0u16; 9];
        gather_rows(&src, &[3, 0, 3], 3, &mut dst).unwrap();
        assert_eq!(dst, [9, 10, 11, 0, 1, 2, 9, 10, 11]);
    }

    #[test]
    fn host_twin_rejects_bad_indices_and_shapes() {
        let src = [0u8; 8];
        let mut dst = [0u8; 4];
        assert!(gather_rows(&src, &[0, 4], 2, &mut dst).is_err());
        assert!(gather_rows(&src, &[-1, 0], 2, &mut dst).is_err());
        assert!(gather_rows(&src, &[0], 2, &mut dst).is_err());
        assert!(gather_rows(&src, &[0, 1], 3, &mut dst[..]).is_err());
        assert!(gather_rows(&src, &[0, 1], 0, &mut dst).is_err());
    }
}
