//! Host twins of the grouped GEMM kernels (plain and with SwiGLU): the same functions over plain slices,
//! accumulated in f32 and rounded to bf16 once, as the kernels do (the kernels' summation
//! order differs, so they agree to bf16 rounding, not bit for bit).

use half::bf16;

use super::{gate_up_rows, GroupLayout, GroupedGemmShape, GATE_UP_BLOCK};
use crate::error::{Error, Result};

/// The first row of every group of `layout`, checking `counts` (one per group) against it and
/// against the `rows` of `A`: no negative count, `counts[g] <= m_max` (masked), and the groups'
/// rows within `A` (contiguous). Errors name the count that breaks the rule.
pub fn group_starts(counts: &[i32], layout: GroupLayout, rows: usize) -> Result<Vec<usize>> {
    layout.check(counts.len(), rows)?;
    let mut starts = Vec::with_capacity(counts.len());
    let mut next = 0usize;
    for (g, &c) in counts.iter().enumerate() {
        let c = usize::try_from(c).map_err(|_| {
            Error::invalid(
                "counts",
                format!("counts[{g}] = {c}"),
                "must not be negative",
            )
        })?;
        let start = match layout {
            GroupLayout::Masked { m_max } => {
                if c > m_max {
                    return Err(Error::invalid(
                        "counts",
                        format!("counts[{g}] = {c}"),
                        format!("must be <= m_max = {m_max}"),
                    ));
                }
                g * m_max
            }
            GroupLayout::Contiguous { alignment } => {
                let start = next;
                next = start + c.div_ceil(alignment) * alignment;
                if start + c > rows {
                    return Err(Error::invalid(
                        "counts",
                        format!("counts[0..={g}] covering {} rows", start + c),
                        format!("must fit in the {rows} rows of a"),
                    ));
                }
                start
            }
        };
        starts.push(start);
    }
    Ok(starts)
}

/// One row of a group's GEMM: `out[j] = sum_i a_row[i] * b_g[j, i]` in f32 (`b_g = [n, k]`).
pub fn gemm_row(a_row: &[bf16], b_g: &[bf16], n: usize, out: &mut [f32]) {
    let k = a_row.len();
    let a: Vec<f32> = a_row.iter().map(|v| v.to_f32()).collect();
    for (j, o) in out.iter_mut().enumerate().take(n) {
        let w = &b_g[j * k..(j + 1) * k];
        *o = a.iter().zip(w).map(|(x, y)| x * y.to_f32()).sum();
    }
}

/// Host twin of `grouped_gemm_bf16_cuda`: for every valid row `r` of group `g`,
/// `d[r, :] = bf16(a[r, :] x b[g]^T)`; rows outside every group's count are left as they are.
/// `a` is `[rows, k]`, `b` `[groups, n, k]`, `d` `[rows, n]`.
pub fn grouped_gemm(
    a: &[bf16],
    b: &[bf16],
    counts: &[i32],
    shape: &GroupedGemmShape,
    d: &mut [bf16],
) -> Result<()> {
    grouped_gemm_impl(a, b, counts, shape, None, Output::Plain(d))
}

/// Where [`grouped_gemm_impl`] writes a row's product.
enum Output<'a> {
    /// `d [rows, n]`.
    Plain(&'a mut [bf16]),
    /// `act [rows, n / 2]`: SwiGLU of the blocked gate_up product ([`super::GATE_UP_BLOCK`]).
    Swiglu(&'a mut [bf16]),
}

/// The extra groups of [`grouped_gemm_extra`] (the host side of `ExtraGroups`).
#[derive(Clone, Copy, Debug)]
pub struct HostExtraGroups<'a> {
    /// Index of the first extra group.
    pub first: usize,
    /// Their weights `[groups - first, n, k]`.
    pub b: &'a [bf16],
    /// Input rows of every extra group `[rows, k]`; `None`: their blocks of `a`.
    pub a: Option<&'a [bf16]>,
}

/// Host twin of `grouped_gemm_bf16_extra_cuda` (masked layout): [`grouped_gemm`] whose groups
/// `extra.first..` take their weights from `extra.b` and, with `extra.a`, their valid rows from
/// the first rows of `extra.a` (their outputs still go to their blocks of `d`). With `extra.a`,
/// `a` holds only the first `extra.first` blocks.
pub fn grouped_gemm_extra(
    a: &[bf16],
    b: &[bf16],
    counts: &[i32],
    shape: &GroupedGemmShape,
    extra: &HostExtraGroups<'_>,
    d: &mut [bf16],
) -> Result<()> {
    grouped_gemm_impl(a, b, counts, shape, Some(extra), Output::Plain(d))
}

fn grouped_gemm_impl(
    a: &[bf16],
    b: &[bf16],
    counts: &[i32],
    shape: &GroupedGemmShape,
    extra: Option<&HostExtraGroups<'_>>,
    mut out: Output<'_>,
) -> Result<()> {
    shape.check()?;
    if counts.len() != shape.groups {
        return Err(Error::Length {
            arg: "counts",
            expected: shape.groups,
            got: counts.len(),
        });
    }
    let (n, k) = (shape.n, shape.k);
    let first_extra = match extra {
        None => shape.groups,
        Some(x) => {
            if !matches!(shape.layout, GroupLayout::Masked { .. }) {
                return Err(Error::invalid(
                    "extra",
                    "extra groups",
                    "need the masked layout",
                ));
            }
            if x.first == 0 || x.first >= shape.groups {
                return Err(Error::invalid(
                    "extra.first",
                    x.first,
                    format!("must be in 1..{} (the GEMM's groups)", shape.groups),
                ));
            }
            Error::check_len("extra.b", (shape.groups - x.first) * n * k, x.b.len())?;
            x.first
        }
    };
    let extra_a = extra.and_then(|x| x.a);
    let a_rows = match extra_a {
        Some(_) => shape.rows / shape.groups * first_extra,
        None => shape.rows,
    };
    Error::check_len("a", a_rows * k, a.len())?;
    Error::check_len("b", first_extra * n * k, b.len())?;
    match &out {
        Output::Plain(d) => Error::check_len("d", shape.rows * n, d.len())?,
        Output::Swiglu(act) => {
            if n % (2 * GATE_UP_BLOCK) != 0 {
                return Err(Error::invalid(
                    "n",
                    n,
                    format!(
                        "the gate_up width 2I must be a multiple of {}",
                        2 * GATE_UP_BLOCK
                    ),
                ));
            }
            Error::check_len("act", shape.rows * (n / 2), act.len())?
        }
    }
    let starts = group_starts(counts, shape.layout, shape.rows)?;
    if let Some(xa) = extra_a {
        if let Some((g, c)) = counts
            .iter()
            .enumerate()
            .skip(first_extra)
            .find(|(_, &c)| c as usize * k > xa.len())
        {
            return Err(Error::invalid(
                "counts",
                format!("counts[{g}] = {c}"),
                format!("must not exceed the {} rows of extra.a", xa.len() / k),
            ));
        }
    }
    let mut acc = vec![0f32; n];
    for (g, (&start, &c)) in starts.iter().zip(counts).enumerate() {
        let b_g = match extra {
            Some(x) if g >= first_extra => {
                let j = g - first_extra;
                &x.b[j * n * k..(j + 1) * n * k]
            }
            _ => &b[g * n * k..(g + 1) * n * k],
        };
        for (i, r) in (start..start + c as usize).enumerate() {
            let a_row = match extra_a {
                Some(xa) if g >= first_extra => &xa[i * k..(i + 1) * k],
                _ => &a[r * k..(r + 1) * k],
            };
            gemm_row(a_row, b_g, n, &mut acc);
            match &mut out {
                Output::Plain(d) => {
                    for (o, v) in d[r * n..(r + 1) * n].iter_mut().zip(&acc) {
                        *o = bf16::from_f32(*v);
                    }
                }
                Output::Swiglu(act) => {
                    let row = &mut act[r * (n / 2)..(r + 1) * (n / 2)];
                    for (j, o) in row.iter_mut().enumerate() {
                        let (gate, up) = gate_up_rows(j);
                        *o = bf16::from_f32(silu(acc[gate]) * acc[up]);
                    }
                }
            }
        }
    }
    Ok(())
}

/// `silu(x) = x / (1 + exp(-x))` in f32.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Host twin of `grouped_gemm_swiglu_bf16_cuda`, the experts' first GEMM with SwiGLU in its
/// epilogue: for every valid row `r`, `act[r, j] = bf16(silu(gate) * up)` with `gate` and `up`
/// the f32 products of `a[r]` with the gate and the up row of column `j` of the group's blocked
/// gate_up weight ([`super::GATE_UP_BLOCK`], [`gate_up_rows`]); `b` is `[groups, n = 2I, k]`,
/// `act` `[rows, n / 2]`, and `extra` as in [`grouped_gemm_extra`]. Rows past the counts keep
/// their values.
pub fn grouped_gemm_swiglu(
    a: &[bf16],
    b: &[bf16],
    counts: &[i32],
    shape: &GroupedGemmShape,
    extra: Option<&HostExtraGroups<'_>>,
    act: &mut [bf16],
) -> Result<()> {
    grouped_gemm_impl(a, b, counts, shape, extra, Output::Swiglu(act))
}

/// Host twin of `swiglu_rows_bf16_cuda`: `act[r, j] = bf16(silu(gate) * up)` for every row of
/// `h` (`[rows, 2 * inter]`, blocked column order, [`gate_up_rows`]) into `act`
/// (`[rows, inter]`).
pub fn swiglu_rows(h: &[bf16], rows: usize, inter: usize, act: &mut [bf16]) -> Result<()> {
    if inter == 0 || inter % GATE_UP_BLOCK != 0 {
        return Err(Error::invalid(
            "inter",
            inter,
            format!("must be a positive multiple of {GATE_UP_BLOCK}"),
        ));
    }
    Error::check_len("h", rows * 2 * inter, h.len())?;
    Error::check_len("act", rows * inter, act.len())?;
    for r in 0..rows {
        let row = &h[r * 2 * inter..(r + 1) * 2 * inter];
        for (j, o) in act[r * inter..(r + 1) * inter].iter_mut().enumerate() {
            let (gate, up) = gate_up_rows(j);
            *o = bf16::from_f32(silu(row[gate].to_f32()) * row[up].to_f32());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    }

    #[test]
    fn contiguous_starts_follow_aligned_counts() {
        let layout = GroupLayout::Contiguous { alignment: 4 };
        assert_eq!(
            group_starts(&[3, 0, 5, 1], layout, 17).unwrap(),
            [0, 4, 4, 12]
        );
        // The last group's rows must fit in a.
        assert!(group_starts(&[3, 0, 5, 1], layout, 12).is_err());
        assert!(group_starts(&[-1], layout, 12).is_err());
    }

    #[test]
    fn masked_starts_are_block_starts_and_counts_are_capped() {
        let layout = GroupLayout::Masked { m_max: 8 };
        assert_eq!(group_starts(&[0, 8, 3], layout, 24).unwrap(), [0, 8, 16]);
        let err = group_starts(&[0, 9, 3], layout, 24)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("counts[1] = 9") && err.contains("m_max = 8"),
            "{err}"
        );
        // rows must be groups * m_max.
        assert!(group_starts(&[0, 1, 3], layout, 23).is_err());
    }

    #[test]
    fn grouped_gemm_computes_each_group_with_its_weight_and_leaves_other_rows() {
        // Two groups, k = 8, n = 8; group 0 has 1 row, group 1 has 2 (masked, m_max 2).
        let (k, n) = (8, 8);
        let a: Vec<bf16> = bf(&(0..4 * k).map(|i| (i % 5) as f32 - 2.0).collect::<Vec<_>>());
        let mut b = vec![bf16::ZERO; 2 * n * k];
        for j in 0..n {
            b[j * k + j] = bf16::from_f32(1.0); // group 0: identity
            b[n * k + j * k + j] = bf16::from_f32(2.0); // group 1: 2 x identity
        }
        let shape = GroupedGemmShape {
            groups: 2,
            rows: 4,
            n,
            k,
            layout: GroupLayout::Masked { m_max: 2 },
        };
        let sentinel = bf16::from_f32(-7.0);
        let mut d = vec![sentinel; 4 * n];
        grouped_gemm(&a, &b, &[1, 2], &shape, &mut d).unwrap();
        assert_eq!(&d[0..n], &a[0..k]);
        assert!(
            d[n..2 * n].iter().all(|&v| v == sentinel),
            "row 1 is past count 1"
        );
        for r in 2..4 {
            for j in 0..n {
                assert_eq!(d[r * n + j].to_f32(), 2.0 * a[r * k + j].to_f32());
            }
        }
    }

    #[test]
    fn extra_groups_take_their_own_weights_and_rows() {
        // Three groups (masked, m_max 2, k = n = 8): group 0 routed (identity weight), groups
        // 1 and 2 extra (3 x and -1 x identity) reading the two rows of `extra_a`.
        let (k, n) = (8, 8);
        let a: Vec<bf16> = bf(&(0..2 * k).map(|i| i as f32).collect::<Vec<_>>());
        let xa: Vec<bf16> = bf(&(0..2 * k).map(|i| 100.0 + i as f32).collect::<Vec<_>>());
        let mut b = vec![bf16::ZERO; n * k];
        let mut xb = vec![bf16::ZERO; 2 * n * k];
        for j in 0..n {
            b[j * k + j] = bf16::from_f32(1.0);
            xb[j * k + j] = bf16::from_f32(3.0);
            xb[n * k + j * k + j] = bf16::from_f32(-1.0);
        }
        let shape = GroupedGemmShape {
            groups: 3,
            rows: 6,
            n,
            k,
            layout: GroupLayout::Masked { m_max: 2 },
        };
        let extra = HostExtraGroups {
            first: 1,
            b: &xb,
            a: Some(&xa),
        };
        let sentinel = bf16::from_f32(-7.0);
        let mut d = vec![sentinel; 6 * n];
        grouped_gemm_extra(&a, &b, &[2, 2, 1], &shape, &extra, &mut d).unwrap();
        assert_eq!(&d[0..2 * n], &a[..]);
        for j in 0..n {
            let scaled = |v: bf16, f: f32| bf16::from_f32(f * v.to_f32());
            assert_eq!(d[2 * n + j], scaled(xa[j], 3.0));
            assert_eq!(d[3 * n + j], scaled(xa[k + j], 3.0));
            assert_eq!(d[4 * n + j], scaled(xa[j], -1.0));
        }
        assert!(d[5 * n..].iter().all(|&v| v == sentinel), "past count 1");
        // An extra group may not read past the rows of extra_a.
        let err = grouped_gemm_extra(
            &a,
            &b,
            &[2, 2, 1],
            &shape,
            &HostExtraGroups {
                a: Some(&xa[..k]),
                ..extra
            },
            &mut d,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("counts[1] = 2"), "{err}");
        // Extra groups need the masked layout.
        let contiguous = GroupedGemmShape {
            layout: GroupLayout::Contiguous { alignment: 1 },
            ..shape
        };
        assert!(grouped_gemm_extra(&a, &b, &[2, 2, 1], &contiguous, &extra, &mut d).is_err());
    }

    #[test]
    fn swiglu_gemm_pairs_the_blocked_gate_and_up_rows() {
        // One group, I = 8, k = 8: weight row w is (w + 1, 0, ..), so the product of a row
        // (x, 0, ..) is x * (w + 1) and column j pairs rows gate_up_rows(j).
        let (inter, k) = (8, 8);
        let b: Vec<bf16> = (0..2 * inter * k)
            .map(|e| {
                bf16::from_f32(if e % k == 0 {
                    (e / k) as f32 + 1.0
                } else {
                    0.0
                })
            })
            .collect();
        let mut a = vec![bf16::ZERO; 2 * k];
        a[0] = bf16::from_f32(0.5);
        a[k] = bf16::from_f32(9.0);
        let sentinel = bf16::from_f32(7.0);
        let mut act = vec![sentinel; 2 * inter];
        let shape = GroupedGemmShape {
            groups: 1,
            rows: 2,
            n: 2 * inter,
            k,
            layout: GroupLayout::Contiguous { alignment: 1 },
        };
        grouped_gemm_swiglu(&a, &b, &[1], &shape, None, &mut act).unwrap();
        for (j, got) in act[..inter].iter().enumerate() {
            // Blocked layout: gate row j, up row j + 8 (one block of 8).
            let (gate, up) = (0.5 * (j as f32 + 1.0), 0.5 * (j as f32 + 9.0));
            assert_eq!(*got, bf16::from_f32(silu(gate) * up), "column {j}");
        }
        assert!(
            act[inter..].iter().all(|&v| v == sentinel),
            "row 1 is past the count"
        );
        let odd = GroupedGemmShape { n: 8, ..shape };
        assert!(grouped_gemm_swiglu(&a, &b[..8 * k], &[1], &odd, None, &mut act).is_err());
    }

    #[test]
    fn swiglu_rows_pairs_blocked_columns() {
        let inter = 8;
        let h: Vec<bf16> = (0..2 * 2 * inter)
            .map(|c| bf16::from_f32(c as f32 * 0.25 - 1.0))
            .collect();
        let mut act = vec![bf16::ZERO; 2 * inter];
        swiglu_rows(&h, 2, inter, &mut act).unwrap();
        for r in 0..2 {
            for j in 0..inter {
                let (g, u) = (h[r * 16 + j].to_f32(), h[r * 16 + 8 + j].to_f32());
                assert_eq!(
                    act[r * inter + j],
                    bf16::from_f32(silu(g) * u),
                    "row {r} col {j}"
                );
            }
        }
        assert!(swiglu_rows(&h, 2, 12, &mut act).is_err());
    }
}
