//! GPU tests: the block-scaled fp8 grouped GEMMs (both layouts, both tile configurations and
//! the tile-less GEMV of masked blocks, with extra groups; a decode step's two GEMVs back to
//! back, the down GEMV a dependent launch), the gate_up GEMM with SwiGLU and
//! the act quantization in its epilogue, the experts' SwiGLU + fp8 quantization pass and the
//! weight dequantization against
//! their host twins, on fresh random operands quantized as DeepSeek's weights and the fp8
//! dispatch's activations are, written into poisoned outputs.
//!
//! Tolerance: the reference is the f32 GEMM of the dequantized operands (the host twin before
//! its bf16 rounding). Over the valid rows of every case, DeepGEMM's measure
//! `1 - 2<x, y> / (<x, x> + <y, y>)` must be at most 1e-3 (`DIFF_MAX`), and per row
//! `||got - ref|| / ||ref|| <= 1e-2` with every element within `2e-2 * max|ref|` (bf16 out,
//! f32 sums in another order). Rows outside the groups' counts keep their poison bit for bit.
//!
//! `gpu_grouped_gemm_fp8` runs every case; `gpu_grouped_gemm_fp8 NAME` only those whose name
//! contains NAME. Zero cases run is a failure.

mod common;

use std::sync::Arc;

use common::{device, poisoned, CaseResult, Poison, Runner};
use cudarc::driver::{CudaSlice, CudaStream};
use ep_kernels::gemm::fp8::{self, DeviceFp8, ExtraGroupsFp8, HostExtraGroupsFp8, HostFp8};
use ep_kernels::gemm::{self, GemmTiles, GroupLayout, GroupedGemmShape, GroupedGemmWorkspace};
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// DeepGEMM's accuracy bound on `1 - 2<x, y> / (<x, x> + <y, y>)`.
const DIFF_MAX: f64 = 1e-3;

/// A quantized operand on the host.
struct Quantized {
    q: Vec<F8E4M3>,
    scales: Vec<f32>,
}

impl Quantized {
    fn host(&self) -> HostFp8<'_> {
        HostFp8 {
            q: &self.q,
            scales: &self.scales,
        }
    }
}

/// Random `[rows, k]` activations, rows of varied magnitude, quantized 1 x 128.
fn random_rows(rng: &mut StdRng, rows: usize, k: usize) -> Quantized {
    let w: Vec<f32> = (0..rows)
        .flat_map(|_| {
            let mag = 10f32.powf(rng.random_range(-1.0..1.0));
            (0..k)
                .map(|_| rng.random_range(-mag..mag))
                .collect::<Vec<_>>()
        })
        .collect();
    let (q, scales) = fp8::quantize_weight(&w, rows, k, 1).expect("valid shape");
    Quantized { q, scales }
}

/// Random `[groups, n, k]` weights in `scale_rows x 128` blocks per group: small ones drawn in
/// f32 and quantized as DeepSeek's are; large ones (DeepSeek-V3's shapes) as random finite e4m3
/// bit patterns with random block scales, which is as valid an fp8 weight and fast to make.
fn random_weights(
    rng: &mut StdRng,
    groups: usize,
    n: usize,
    k: usize,
    scale_rows: usize,
) -> Quantized {
    let (sr, sc) = fp8::weight_scale_dims(n, k, scale_rows);
    if groups * n * k > 1 << 24 {
        let q = (0..groups * n * k)
            .map(|_| {
                let bits: u8 = rng.random();
                // 0x7f / 0xff are e4m3's NaNs.
                F8E4M3::from_bits(if bits & 0x7f == 0x7f { 0 } else { bits })
            })
            .collect();
        let scales = (0..groups * sr * sc)
            .map(|_| rng.random_range(0.5f32..2.0) * 2e-4)
            .collect();
        return Quantized { q, scales };
    }
    let mut q = Vec::new();
    let mut scales = Vec::new();
    for _ in 0..groups {
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.05..0.05)).collect();
        let (gq, gs) = fp8::quantize_weight(&w, n, k, scale_rows).expect("valid shape");
        q.extend(gq);
        scales.extend(gs);
    }
    Quantized { q, scales }
}

/// The f32 products of the dequantized row `a_row` with group `j`'s dequantized weight
/// (`[n, k]` in `scale_rows x 128` blocks), computed without materialising the weight.
fn products(a_row: &[f32], w: &Quantized, j: usize, n: usize, scale_rows: usize) -> Vec<f32> {
    let k = a_row.len();
    let (sr, sc) = fp8::weight_scale_dims(n, k, scale_rows);
    let table: Vec<f32> = (0..=255u8).map(|b| F8E4M3::from_bits(b).to_f32()).collect();
    let q = &w.q[j * n * k..(j + 1) * n * k];
    let s = &w.scales[j * sr * sc..(j + 1) * sr * sc];
    (0..n)
        .map(|r| {
            let srow = &s[(r / scale_rows) * sc..(r / scale_rows + 1) * sc];
            a_row
                .chunks(fp8::FP8_BLOCK)
                .zip(q[r * k..(r + 1) * k].chunks(fp8::FP8_BLOCK))
                .zip(srow)
                .map(|((x, y), sv)| {
                    x.iter()
                        .zip(y)
                        .map(|(x, y)| x * (table[y.to_bits() as usize] * sv))
                        .sum::<f32>()
                })
                .sum()
        })
        .collect()
}

/// A quantized operand on the device: values and scales.
type DeviceQuantized = (CudaSlice<F8E4M3>, CudaSlice<f32>);

fn fp8_of(v: &DeviceQuantized) -> DeviceFp8<'_> {
    DeviceFp8 {
        q: &v.0,
        scales: &v.1,
    }
}

fn to_device(
    stream: &Arc<CudaStream>,
    v: &Quantized,
) -> Result<DeviceQuantized, Box<dyn std::error::Error>> {
    Ok((stream.clone_htod(&v.q)?, stream.clone_htod(&v.scales)?))
}

/// The rows of `layout` for `counts`: `groups x m_max` masked, the aligned counts contiguous.
fn layout_rows(counts: &[i32], layout: GroupLayout) -> usize {
    match layout {
        GroupLayout::Masked { m_max } => counts.len() * m_max,
        GroupLayout::Contiguous { alignment } => counts
            .iter()
            .map(|&x| (x as usize).div_ceil(alignment) * alignment)
            .sum(),
    }
}

/// A case's random operands of `[n, k]` GEMMs over `counts.len()` groups whose last `extra`
/// are extra groups (masked layout): the other groups' rows `a` (`rows` of the layout, or
/// their blocks with extra groups) and weights `b`, the extra groups' weights `xb` and the rows
/// `xa` they all read.
struct Operands {
    a: Quantized,
    b: Quantized,
    xb: Quantized,
    xa: Quantized,
    first_extra: usize,
    extra: usize,
    k: usize,
}

impl Operands {
    fn random(
        rng: &mut StdRng,
        counts: &[i32],
        rows: usize,
        (n, k): (usize, usize),
        extra: usize,
    ) -> Self {
        let groups = counts.len();
        let first_extra = groups - extra;
        let own_rows = counts[first_extra..].iter().copied().max().unwrap_or(0) as usize;
        let a_rows = if extra > 0 {
            rows / groups * first_extra
        } else {
            rows
        };
        Operands {
            a: random_rows(rng, a_rows, k),
            b: random_weights(rng, first_extra, n, k, fp8::FP8_BLOCK),
            xb: random_weights(rng, extra, n, k, fp8::FP8_BLOCK),
            xa: random_rows(rng, own_rows, k),
            first_extra,
            extra,
            k,
        }
    }

    /// Group `g`'s weights and its index among them.
    fn weights(&self, g: usize) -> (&Quantized, usize) {
        if g >= self.first_extra {
            (&self.xb, g - self.first_extra)
        } else {
            (&self.b, g)
        }
    }

    /// The dequantized input of group `g`'s valid row `m`, row `r` of the layout.
    fn input_row(
        &self,
        g: usize,
        m: usize,
        r: usize,
    ) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
        let (src, row) = if g >= self.first_extra {
            (&self.xa, m)
        } else {
            (&self.a, r)
        };
        let (k, ks) = (self.k, fp8::row_scale_cols(self.k));
        Ok(fp8::dequantize_rows(
            &src.q[row * k..(row + 1) * k],
            &src.scales[row * ks..(row + 1) * ks],
            1,
            k,
        )?)
    }

    /// The extra groups for the host twins.
    fn host_extra(&self) -> Option<HostExtraGroupsFp8<'_>> {
        (self.extra > 0).then(|| HostExtraGroupsFp8 {
            first: self.first_extra,
            b: self.xb.host(),
            a: Some(self.xa.host()),
        })
    }

    fn to_device(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceOperands, Box<dyn std::error::Error>> {
        Ok(DeviceOperands {
            a: to_device(stream, &self.a)?,
            b: to_device(stream, &self.b)?,
            xb: to_device(stream, &self.xb)?,
            xa: to_device(stream, &self.xa)?,
            first_extra: self.first_extra,
            has_extra: self.extra > 0,
        })
    }
}

/// [`Operands`] on the device.
struct DeviceOperands {
    a: DeviceQuantized,
    b: DeviceQuantized,
    xb: DeviceQuantized,
    xa: DeviceQuantized,
    first_extra: usize,
    has_extra: bool,
}

impl DeviceOperands {
    /// The extra groups, reading their own rows.
    fn extra(&self) -> Option<ExtraGroupsFp8<'_>> {
        self.has_extra.then(|| ExtraGroupsFp8 {
            first: self.first_extra,
            b: fp8_of(&self.xb),
            a: Some(fp8_of(&self.xa)),
        })
    }
}

/// Accumulates DeepGEMM's measure over rows and checks each row.
#[derive(Default)]
struct Accuracy {
    xy: f64,
    xx: f64,
    yy: f64,
}

impl Accuracy {
    fn row(&mut self, what: &str, got: &[bf16], want: &[f32]) -> CaseResult {
        let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (mut e2, mut r2) = (0f64, 0f64);
        for (j, (g, w)) in got.iter().zip(want).enumerate() {
            let g = g.to_f32();
            if !g.is_finite() || (g - w).abs() > 2e-2 * max_ref + 1e-6 {
                return Err(
                    format!("{what}: column {j}: got {g}, want {w} (max |ref| {max_ref})").into(),
                );
            }
            let (g, w) = (f64::from(g), f64::from(*w));
            e2 += (g - w).powi(2);
            r2 += w * w;
            self.xy += g * w;
            self.xx += g * g;
            self.yy += w * w;
        }
        let rel = (e2 / r2.max(1e-30)).sqrt();
        if rel > 1e-2 {
            return Err(format!("{what}: relative error {rel:.2e} > 1e-2").into());
        }
        Ok(())
    }

    fn finish(&self) -> CaseResult {
        if self.xx + self.yy == 0.0 {
            return Ok(());
        }
        let diff = 1.0 - 2.0 * self.xy / (self.xx + self.yy);
        if diff > DIFF_MAX {
            return Err(format!("DeepGEMM's diff {diff:.3e} > {DIFF_MAX:e}").into());
        }
        Ok(())
    }
}

/// Checks that every row outside the groups' counts still holds the poison bit pattern.
fn check_untouched(d: &[bf16], cols: usize, counts: &[i32], starts: &[usize]) -> CaseResult {
    let rows = d.len() / cols;
    let mut valid = vec![false; rows];
    for (&s, &c) in starts.iter().zip(counts) {
        valid[s..s + c as usize].iter_mut().for_each(|v| *v = true);
    }
    for r in (0..rows).filter(|&r| !valid[r]) {
        if let Some(j) = (0..cols).find(|&j| d[r * cols + j].to_bits() != bf16::poison().to_bits())
        {
            return Err(format!("row {r} is past every count but column {j} was written").into());
        }
    }
    Ok(())
}

/// One case: random operands, the CUDA GEMM against the f32 reference on every valid row (or
/// `sample` rows per group), poison outside. `extra`: the last `extra` groups are extra groups
/// reading `extra_rows` rows of their own (masked layout).
struct Case<'a> {
    counts: &'a [i32],
    layout: GroupLayout,
    n: usize,
    k: usize,
    tiles: GemmTiles,
    extra: usize,
    sample: Option<usize>,
}

fn run_case(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    c: &Case<'_>,
) -> CaseResult {
    let groups = c.counts.len();
    let (n, k) = (c.n, c.k);
    let rows = layout_rows(c.counts, c.layout);
    let shape = GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout: c.layout,
    };
    let ops = Operands::random(rng, c.counts, rows, (n, k), c.extra);
    let dev = ops.to_device(stream)?;
    let counts = stream.clone_htod(c.counts)?;
    let mut d = poisoned::<bf16>(stream, rows * n)?;
    fp8::grouped_gemm_fp8_cuda(
        stream,
        &fp8_of(&dev.a),
        &fp8_of(&dev.b),
        &counts,
        &shape,
        dev.extra().as_ref(),
        c.tiles,
        &mut d,
        ws,
    )?;
    let d = stream.clone_dtoh(&d)?;
    let starts = gemm::group_starts(c.counts, c.layout, rows)?;
    check_untouched(&d, n, c.counts, &starts)?;

    // The host twin on the whole problem must agree with the f32 reference to bf16 rounding
    // (checked on the same rows below).
    if c.sample.is_none() && rows * n * k <= 1 << 24 {
        let mut twin = vec![bf16::poison(); rows * n];
        fp8::grouped_gemm_fp8(
            ops.a.host(),
            ops.b.host(),
            c.counts,
            &shape,
            ops.host_extra().as_ref(),
            &mut twin,
        )?;
        check_untouched(&twin, n, c.counts, &starts)?;
    }

    let mut acc = Accuracy::default();
    for (g, (&s, &cnt)) in starts.iter().zip(c.counts).enumerate() {
        let (w, j) = ops.weights(g);
        for m in checked_rows(rng, cnt as usize, c.sample) {
            let r = s + m;
            let want = products(&ops.input_row(g, m, r)?, w, j, n, fp8::FP8_BLOCK);
            acc.row(&format!("group {g} row {m}"), &d[r * n..(r + 1) * n], &want)?;
        }
    }
    acc.finish()
}

/// The rows of a group of `cnt` rows that a case checks: all of them, or with `sample = Some(m)`
/// the first, the last and `m - 2` random ones.
fn checked_rows(rng: &mut StdRng, cnt: usize, sample: Option<usize>) -> Vec<usize> {
    match sample {
        Some(m) if cnt > m => {
            let mut v = vec![0, cnt - 1];
            v.extend((2..m).map(|_| rng.random_range(0..cnt)));
            v
        }
        _ => (0..cnt).collect(),
    }
}

/// `groups` counts summing to `total`, some zero.
fn uneven_counts(rng: &mut StdRng, groups: usize, total: usize) -> Vec<i32> {
    let mut w: Vec<f64> = (0..groups)
        .map(|_| {
            if rng.random_range(0..5) == 0 {
                0.0
            } else {
                rng.random_range(0.1..1.0)
            }
        })
        .collect();
    let sum: f64 = w.iter().sum();
    w.iter_mut().for_each(|x| *x /= sum);
    let mut counts: Vec<i32> = w.iter().map(|x| (x * total as f64) as i32).collect();
    let rest = total as i32 - counts.iter().sum::<i32>();
    let last = counts.iter().rposition(|&c| c > 0).unwrap_or(0);
    counts[last] += rest;
    counts
}

/// The weight dequantization kernel against its host twin, bit for bit, partial edge blocks
/// and 64-row scale blocks included.
fn dequantize_case(stream: &Arc<CudaStream>, rng: &mut StdRng) -> CaseResult {
    for (n, k, scale_rows) in [(576, 7168, 128), (130, 208, 128), (256, 128, 64)] {
        let w = random_weights(rng, 1, n, k, scale_rows);
        let q = stream.clone_htod(&w.q)?;
        let s = stream.clone_htod(&w.scales)?;
        let mut out = poisoned::<bf16>(stream, n * k)?;
        fp8::dequantize_weight_cuda(stream, &q, &s, n, k, scale_rows, &mut out)?;
        let got = stream.clone_dtoh(&out)?;
        let want = fp8::dequantize_weight(&w.q, &w.scales, n, k, scale_rows)?;
        if let Some(i) = (0..n * k).find(|&i| got[i] != bf16::from_f32(want[i])) {
            return Err(format!(
                "[{n}, {k}] / {scale_rows}: element {i}: got {}, want {}",
                got[i],
                bf16::from_f32(want[i])
            )
            .into());
        }
    }
    Ok(())
}

/// The experts' SwiGLU + fp8 quantization against its host twin: scales to f32 rounding (the
/// kernel's `expf` may differ from the host's `exp` in the last bit), values to one e4m3 step,
/// rows past a masked block's count untouched.
fn swiglu_quantize_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: usize,
    (inter, block): (usize, usize),
    m_max: Option<usize>,
    hot: bool,
) -> CaseResult {
    let h: Vec<bf16> = (0..rows * 2 * inter)
        .map(|_| bf16::from_f32(rng.random_range(-4.0f32..4.0)))
        .collect();
    let counts = m_max.map_or(Vec::new(), |m| mask_counts(rng, rows / m, m, hot));
    let groups = inter / 128;
    let mut q_want = vec![F8E4M3::poison(); rows * inter];
    let mut s_want = vec![f32::poison(); rows * groups];
    let mask = m_max.map(|m| (counts.as_slice(), m));
    fp8::swiglu_quantize(&h, rows, inter, block, mask, &mut q_want, &mut s_want)?;
    let h_dev = stream.clone_htod(&h)?;
    let c_dev = stream.clone_htod(&counts.iter().copied().chain([0]).collect::<Vec<_>>())?;
    let c_view = c_dev.slice(0..counts.len());
    let mut q = poisoned::<F8E4M3>(stream, rows * inter)?;
    let mut s = poisoned::<f32>(stream, rows * groups)?;
    let dmask = m_max.map(|m| (&c_view as &dyn cudarc::driver::DevicePtr<i32>, m));
    fp8::swiglu_quantize_fp8_cuda(stream, &h_dev, rows, inter, block, dmask, &mut q, &mut s)?;
    let (q, s) = (stream.clone_dtoh(&q)?, stream.clone_dtoh(&s)?);
    for r in 0..rows {
        for g in 0..groups {
            let (gs, ws) = (s[r * groups + g], s_want[r * groups + g]);
            if ws.to_bits() == f32::poison().to_bits() {
                if gs.to_bits() != ws.to_bits() {
                    return Err(format!("row {r} is past its block's count but was written").into());
                }
                continue;
            }
            if (gs - ws).abs() > ws * 1e-5 {
                return Err(format!("row {r} group {g}: scale {gs}, want {ws}").into());
            }
            for c in g * 128..(g + 1) * 128 {
                let (a, b) = (q[r * inter + c].to_f32(), q_want[r * inter + c].to_f32());
                if (a - b).abs() > b.abs() / 8.0 + 1e-3 {
                    return Err(format!("row {r} column {c}: got {a}, want {b}").into());
                }
            }
        }
    }
    Ok(())
}

/// The gate_up GEMM with SwiGLU and the act quantization in its epilogue (`gemv: None`: the
/// CUTLASS tiles; `Some(extra)`: the tile-less GEMV, masked, its last `extra` groups extra ones
/// with their own weights and rows) against the host twin's row function on the f32 products
/// (`b`'s rows taken as 128-row gate and up blocks in turn), per valid (or sampled) row: every
/// scale within 2e-3 relative, and every dequantized act value within one e4m3 step (1/8 of it)
/// plus 4e-3 of its block's amax. The products differ from the f32 reference as the plain
/// GEMM's do (the tensor cores' partial sums), which moves an amax by a few 1e-4 and a small
/// value by more than its own e4m3 step. Rows outside the groups' counts keep their poison in
/// both outputs. The GEMV runs twice (its arrival counters must be left at zero).
#[allow(clippy::too_many_arguments)]
fn swiglu_gemm_case(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    counts: &[i32],
    layout: GroupLayout,
    (n, k): (usize, usize),
    sample: Option<usize>,
    gemv: Option<usize>,
) -> CaseResult {
    let groups = counts.len();
    let rows = layout_rows(counts, layout);
    let shape = GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout,
    };
    let inter = n / 2;
    let sg = inter / fp8::FP8_BLOCK;
    let ops = Operands::random(rng, counts, rows, (n, k), gemv.unwrap_or(0));
    let dev = ops.to_device(stream)?;
    let counts_dev = stream.clone_htod(counts)?;
    let mut q = poisoned::<F8E4M3>(stream, rows * inter)?;
    let mut s = poisoned::<f32>(stream, rows * sg)?;
    match gemv {
        None => fp8::grouped_gemm_swiglu_fp8_cuda(
            stream,
            &fp8_of(&dev.a),
            &fp8_of(&dev.b),
            &counts_dev,
            &shape,
            &mut q,
            &mut s,
            ws,
        )?,
        Some(_) => {
            let mut products = poisoned::<f32>(stream, rows * inter)?;
            for _ in 0..2 {
                fp8::grouped_gemv_swiglu_fp8_cuda(
                    stream,
                    &fp8_of(&dev.a),
                    &fp8_of(&dev.b),
                    &counts_dev,
                    &shape,
                    dev.extra().as_ref(),
                    &mut q,
                    &mut s,
                    &mut products,
                    ws,
                )?;
            }
        }
    }
    let (q, s) = (stream.clone_dtoh(&q)?, stream.clone_dtoh(&s)?);
    let starts = gemm::group_starts(counts, layout, rows)?;
    let mut valid = vec![false; rows];
    for (&st, &c) in starts.iter().zip(counts) {
        valid[st..st + c as usize]
            .iter_mut()
            .for_each(|v| *v = true);
    }
    for r in (0..rows).filter(|&r| !valid[r]) {
        let q_row = &q[r * inter..(r + 1) * inter];
        let s_row = &s[r * sg..(r + 1) * sg];
        if q_row
            .iter()
            .any(|v| v.to_bits() != F8E4M3::poison().to_bits())
            || s_row.iter().any(|v| v.to_bits() != f32::poison().to_bits())
        {
            return Err(format!("row {r} is outside every group but was written").into());
        }
    }
    for (g, (&st, &cnt)) in starts.iter().zip(counts).enumerate() {
        let (w, j) = ops.weights(g);
        for m in checked_rows(rng, cnt as usize, sample) {
            let r = st + m;
            let products = products(&ops.input_row(g, m, r)?, w, j, n, fp8::FP8_BLOCK);
            let mut q_want = vec![F8E4M3::ZERO; inter];
            let mut s_want = vec![0f32; sg];
            fp8::host::swiglu_quantize_row(
                &products,
                fp8::FP8_GATE_UP_BLOCK,
                &mut q_want,
                &mut s_want,
            );
            for blk in 0..sg {
                let (got, want) = (s[r * sg + blk], s_want[blk]);
                if (got - want).abs() > want * 2e-3 {
                    return Err(
                        format!("group {g} row {m} block {blk}: scale {got}, want {want}").into(),
                    );
                }
            }
            for c in 0..inter {
                let blk = c / fp8::FP8_BLOCK;
                let x = q[r * inter + c].to_f32() * s[r * sg + blk];
                let y = q_want[c].to_f32() * s_want[blk];
                let amax = s_want[blk] * 448.0;
                if (x - y).abs() > y.abs() / 8.0 + 4e-3 * amax {
                    return Err(format!("group {g} row {m} column {c}: act {x}, want {y}").into());
                }
            }
        }
    }
    // The host twin on the whole problem leaves the same rows untouched and agrees with the
    // row function (checked above) where it is small enough to run.
    if sample.is_none() && rows * n * k <= 1 << 24 {
        let mut q_twin = vec![F8E4M3::poison(); rows * inter];
        let mut s_twin = vec![f32::poison(); rows * sg];
        fp8::grouped_gemm_swiglu_fp8(
            ops.a.host(),
            ops.b.host(),
            counts,
            &shape,
            ops.host_extra().as_ref(),
            &mut q_twin,
            &mut s_twin,
        )?;
        for r in 0..rows {
            let twin_written = s_twin[r * sg].to_bits() != f32::poison().to_bits();
            if twin_written != valid[r] {
                return Err(format!("host twin: row {r} written {twin_written}").into());
            }
            for blk in (0..sg).filter(|_| valid[r]) {
                let (got, want) = (s[r * sg + blk], s_twin[r * sg + blk]);
                if (got - want).abs() > want * 2e-3 {
                    return Err(format!(
                        "host twin: row {r} block {blk}: scale {got}, want {want}"
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// A decode step's two GEMVs back to back, as the layer runs them: the fused gate_up GEMV
/// (SwiGLU, act quantized) and the down GEMV on its act, a dependent launch that starts while
/// the gate_up grid runs. The act and the products are poisoned before every step, so a down
/// GEMV that read its act before the gate_up grid finished writing it differs from the f32
/// reference on the act the step wrote. `(h, inter)`: the hidden and intermediate sizes;
/// the last `extra` groups are extra groups with rows of their own for gate_up.
fn gemv_chain_case(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    counts: &[i32],
    m_max: usize,
    (h, inter): (usize, usize),
    extra: usize,
) -> CaseResult {
    let groups = counts.len();
    let rows = groups * m_max;
    let layout = GroupLayout::Masked { m_max };
    let up_shape = GroupedGemmShape {
        groups,
        rows,
        n: 2 * inter,
        k: h,
        layout,
    };
    let down_shape = GroupedGemmShape {
        groups,
        rows,
        n: h,
        k: inter,
        layout,
    };
    // The gate_up operands; the down GEMM's weights (its rows are the act).
    let up = Operands::random(rng, counts, rows, (2 * inter, h), extra);
    let up_dev = up.to_device(stream)?;
    let first_extra = up.first_extra;
    let w2 = random_weights(rng, first_extra, h, inter, fp8::FP8_BLOCK);
    let xw2 = random_weights(rng, extra, h, inter, fp8::FP8_BLOCK);
    let (w2_d, xw2_d) = (to_device(stream, &w2)?, to_device(stream, &xw2)?);
    let down_extra = (extra > 0).then_some(ExtraGroupsFp8 {
        first: first_extra,
        b: fp8_of(&xw2_d),
        a: None,
    });
    let counts_dev = stream.clone_htod(counts)?;
    let starts = gemm::group_starts(counts, layout, rows)?;
    let sg = inter / fp8::FP8_BLOCK;
    for step in 0..3 {
        let mut act = poisoned::<F8E4M3>(stream, rows * inter)?;
        let mut act_s = poisoned::<f32>(stream, rows * sg)?;
        let mut scratch = poisoned::<f32>(stream, rows * inter)?;
        let mut d = poisoned::<bf16>(stream, rows * h)?;
        fp8::grouped_gemv_swiglu_fp8_cuda(
            stream,
            &fp8_of(&up_dev.a),
            &fp8_of(&up_dev.b),
            &counts_dev,
            &up_shape,
            up_dev.extra().as_ref(),
            &mut act,
            &mut act_s,
            &mut scratch,
            ws,
        )?;
        fp8::grouped_gemm_fp8_cuda(
            stream,
            &DeviceFp8 {
                q: &act,
                scales: &act_s,
            },
            &fp8_of(&w2_d),
            &counts_dev,
            &down_shape,
            down_extra.as_ref(),
            GemmTiles::Gemv,
            &mut d,
            ws,
        )?;
        let (act, act_s, d) = (
            stream.clone_dtoh(&act)?,
            stream.clone_dtoh(&act_s)?,
            stream.clone_dtoh(&d)?,
        );
        check_untouched(&d, h, counts, &starts)?;
        let mut acc = Accuracy::default();
        for (g, (&st, &cnt)) in starts.iter().zip(counts).enumerate() {
            let (w, j) = if g >= first_extra {
                (&xw2, g - first_extra)
            } else {
                (&w2, g)
            };
            for r in st..st + cnt as usize {
                let scales = &act_s[r * sg..(r + 1) * sg];
                if let Some(blk) = scales.iter().position(|v| !(v.is_finite() && *v > 0.0)) {
                    return Err(format!(
                        "step {step}: group {g} row {r}: act scale {blk} is {}",
                        scales[blk]
                    )
                    .into());
                }
                let act_row =
                    fp8::dequantize_rows(&act[r * inter..(r + 1) * inter], scales, 1, inter)?;
                let want = products(&act_row, w, j, h, fp8::FP8_BLOCK);
                acc.row(
                    &format!("step {step}: group {g} row {r}"),
                    &d[r * h..(r + 1) * h],
                    &want,
                )?;
            }
        }
        acc.finish()?;
    }
    Ok(())
}

/// Counts of `blocks` masked blocks of `m` rows: random in `0..=m`, or with `hot` one full
/// block (a decode step's tokens all on one expert) among blocks of 0 or 1 rows.
fn mask_counts(rng: &mut StdRng, blocks: usize, m: usize, hot: bool) -> Vec<i32> {
    (0..blocks)
        .map(|b| match (hot, b) {
            (true, 1) => m as i32,
            (true, _) => rng.random_range(0..=1),
            (false, _) => rng.random_range(0..=m as i32),
        })
        .collect()
}

/// The experts' input quantization against its host twin, bit for bit (the per-token cast's
/// arithmetic), masked blocks past their counts untouched.
fn quantize_rows_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: usize,
    cols: usize,
    m_max: Option<usize>,
    hot: bool,
) -> CaseResult {
    let x: Vec<bf16> = (0..rows * cols)
        .map(|_| {
            bf16::from_f32(rng.random_range(-4.0f32..4.0) * 10f32.powi(rng.random_range(-2..2)))
        })
        .collect();
    let counts = m_max.map_or(Vec::new(), |m| mask_counts(rng, rows / m, m, hot));
    let groups = cols / 128;
    let mut q_want = vec![F8E4M3::poison(); rows * cols];
    let mut s_want = vec![f32::poison(); rows * groups];
    let mask = m_max.map(|m| (counts.as_slice(), m));
    fp8::quantize_rows(&x, rows, cols, mask, &mut q_want, &mut s_want)?;
    let x_dev = stream.clone_htod(&x)?;
    let c_dev = stream.clone_htod(&counts.iter().copied().chain([0]).collect::<Vec<_>>())?;
    let c_view = c_dev.slice(0..counts.len());
    let mut q = poisoned::<F8E4M3>(stream, rows * cols)?;
    let mut s = poisoned::<f32>(stream, rows * groups)?;
    let dmask = m_max.map(|m| (&c_view as &dyn cudarc::driver::DevicePtr<i32>, m));
    fp8::quantize_rows_fp8_cuda(stream, &x_dev, rows, cols, dmask, &mut q, &mut s)?;
    let (q, s) = (stream.clone_dtoh(&q)?, stream.clone_dtoh(&s)?);
    if let Some(i) = (0..rows * cols).find(|&i| q[i].to_bits() != q_want[i].to_bits()) {
        return Err(format!("value {i}: got {}, want {}", q[i], q_want[i]).into());
    }
    if let Some(i) = (0..rows * groups).find(|&i| s[i].to_bits() != s_want[i].to_bits()) {
        return Err(format!("scale {i}: got {}, want {}", s[i], s_want[i]).into());
    }
    Ok(())
}

/// Bad arguments are refused before any launch, naming the argument.
fn bad_input_case(stream: &Arc<CudaStream>, ws: &mut GroupedGemmWorkspace) -> CaseResult {
    let a = stream.alloc_zeros::<F8E4M3>(4 * 128)?;
    let sa = stream.alloc_zeros::<f32>(4)?;
    let b = stream.alloc_zeros::<F8E4M3>(2 * 128 * 128)?;
    let sb = stream.alloc_zeros::<f32>(2)?;
    let sb_short = stream.alloc_zeros::<f32>(1)?;
    let counts = stream.clone_htod(&[2i32, 2])?;
    let mut d = stream.alloc_zeros::<bf16>(4 * 128)?;
    let ok = GroupedGemmShape {
        groups: 2,
        rows: 4,
        n: 128,
        k: 128,
        layout: GroupLayout::Masked { m_max: 2 },
    };
    let expect = |what: &str, r: ep_kernels::Result<()>, word: &str| -> CaseResult {
        match r {
            Ok(()) => Err(format!("{what}: accepted").into()),
            Err(e) if e.to_string().contains(word) => Ok(()),
            Err(e) => Err(format!("{what}: error does not name `{word}`: {e}").into()),
        }
    };
    let a_dev = DeviceFp8 { q: &a, scales: &sa };
    let run = |shape: GroupedGemmShape,
               bs: &dyn cudarc::driver::DevicePtr<f32>,
               d: &mut cudarc::driver::CudaSlice<bf16>,
               ws: &mut GroupedGemmWorkspace| {
        fp8::grouped_gemm_fp8_cuda(
            stream,
            &a_dev,
            &DeviceFp8 { q: &b, scales: bs },
            &counts,
            &shape,
            None,
            GemmTiles::Auto,
            d,
            ws,
        )
    };
    expect("b scales short", run(ok, &sb_short, &mut d, ws), "b scales")?;
    expect(
        "k = 120",
        run(GroupedGemmShape { k: 120, ..ok }, &sb, &mut d, ws),
        "`k`",
    )?;
    let gemv = |shape: GroupedGemmShape, d: &mut cudarc::driver::CudaSlice<bf16>, ws| {
        fp8::grouped_gemm_fp8_cuda(
            stream,
            &a_dev,
            &DeviceFp8 { q: &b, scales: &sb },
            &counts,
            &shape,
            None,
            GemmTiles::Gemv,
            d,
            ws,
        )
    };
    expect(
        "gemv on the contiguous layout",
        gemv(
            GroupedGemmShape {
                layout: GroupLayout::Contiguous { alignment: 1 },
                ..ok
            },
            &mut d,
            ws,
        ),
        "`tiles`",
    )?;
    // k = 112: whole 16-byte rows, but not whole 64-channel steps of the GEMV.
    let b112 = stream.alloc_zeros::<F8E4M3>(2 * 128 * 112)?;
    let a112 = stream.alloc_zeros::<F8E4M3>(4 * 112)?;
    let r = fp8::grouped_gemm_fp8_cuda(
        stream,
        &DeviceFp8 {
            q: &a112,
            scales: &sa,
        },
        &DeviceFp8 {
            q: &b112,
            scales: &sb,
        },
        &counts,
        &GroupedGemmShape { k: 112, ..ok },
        None,
        GemmTiles::Gemv,
        &mut d,
        ws,
    );
    expect("gemv with k = 112", r, "`k`")?;
    // The fused SwiGLU GEMV: n = 128 is not a gate block and its up block.
    let mut act = stream.alloc_zeros::<F8E4M3>(4 * 64)?;
    let mut act_s = stream.alloc_zeros::<f32>(4)?;
    let mut products = stream.alloc_zeros::<f32>(4 * 64)?;
    let r = fp8::grouped_gemv_swiglu_fp8_cuda(
        stream,
        &a_dev,
        &DeviceFp8 { q: &b, scales: &sb },
        &counts,
        &ok,
        None,
        &mut act,
        &mut act_s,
        &mut products,
        ws,
    );
    expect("gemv swiglu with n = 128", r, "`shape.n`")?;
    Ok(())
}

fn main() {
    let mut runner = Runner::from_env("gpu_grouped_gemm_fp8");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => gpu_test_suite::skip(&format!("no CUDA device: {e}")),
    };
    let mut ws = match GroupedGemmWorkspace::new(&stream, 260) {
        Ok(w) => w,
        Err(e) => {
            println!("FAILED setup: workspace: {e}");
            gpu_test_suite::finish(0, 1);
        }
    };
    let contiguous = GroupLayout::Contiguous { alignment: 1 };
    let masked = |m_max| GroupLayout::Masked { m_max };
    for tiles in [
        GemmTiles::Wide,
        GemmTiles::WideM,
        GemmTiles::Narrow,
        GemmTiles::Auto,
    ] {
        let t = format!("{tiles:?}").to_lowercase();
        fn case(
            counts: &[i32],
            layout: GroupLayout,
            n: usize,
            k: usize,
            extra: usize,
            sample: Option<usize>,
            tiles: GemmTiles,
        ) -> Case<'_> {
            Case {
                counts,
                layout,
                n,
                k,
                tiles,
                extra,
                sample,
            }
        }
        runner.case(&format!("{t}/contiguous/small-odd"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&[5, 0, 1, 70, 33], contiguous, 256, 384, 0, None, tiles),
            )
        });
        // K and N not multiples of 128: partial scale blocks at the edges.
        runner.case(&format!("{t}/contiguous/partial-blocks"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&[3, 140, 0, 9], contiguous, 400, 208, 0, None, tiles),
            )
        });
        runner.case(&format!("{t}/contiguous/one-group-holds-all"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&[0, 0, 300, 0], contiguous, 256, 256, 0, None, tiles),
            )
        });
        runner.case(&format!("{t}/contiguous/all-empty"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&[0, 0, 0], contiguous, 128, 128, 0, None, tiles),
            )
        });
        runner.case(&format!("{t}/masked/small-odd"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&[0, 20, 7, 1], masked(20), 256, 384, 0, None, tiles),
            )
        });
        runner.case(&format!("{t}/masked/extra-groups"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&[4, 0, 3, 5, 5], masked(8), 256, 256, 2, None, tiles),
            )
        });
        runner.case(&format!("{t}/contiguous/uneven-64-groups"), |rng| {
            let counts = uneven_counts(rng, 64, 3000);
            run_case(
                &stream,
                &mut ws,
                rng,
                &case(&counts, contiguous, 512, 640, 0, Some(3), tiles),
            )
        });
    }
    // The tile-less GEMV (masked only): one pass of up to 8 rows, several passes, extra groups,
    // partial scale blocks along N (n = 400) and K (k = 320: a last block of 64 channels).
    for (name, counts, m_max, n, k, extra) in [
        ("one-row", &[1, 0, 0, 1, 1][..], 4, 256, 384, 0),
        ("small-odd-passes", &[0, 20, 7, 1][..], 20, 256, 384, 0),
        ("extra-groups", &[4, 0, 3, 5, 5][..], 8, 256, 256, 2),
        ("partial-blocks", &[2, 8, 0, 9][..], 9, 400, 320, 1),
        ("all-empty", &[0, 0, 0][..], 4, 128, 128, 0),
        ("gpt-oss-2880", &[1, 2, 0, 1][..], 2, 2880, 2880, 0),
        // One group with few units (a dense projection): warps share K (`gemv_tail_split`):
        // DeepSeek-V3's kv_a_proj_with_mqa, q_a_proj and o_proj, two passes, a partial last
        // scale block of K.
        ("split-k/kv-a-576x7168", &[3][..], 3, 576, 7168, 0),
        ("split-k/q-a-1536x7168", &[1][..], 1, 1536, 7168, 0),
        ("split-k/o-proj-7168x16384", &[8][..], 8, 7168, 16384, 0),
        ("split-k/two-passes", &[13][..], 13, 256, 1024, 0),
        ("split-k/partial-k", &[5][..], 5, 144, 1088, 0),
        // A round of one warp a unit, then the units left shared by teams (9 x 256 units on
        // 132-SM devices: 192 left, teams of 4 at K 2048), one group of them an extra one.
        (
            "split-k/round-and-tail",
            &[1, 2, 1, 1, 3, 1, 1, 1, 1][..],
            3,
            4096,
            2048,
            1,
        ),
    ] {
        runner.case(&format!("gemv/masked/{name}"), |rng| {
            run_case(
                &stream,
                &mut ws,
                rng,
                &Case {
                    counts,
                    layout: masked(m_max),
                    n,
                    k,
                    tiles: GemmTiles::Gemv,
                    extra,
                    sample: None,
                },
            )
        });
    }
    // DeepSeek-V3's expert GEMMs (gate_up [2I, H] and down [H, I], H 7168, I 2048) on one rank
    // of EP8 (32 experts): blocks of a few decode rows (masked) and prefill rows (contiguous),
    // rows sampled.
    for (what, n, k) in [("gate-up", 4096, 7168), ("down", 7168, 2048)] {
        runner.case(&format!("deepseek-v3/{what}/masked-32x4"), |rng| {
            let counts: Vec<i32> = (0..32).map(|_| rng.random_range(0..=4)).collect();
            run_case(
                &stream,
                &mut ws,
                rng,
                &Case {
                    counts: &counts,
                    layout: masked(4),
                    n,
                    k,
                    tiles: GemmTiles::Auto,
                    extra: 0,
                    sample: Some(2),
                },
            )
        });
        runner.case(
            &format!("deepseek-v3/{what}/gemv-masked-33x2-shared"),
            |rng| {
                // 32 routed experts with 0-2 rows and the shared expert's block over 2 tokens.
                let mut counts: Vec<i32> = (0..32).map(|_| rng.random_range(0..=2)).collect();
                counts.push(2);
                run_case(
                    &stream,
                    &mut ws,
                    rng,
                    &Case {
                        counts: &counts,
                        layout: masked(2),
                        n,
                        k,
                        tiles: GemmTiles::Gemv,
                        extra: 1,
                        sample: None,
                    },
                )
            },
        );
        runner.case(&format!("deepseek-v3/{what}/contiguous-32-uneven"), |rng| {
            let counts = uneven_counts(rng, 32, 8192);
            run_case(
                &stream,
                &mut ws,
                rng,
                &Case {
                    counts: &counts,
                    layout: contiguous,
                    n,
                    k,
                    tiles: GemmTiles::Auto,
                    extra: 0,
                    sample: Some(3),
                },
            )
        });
    }
    // Masked: random counts; one hot block among nearly empty ones; more blocks than a block of
    // threads lays out at once (the kernels' prefix of the counts runs in chunks).
    // The gate_up GEMM with SwiGLU in its epilogue: small odd groups, one group with all the
    // rows, empty groups, a masked layout, and DeepSeek-V3's shapes (sampled rows).
    for (name, counts, layout, n, k, sample) in [
        (
            "contiguous/small-odd",
            vec![5, 0, 1, 70, 33],
            contiguous,
            512,
            384,
            None,
        ),
        (
            "contiguous/one-group-holds-all",
            vec![0, 300, 0],
            contiguous,
            256,
            256,
            None,
        ),
        (
            "contiguous/all-empty",
            vec![0, 0, 0],
            contiguous,
            256,
            128,
            None,
        ),
        (
            "masked/small-odd",
            vec![0, 20, 7, 1],
            masked(20),
            768,
            256,
            None,
        ),
        (
            "deepseek-v3/contiguous-8",
            vec![900, 0, 17, 1024, 3, 512, 250, 1],
            contiguous,
            4096,
            7168,
            Some(3),
        ),
    ] {
        runner.case(&format!("swiglu-gemm/{name}"), |rng| {
            swiglu_gemm_case(&stream, &mut ws, rng, &counts, layout, (n, k), sample, None)
        });
    }
    // The tile-less GEMV with SwiGLU fused (masked): one row, passes of up to 8 rows, a hot
    // group, extra groups (the shared expert, its own rows), K with a partial last scale block,
    // and DeepSeek-V3's decode token (its 8 experts and the shared one: 9 x 256 units, a round,
    // then teams sharing K).
    for (name, counts, m_max, n, k, extra) in [
        ("one-row", vec![1, 0, 0, 1, 1], 4, 256, 384, 0),
        ("small-odd-passes", vec![0, 20, 7, 1], 20, 512, 384, 0),
        ("extra-groups", vec![4, 0, 3, 5, 5], 8, 256, 256, 2),
        ("partial-k", vec![2, 8, 0, 9], 9, 768, 320, 1),
        ("hot-group", vec![0, 64, 1, 0, 1, 1], 64, 256, 512, 0),
        ("all-empty", vec![0, 0, 0], 4, 256, 128, 0),
        ("deepseek-v3/one-token-8+1", vec![1; 9], 1, 4096, 7168, 1),
    ] {
        runner.case(&format!("gemv-swiglu/masked/{name}"), |rng| {
            swiglu_gemm_case(
                &stream,
                &mut ws,
                rng,
                &counts,
                masked(m_max),
                (n, k),
                None,
                Some(extra),
            )
        });
    }
    // The two GEMVs of a decode step, the down GEMV a dependent launch on the gate_up's act.
    for (name, counts, m_max, h, inter, extra) in [
        ("one-row", vec![1, 0, 0, 1, 1], 4, 384, 256, 1),
        ("passes", vec![0, 20, 7, 1], 20, 512, 256, 0),
        ("deepseek-v3/one-token-8+1", vec![1; 9], 1, 7168, 2048, 1),
        // Empty, one-row and three-row groups over several rounds of the grid's warps.
        (
            "many-groups",
            (0..250).map(|g| [0, 1, 3][g % 3]).collect(),
            3,
            256,
            512,
            2,
        ),
    ] {
        runner.case(&format!("gemv-chain/masked/{name}"), |rng| {
            gemv_chain_case(&stream, &mut ws, rng, &counts, m_max, (h, inter), extra)
        });
    }
    // Gate and up columns in 128-column blocks in turn (the experts' layout) or stacked.
    for (name, rows, inter, block, m_max, hot) in [
        ("contiguous/300x2048/blocks", 300, 2048, 128, None, false),
        ("masked/8x16x1408/stacked", 128, 1408, 1408, Some(16), false),
        ("masked/8x16x1408/blocks", 128, 1408, 128, Some(16), false),
        (
            "masked-hot/33x64x1024/blocks",
            33 * 64,
            1024,
            128,
            Some(64),
            true,
        ),
        ("masked/300x4x256/stacked", 1200, 256, 256, Some(4), false),
    ] {
        runner.case(&format!("swiglu-quantize/{name}"), |rng| {
            swiglu_quantize_case(&stream, rng, rows, (inter, block), m_max, hot)
        });
    }
    for (name, rows, cols, m_max, hot) in [
        ("contiguous/300x7168", 300, 7168, None, false),
        ("masked/32x16x2048", 512, 2048, Some(16), false),
        ("masked-hot/33x64x2048", 33 * 64, 2048, Some(64), true),
        ("masked/300x4x256", 1200, 256, Some(4), false),
    ] {
        runner.case(&format!("quantize-rows/{name}"), |rng| {
            quantize_rows_case(&stream, rng, rows, cols, m_max, hot)
        });
    }
    runner.case("dequantize-weight", |rng| dequantize_case(&stream, rng));
    runner.case("bad-input", |_| bad_input_case(&stream, &mut ws));
    runner.finish();
}
