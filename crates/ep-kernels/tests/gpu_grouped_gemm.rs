//! GPU tests: the grouped GEMMs (both layouts, every tile configuration, plain and with the
//! SwiGLU epilogue) against their host twins, on fresh random inputs written into poisoned
//! outputs.
//!
//! Tolerance (bf16 out, f32 accumulation in a different order than the host's): per row,
//! `||got - ref|| / ||ref|| <= 1e-2` and every element within `2e-2 * max|ref|` of the
//! reference (one bf16 rounding is 2^-9 relative; the rest is summation order). Rows outside
//! the groups' counts must keep their poison bit for bit. The SwiGLU GEMMs are held to the
//! same per-row tolerance on `act = silu(gate) * up`. For the DeepSeek-V3 shapes the
//! reference is computed on sampled rows of every group (all rows are checked for poison).
//!
//! `gpu_grouped_gemm` runs every case; `gpu_grouped_gemm NAME` only those whose name contains
//! NAME. The device-side count checks trap the context, so they run in a child process
//! (`--trap-child CASE`, started by the case itself).

mod common;

use std::process::Command;
use std::sync::Arc;

use common::{device, poisoned, CaseResult, Poison, Runner};
use cudarc::driver::{CudaSlice, CudaStream};
use ep_kernels::gemm::{
    self, GemmGrid, GemmTiles, GroupLayout, GroupedGemmShape, GroupedGemmWorkspace,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// Random bf16 values uniform in `[-scale, scale)`.
fn random_bf16(rng: &mut StdRng, len: usize, scale: f32) -> Vec<bf16> {
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

/// The rows of `a` each group's rows start at (host twin).
fn starts(counts: &[i32], layout: GroupLayout, rows: usize) -> Vec<usize> {
    gemm::group_starts(counts, layout, rows).expect("valid counts")
}

/// Checks one row against its f32 reference.
fn check_row(what: &str, got: &[bf16], want: &[f32]) -> CaseResult {
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut err2 = 0f64;
    let mut ref2 = 0f64;
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        if !g.is_finite() || (g - w).abs() > 2e-2 * max_ref + 1e-6 {
            return Err(
                format!("{what}: column {j}: got {g}, want {w} (max |ref| {max_ref})").into(),
            );
        }
        err2 += f64::from(g - w).powi(2);
        ref2 += f64::from(*w).powi(2);
    }
    let rel = (err2 / ref2.max(1e-30)).sqrt();
    if rel > 1e-2 {
        return Err(format!("{what}: relative error {rel:.2e} > 1e-2").into());
    }
    Ok(())
}

/// Checks that every row outside the groups' counts still holds the poison bit pattern.
fn check_untouched(
    what: &str,
    d: &[bf16],
    n: usize,
    counts: &[i32],
    starts: &[usize],
) -> CaseResult {
    let rows = d.len() / n;
    let mut valid = vec![false; rows];
    for (&s, &c) in starts.iter().zip(counts) {
        valid[s..s + c as usize].iter_mut().for_each(|v| *v = true);
    }
    for (r, _) in valid.iter().enumerate().filter(|(_, v)| !**v) {
        if let Some(j) = (0..n).find(|&j| d[r * n + j].to_bits() != bf16::poison().to_bits()) {
            return Err(
                format!("{what}: row {r} is past every count but column {j} was written").into(),
            );
        }
    }
    Ok(())
}

/// One grouped GEMM case: random A, B, counts; the CUDA kernel against the host twin on
/// `sample` rows per group (all rows when `None`).
#[allow(clippy::too_many_arguments)]
fn gemm_case(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    counts: &[i32],
    layout: GroupLayout,
    extra_rows: usize,
    n: usize,
    k: usize,
    tiles: GemmTiles,
    sample: Option<usize>,
) -> CaseResult {
    let groups = counts.len();
    let rows = match layout {
        GroupLayout::Masked { m_max } => groups * m_max,
        GroupLayout::Contiguous { alignment } => {
            counts
                .iter()
                .map(|&c| (c as usize).div_ceil(alignment) * alignment)
                .sum::<usize>()
                + extra_rows
        }
    };
    let shape = GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout,
    };
    let a = random_bf16(rng, rows * k, 1.0);
    let b = random_bf16(rng, groups * n * k, 0.05);
    let a_dev = stream.clone_htod(&a)?;
    let b_dev = stream.clone_htod(&b)?;
    let c_dev = stream.clone_htod(counts)?;
    let mut d_dev = poisoned::<bf16>(stream, rows * n)?;
    gemm::grouped_gemm_bf16_cuda(
        stream, &a_dev, &b_dev, &c_dev, &shape, tiles, &mut d_dev, ws,
    )?;
    let d = stream.clone_dtoh(&d_dev)?;
    let st = starts(counts, layout, rows);
    check_untouched("d", &d, n, counts, &st)?;
    let mut want = vec![0f32; n];
    for (g, (&s, &c)) in st.iter().zip(counts).enumerate() {
        let c = c as usize;
        let picked: Vec<usize> = match sample {
            Some(m) if c > m => {
                let mut v = vec![0, c - 1];
                v.extend((2..m).map(|_| rng.random_range(0..c)));
                v
            }
            _ => (0..c).collect(),
        };
        for m in picked {
            let r = s + m;
            gemm::host::gemm_row(
                &a[r * k..(r + 1) * k],
                &b[g * n * k..(g + 1) * n * k],
                n,
                &mut want,
            );
            check_row(
                &format!("group {g} row {m} (a row {r})"),
                &d[r * n..(r + 1) * n],
                &want,
            )?;
        }
    }
    Ok(())
}

/// A grouped GEMM (`swiglu`: the experts' first GEMM with the SwiGLU epilogue,
/// `grouped_gemm_swiglu_bf16_cuda`, `n` = 2I; else `grouped_gemm_bf16_extra_cuda`) with any
/// tiles against its host twin (`grouped_gemm_swiglu` / `grouped_gemm_extra` /
/// `grouped_gemm`) on every valid row; rows past the counts keep their poison. `extra`
/// (masked layout only): `(groups, own rows)` of extra groups after the routed ones, with
/// their own weights and, with own rows, their own input (the shared experts' blocks in a MoE
/// layer).
#[allow(clippy::too_many_arguments)]
fn host_twin_case(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    routed_counts: &[i32],
    extra: Option<(usize, Option<usize>)>,
    layout: GroupLayout,
    n: usize,
    k: usize,
    tiles: GemmTiles,
    swiglu: bool,
) -> CaseResult {
    let first = routed_counts.len();
    let (nx, own_rows) = extra.unwrap_or((0, None));
    let groups = first + nx;
    let mut counts = routed_counts.to_vec();
    let (rows, block_rows) = match layout {
        GroupLayout::Masked { m_max } => {
            counts.extend(std::iter::repeat_n(
                own_rows.unwrap_or(m_max / 2 + 1) as i32,
                nx,
            ));
            (groups * m_max, m_max)
        }
        GroupLayout::Contiguous { alignment } => {
            let rows = counts
                .iter()
                .map(|&c| (c as usize).div_ceil(alignment) * alignment)
                .sum();
            (rows, 0)
        }
    };
    // Output columns: act is half the gate_up width.
    let w = if swiglu { n / 2 } else { n };
    let a_rows = if own_rows.is_some() {
        first * block_rows
    } else {
        rows
    };
    let a = random_bf16(rng, a_rows * k, 1.0);
    let b = random_bf16(rng, first * n * k, 0.05);
    let xb = random_bf16(rng, nx * n * k, 0.05);
    let xa = own_rows.map(|r| random_bf16(rng, r * k, 1.0));
    let shape = GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout,
    };
    let a_dev = stream.clone_htod(&a)?;
    let b_dev = stream.clone_htod(&b)?;
    let xb_dev = stream.clone_htod(&xb)?;
    let xa_dev = xa.as_ref().map(|v| stream.clone_htod(v)).transpose()?;
    let c_dev = stream.clone_htod(&counts)?;
    let mut out_dev = poisoned::<bf16>(stream, rows * w)?;
    let spec = (nx > 0).then(|| gemm::ExtraGroups {
        first,
        b: &xb_dev,
        a: xa_dev
            .as_ref()
            .map(|a| a as &dyn cudarc::driver::DevicePtr<bf16>),
    });
    let host_extra = (nx > 0).then(|| gemm::HostExtraGroups {
        first,
        b: &xb,
        a: xa.as_deref(),
    });
    // The plain and the SwiGLU launcher take the same arguments.
    type Launch = fn(
        &Arc<CudaStream>,
        &CudaSlice<bf16>,
        &CudaSlice<bf16>,
        &CudaSlice<i32>,
        &GroupedGemmShape,
        Option<&gemm::ExtraGroups<'_>>,
        GemmTiles,
        &mut CudaSlice<bf16>,
        &mut GroupedGemmWorkspace,
    ) -> ep_kernels::Result<()>;
    let launch: Launch = if swiglu {
        gemm::grouped_gemm_swiglu_bf16_cuda
    } else {
        gemm::grouped_gemm_bf16_extra_cuda
    };
    launch(
        stream,
        &a_dev,
        &b_dev,
        &c_dev,
        &shape,
        spec.as_ref(),
        tiles,
        &mut out_dev,
        ws,
    )?;
    let mut want = vec![bf16::poison(); rows * w];
    match (&host_extra, swiglu) {
        (x, true) => gemm::grouped_gemm_swiglu(&a, &b, &counts, &shape, x.as_ref(), &mut want)?,
        (Some(x), false) => gemm::grouped_gemm_extra(&a, &b, &counts, &shape, x, &mut want)?,
        (None, false) => gemm::grouped_gemm(&a, &b, &counts, &shape, &mut want)?,
    }
    let out = stream.clone_dtoh(&out_dev)?;
    let st = starts(&counts, shape.layout, rows);
    check_untouched("out", &out, w, &counts, &st)?;
    for (g, (&s, &c)) in st.iter().zip(&counts).enumerate() {
        for m in 0..c as usize {
            let r = s + m;
            let want_row: Vec<f32> = want[r * w..(r + 1) * w]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            check_row(
                &format!("group {g} row {m} (out row {r})"),
                &out[r * w..(r + 1) * w],
                &want_row,
            )?;
        }
    }
    Ok(())
}

/// Random counts for `groups` groups with `total` rows: some zero, one heavy.
fn uneven_counts(rng: &mut StdRng, groups: usize, total: usize) -> Vec<i32> {
    let weights: Vec<f64> = (0..groups)
        .map(|g| {
            if rng.random_bool(0.2) {
                0.0
            } else {
                1.0 / (1.0 + g as f64).powf(1.1)
            }
        })
        .collect();
    let sum: f64 = weights.iter().sum::<f64>().max(1e-9);
    weights
        .iter()
        .map(|w| (w / sum * total as f64).round() as i32)
        .collect()
}

/// SwiGLU over dense rows of a blocked gate_up product (`swiglu_rows_bf16_cuda`) against its
/// host twin: within one bf16 ulp (the device `expf` differs from the host's by an f32 ulp).
fn swiglu_rows_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: usize,
    inter: usize,
) -> CaseResult {
    let h = random_bf16(rng, rows * 2 * inter, 4.0);
    let h_dev = stream.clone_htod(&h)?;
    let mut act_dev = poisoned::<bf16>(stream, rows * inter)?;
    gemm::swiglu_rows_bf16_cuda(stream, &h_dev, rows, inter, &mut act_dev)?;
    let got = stream.clone_dtoh(&act_dev)?;
    let mut want = vec![bf16::ZERO; rows * inter];
    gemm::swiglu_rows(&h, rows, inter, &mut want)?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if (g.to_bits() as i32 - w.to_bits() as i32).abs() > 1 {
            return Err(
                format!("act[{i}]: got {g}, want {w} (more than one bf16 ulp apart)").into(),
            );
        }
    }
    let mut short = stream.alloc_zeros::<bf16>(rows * inter - 8)?;
    match gemm::swiglu_rows_bf16_cuda(stream, &h_dev, rows, inter, &mut short) {
        Err(e) if e.to_string().contains("`act`") => {}
        other => return Err(format!("a short act gave {other:?}").into()),
    }
    match gemm::swiglu_rows_bf16_cuda(stream, &h_dev, rows, inter + 4, &mut act_dev) {
        Err(e) if e.to_string().contains("`inter`") => Ok(()),
        other => Err(format!("inter = {} gave {other:?}", inter + 4).into()),
    }
}

/// gate_up GEMM with SwiGLU -> down GEMM (the experts' MLP, blocked gate_up weights) against an
/// f32 reference of the MLP with bf16 rounding at the same point (act), on sampled rows.
#[allow(clippy::too_many_arguments)]
fn mlp_case(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    counts: &[i32],
    layout: GroupLayout,
    hidden: usize,
    inter: usize,
    sample: usize,
) -> CaseResult {
    let groups = counts.len();
    let rows = match layout {
        GroupLayout::Masked { m_max } => groups * m_max,
        GroupLayout::Contiguous { alignment } => counts
            .iter()
            .map(|&c| (c as usize).div_ceil(alignment) * alignment)
            .sum(),
    };
    let x = random_bf16(rng, rows * hidden, 1.0);
    let w1 = random_bf16(rng, groups * 2 * inter * hidden, 0.03);
    let w2 = random_bf16(rng, groups * hidden * inter, 0.03);
    let x_dev = stream.clone_htod(&x)?;
    let w1_dev = stream.clone_htod(&w1)?;
    let w2_dev = stream.clone_htod(&w2)?;
    let c_dev = stream.clone_htod(counts)?;
    let mut a_dev = poisoned::<bf16>(stream, rows * inter)?;
    let mut y_dev = poisoned::<bf16>(stream, rows * hidden)?;
    let up = GroupedGemmShape {
        groups,
        rows,
        n: 2 * inter,
        k: hidden,
        layout,
    };
    let down = GroupedGemmShape {
        groups,
        rows,
        n: hidden,
        k: inter,
        layout,
    };
    gemm::grouped_gemm_swiglu_bf16_cuda(
        stream,
        &x_dev,
        &w1_dev,
        &c_dev,
        &up,
        None,
        GemmTiles::Auto,
        &mut a_dev,
        ws,
    )?;
    gemm::grouped_gemm_bf16_cuda(
        stream,
        &a_dev,
        &w2_dev,
        &c_dev,
        &down,
        GemmTiles::Auto,
        &mut y_dev,
        ws,
    )?;
    let y = stream.clone_dtoh(&y_dev)?;
    let st = starts(counts, layout, rows);
    check_untouched("y", &y, hidden, counts, &st)?;
    let mut h = vec![0f32; 2 * inter];
    let mut want = vec![0f32; hidden];
    for (g, (&s, &c)) in st.iter().zip(counts).enumerate() {
        for _ in 0..sample.min(c as usize) {
            let r = s + rng.random_range(0..c as usize);
            let w1g = &w1[g * 2 * inter * hidden..(g + 1) * 2 * inter * hidden];
            gemm::host::gemm_row(&x[r * hidden..(r + 1) * hidden], w1g, 2 * inter, &mut h);
            let act: Vec<bf16> = (0..inter)
                .map(|j| {
                    let (gate, upv) = gemm::gate_up_rows(j);
                    bf16::from_f32(gemm::host::silu(h[gate]) * h[upv])
                })
                .collect();
            let w2g = &w2[g * hidden * inter..(g + 1) * hidden * inter];
            gemm::host::gemm_row(&act, w2g, hidden, &mut want);
            check_row(
                &format!("mlp group {g} row {r}"),
                &y[r * hidden..(r + 1) * hidden],
                &want,
            )?;
        }
    }
    Ok(())
}

/// Bad arguments are errors before any launch, naming the argument.
fn bad_input_case(stream: &Arc<CudaStream>, ws: &mut GroupedGemmWorkspace) -> CaseResult {
    let a = stream.alloc_zeros::<bf16>(4 * 16)?;
    let b = stream.alloc_zeros::<bf16>(2 * 16 * 16)?;
    let counts = stream.clone_htod(&[2i32, 2])?;
    let mut d = stream.alloc_zeros::<bf16>(4 * 16)?;
    let ok = GroupedGemmShape {
        groups: 2,
        rows: 4,
        n: 16,
        k: 16,
        layout: GroupLayout::Masked { m_max: 2 },
    };
    let expect = |what: &str, r: ep_kernels::Result<()>, word: &str| -> CaseResult {
        match r {
            Ok(()) => Err(format!("{what}: accepted").into()),
            Err(e) if e.to_string().contains(word) => Ok(()),
            Err(e) => Err(format!("{what}: error does not name `{word}`: {e}").into()),
        }
    };
    let mut run = |shape: GroupedGemmShape, a: &_, d: &mut _| {
        gemm::grouped_gemm_bf16_cuda(stream, a, &b, &counts, &shape, GemmTiles::Auto, d, ws)
    };
    expect(
        "k = 12",
        run(GroupedGemmShape { k: 12, ..ok }, &a, &mut d),
        "`k`",
    )?;
    expect(
        "masked rows != groups * m_max",
        run(GroupedGemmShape { rows: 3, ..ok }, &a, &mut d),
        "`a`",
    )?;
    let short = stream.alloc_zeros::<bf16>(3 * 16)?;
    expect("a too short", run(ok, &short, &mut d), "`a`")?;
    expect(
        "groups 0",
        run(GroupedGemmShape { groups: 0, ..ok }, &a, &mut d),
        "`groups`",
    )?;
    expect(
        "alignment 0",
        run(
            GroupedGemmShape {
                layout: GroupLayout::Contiguous { alignment: 0 },
                ..ok
            },
            &a,
            &mut d,
        ),
        "`alignment`",
    )?;
    let mut small = GroupedGemmWorkspace::new(stream, 1)?;
    expect(
        "workspace for 1 group",
        gemm::grouped_gemm_bf16_cuda(
            stream,
            &a,
            &b,
            &counts,
            &ok,
            GemmTiles::Auto,
            &mut d,
            &mut small,
        ),
        "`workspace`",
    )?;
    let mut o = stream.alloc_zeros::<bf16>(4 * 12)?;
    let b24 = stream.alloc_zeros::<bf16>(2 * 24 * 16)?;
    expect(
        "swiglu gate_up width 24",
        gemm::grouped_gemm_swiglu_bf16_cuda(
            stream,
            &a,
            &b24,
            &counts,
            &GroupedGemmShape { n: 24, ..ok },
            None,
            GemmTiles::Auto,
            &mut o,
            ws,
        ),
        "`n` = 24",
    )?;
    Ok(())
}

/// 64 groups of uneven sizes (3000 rows in all, some empty), 256 x 384, 3 groups sampled.
fn uneven_64_groups(
    stream: &Arc<CudaStream>,
    ws: &mut GroupedGemmWorkspace,
    rng: &mut StdRng,
    tiles: GemmTiles,
) -> CaseResult {
    let counts = uneven_counts(rng, 64, 3000);
    let contiguous = GroupLayout::Contiguous { alignment: 1 };
    gemm_case(
        stream,
        ws,
        rng,
        &counts,
        contiguous,
        0,
        256,
        384,
        tiles,
        Some(3),
    )
}

/// A child process runs a GEMM whose device counts break the layout; the kernel must print
/// the offending entry and fail the stream (the child exits non-zero).
fn trap_case(which: &str, needle: &str) -> CaseResult {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe).args(["--trap-child", which]).output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        return Err(format!("child with bad counts ({which}) succeeded:\n{text}").into());
    }
    if !text.contains(needle) {
        return Err(format!("child output does not contain {needle:?}:\n{text}").into());
    }
    Ok(())
}

/// The child side of [`trap_case`].
fn trap_child(which: &str) -> ! {
    let result = (|| -> CaseResult {
        let (_ctx, stream) = device()?;
        let mut ws = GroupedGemmWorkspace::new(&stream, 4)?;
        let (counts, layout, rows): (Vec<i32>, GroupLayout, usize) = match which {
            "masked" | "masked-gemv" => (vec![3, 129], GroupLayout::Masked { m_max: 128 }, 256),
            _ => (vec![3, 62], GroupLayout::Contiguous { alignment: 1 }, 64),
        };
        let shape = GroupedGemmShape {
            groups: 2,
            rows,
            n: 16,
            k: 16,
            layout,
        };
        let a = stream.alloc_zeros::<bf16>(rows * 16)?;
        let b = stream.alloc_zeros::<bf16>(2 * 16 * 16)?;
        let c = stream.clone_htod(&counts)?;
        let mut d = stream.alloc_zeros::<bf16>(rows * 16)?;
        let tiles = if which == "masked-gemv" {
            GemmTiles::Gemv
        } else {
            GemmTiles::Auto
        };
        gemm::grouped_gemm_bf16_cuda(&stream, &a, &b, &c, &shape, tiles, &mut d, &mut ws)?;
        stream.synchronize()?;
        Ok(())
    })();
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            println!("child error: {e}");
            std::process::exit(3);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--trap-child") {
        trap_child(args.get(i + 1).map_or("masked", String::as_str));
    }
    let mut runner = Runner::from_env("gpu_grouped_gemm");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => gpu_test_suite::skip(&format!("no CUDA device: {e}")),
    };
    let mut ws = match GroupedGemmWorkspace::new(&stream, 256) {
        Ok(w) => w,
        Err(e) => {
            println!("FAILED setup: workspace: {e}");
            gpu_test_suite::finish(0, 1);
        }
    };
    let contiguous = |alignment| GroupLayout::Contiguous { alignment };
    let masked = |m_max| GroupLayout::Masked { m_max };

    for tiles in [GemmTiles::Wide, GemmTiles::WideM, GemmTiles::Narrow] {
        let t = format!("{tiles:?}").to_lowercase();
        runner.case(&format!("{t}/contiguous/small-odd"), |rng| {
            gemm_case(
                &stream,
                &mut ws,
                rng,
                &[5, 0, 1, 70, 33],
                contiguous(1),
                0,
                40,
                72,
                tiles,
                None,
            )
        });
        runner.case(&format!("{t}/contiguous/aligned-8-with-slack"), |rng| {
            gemm_case(
                &stream,
                &mut ws,
                rng,
                &[13, 0, 8, 1],
                contiguous(8),
                11,
                24,
                64,
                tiles,
                None,
            )
        });
        runner.case(&format!("{t}/contiguous/one-group-holds-all"), |rng| {
            gemm_case(
                &stream,
                &mut ws,
                rng,
                &[0, 0, 300, 0],
                contiguous(1),
                0,
                264,
                136,
                tiles,
                None,
            )
        });
        runner.case(&format!("{t}/contiguous/all-empty"), |rng| {
            gemm_case(
                &stream,
                &mut ws,
                rng,
                &[0, 0, 0],
                contiguous(1),
                5,
                16,
                16,
                tiles,
                None,
            )
        });
        runner.case(&format!("{t}/masked/small-odd"), |rng| {
            gemm_case(
                &stream,
                &mut ws,
                rng,
                &[0, 20, 7, 1],
                masked(20),
                0,
                40,
                72,
                tiles,
                None,
            )
        });
        runner.case(&format!("{t}/contiguous/uneven-64-groups"), |rng| {
            uneven_64_groups(&stream, &mut ws, rng, tiles)
        });
    }
    // The launch grids (`GemmGrid`): about one CTA per tile, and persistent on a few SMs (an
    // odd count, which the two-CTA clusters round).
    for grid in [GemmGrid::PerTile, GemmGrid::PersistentOn(7)] {
        for tiles in [GemmTiles::Wide, GemmTiles::WideM, GemmTiles::Narrow] {
            let t = format!("{tiles:?}").to_lowercase();
            runner.case(
                &format!("{t}/contiguous/uneven-64-groups/{grid:?}"),
                |rng| {
                    ws.set_grid(grid)?;
                    let r = uneven_64_groups(&stream, &mut ws, rng, tiles);
                    ws.set_grid(GemmGrid::Persistent)?;
                    r
                },
            );
        }
    }
    // The tile-less kernel for a few rows per block (masked only): one row per group, several
    // passes over the weights (counts above GEMV_ROWS_PER_PASS), a partial column slab.
    let gemv = GemmTiles::Gemv;
    runner.case("gemv/masked/small-odd-several-passes", |rng| {
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &[0, 20, 7, 1],
            masked(20),
            0,
            40,
            72,
            gemv,
            None,
        )
    });
    runner.case("gemv/masked/one-row-per-group", |rng| {
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &[1, 0, 1, 1, 0, 0, 1],
            masked(4),
            0,
            136,
            264,
            gemv,
            None,
        )
    });
    runner.case("gemv/masked/all-empty", |rng| {
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &[0, 0, 0],
            masked(2),
            0,
            16,
            16,
            gemv,
            None,
        )
    });
    runner.case("gemv/masked/ds-v3-decode-gate-up", |rng| {
        let counts: Vec<i32> = (0..16).map(|_| rng.random_range(0..=2)).collect();
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &counts,
            masked(128),
            0,
            2 * 2048,
            7168,
            gemv,
            None,
        )
    });
    runner.case("gemv/masked/ds-v3-decode-down", |rng| {
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &[0, 3, 1, 5, 0, 1],
            masked(8),
            0,
            7168,
            2048,
            gemv,
            None,
        )
    });
    // Extra groups (the shared experts' blocks in a MoE layer), masked layout.
    for tiles in [GemmTiles::Narrow, GemmTiles::Wide, GemmTiles::Gemv] {
        let t = format!("{tiles:?}").to_lowercase();
        runner.case(&format!("{t}/masked/extra-groups-own-rows"), |rng| {
            let extra = Some((2, Some(5)));
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &[3, 0, 16, 1],
                extra,
                masked(16),
                40,
                72,
                tiles,
                false,
            )
        });
        runner.case(&format!("{t}/masked/extra-groups-block-rows"), |rng| {
            let extra = Some((1, None));
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &[0, 9, 2],
                extra,
                masked(12),
                136,
                48,
                tiles,
                false,
            )
        });
    }
    // The SwiGLU epilogue: the tile-less GEMV and every CUTLASS configuration.
    for tiles in [GemmTiles::Gemv, GemmTiles::Narrow] {
        let t = format!("{tiles:?}").to_lowercase();
        runner.case(&format!("{t}-swiglu/masked/small-odd"), |rng| {
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &[0, 5, 3, 1],
                None,
                masked(8),
                80,
                72,
                tiles,
                true,
            )
        });
        runner.case(&format!("{t}-swiglu/masked/extra-groups-own-rows"), |rng| {
            let extra = Some((2, Some(3)));
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &[2, 0, 1],
                extra,
                masked(4),
                48,
                48,
                tiles,
                true,
            )
        });
        runner.case(
            &format!("{t}-swiglu/masked/extra-groups-block-rows"),
            |rng| {
                let extra = Some((1, None));
                host_twin_case(
                    &stream,
                    &mut ws,
                    rng,
                    &[1, 1],
                    extra,
                    masked(6),
                    32,
                    264,
                    tiles,
                    true,
                )
            },
        );
        runner.case(&format!("{t}-swiglu/masked/ds-v3-decode"), |rng| {
            let counts: Vec<i32> = (0..8).map(|_| rng.random_range(0..=2)).collect();
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &counts,
                None,
                masked(128),
                4096,
                7168,
                tiles,
                true,
            )
        });
    }
    runner.case("narrow-swiglu/masked/full-blocks", |rng| {
        let counts = [64, 0, 37, 1];
        host_twin_case(
            &stream,
            &mut ws,
            rng,
            &counts,
            None,
            masked(64),
            272,
            200,
            GemmTiles::Narrow,
            true,
        )
    });
    for tiles in [GemmTiles::Wide, GemmTiles::WideM] {
        let t = format!("{tiles:?}").to_lowercase();
        runner.case(&format!("{t}-swiglu/contiguous/uneven-odd-m"), |rng| {
            let counts = [3, 0, 130, 64, 1, 257];
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &counts,
                None,
                contiguous(1),
                528,
                520,
                tiles,
                true,
            )
        });
        runner.case(
            &format!("{t}-swiglu/contiguous/one-group-all-rows-aligned"),
            |rng| {
                let counts = [0, 0, 300, 0];
                host_twin_case(
                    &stream,
                    &mut ws,
                    rng,
                    &counts,
                    None,
                    contiguous(128),
                    272,
                    96,
                    tiles,
                    true,
                )
            },
        );
        runner.case(&format!("{t}-swiglu/contiguous/ds-v3-shapes"), |rng| {
            let counts = [5, 0, 33, 129];
            host_twin_case(
                &stream,
                &mut ws,
                rng,
                &counts,
                None,
                contiguous(1),
                4096,
                7168,
                tiles,
                true,
            )
        });
    }
    runner.case("gemv/contiguous-layout-refused", |_| {
        let zeros = |len| stream.alloc_zeros::<bf16>(len);
        let (a, b, mut d) = (zeros(4 * 16)?, zeros(2 * 16 * 16)?, zeros(4 * 16)?);
        let c = stream.clone_htod(&[1i32, 1])?;
        let shape = GroupedGemmShape {
            groups: 2,
            rows: 4,
            n: 16,
            k: 16,
            layout: GroupLayout::Contiguous { alignment: 1 },
        };
        match gemm::grouped_gemm_bf16_cuda(
            &stream,
            &a,
            &b,
            &c,
            &shape,
            GemmTiles::Gemv,
            &mut d,
            &mut ws,
        ) {
            Err(e) if e.to_string().contains("tiles") && e.to_string().contains("masked") => Ok(()),
            Err(e) => Err(format!("error does not name tiles and the layout: {e}").into()),
            Ok(()) => Err("Gemv accepted the contiguous layout".into()),
        }
    });
    runner.case("narrow/masked/extra-groups-bad-args", |rng| {
        // Host-side checks before any launch: extra groups need the masked layout, their
        // weights and own rows must match, `first` must leave at least one routed group.
        let (n, k) = (16, 16);
        let zeros = |len| stream.alloc_zeros::<bf16>(len);
        let a = zeros(2 * 4 * k)?;
        let b = zeros(n * k)?;
        let xb = zeros(n * k)?;
        let xa = zeros(5 * k)?;
        let c = stream.clone_htod(&[1i32, 1])?;
        let mut d = zeros(2 * 4 * n)?;
        let masked = GroupedGemmShape {
            groups: 2,
            rows: 8,
            n,
            k,
            layout: GroupLayout::Masked { m_max: 4 },
        };
        let contiguous = GroupedGemmShape {
            layout: GroupLayout::Contiguous { alignment: 1 },
            ..masked
        };
        let _ = rng.random::<u8>();
        let tries: [(&str, GroupedGemmShape, gemm::ExtraGroups); 3] = [
            (
                "masked layout",
                contiguous,
                gemm::ExtraGroups {
                    first: 1,
                    b: &xb,
                    a: None,
                },
            ),
            (
                "extra.first",
                masked,
                gemm::ExtraGroups {
                    first: 0,
                    b: &xb,
                    a: None,
                },
            ),
            (
                "extra.a",
                masked,
                gemm::ExtraGroups {
                    first: 1,
                    b: &xb,
                    a: Some(&xa),
                },
            ),
        ];
        for (needle, shape, extra) in tries {
            match gemm::grouped_gemm_bf16_extra_cuda(
                &stream,
                &a,
                &b,
                &c,
                &shape,
                Some(&extra),
                GemmTiles::Narrow,
                &mut d,
                &mut ws,
            ) {
                Err(e) if e.to_string().contains(needle) => {}
                Err(e) => return Err(format!("error does not name {needle}: {e}").into()),
                Ok(()) => return Err(format!("accepted a bad {needle}").into()),
            }
        }
        Ok(())
    });
    // DeepSeek-V3 expert shapes (H = 7168, I = 2048), 8 experts, sampled rows.
    let (h, i) = (7168, 2048);
    runner.case("auto/contiguous/ds-v3-gate-up", |rng| {
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &[0, 1, 129, 300, 64, 1000, 17, 2585],
            contiguous(1),
            0,
            2 * i,
            h,
            GemmTiles::Auto,
            Some(4),
        )
    });
    runner.case("auto/contiguous/ds-v3-down-aligned-128", |rng| {
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &[512, 0, 1, 127, 128, 129, 700, 2],
            contiguous(128),
            0,
            h,
            i,
            GemmTiles::Auto,
            Some(4),
        )
    });
    runner.case("auto/masked/ds-v3-decode-gate-up", |rng| {
        let counts: Vec<i32> = (0..8).map(|_| rng.random_range(0..=128)).collect();
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &counts,
            masked(128),
            0,
            2 * i,
            h,
            GemmTiles::Auto,
            Some(4),
        )
    });
    runner.case("auto/masked/ds-v3-decode-down-m1024", |rng| {
        let counts = [0, 32, 1, 1024];
        gemm_case(
            &stream,
            &mut ws,
            rng,
            &counts,
            masked(1024),
            0,
            h,
            i,
            GemmTiles::Auto,
            Some(4),
        )
    });
    runner.case("mlp/contiguous/hidden-not-multiple-of-128", |rng| {
        mlp_case(
            &stream,
            &mut ws,
            rng,
            &[7, 0, 130, 64],
            contiguous(1),
            1000,
            248,
            4,
        )
    });
    runner.case("mlp/masked/ds-v3-shapes", |rng| {
        mlp_case(&stream, &mut ws, rng, &[4, 0, 1, 31], masked(32), h, i, 2)
    });
    runner.case("swiglu-rows/odd-rows", |rng| {
        swiglu_rows_case(&stream, rng, 37, 136)
    });
    runner.case("swiglu-rows/ds-v3-shared", |rng| {
        swiglu_rows_case(&stream, rng, 300, 2048)
    });
    runner.case("bad-input/errors-before-launch", |_| {
        bad_input_case(&stream, &mut ws)
    });
    runner.case("device-check/masked-count-above-m-max", |_| {
        trap_case("masked", "counts[1] = 129 exceeds m_max = 128")
    });
    runner.case("device-check/gemv-count-above-m-max", |_| {
        trap_case("masked-gemv", "counts[1] = 129 exceeds m_max = 128")
    });
    runner.case("device-check/contiguous-counts-overrun-a", |_| {
        trap_case("contiguous", "need 65 rows of a, which has 64")
    });
    runner.finish();
}
