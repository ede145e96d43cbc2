//! Host twins of the expert-order kernels.

use half::bf16;

use crate::error::{Error, Result};

/// Where each (token, slot) pair went: the per-expert counts and every pair's row of `A`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertOrder {
    /// `[L]` pairs per local expert.
    pub counts: Vec<i32>,
    /// `[N, K]` row of `A` of each pair, `-1` for a slot without a local expert.
    pub positions: Vec<i32>,
}

/// Checks `topk_idx` (`[n, k]`, `-1` or a local expert id below `num_local`).
fn check_idx(topk_idx: &[i64], num_local: usize) -> Result<()> {
    if let Some((i, &v)) = topk_idx
        .iter()
        .enumerate()
        .find(|(_, &v)| v < -1 || v >= num_local as i64)
    {
        return Err(Error::invalid(
            "topk_idx",
            format!("topk_idx[{i}] = {v}"),
            format!("must be -1 or a local expert id below {num_local}"),
        ));
    }
    Ok(())
}

/// Host twin of `permute_cuda`: places the pairs of `topk_idx` (`[n, k]`) in expert-major
/// order (an expert's pairs in (token, slot) order) and copies the rows of `x` (`[n, row]`)
/// into `a` (`[rows, row]`, at least [`super::rows_bound`] rows). Rows of `a` no pair lands on
/// are left as they are.
pub fn permute<T: Copy>(
    x: &[T],
    topk_idx: &[i64],
    k: usize,
    num_local: usize,
    alignment: usize,
    row: usize,
    a: &mut [T],
) -> Result<ExpertOrder> {
    if k == 0 || row == 0 || alignment == 0 || num_local == 0 {
        return Err(Error::invalid(
            "k / row / alignment / num_local",
            format!("{k} / {row} / {alignment} / {num_local}"),
            "must all be positive",
        ));
    }
    if topk_idx.len() % k != 0 {
        return Err(Error::invalid(
            "topk_idx",
            format!("{} entries", topk_idx.len()),
            format!("must be whole rows of k = {k}"),
        ));
    }
    let n = topk_idx.len() / k;
    Error::check_len("x", n * row, x.len())?;
    check_idx(topk_idx, num_local)?;
    let mut counts = vec![0i32; num_local];
    for &e in topk_idx.iter().filter(|&&e| e >= 0) {
        counts[e as usize] += 1;
    }
    let mut starts = Vec::with_capacity(num_local);
    let mut next = 0usize;
    for &c in &counts {
        starts.push(next);
        next += (c as usize).div_ceil(alignment) * alignment;
    }
    if a.len() < next * row {
        return Err(Error::invalid(
            "a",
            format!("{} rows", a.len() / row),
            format!("must hold the {next} rows the placement needs"),
        ));
    }
    let mut fill = vec![0usize; num_local];
    let mut positions = vec![-1i32; n * k];
    for (p, &e) in topk_idx.iter().enumerate() {
        if e < 0 {
            continue;
        }
        let e = e as usize;
        let r = starts[e] + fill[e];
        fill[e] += 1;
        positions[p] = r as i32;
        let tok = p / k;
        a[r * row..(r + 1) * row].copy_from_slice(&x[tok * row..(tok + 1) * row]);
    }
    Ok(ExpertOrder { counts, positions })
}

/// Host twin of `scatter_cuda`: `dst[positions[t, s]] = src[t]` for every valid slot of
/// `positions` (`[n, k]`, as [`permute`] returns them); `src` is `[n, row]`, `dst`
/// `[rows, row]`. Rows no slot lands on are left as they are.
pub fn scatter<T: Copy>(
    src: &[T],
    positions: &[i32],
    k: usize,
    row: usize,
    dst: &mut [T],
) -> Result<()> {
    let n = slot_tokens(positions, k, row)?;
    Error::check_len("src", n * row, src.len())?;
    let rows = dst.len() / row;
    for (i, &p) in positions.iter().enumerate() {
        if p < 0 {
            continue;
        }
        let p = slot_row(i, p, rows, "dst")?;
        let t = i / k;
        dst[p * row..(p + 1) * row].copy_from_slice(&src[t * row..(t + 1) * row]);
    }
    Ok(())
}

/// Host twin of `unpermute_cuda`: `out[t] = bf16(sum_k w[t, k] * y[positions[t, k]])` in f32,
/// slot order, fused multiply-adds (as the kernel); `y` is `[rows, row]`, `out` `[n, row]`.
pub fn unpermute(
    y: &[bf16],
    positions: &[i32],
    weights: &[f32],
    k: usize,
    row: usize,
    out: &mut [bf16],
) -> Result<()> {
    let n = slot_tokens(positions, k, row)?;
    Error::check_len("weights", n * k, weights.len())?;
    Error::check_len("out", n * row, out.len())?;
    let rows = y.len() / row;
    let mut acc = vec![0f32; row];
    for t in 0..n {
        acc.iter_mut().for_each(|v| *v = 0.0);
        for s in 0..k {
            let p = positions[t * k + s];
            if p < 0 {
                continue;
            }
            let p = slot_row(t * k + s, p, rows, "y")?;
            let w = weights[t * k + s];
            for (a, v) in acc.iter_mut().zip(&y[p * row..(p + 1) * row]) {
                *a = w.mul_add(v.to_f32(), *a);
            }
        }
        for (o, a) in out[t * row..(t + 1) * row].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    Ok(())
}

/// The token count of a `[n, k]` slot table, refusing a zero `k` or `row` and a ragged table.
fn slot_tokens(positions: &[i32], k: usize, row: usize) -> Result<usize> {
    if k == 0 || row == 0 || positions.len() % k != 0 {
        return Err(Error::invalid(
            "positions",
            format!("{} entries with k = {k}, row = {row}", positions.len()),
            "must be whole rows of a positive k, with a positive row",
        ));
    }
    Ok(positions.len() / k)
}

/// Slot `i`'s row `p` (not negative), refused unless it is below the `rows` of `rows_of`.
fn slot_row(i: usize, p: i32, rows: usize, rows_of: &str) -> Result<usize> {
    let p = p as usize;
    if p >= rows {
        return Err(Error::invalid(
            "positions",
            format!("positions[{i}] = {p}"),
            format!("must be below the {rows} rows of {rows_of}"),
        ));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_groups_pairs_by_expert_with_aligned_starts() {
        // 3 tokens, k = 2, 3 local experts, alignment 2; rows of 1 element.
        let x = [10u16, 11, 12];
        let idx = [1, -1, 0, 1, 2, 1];
        let mut a = [0u16; 8];
        let o = permute(&x, &idx, 2, 3, 2, 1, &mut a).unwrap();
        assert_eq!(o.counts, [1, 3, 1]);
        // Expert 0 at row 0, expert 1 at rows 2..5, expert 2 at row 6.
        assert_eq!(o.positions, [2, -1, 0, 3, 6, 4]);
        assert_eq!(&a[..7], &[11, 0, 10, 11, 12, 0, 12]);
        assert!(permute(&x, &[3, 0, 0, 0, 0, 0], 2, 3, 2, 1, &mut a).is_err());
    }

    #[test]
    fn unpermute_sums_weighted_rows_in_slot_order() {
        let y: Vec<bf16> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let mut out = [bf16::ZERO; 4];
        unpermute(&y, &[1, -1, 0, 1], &[0.5, 9.0, 2.0, 1.0], 2, 2, &mut out).unwrap();
        let got: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        assert_eq!(got, [1.5, 2.0, 5.0, 8.0]);
    }
}
