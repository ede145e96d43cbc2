//! Greedy sampling on the device: the index of each row's largest logit (the first on ties),
//! so that a decode step reads back one id a sequence instead of its logits
//! (`docs/design.md`, "Greedy sampling"). Host twin: [`argmax_rows`]; on CUDA
//! `argmax_rows_f32_cuda` and `argmax_rows_bf16_cuda` (`argmax.cu`), whose per-row keys
//! [`key_index`] turns into ids.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

use crate::error::{Error, Result};

/// Most rows one launch takes (the grid's second dimension).
pub const MAX_ARGMAX_ROWS: usize = 65535;

/// Checks `rows` rows of `vocab` logits against `len` values; an error names what is wrong.
pub fn check_argmax(rows: usize, vocab: usize, len: usize) -> Result<()> {
    if vocab == 0 || vocab >= u32::MAX as usize {
        return Err(Error::invalid("vocab", vocab, "must be in 1 .. 2^32 - 1"));
    }
    if rows > MAX_ARGMAX_ROWS {
        return Err(Error::invalid(
            "rows",
            rows,
            format!("at most {MAX_ARGMAX_ROWS} a launch"),
        ));
    }
    Error::check_len("logits", rows * vocab, len)
}

/// The index a row's key (`argmax.cu`) holds: the complement of its low 32 bits.
pub fn key_index(key: u64) -> u32 {
    u32::MAX - (key & 0xffff_ffff) as u32
}

/// Host twin: the index of the largest value of each row of `logits` (`[rows, vocab]`), the
/// first one on ties; NaN never wins, and a row of `-inf` (or NaN) gives 0.
pub fn argmax_rows(logits: &[f32], vocab: usize) -> Result<Vec<u32>> {
    if vocab == 0 {
        return Err(Error::invalid("vocab", vocab, "must be at least 1"));
    }
    Error::check_len("logits", logits.len() / vocab * vocab, logits.len())?;
    Ok(logits
        .chunks(vocab)
        .map(|row| {
            let (mut best, mut at) = (f32::NEG_INFINITY, 0);
            for (i, &v) in row.iter().enumerate() {
                if v > best {
                    (best, at) = (v, i);
                }
            }
            at as u32
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_largest_of_each_row() {
        let ninf = f32::NEG_INFINITY;
        let logits = [
            1.0,
            3.0,
            3.0,
            0.0,
            ninf,
            ninf,
            ninf,
            ninf,
            f32::NAN,
            -1.0,
            -0.5,
            -0.5,
        ];
        assert_eq!(argmax_rows(&logits, 4).unwrap(), [1, 0, 2]);
        assert_eq!(key_index(u64::from(u32::MAX - 77)), 77);
        assert!(check_argmax(65536, 4, 65536 * 4).is_err());
        assert!(argmax_rows(&logits, 5).is_err());
    }
}
