//! Host twins of the block-scaled fp8 grouped GEMMs: the operands dequantized exactly as
//! DeepSeek's `weight_dequant` does (`f32(q) * scale` per block), multiplied in f32 and
//! rounded to bf16 once. The kernels sum the same products per 128 channels and scale each
//! partial sum, so the two agree to f32 summation order and bf16 rounding.

use float8::F8E4M3;
use half::bf16;

use super::{check_shape, row_scale_cols, weight_scale_dims, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::gemm::host::silu;
use crate::gemm::{group_starts, GroupLayout, GroupedGemmShape};

/// A block-scaled e4m3 operand on the host: its values and its f32 scales.
#[derive(Clone, Copy, Debug)]
pub struct HostFp8<'a> {
    /// The e4m3 values, row-major.
    pub q: &'a [F8E4M3],
    /// The scales, row-major over the blocks.
    pub scales: &'a [f32],
}

/// `y[r, c] = f32(q[r, c]) * scales[r / scale_rows, c / 128]` for a `[n, k]` operand whose
/// scale blocks are `scale_rows x 128` (partial at the edges): DeepSeek's `weight_dequant` for
/// `scale_rows = 128`, a 1 x 128 activation for `scale_rows = 1`.
pub fn dequantize_weight(
    q: &[F8E4M3],
    scales: &[f32],
    n: usize,
    k: usize,
    scale_rows: usize,
) -> Result<Vec<f32>> {
    if scale_rows == 0 {
        return Err(Error::invalid("scale_rows", 0, "must be positive"));
    }
    let (sr, sc) = weight_scale_dims(n, k, scale_rows);
    Error::check_len("q", n * k, q.len())?;
    Error::check_len("scales", sr * sc, scales.len())?;
    let mut y = Vec::with_capacity(n * k);
    for r in 0..n {
        let srow = &scales[(r / scale_rows) * sc..(r / scale_rows + 1) * sc];
        y.extend(
            q[r * k..(r + 1) * k]
                .iter()
                .enumerate()
                .map(|(c, v)| v.to_f32() * srow[c / FP8_BLOCK]),
        );
    }
    Ok(y)
}

/// Quantizes a `[n, k]` f32 operand to e4m3 with `scale_rows x 128` scale blocks, as
/// DeepSeek's release weights are made: per block `scale = max(amax, 1e-4) / 448`,
/// `q = e4m3(w / scale)` (round to nearest even, saturating). Returns the values and the
/// `[ceil(n / scale_rows), ceil(k / 128)]` scales; [`dequantize_weight`] inverts it up to the
/// e4m3 rounding.
pub fn quantize_weight(
    w: &[f32],
    n: usize,
    k: usize,
    scale_rows: usize,
) -> Result<(Vec<F8E4M3>, Vec<f32>)> {
    if scale_rows == 0 {
        return Err(Error::invalid("scale_rows", 0, "must be positive"));
    }
    Error::check_len("w", n * k, w.len())?;
    let (sr, sc) = weight_scale_dims(n, k, scale_rows);
    let mut scales = vec![0f32; sr * sc];
    for r in 0..n {
        for (c, v) in w[r * k..(r + 1) * k].iter().enumerate() {
            let s = &mut scales[(r / scale_rows) * sc + c / FP8_BLOCK];
            *s = s.max(v.abs());
        }
    }
    for s in &mut scales {
        *s = crate::fp8::host::group_scale(*s, crate::fp8::ScaleFormat::Float);
    }
    let q = (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            F8E4M3::from_f32(w[i] / scales[(r / scale_rows) * sc + c / FP8_BLOCK])
        })
        .collect();
    Ok((q, scales))
}

/// [`dequantize_weight`] of `[rows, k]` activations with 1 x 128 scales
/// (`[rows, ceil(k / 128)]`).
pub fn dequantize_rows(q: &[F8E4M3], scales: &[f32], rows: usize, k: usize) -> Result<Vec<f32>> {
    dequantize_weight(q, scales, rows, k, 1)
}

/// The extra groups of the fp8 GEMMs (masked layout; see `gemm::ExtraGroups`): groups
/// `first..` take their weights from `b` and, with `a`, their rows from `a`.
#[derive(Clone, Copy, Debug)]
pub struct HostExtraGroupsFp8<'a> {
    /// Index of the first extra group.
    pub first: usize,
    /// Their weights `[groups - first, n, k]` with their scales.
    pub b: HostFp8<'a>,
    /// Input rows of every extra group `[rows, k]` with their scales; `None`: their blocks of
    /// `a`.
    pub a: Option<HostFp8<'a>>,
}

/// Host twin of `grouped_gemm_fp8_cuda`: for every valid row `r` of group `g`,
/// `d[r, :] = bf16(deq(a)[r, :] x deq(b[g])^T)` with 128 x 128 weight scale blocks; rows outside
/// every group's count keep their values. Shapes as in [`super`].
pub fn grouped_gemm_fp8(
    a: HostFp8<'_>,
    b: HostFp8<'_>,
    counts: &[i32],
    shape: &GroupedGemmShape,
    extra: Option<&HostExtraGroupsFp8<'_>>,
    d: &mut [bf16],
) -> Result<()> {
    Error::check_len("d", shape.rows * shape.n, d.len())?;
    run(a, b, counts, shape, extra, |r, acc| {
        for (o, v) in d[r * shape.n..(r + 1) * shape.n].iter_mut().zip(acc) {
            *o = bf16::from_f32(*v);
        }
    })
}

/// Checks the operands, then calls `write(row, products)` for every valid row.
fn run(
    a: HostFp8<'_>,
    b: HostFp8<'_>,
    counts: &[i32],
    shape: &GroupedGemmShape,
    extra: Option<&HostExtraGroupsFp8<'_>>,
    mut write: impl FnMut(usize, &[f32]),
) -> Result<()> {
    check_shape(shape)?;
    Error::check_len("counts", shape.groups, counts.len())?;
    let (n, k) = (shape.n, shape.k);
    let scale_rows = FP8_BLOCK;
    let (sr, sc) = weight_scale_dims(n, k, scale_rows);
    let ks = row_scale_cols(k);
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
            if x.first >= shape.groups {
                return Err(Error::invalid(
                    "extra.first",
                    x.first,
                    format!("must be below the GEMM's {} groups", shape.groups),
                ));
            }
            let xg = shape.groups - x.first;
            Error::check_len("extra.b", xg * n * k, x.b.q.len())?;
            Error::check_len("extra.b scales", xg * sr * sc, x.b.scales.len())?;
            x.first
        }
    };
    let extra_a = extra.and_then(|x| x.a);
    let a_rows = match extra_a {
        Some(xa) => {
            if xa.q.len() % k != 0 {
                return Err(Error::invalid(
                    "extra.a",
                    format!("{} values", xa.q.len()),
                    format!("must be whole rows of k = {k}"),
                ));
            }
            Error::check_len("extra.a scales", xa.q.len() / k * ks, xa.scales.len())?;
            shape.rows / shape.groups * first_extra
        }
        None => shape.rows,
    };
    Error::check_len("a", a_rows * k, a.q.len())?;
    Error::check_len("a scales", a_rows * ks, a.scales.len())?;
    Error::check_len("b", first_extra * n * k, b.q.len())?;
    Error::check_len("b scales", first_extra * sr * sc, b.scales.len())?;
    let starts = group_starts(counts, shape.layout, shape.rows)?;
    let mut acc = vec![0f32; n];
    for (g, (&start, &c)) in starts.iter().zip(counts).enumerate() {
        let (wq, ws) = match extra {
            Some(x) if g >= first_extra => {
                let j = g - first_extra;
                (
                    &x.b.q[j * n * k..(j + 1) * n * k],
                    &x.b.scales[j * sr * sc..(j + 1) * sr * sc],
                )
            }
            _ => (
                &b.q[g * n * k..(g + 1) * n * k],
                &b.scales[g * sr * sc..(g + 1) * sr * sc],
            ),
        };
        let w = dequantize_weight(wq, ws, n, k, scale_rows)?;
        for (i, r) in (start..start + c as usize).enumerate() {
            let row = match extra_a {
                Some(xa) if g >= first_extra => {
                    if (i + 1) * k > xa.q.len() {
                        return Err(Error::invalid(
                            "counts",
                            format!("counts[{g}] = {c}"),
                            format!("must not exceed the {} rows of extra.a", xa.q.len() / k),
                        ));
                    }
                    dequantize_rows(
                        &xa.q[i * k..(i + 1) * k],
                        &xa.scales[i * ks..(i + 1) * ks],
                        1,
                        k,
                    )?
                }
                _ => dequantize_rows(
                    &a.q[r * k..(r + 1) * k],
                    &a.scales[r * ks..(r + 1) * ks],
                    1,
                    k,
                )?,
            };
            for (j, o) in acc.iter_mut().enumerate() {
                *o = row
                    .iter()
                    .zip(&w[j * k..(j + 1) * k])
                    .map(|(x, y)| x * y)
                    .sum();
            }
            write(r, &acc);
        }
    }
    Ok(())
}

/// Host twin of `quantize_rows_fp8_cuda`: `x` (`[rows, cols]` bf16) quantized 1 x 128 into
/// `q` and `scales` as the per-token fp8 cast (`crate::fp8::quantize`) does; with `mask`
/// (`(counts, m_max)` of a masked layout) only the rows within each block's count (the
/// others' outputs stay as they are).
pub fn quantize_rows(
    x: &[bf16],
    rows: usize,
    cols: usize,
    mask: Option<(&[i32], usize)>,
    q: &mut [F8E4M3],
    scales: &mut [f32],
) -> Result<()> {
    Error::check_len("x", rows * cols, x.len())?;
    Error::check_len("q", rows * cols, q.len())?;
    let groups = cols / FP8_BLOCK;
    Error::check_len("scales", rows * groups, scales.len())?;
    for r in 0..rows {
        if !row_valid(r, rows, mask)? {
            continue;
        }
        let (rq, rs) = crate::fp8::quantize(
            &x[r * cols..(r + 1) * cols],
            1,
            cols,
            crate::fp8::ScaleFormat::Float,
        )?;
        q[r * cols..(r + 1) * cols].copy_from_slice(&rq);
        scales[r * groups..(r + 1) * groups].copy_from_slice(&rs);
    }
    Ok(())
}

/// Whether row `r` of `rows` is within its block's count under `mask`.
fn row_valid(r: usize, rows: usize, mask: Option<(&[i32], usize)>) -> Result<bool> {
    let Some((counts, m_max)) = mask else {
        return Ok(true);
    };
    if m_max == 0 || counts.len() * m_max != rows {
        return Err(Error::invalid(
            "mask",
            format!("{} counts of m_max {m_max}", counts.len()),
            format!("must cover the {rows} rows"),
        ));
    }
    Ok(((r % m_max) as i64) < i64::from(counts[r / m_max]))
}

/// Host twin of `swiglu_quantize_fp8_cuda`: for every row of `h` (`[rows, 2 * inter]` bf16,
/// `block` gate columns then `block` up columns in turn: `block = inter` for gate then up) and
/// every 128 columns of `act = silu(gate) * up`, the e4m3 values `q` (`[rows, inter]`) and
/// scales `scales` (`[rows, inter / 128]`) of the per-token cast; with `mask` only the rows
/// within each block's count.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_quantize(
    h: &[bf16],
    rows: usize,
    inter: usize,
    block: usize,
    mask: Option<(&[i32], usize)>,
    q: &mut [F8E4M3],
    scales: &mut [f32],
) -> Result<()> {
    check_gate_up_block(inter, block)?;
    Error::check_len("h", rows * 2 * inter, h.len())?;
    Error::check_len("q", rows * inter, q.len())?;
    Error::check_len("scales", rows * inter / FP8_BLOCK, scales.len())?;
    let mut row = vec![0f32; 2 * inter];
    for r in 0..rows {
        if !row_valid(r, rows, mask)? {
            continue;
        }
        for (o, v) in row.iter_mut().zip(&h[r * 2 * inter..(r + 1) * 2 * inter]) {
            *o = v.to_f32();
        }
        swiglu_quantize_row(
            &row,
            block,
            &mut q[r * inter..(r + 1) * inter],
            scales_of(scales, r, inter),
        );
    }
    Ok(())
}

/// Host twin of `grouped_gemm_swiglu_fp8_cuda` and `grouped_gemv_swiglu_fp8_cuda`: the gate_up
/// GEMM of [`grouped_gemm_fp8`] (`b` in 128-row gate and up blocks in turn,
/// [`super::FP8_GATE_UP_BLOCK`]; `extra` groups as there) with SwiGLU and the 1 x 128
/// quantization of [`swiglu_quantize`] applied to its f32 products (no bf16 rounding in
/// between): `q` `[rows, n / 2]` e4m3, `scales` `[rows, n / 256]`; rows outside every group's
/// count keep their values.
pub fn grouped_gemm_swiglu_fp8(
    a: HostFp8<'_>,
    b: HostFp8<'_>,
    counts: &[i32],
    shape: &GroupedGemmShape,
    extra: Option<&HostExtraGroupsFp8<'_>>,
    q: &mut [F8E4M3],
    scales: &mut [f32],
) -> Result<()> {
    let inter = shape.n / 2;
    check_gate_up_block(inter, super::FP8_GATE_UP_BLOCK)?;
    Error::check_len("q", shape.rows * inter, q.len())?;
    Error::check_len("scales", shape.rows * inter / FP8_BLOCK, scales.len())?;
    run(a, b, counts, shape, extra, |r, acc| {
        swiglu_quantize_row(
            acc,
            super::FP8_GATE_UP_BLOCK,
            &mut q[r * inter..(r + 1) * inter],
            scales_of(scales, r, inter),
        );
    })
}

/// `inter` a positive multiple of 128 made of whole `block`s, `block` a multiple of 128.
fn check_gate_up_block(inter: usize, block: usize) -> Result<()> {
    if inter == 0 || inter % FP8_BLOCK != 0 {
        return Err(Error::invalid(
            "inter",
            inter,
            format!("must be a positive multiple of {FP8_BLOCK}"),
        ));
    }
    if block == 0 || block % FP8_BLOCK != 0 || inter % block != 0 {
        return Err(Error::invalid(
            "block",
            block,
            format!("must be a multiple of {FP8_BLOCK} dividing inter = {inter}"),
        ));
    }
    Ok(())
}

fn scales_of(scales: &mut [f32], r: usize, inter: usize) -> &mut [f32] {
    let g = inter / FP8_BLOCK;
    &mut scales[r * g..(r + 1) * g]
}

/// One row of [`swiglu_quantize`] and [`grouped_gemm_swiglu_fp8`]: `row` holds `block` gate
/// products then `block` up products in turn (`[2 * inter]` f32); writes the row's e4m3 act
/// `q` (`[inter]`) and its scales (`[inter / 128]`).
pub fn swiglu_quantize_row(row: &[f32], block: usize, q: &mut [F8E4M3], scales: &mut [f32]) {
    for (g, scale_out) in scales.iter_mut().enumerate() {
        let cols = g * FP8_BLOCK..(g + 1) * FP8_BLOCK;
        let act: Vec<f32> = cols
            .clone()
            .map(|c| {
                let gate = c / block * 2 * block + c % block;
                silu(row[gate]) * row[gate + block]
            })
            .collect();
        let amax = act.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = crate::fp8::host::group_scale(amax, crate::fp8::ScaleFormat::Float);
        *scale_out = scale;
        for (o, a) in q[cols].iter_mut().zip(&act) {
            *o = F8E4M3::from_f32(a / scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e4m3(v: &[f32]) -> Vec<F8E4M3> {
        v.iter().map(|&x| F8E4M3::from_f32(x)).collect()
    }

    #[test]
    fn dequantize_applies_each_block_scale_with_partial_edges() {
        // [3, 130]: two column blocks (128 + 2), one row block of 128 (partial).
        let (n, k) = (3, 130);
        let q = e4m3(&vec![2.0; n * k]);
        let scales = [0.5, 4.0];
        let y = dequantize_weight(&q, &scales, n, k, 128).unwrap();
        assert_eq!(y[0], 1.0);
        assert_eq!(y[127], 1.0);
        assert_eq!(y[128], 8.0);
        assert_eq!(y[2 * k + 129], 8.0);
        assert!(dequantize_weight(&q, &[1.0], n, k, 128).is_err());
    }

    #[test]
    fn quantize_weight_round_trips_within_e4m3_precision() {
        let (n, k) = (130, 200);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let (q, s) = quantize_weight(&w, n, k, 128).unwrap();
        assert_eq!(s.len(), 2 * 2);
        let back = dequantize_weight(&q, &s, n, k, 128).unwrap();
        for (a, b) in w.iter().zip(&back) {
            // e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative, plus subnormals.
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-2, "{a} vs {b}");
        }
    }

    #[test]
    fn fp8_gemm_equals_the_f32_gemm_of_the_dequantized_operands() {
        // One group, 2 rows, n = 16, k = 256 (two K blocks with different scales).
        let (rows, n, k) = (2, 16, 256);
        let aq = e4m3(
            &(0..rows * k)
                .map(|i| ((i % 7) as f32 - 3.0) / 2.0)
                .collect::<Vec<_>>(),
        );
        let asc = [0.25, 2.0, 1.0, 0.5];
        let bq = e4m3(
            &(0..n * k)
                .map(|i| ((i % 5) as f32 - 2.0) / 4.0)
                .collect::<Vec<_>>(),
        );
        let bsc = [1.5, 0.125];
        let shape = GroupedGemmShape {
            groups: 1,
            rows,
            n,
            k,
            layout: GroupLayout::Contiguous { alignment: 1 },
        };
        let mut d = vec![bf16::ZERO; rows * n];
        grouped_gemm_fp8(
            HostFp8 {
                q: &aq,
                scales: &asc,
            },
            HostFp8 {
                q: &bq,
                scales: &bsc,
            },
            &[2],
            &shape,
            None,
            &mut d,
        )
        .unwrap();
        let a = dequantize_rows(&aq, &asc, rows, k).unwrap();
        let b = dequantize_weight(&bq, &bsc, n, k, 128).unwrap();
        for r in 0..rows {
            for j in 0..n {
                let want: f32 = (0..k).map(|c| a[r * k + c] * b[j * k + c]).sum();
                assert_eq!(d[r * n + j], bf16::from_f32(want));
            }
        }
    }

    #[test]
    fn swiglu_quantize_quantizes_each_act_group_and_skips_masked_rows() {
        let (rows, inter) = (2, 256);
        let h: Vec<bf16> = (0..rows * 2 * inter)
            .map(|i| bf16::from_f32(((i % 13) as f32 - 6.0) / 3.0))
            .collect();
        let mut q = vec![F8E4M3::ZERO; rows * inter];
        let mut s = vec![-1f32; rows * 2];
        swiglu_quantize(&h, rows, inter, inter, Some((&[1, 0], 1)), &mut q, &mut s).unwrap();
        assert_eq!(&s[2..], &[-1.0, -1.0], "row 1 is past its block's count");
        for c in 0..inter {
            let act = silu(h[c].to_f32()) * h[inter + c].to_f32();
            let back = q[c].to_f32() * s[c / 128];
            assert!(
                (back - act).abs() <= act.abs() / 16.0 + s[c / 128],
                "{back} vs {act}"
            );
        }
        assert!(swiglu_quantize(&h, rows, 100, 100, None, &mut q, &mut s).is_err());
        assert!(swiglu_quantize(&h, rows, inter, 64, None, &mut q, &mut s).is_err());
    }

    #[test]
    fn swiglu_quantize_pairs_gate_and_up_blocks_in_turn() {
        // inter 256 in 128-column blocks: h = [gate 0..128 | up 0..128 | gate 128.. | up 128..]
        // is the stacked row [gate | up] with its middle blocks swapped.
        let (rows, inter) = (3, 256);
        let stacked: Vec<bf16> = (0..rows * 2 * inter)
            .map(|i| bf16::from_f32(((i * 7 % 23) as f32 - 11.0) / 5.0))
            .collect();
        let mut blocked = stacked.clone();
        for r in 0..rows {
            let row = &mut blocked[r * 2 * inter..(r + 1) * 2 * inter];
            let (a, b) = row.split_at_mut(256);
            a[128..].swap_with_slice(&mut b[..128]);
        }
        let (mut q1, mut s1) = (vec![F8E4M3::ZERO; rows * inter], vec![0f32; rows * 2]);
        let (mut q2, mut s2) = (q1.clone(), s1.clone());
        swiglu_quantize(&stacked, rows, inter, inter, None, &mut q1, &mut s1).unwrap();
        swiglu_quantize(&blocked, rows, inter, 128, None, &mut q2, &mut s2).unwrap();
        assert_eq!(s1, s2);
        assert!(q1.iter().zip(&q2).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn the_fused_gate_up_twin_quantizes_the_unrounded_products() {
        // One group of 2 rows, inter 128 (n 256), k 128: every product is exact in f32.
        let (rows, n, k) = (2, 256, 128);
        let shape = GroupedGemmShape {
            groups: 1,
            rows,
            n,
            k,
            layout: GroupLayout::Contiguous { alignment: 1 },
        };
        let aq: Vec<F8E4M3> = (0..rows * k)
            .map(|i| F8E4M3::from_f32(((i % 5) as f32 - 2.0) / 4.0))
            .collect();
        let asc = vec![0.5f32; rows];
        let bq: Vec<F8E4M3> = (0..n * k)
            .map(|i| F8E4M3::from_f32(((i % 7) as f32 - 3.0) / 8.0))
            .collect();
        let bsc = vec![0.25f32, 2.0];
        let (host_a, host_b) = (
            HostFp8 {
                q: &aq,
                scales: &asc,
            },
            HostFp8 {
                q: &bq,
                scales: &bsc,
            },
        );
        let (mut q, mut s) = (vec![F8E4M3::ZERO; rows * n / 2], vec![0f32; rows]);
        grouped_gemm_swiglu_fp8(host_a, host_b, &[2], &shape, None, &mut q, &mut s).unwrap();
        let a = dequantize_rows(&aq, &asc, rows, k).unwrap();
        let b = dequantize_weight(&bq, &bsc, n, k, 128).unwrap();
        let dot = |r: usize, j: usize| -> f32 { (0..k).map(|c| a[r * k + c] * b[j * k + c]).sum() };
        for r in 0..rows {
            let row: Vec<f32> = (0..n).map(|j| dot(r, j)).collect();
            let (mut want_q, mut want_s) = (vec![F8E4M3::ZERO; n / 2], vec![0f32; 1]);
            swiglu_quantize_row(&row, 128, &mut want_q, &mut want_s);
            assert_eq!(s[r], want_s[0]);
            assert_eq!(q[r * 128..(r + 1) * 128], want_q[..]);
        }
    }
}
