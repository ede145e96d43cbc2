//! Per-head GEMMs over rows laid out `[tokens, heads, width]`: `y[t, g, :] = x[t, g, first ..
//! first + k] · w[g]` with `w = [heads, k, n]` and `y = [tokens, heads, n]`. MLA's absorbed
//! attention maps each head's query into the latent space (`q_nope · W_UK`) and each head's
//! latent output back to values (`o · W_UV^T`) this way; run as one strided batched GEMM (a
//! batch a head) whose operands and output keep the token-major layout, so no transpose is
//! ever copied. Host twin: [`per_head_gemm`] (f32); on CUDA `per_head_gemm_bf16_cuda` (cuBLAS,
//! bf16 in and out, f32 accumulation).

use crate::error::{Error, Result};

/// The sizes of a per-head GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerHeadShape {
    /// Rows of `x` and `y`.
    pub tokens: usize,
    /// Heads: maps in `w`, and blocks of each row of `x` and `y`.
    pub heads: usize,
    /// Values of one head in a row of `x`.
    pub x_width: usize,
    /// First value of a head's block that the map reads.
    pub first: usize,
    /// Values a map reads (`w`'s middle dimension).
    pub k: usize,
    /// Values a map writes (`w`'s last dimension, `y`'s per head).
    pub n: usize,
}

impl PerHeadShape {
    /// Checks the sizes against the lengths of `x`, `w` and `y`; an error names what is wrong.
    pub fn check(&self, x_len: usize, w_len: usize, y_len: usize) -> Result<()> {
        let s = self;
        if s.heads == 0 || s.k == 0 || s.n == 0 {
            return Err(Error::invalid(
                "per-head shape",
                format!("{} heads, k {}, n {}", s.heads, s.k, s.n),
                "heads, k and n must be at least 1",
            ));
        }
        if s.first.checked_add(s.k).is_none_or(|end| end > s.x_width) {
            return Err(Error::invalid(
                "per-head shape",
                format!("values {} .. {} + {}", s.first, s.first, s.k),
                format!("must lie in a head's {} values of x", s.x_width),
            ));
        }
        let x_row = s.heads.checked_mul(s.x_width);
        let y_row = s.heads.checked_mul(s.n);
        let fits = |v: Option<usize>| v.is_some_and(|v| i32::try_from(v).is_ok());
        if !fits(x_row) || !fits(y_row) || !fits(Some(s.tokens)) || !fits(Some(s.k * s.n)) {
            return Err(Error::invalid(
                "per-head shape",
                s,
                "tokens, a row of x or y and one map must fit in an i32",
            ));
        }
        Error::check_lens(
            &[
                ("x", s.tokens * s.heads * s.x_width, x_len),
                ("w", s.heads * s.k * s.n, w_len),
                ("y", s.tokens * s.heads * s.n, y_len),
            ],
            s,
        )
    }
}

impl std::fmt::Display for PerHeadShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self;
        write!(
            f,
            "{} tokens x {} heads of {} values, values {} .. {} mapped to {}",
            s.tokens,
            s.heads,
            s.x_width,
            s.first,
            s.first + s.k,
            s.n
        )
    }
}

/// Host twin of the per-head GEMM in f32: `y[t, g, j] = sum_i x[t, g, first + i] w[g, i, j]`,
/// every output written.
pub fn per_head_gemm(x: &[f32], w: &[f32], shape: PerHeadShape, y: &mut [f32]) -> Result<()> {
    shape.check(x.len(), w.len(), y.len())?;
    let PerHeadShape {
        tokens,
        heads,
        x_width,
        first,
        k,
        n,
    } = shape;
    for t in 0..tokens {
        for g in 0..heads {
            let xr = &x[(t * heads + g) * x_width + first..][..k];
            let out = &mut y[(t * heads + g) * n..][..n];
            out.fill(0.0);
            for (i, &a) in xr.iter().enumerate() {
                let wr = &w[(g * k + i) * n..][..n];
                for (o, &b) in out.iter_mut().zip(wr) {
                    *o += a * b;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> PerHeadShape {
        PerHeadShape {
            tokens: 2,
            heads: 3,
            x_width: 5,
            first: 1,
            k: 2,
            n: 4,
        }
    }

    #[test]
    fn reads_each_heads_slice_and_writes_token_major() {
        let s = shape();
        let x: Vec<f32> = (0..s.tokens * s.heads * s.x_width)
            .map(|i| i as f32)
            .collect();
        let w: Vec<f32> = (0..s.heads * s.k * s.n)
            .map(|i| (i % 7) as f32 - 3.0)
            .collect();
        let mut y = vec![f32::NAN; s.tokens * s.heads * s.n];
        per_head_gemm(&x, &w, s, &mut y).unwrap();
        for t in 0..s.tokens {
            for g in 0..s.heads {
                for j in 0..s.n {
                    let want: f32 = (0..s.k)
                        .map(|i| x[t * 15 + g * 5 + 1 + i] * w[g * s.k * s.n + i * s.n + j])
                        .sum();
                    assert_eq!(y[t * 12 + g * 4 + j], want);
                }
            }
        }
    }

    #[test]
    fn refuses_a_slice_past_the_head() {
        let s = PerHeadShape {
            first: 4,
            ..shape()
        };
        let err = per_head_gemm(&[0.0; 30], &[0.0; 24], s, &mut [0.0; 24]).unwrap_err();
        assert!(
            err.to_string().contains("must lie in a head's 5 values"),
            "{err}"
        );
        let err = per_head_gemm(&[0.0; 29], &[0.0; 24], shape(), &mut [0.0; 24]).unwrap_err();
        assert!(err.to_string().contains("must hold 30"), "{err}");
    }
}
