//! Rotary position embedding of MLA's rope columns where they lie: each head's `dim` columns
//! from `first` of token-major rows `[tokens, heads, x_width]` (the query's rope part of
//! `q_b_proj`'s output, the key's of `kv_a_proj_with_mqa`'s), rotated by their token's cos
//! and sin rows and written contiguous `[tokens, heads, dim]` (`rope.cu`). candle's rope
//! kernels take contiguous `[b, heads, t, dim]` rows only, and its strided copy of the columns
//! into that layout took longer than the rotation (`docs/design.md`, "MLA attention"). Host
//! twin: [`rope_rows`]; on CUDA `rope_bf16_cuda`.

use half::bf16;

use crate::error::{Error, Result};

/// Where the rope columns lie and how they pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Tokens (rows of the cos and sin tables).
    pub tokens: usize,
    /// Heads of a token.
    pub heads: usize,
    /// Values of a head's block of `x`.
    pub x_width: usize,
    /// First rope column of a head's block.
    pub first: usize,
    /// Rope columns of a head (even).
    pub dim: usize,
    /// Pairs `(2i, 2i + 1)` (DeepSeek's interleaved checkpoints) or `(i, i + dim / 2)`.
    pub interleave: bool,
}

impl RopeShape {
    /// Checks the shape against the lengths of `x`, the cos and sin tables and `out`; an
    /// error names what is wrong.
    pub fn check(&self, x: usize, cos: usize, sin: usize, out: usize) -> Result<()> {
        let s = self;
        if s.dim == 0 || s.dim % 2 != 0 || s.first.checked_add(s.dim).is_none_or(|e| e > s.x_width)
        {
            return Err(Error::invalid(
                "rope shape",
                format!("{} columns from {} of {}", s.dim, s.first, s.x_width),
                "an even, positive number of columns inside each head's block",
            ));
        }
        let rows = s.tokens.checked_mul(s.heads);
        let Some(x_len) = rows.and_then(|r| r.checked_mul(s.x_width)) else {
            return Err(Error::invalid(
                "rope shape",
                format!("{} tokens x {} heads x {}", s.tokens, s.heads, s.x_width),
                "the rows' size must fit in a usize",
            ));
        };
        Error::check_lens(
            &[
                ("x", x_len, x),
                ("cos", s.tokens * s.dim / 2, cos),
                ("sin", s.tokens * s.dim / 2, sin),
                ("out", s.tokens * s.heads * s.dim, out),
            ],
            format_args!(
                "{} tokens x {} heads of {} rope columns in blocks of {}",
                s.tokens, s.heads, s.dim, s.x_width
            ),
        )
    }

    /// The two columns of pair `i` within a head's rope columns.
    pub fn pair(&self, i: usize) -> (usize, usize) {
        if self.interleave {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + self.dim / 2)
        }
    }
}

/// Host twin, in bf16 arithmetic (each product rounded to bf16, then their f32 sum or
/// difference rounded to bf16; `half`'s operators; the kernel, as candle's, may fuse one
/// product into the sum): for token `t`, head `h` and pair `i` with columns `(a, b)`
/// ([`RopeShape::pair`]) of `x[t, h, first ..]`, `c = cos[t, i]`, `s = sin[t, i]`:
/// `out[t, h, a] = x_a c - x_b s`, `out[t, h, b] = x_a s + x_b c`.
pub fn rope_rows(
    x: &[bf16],
    cos: &[bf16],
    sin: &[bf16],
    shape: RopeShape,
    out: &mut [bf16],
) -> Result<()> {
    shape.check(x.len(), cos.len(), sin.len(), out.len())?;
    let RopeShape {
        tokens,
        heads,
        x_width,
        first,
        dim,
        ..
    } = shape;
    for t in 0..tokens {
        for h in 0..heads {
            let row = &x[(t * heads + h) * x_width + first..][..dim];
            let o = &mut out[(t * heads + h) * dim..][..dim];
            for i in 0..dim / 2 {
                let (a, b) = shape.pair(i);
                let (c, s) = (cos[t * dim / 2 + i], sin[t * dim / 2 + i]);
                o[a] = row[a] * c - row[b] * s;
                o[b] = row[a] * s + row[b] * c;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: f32) -> bf16 {
        bf16::from_f32(v)
    }

    #[test]
    fn pairs_rotate_by_their_token_s_angle_in_both_layouts() {
        // One token, one head of 4 rope columns after 2 other columns; angle 90 degrees for
        // pair 0, 0 degrees for pair 1.
        let x = [9.0, 9.0, 1.0, 2.0, 3.0, 4.0].map(b);
        let (cos, sin) = ([0.0, 1.0].map(b), [1.0, 0.0].map(b));
        for (interleave, want) in [
            (true, [-2.0, 1.0, 3.0, 4.0]),
            // Pairs (0, 2) and (1, 3): pair 0 (1, 3) turns to (-3, 1).
            (false, [-3.0, 2.0, 1.0, 4.0]),
        ] {
            let shape = RopeShape {
                tokens: 1,
                heads: 1,
                x_width: 6,
                first: 2,
                dim: 4,
                interleave,
            };
            let mut out = [b(f32::NAN); 4];
            rope_rows(&x, &cos, &sin, shape, &mut out).unwrap();
            assert_eq!(out, want.map(b), "interleave {interleave}");
        }
    }

    #[test]
    fn bad_shapes_are_refused_in_words() {
        let shape = RopeShape {
            tokens: 2,
            heads: 3,
            x_width: 8,
            first: 6,
            dim: 4,
            interleave: true,
        };
        let err = shape.check(48, 4, 4, 24).unwrap_err().to_string();
        assert!(err.contains("rope shape"), "{err}");
        let ok = RopeShape { first: 4, ..shape };
        assert!(ok.check(48, 4, 4, 24).is_ok());
        let err = ok.check(48, 3, 4, 24).unwrap_err().to_string();
        assert!(err.contains("cos"), "{err}");
    }
}
