//! Row gather ("permute"): `dst[i, :] = src[index[i], :]`, the packing step of a dispatch
//! built from collectives (gather the rows bound for each rank into one contiguous send
//! buffer). Kernel: `permute.cu`; typed launcher: `gather_rows_cuda` (`cuda/permute.rs`,
//! `cuda` feature); host twin: [`gather_rows`].

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
pub use super::cuda::permute::gather_rows_cuda;

/// Checks the shapes shared by the kernel and its host twin; returns the number of source rows.
pub(super) fn check_shapes(
    src_len: usize,
    index_len: usize,
    row_len: usize,
    dst_len: usize,
) -> Result<usize> {
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

/// Host twin of `gather_rows_cuda`: `dst[i * row_len..][..row_len] =
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
