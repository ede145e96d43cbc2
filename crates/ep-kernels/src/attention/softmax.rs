//! The softmax of MLA's attention scores over the two score products, with the scale and the
//! additive mask, in one pass (`scores_softmax.cu`): where candle's ops make four passes over
//! the `[seqs, queries * heads, len]` scores (their sum, the scale, the broadcast mask, the
//! softmax), the broadcast mask alone the longest kernel of a batch-64 decode step
//! (`docs/design.md`, "MLA attention"). Host twin: [`scores_softmax`]; on CUDA
//! `scores_softmax_bf16_cuda`.

use crate::error::{Error, Result};

/// The sizes of the scores: `seqs` sequences of `queries` queries of `heads` heads (rows laid
/// out `[seqs, queries, heads]`, token-major), each over `len` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoresShape {
    /// Sequences (the mask's first dimension).
    pub seqs: usize,
    /// Heads of a query, the mask row shared by them.
    pub heads: usize,
    /// Queries of a sequence (its new tokens, padded).
    pub queries: usize,
    /// Keys of a row.
    pub len: usize,
}

impl ScoresShape {
    /// Rows of the scores: `seqs * queries * heads`.
    pub fn rows(&self) -> usize {
        self.seqs * self.heads * self.queries
    }

    /// Checks the sizes against the lengths of the two products, the mask and the output, and
    /// `scale`; an error names what is wrong.
    pub fn check(&self, scores: [usize; 2], mask: usize, probs: usize, scale: f32) -> Result<()> {
        let s = self;
        let rows = s
            .seqs
            .checked_mul(s.heads)
            .and_then(|v| v.checked_mul(s.queries));
        let Some(elems) = rows.and_then(|r| r.checked_mul(s.len)) else {
            return Err(Error::invalid(
                "scores shape",
                format!("{} x {} x {} x {}", s.seqs, s.heads, s.queries, s.len),
                "the scores' size must fit in a usize",
            ));
        };
        if s.heads == 0 || s.queries == 0 || s.len == 0 {
            return Err(Error::invalid(
                "scores shape",
                format!("{} heads, {} queries, {} keys", s.heads, s.queries, s.len),
                "heads, queries and keys must be at least 1",
            ));
        }
        if !scale.is_finite() {
            return Err(Error::invalid("scale", scale, "must be finite"));
        }
        Error::check_lens(
            &[
                ("latent scores", elems, scores[0]),
                ("rope scores", elems, scores[1]),
                ("mask", s.seqs * s.queries * s.len, mask),
                ("probs", elems, probs),
            ],
            format_args!(
                "{} sequences x {} heads x {} queries x {} keys",
                s.seqs, s.heads, s.queries, s.len
            ),
        )
    }
}

/// Host twin, in f32: `probs[r, j] = softmax_j((latent[r, j] + rope[r, j]) * scale +
/// mask[s, q, j])` for row `r` of query `q` of sequence `s` (rows laid out
/// `[seqs, queries, heads]`: the mask row is `r / heads`); a row whose every score is `-inf`
/// gives zeros.
pub fn scores_softmax(
    latent: &[f32],
    rope: &[f32],
    mask: &[f32],
    scale: f32,
    shape: ScoresShape,
    probs: &mut [f32],
) -> Result<()> {
    shape.check([latent.len(), rope.len()], mask.len(), probs.len(), scale)?;
    let ScoresShape { heads, len, .. } = shape;
    for row in 0..shape.rows() {
        let m = &mask[row / heads * len..][..len];
        let out = &mut probs[row * len..][..len];
        for (j, o) in out.iter_mut().enumerate() {
            *o = (latent[row * len + j] + rope[row * len + j]) * scale + m[j];
        }
        let max = out.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            out.fill(0.0);
            continue;
        }
        let mut sum = 0.0f32;
        for o in out.iter_mut() {
            *o = (*o - max).exp();
            sum += *o;
        }
        out.iter_mut().for_each(|o| *o /= sum);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_head_shares_its_sequences_mask() {
        let shape = ScoresShape {
            seqs: 2,
            heads: 2,
            queries: 1,
            len: 3,
        };
        let latent = [1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 5.0, 0.0, 0.0];
        let rope = [0.0; 12];
        let ninf = f32::NEG_INFINITY;
        let mask = [0.0, 0.0, ninf, ninf, ninf, ninf];
        let mut probs = [f32::NAN; 12];
        scores_softmax(&latent, &rope, &mask, 1.0, shape, &mut probs).unwrap();
        let e = 1f32.exp();
        let want0 = [1.0 / (1.0 + e), e / (1.0 + e), 0.0];
        for (g, w) in probs[..3].iter().zip(want0) {
            assert!((g - w).abs() < 1e-6, "{probs:?}");
        }
        assert_eq!(&probs[3..6], &[0.5, 0.5, 0.0]);
        // The second sequence is masked everywhere: zeros, not NaN.
        assert_eq!(&probs[6..], &[0.0; 6]);
    }

    #[test]
    fn refuses_a_mask_of_the_wrong_size() {
        let shape = ScoresShape {
            seqs: 2,
            heads: 3,
            queries: 1,
            len: 4,
        };
        let err = scores_softmax(
            &[0.0; 24],
            &[0.0; 24],
            &[0.0; 24],
            1.0,
            shape,
            &mut [0.0; 24],
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("`mask` = 24 values: must hold 8"),
            "{err}"
        );
    }
}
