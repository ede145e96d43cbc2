//! `bench_grouped_gemm`: the experts' grouped GEMMs (gate_up with SwiGLU in its epilogue ->
//! down) at DeepSeek-V3 shapes (hidden 7168, expert inner 2048), in both layouts, beside the peers a
//! candle user has, all in one process on one GPU:
//!
//! - ours: `ep_kernels::gemm` (CUTLASS grouped GEMMs, SwiGLU fused into the first) on
//!   expert-major rows;
//! - dense cuBLAS (candle matmul) on the same number of rows with one expert's weights: the
//!   FLOP-rate anchor;
//! - candle-nn 0.11's `moe::moe_gemm` (WMMA) on the same routing (it gathers the token rows
//!   itself, so its input is the un-permuted `[T, H]`);
//! - the GPU's device-to-device copy bandwidth (bytes read + written over time), the anchor of
//!   the weight-bound decode cases.
//!
//! FLOPs are `rows x 3 x 2 x H x I`; weight bytes are `3 x H x I x 2` per expert with rows.
//! Each method's time is the median over `EP_BENCH_ROUNDS` rounds (default 3; every round
//! runs every method, so clock and power drift spread over all of them, and starts one method
//! later than the round before, so that no method is always timed first) of the median of
//! `EP_BENCH_ITERS` (default 10) event-timed runs after `EP_BENCH_WARMUP_MS` (default 200) ms of
//! warm-up (sustained clocks: a method timed right after an idle spell runs up to 15% faster on
//! H200); `EP_BENCH_IDLE_MS` (default 0) leaves the GPU idle that long before each method's
//! warm-up, to time every method at the clocks of a burst after a rest, as a peer measured
//! from Python may be.
//! Prints a table; writes JSON lines to `$EP_BENCH_OUT` if set. `EP_BENCH_CASES` keeps the
//! cases whose names contain one of its comma-separated parts, `EP_BENCH_METHODS` the methods.
//! `scripts/gpu/anchors/torch_grouped_mm.py` runs PyTorch's `torch._grouped_mm` on the same
//! cases (run it in the same device command).
//!
//! The fp8 rows run the block-scaled fp8 experts (`ep_kernels::gemm::fp8`: e4m3 rows with
//! 1 x 128 scales, e4m3 weights with 128 x 128 scales, DeepSeek-V3's recipe) as the layer
//! runs them ("fp8": gate_up GEMM with SwiGLU and the act cast in its epilogue -> down GEMM
//! where `gemm_fp8::swiglu_in_epilogue` says so, else gate_up GEMM -> SwiGLU + cast in one pass
//! -> down GEMM), always in the epilogue on the contiguous layout ("SwiGLU epilogue"), always
//! with the pass ("SwiGLU pass"), and the two GEMMs alone ("fp8 GEMMs only"); on masked cases
//! also the tile-less GEMV as the layer runs it ("fp8 gemv": SwiGLU and the cast fused into the
//! gate_up GEMV), with the pass ("fp8 gemv, SwiGLU pass") and alone ("fp8 gemv GEMMs only");
//! their weight bytes count one byte per weight.
//! `scripts/gpu/anchors/fp8_grouped_mm.py` runs PyTorch's `torch._scaled_grouped_mm` and
//! DeepGEMM on the same cases.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, CudaView};
use candle_core::{DType, Device, Storage, Tensor, D};
use ep_kernels::gemm::fp8::{self as gemm_fp8, DeviceFp8};
use ep_kernels::gemm::{self, GemmTiles, GroupLayout, GroupedGemmShape, GroupedGemmWorkspace};
use float8::F8E4M3;
use half::bf16;
use moe_layer::ep_runtime::device_tensor::alloc_uninit;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type BoxError = Box<dyn std::error::Error>;

const HIDDEN: usize = 7168;
const INTER: usize = 2048;
const TOPK: usize = 8;
const MAX_EXPERTS: usize = 256;

/// One benchmark case.
struct Case {
    name: String,
    experts: usize,
    layout: GroupLayout,
    /// `[T * K]` expert of each (token, k) (the routing moe_gemm takes).
    topk_ids: Vec<u32>,
    tokens: usize,
}

impl Case {
    fn counts(&self) -> Vec<i32> {
        let mut c = vec![0i32; self.experts];
        for &e in &self.topk_ids {
            c[e as usize] += 1;
        }
        c
    }

    fn rows(&self) -> usize {
        match self.layout {
            GroupLayout::Masked { m_max } => self.experts * m_max,
            GroupLayout::Contiguous { .. } => self.topk_ids.len(),
        }
    }
}

/// Balanced routing: token t's k-th expert is (t * K + k) mod E (K distinct experts per token
/// when E >= K), so every expert gets T * K / E rows.
fn balanced(tokens: usize, experts: usize) -> Vec<u32> {
    (0..tokens * TOPK)
        .map(|i| ((i / TOPK * TOPK + i % TOPK) % experts) as u32)
        .collect()
}

/// Uniform routing: K distinct experts per token drawn uniformly (the layer benchmark's random
/// gate gives about this: per-expert counts spread around T * K / E).
fn uniform(rng: &mut StdRng, tokens: usize, experts: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(tokens * TOPK);
    for _ in 0..tokens {
        let mut chosen: Vec<u32> = Vec::with_capacity(TOPK);
        while chosen.len() < TOPK.min(experts) {
            let e = rng.random_range(0..experts as u32);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        out.extend(chosen);
    }
    out
}

/// Zipf-like routing: K distinct experts per token drawn with weight 1 / (rank + 1)^1.2 over a
/// random order of the experts, a fifth of the experts never chosen.
fn zipf(rng: &mut StdRng, tokens: usize, experts: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..experts).collect();
    for i in (1..experts).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let live = experts - experts / 5;
    let w: Vec<f64> = (0..live)
        .map(|r| 1.0 / (r as f64 + 1.0).powf(1.2))
        .collect();
    let mut out = Vec::with_capacity(tokens * TOPK);
    for _ in 0..tokens {
        let mut chosen: Vec<usize> = Vec::with_capacity(TOPK);
        while chosen.len() < TOPK {
            let total: f64 = (0..live)
                .filter(|r| !chosen.contains(r))
                .map(|r| w[r])
                .sum();
            let mut x = rng.random_range(0.0..total);
            for r in (0..live).filter(|r| !chosen.contains(r)) {
                x -= w[r];
                if x <= 0.0 {
                    chosen.push(r);
                    break;
                }
            }
            if x > 0.0 {
                let last = (0..live).rev().find(|r| !chosen.contains(r)).unwrap_or(0);
                chosen.push(last);
            }
        }
        out.extend(chosen.iter().map(|&r| order[r] as u32));
    }
    out
}

/// The elements of a contiguous CUDA tensor of `T`, borrowed from its storage guard.
fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    storage: &'a Storage,
    layout: &candle_core::Layout,
) -> Result<CudaView<'a, T>, BoxError> {
    let Storage::Cuda(s) = storage else {
        return Err("not a CUDA tensor".into());
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or("tensor must be contiguous")?;
    let full: &CudaSlice<T> = s.as_cuda_slice::<T>()?;
    Ok(full.slice(start..end))
}

/// How long each method rests and warms up before it is timed (see the file comment).
#[derive(Clone, Copy)]
struct Warmup {
    idle: std::time::Duration,
    busy: std::time::Duration,
}

impl Warmup {
    fn from_env() -> Self {
        let ms = |name: &str, default: u64| std::time::Duration::from_millis(env_or(name, default));
        Self {
            idle: ms("EP_BENCH_IDLE_MS", 0),
            busy: ms("EP_BENCH_WARMUP_MS", 200),
        }
    }
}

/// Environment variable `name` parsed, or `default` when it is unset or does not parse.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median milliseconds of `f` on `stream` over `iters` event-timed runs, after `warmup`.
fn time_ms(
    stream: &Arc<CudaStream>,
    iters: usize,
    warmup: Warmup,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    std::thread::sleep(warmup.idle);
    // Warm up (200 ms by default), so that every method is timed at the clocks and power a
    // sustained load gets (the first method after an idle spell would otherwise run boosted).
    let start = std::time::Instant::now();
    while start.elapsed() < warmup.busy {
        f()?;
        stream.synchronize()?;
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?));
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Random bf16 `[shape]` with standard deviation `std`, built in chunks along dim 0.
fn randn_bf16(dev: &Device, shape: &[usize], std: f64) -> Result<Tensor, BoxError> {
    let per: usize = shape[1..].iter().product();
    let chunk = (1usize << 28) / per.max(1);
    let mut parts = Vec::new();
    let mut done = 0;
    while done < shape[0] {
        let n = chunk.max(1).min(shape[0] - done);
        let mut s = shape.to_vec();
        s[0] = n;
        parts.push(Tensor::randn(0f32, std as f32, s, dev)?.to_dtype(DType::BF16)?);
        done += n;
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// `silu(gate) * up` of a `[rows, 2I]` tensor (candle ops).
/// Where an fp8 method runs SwiGLU and the act cast.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Swiglu {
    /// As the layer (`gemm_fp8::swiglu_in_epilogue`).
    AsTheLayer,
    /// In the gate_up GEMM's epilogue (contiguous layout).
    Epilogue,
    /// A pass after the gate_up GEMM.
    Pass,
    /// Not at all (the two GEMMs alone).
    None,
}

fn candle_swiglu(h: &Tensor) -> Result<Tensor, BoxError> {
    let gate = h.narrow(D::Minus1, 0, INTER)?;
    let up = h.narrow(D::Minus1, INTER, INTER)?;
    Ok((gate.silu()? * up)?)
}

/// `len` e4m3 values on the device as a quantized weight holds them: `period` normal values
/// quantized in 128 x 128 blocks on the host (the host twin of DeepSeek's weight cast), repeated
/// by device copies. Realistic values matter: random bit patterns draw more power and run
/// slower on a power-capped GPU.
fn random_fp8(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    len: usize,
    period: usize,
) -> Result<CudaSlice<F8E4M3>, BoxError> {
    let period = (period.min(len).max(1)).div_ceil(128 * 128) * 128 * 128;
    let normal: Vec<f32> = (0..period)
        .map(|_| {
            // Irwin-Hall: the sum of 12 uniforms, minus 6, is close to a standard normal.
            (0..12).map(|_| rng.random::<f32>()).sum::<f32>() - 6.0
        })
        .collect();
    let (host, _) = gemm_fp8::quantize_weight(&normal, period / 128, 128, 128)?;
    let src = stream.clone_htod(&host)?;
    let mut out = stream.alloc_zeros::<F8E4M3>(len)?;
    let mut done = 0;
    while done < len {
        let n = period.min(len - done);
        stream.memcpy_dtod(&src.slice(0..n), &mut out.slice_mut(done..done + n))?;
        done += n;
    }
    Ok(out)
}

/// `len` f32 scales of about `value`.
fn scales(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    len: usize,
    value: f32,
) -> Result<CudaSlice<f32>, BoxError> {
    let host: Vec<f32> = (0..len)
        .map(|_| value * rng.random_range(0.5f32..2.0))
        .collect();
    Ok(stream.clone_htod(&host)?)
}

struct Row {
    case: String,
    what: &'static str,
    ms: f64,
    tflops: f64,
    weight_gbs: f64,
    /// Bytes per weight of the method (2 bf16, 1 fp8): its weight GB/s count those.
    weight_byte: f64,
}

fn main() -> Result<(), BoxError> {
    let iters: usize = env_or("EP_BENCH_ITERS", 10);
    let rounds: usize = env_or("EP_BENCH_ROUNDS", 3);
    let warmup = Warmup::from_env();
    let dev = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let stream = cuda.cuda_stream();
    let mut rng = StdRng::seed_from_u64(7);

    // Copy bandwidth: 2 GiB device to device, bytes read + written.
    let copy_bytes = 2usize << 30;
    let src = stream.alloc_zeros::<u8>(copy_bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(copy_bytes)?;
    let copy_ms = time_ms(&stream, iters, warmup, &mut || {
        stream.memcpy_dtod(&src, &mut dst)?;
        Ok(())
    })?;
    let copy_gbs = 2.0 * copy_bytes as f64 / (copy_ms * 1e-3) / 1e9;
    drop((src, dst));
    println!(
        "device-to-device copy: {copy_ms:.3} ms for 2 GiB -> {copy_gbs:.0} GB/s (read + write)"
    );

    let w1 = randn_bf16(&dev, &[MAX_EXPERTS, 2 * INTER, HIDDEN], 0.02)?;
    let w2 = randn_bf16(&dev, &[MAX_EXPERTS, HIDDEN, INTER], 0.02)?;
    // The fp8 experts: e4m3 weights with 128 x 128 block scales.
    let q1 = random_fp8(&stream, &mut rng, MAX_EXPERTS * 2 * INTER * HIDDEN, 1 << 25)?;
    let q2 = random_fp8(&stream, &mut rng, MAX_EXPERTS * HIDDEN * INTER, 1 << 25)?;
    let s1 = scales(
        &stream,
        &mut rng,
        MAX_EXPERTS * (2 * INTER / 128) * (HIDDEN / 128),
        1e-4,
    )?;
    let s2 = scales(
        &stream,
        &mut rng,
        MAX_EXPERTS * (HIDDEN / 128) * (INTER / 128),
        1e-4,
    )?;
    let mut ws = GroupedGemmWorkspace::new(&stream, MAX_EXPERTS)?;

    let contiguous = GroupLayout::Contiguous { alignment: 1 };
    let mut cases = vec![
        Case {
            name: "contiguous 256 x 128".into(),
            experts: 256,
            layout: contiguous,
            topk_ids: balanced(4096, 256),
            tokens: 4096,
        },
        Case {
            name: "contiguous 32 x 1024".into(),
            experts: 32,
            layout: contiguous,
            topk_ids: balanced(4096, 32),
            tokens: 4096,
        },
        Case {
            name: "contiguous 8 x 4096".into(),
            experts: 8,
            layout: contiguous,
            topk_ids: balanced(4096, 8),
            tokens: 4096,
        },
    ];
    cases.push(Case {
        name: "contiguous 256 zipf (32768 rows)".into(),
        experts: 256,
        layout: contiguous,
        topk_ids: zipf(&mut rng, 4096, 256),
        tokens: 4096,
    });
    cases.push(Case {
        name: "contiguous 256 uniform (2048 tokens, ~64 rows each)".into(),
        experts: 256,
        layout: contiguous,
        topk_ids: uniform(&mut rng, 2048, 256),
        tokens: 2048,
    });
    // The layer's shapes across ranks: a rank's 128 experts at EP2 and 64 at EP4 with 4096
    // tokens per rank (about 256 and 512 rows per expert), where `GemmTiles::Auto`, deciding
    // from the permute's bound (every received row's slots), picks `Wide` at EP2 and `WideM`
    // at EP4.
    cases.push(Case {
        name: "contiguous 128 uniform (EP2 4096, ~256 rows each)".into(),
        experts: 128,
        layout: contiguous,
        topk_ids: uniform(&mut rng, 4096, 128),
        tokens: 4096,
    });
    cases.push(Case {
        name: "contiguous 64 uniform (EP4 4096, ~512 rows each)".into(),
        experts: 64,
        layout: contiguous,
        topk_ids: uniform(&mut rng, 4096, 64),
        tokens: 4096,
    });
    cases.push(Case {
        name: "masked 256, one token (8 x 1, m_max 128)".into(),
        experts: 256,
        layout: GroupLayout::Masked { m_max: 128 },
        topk_ids: balanced(1, 256),
        tokens: 1,
    });
    cases.push(Case {
        name: "masked 256 x 4 (m_max 128)".into(),
        experts: 256,
        layout: GroupLayout::Masked { m_max: 128 },
        topk_ids: balanced(128, 256),
        tokens: 128,
    });
    cases.push(Case {
        name: "masked 32 x 32 (m_max 1024)".into(),
        experts: 32,
        layout: GroupLayout::Masked { m_max: 1024 },
        topk_ids: balanced(128, 32),
        tokens: 128,
    });

    if let Ok(want) = std::env::var("EP_BENCH_CASES") {
        cases.retain(|c| want.split(',').any(|w| c.name.contains(w)));
    }
    let mut rows_out: Vec<Row> = Vec::new();
    for case in &cases {
        let e = case.experts;
        let counts = case.counts();
        let routed: usize = counts.iter().map(|&c| c as usize).sum();
        let used = counts.iter().filter(|&&c| c > 0).count();
        let flops = routed as f64 * 6.0 * HIDDEN as f64 * INTER as f64;
        let weight_bytes = used as f64 * 3.0 * (HIDDEN * INTER * 2) as f64;
        let w1e = w1.narrow(0, 0, e)?;
        let w2e = w2.narrow(0, 0, e)?;
        let rows = case.rows();

        // Inputs of every method.
        let a = randn_bf16(&dev, &[rows, HIDDEN], 1.0)?;
        let counts_dev = stream.clone_htod(&counts)?;
        let x = randn_bf16(&dev, &[routed, HIDDEN], 1.0)?;
        let (w1t, w2t) = (w1.get(0)?.t()?, w2.get(0)?.t()?);
        let xs = randn_bf16(&dev, &[case.tokens, HIDDEN], 1.0)?;
        let mut order: Vec<u32> = (0..case.topk_ids.len() as u32).collect();
        order.sort_by_key(|&i| case.topk_ids[i as usize]);
        let sorted_experts: Vec<u32> = order.iter().map(|&i| case.topk_ids[i as usize]).collect();
        let sorted_ids = Tensor::from_vec(order, case.topk_ids.len(), &dev)?;
        let expert_ids = Tensor::from_vec(sorted_experts, case.topk_ids.len(), &dev)?;
        let topk_w = Tensor::ones(case.topk_ids.len(), DType::F32, &dev)?;
        let prefill = case.tokens > 128;

        let (a_g, a_l) = a.storage_and_layout();
        let (w1_g, w1_l) = w1e.storage_and_layout();
        let (w2_g, w2_l) = w2e.storage_and_layout();
        let (a_s, w1_s, w2_s) = (
            view::<bf16>(&a_g, a_l)?,
            view::<bf16>(&w1_g, w1_l)?,
            view::<bf16>(&w2_g, w2_l)?,
        );
        let bufs = RefCell::new((
            alloc_uninit::<bf16>(&stream, rows * INTER)?,
            alloc_uninit::<bf16>(&stream, rows * HIDDEN)?,
        ));
        // The fp8 path's operands: rows with their scales, the gate_up product, act and its
        // scales.
        let aq = random_fp8(&stream, &mut rng, rows * HIDDEN, 1 << 22)?;
        let a_sc = scales(&stream, &mut rng, rows * HIDDEN / 128, 0.01)?;
        let masked = matches!(case.layout, GroupLayout::Masked { .. });
        let fp8_bufs = RefCell::new((
            alloc_uninit::<bf16>(&stream, rows * 2 * INTER)?,
            random_fp8(&stream, &mut rng, rows * INTER, 1 << 22)?,
            scales(&stream, &mut rng, rows * INTER / 128, 0.01)?,
            // The fused SwiGLU GEMV's f32 act values (masked layouts only).
            alloc_uninit::<f32>(&stream, if masked { rows * INTER } else { 4 })?,
        ));
        let (q1e, s1e) = (
            q1.slice(0..e * 2 * INTER * HIDDEN),
            s1.slice(0..e * (2 * INTER / 128) * (HIDDEN / 128)),
        );
        let (q2e, s2e) = (
            q2.slice(0..e * HIDDEN * INTER),
            s2.slice(0..e * (HIDDEN / 128) * (INTER / 128)),
        );
        let ws_cell = RefCell::new(&mut ws);
        let up = GroupedGemmShape {
            groups: e,
            rows,
            n: 2 * INTER,
            k: HIDDEN,
            layout: case.layout,
        };
        let down = GroupedGemmShape {
            groups: e,
            rows,
            n: HIDDEN,
            k: INTER,
            layout: case.layout,
        };
        let ours = |tiles: GemmTiles| {
            let (bufs, ws_cell, a_s, w1_s, w2_s, counts_dev, stream) =
                (&bufs, &ws_cell, &a_s, &w1_s, &w2_s, &counts_dev, &stream);
            move || -> Result<(), BoxError> {
                let mut b = bufs.borrow_mut();
                let (act, y) = &mut *b;
                let mut ws = ws_cell.borrow_mut();
                // gate_up with SwiGLU in its epilogue (the weights' layout does not change
                // the time: random values stand in for the blocked gate_up).
                gemm::grouped_gemm_swiglu_bf16_cuda(
                    stream, a_s, w1_s, counts_dev, &up, None, tiles, act, &mut ws,
                )?;
                gemm::grouped_gemm_bf16_cuda(
                    stream, &*act, w2_s, counts_dev, &down, tiles, y, &mut ws,
                )?;
                Ok(())
            }
        };
        let ours_fp8 = |tiles: GemmTiles, swiglu: Swiglu| {
            let (bufs, fp8_bufs, ws_cell, stream, counts_dev) =
                (&bufs, &fp8_bufs, &ws_cell, &stream, &counts_dev);
            let (aq, a_sc, q1e, s1e, q2e, s2e) = (&aq, &a_sc, &q1e, &s1e, &q2e, &s2e);
            move || -> Result<(), BoxError> {
                let mut b = bufs.borrow_mut();
                let (_, y) = &mut *b;
                let mut f = fp8_bufs.borrow_mut();
                let (h, act_q, act_s, products) = &mut *f;
                let mut ws = ws_cell.borrow_mut();
                let (a_dev, w1_dev) = (
                    DeviceFp8 {
                        q: aq,
                        scales: a_sc,
                    },
                    DeviceFp8 {
                        q: q1e,
                        scales: s1e,
                    },
                );
                // As the layer: the GEMV with SwiGLU fused, else the CUTLASS epilogue where
                // `swiglu_in_epilogue` says so, else the pass.
                let gemv_fused = tiles == GemmTiles::Gemv && swiglu == Swiglu::AsTheLayer;
                let fused = !gemv_fused && gemm_fp8::swiglu_in_epilogue(up.layout, rows, e);
                if gemv_fused {
                    gemm_fp8::grouped_gemv_swiglu_fp8_cuda(
                        stream, &a_dev, &w1_dev, counts_dev, &up, None, act_q, act_s, products,
                        &mut ws,
                    )?;
                } else if swiglu == Swiglu::Epilogue || (swiglu == Swiglu::AsTheLayer && fused) {
                    gemm_fp8::grouped_gemm_swiglu_fp8_cuda(
                        stream, &a_dev, &w1_dev, counts_dev, &up, act_q, act_s, &mut ws,
                    )?;
                } else {
                    gemm_fp8::grouped_gemm_fp8_cuda(
                        stream, &a_dev, &w1_dev, counts_dev, &up, None, tiles, h, &mut ws,
                    )?;
                }
                if swiglu == Swiglu::Pass || (swiglu == Swiglu::AsTheLayer && !fused && !gemv_fused)
                {
                    let mask = match up.layout {
                        GroupLayout::Masked { m_max } => Some((
                            counts_dev
                                as &dyn candle_core::cuda_backend::cudarc::driver::DevicePtr<i32>,
                            m_max,
                        )),
                        GroupLayout::Contiguous { .. } => None,
                    };
                    gemm_fp8::swiglu_quantize_fp8_cuda(
                        stream,
                        &*h,
                        rows,
                        INTER,
                        gemm_fp8::FP8_GATE_UP_BLOCK,
                        mask,
                        act_q,
                        act_s,
                    )?;
                }
                gemm_fp8::grouped_gemm_fp8_cuda(
                    stream,
                    &DeviceFp8 {
                        q: &*act_q,
                        scales: &*act_s,
                    },
                    &DeviceFp8 {
                        q: q2e,
                        scales: s2e,
                    },
                    counts_dev,
                    &down,
                    None,
                    tiles,
                    y,
                    &mut ws,
                )?;
                Ok(())
            }
        };
        let dense = || -> Result<(), BoxError> {
            let h = x.matmul(&w1t)?;
            let act = candle_swiglu(&h)?;
            let _y = act.matmul(&w2t)?;
            Ok(())
        };
        let candle_moe = || -> Result<(), BoxError> {
            let h = candle_nn::moe::moe_gemm(
                &xs,
                &w1e,
                &None,
                &sorted_ids,
                &expert_ids,
                TOPK,
                prefill,
            )?;
            let act = candle_swiglu(&h)?;
            let _y = candle_nn::moe::moe_gemm(
                &act,
                &w2e,
                &Some(topk_w.clone()),
                &sorted_ids,
                &expert_ids,
                TOPK,
                prefill,
            )?;
            Ok(())
        };
        type Method<'m> = (
            &'static str,
            usize,
            Box<dyn FnMut() -> Result<(), BoxError> + 'm>,
        );
        let mut methods: Vec<Method<'_>> = vec![
            ("ours (auto tiles)", iters, Box::new(ours(GemmTiles::Auto))),
            (
                "ours wide 128x256 1x2",
                iters,
                Box::new(ours(GemmTiles::Wide)),
            ),
            (
                "ours wide 128x256 2x1",
                iters,
                Box::new(ours(GemmTiles::WideM)),
            ),
            (
                "ours narrow 64x128",
                iters,
                Box::new(ours(GemmTiles::Narrow)),
            ),
            ("dense cuBLAS (candle matmul)", iters, Box::new(dense)),
            ("candle-nn moe_gemm", 3, Box::new(candle_moe)),
            (
                "ours fp8 (auto tiles)",
                iters,
                Box::new(ours_fp8(GemmTiles::Auto, Swiglu::AsTheLayer)),
            ),
            (
                "ours fp8 wide 128x128 1x2, SwiGLU epilogue",
                iters,
                Box::new(ours_fp8(GemmTiles::Wide, Swiglu::Epilogue)),
            ),
            (
                "ours fp8 wide 128x128 1x2, SwiGLU pass",
                iters,
                Box::new(ours_fp8(GemmTiles::Wide, Swiglu::Pass)),
            ),
            (
                "ours fp8 narrow 64x128, SwiGLU pass",
                iters,
                Box::new(ours_fp8(GemmTiles::Narrow, Swiglu::Pass)),
            ),
            (
                "ours fp8 GEMMs only (auto)",
                iters,
                Box::new(ours_fp8(GemmTiles::Auto, Swiglu::None)),
            ),
        ];
        if matches!(case.layout, GroupLayout::Masked { .. }) {
            methods.insert(
                4,
                (
                    "ours gemv (no tiles)",
                    iters,
                    Box::new(ours(GemmTiles::Gemv)),
                ),
            );
            methods.push((
                "ours fp8 gemv (no tiles)",
                iters,
                Box::new(ours_fp8(GemmTiles::Gemv, Swiglu::AsTheLayer)),
            ));
            methods.push((
                "ours fp8 gemv, SwiGLU pass",
                iters,
                Box::new(ours_fp8(GemmTiles::Gemv, Swiglu::Pass)),
            ));
            methods.push((
                "ours fp8 gemv GEMMs only",
                iters,
                Box::new(ours_fp8(GemmTiles::Gemv, Swiglu::None)),
            ));
        }
        if let Ok(want) = std::env::var("EP_BENCH_METHODS") {
            methods.retain(|(what, _, _)| want.split(',').any(|w| what.contains(w)));
        }
        // Rounds over the methods, so that clock and power drift spread over all of them; each
        // round starts one method later, so that no method is always timed first (the first
        // in a round measured up to 2-4 % faster than the same kernel later in it).
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); methods.len()];
        let count = methods.len();
        for round in 0..rounds {
            for j in 0..count {
                let i = (round + j) % count;
                let (what, n, f) = &mut methods[i];
                // Progress (with the time, to line it up with clocks sampled beside the run).
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                eprintln!("{now:.2} {}: {what}", case.name);
                times[i].push(time_ms(&stream, *n, warmup, f)?);
            }
        }
        for ((what, _, _), mut t) in methods.iter().zip(times) {
            t.sort_by(f64::total_cmp);
            let ms = t[t.len() / 2];
            let weight_byte = if what.contains("fp8") { 1.0 } else { 2.0 };
            rows_out.push(Row {
                case: case.name.clone(),
                what,
                ms,
                tflops: flops / (ms * 1e-3) / 1e12,
                weight_gbs: weight_bytes / 2.0 * weight_byte / (ms * 1e-3) / 1e9,
                weight_byte,
            });
        }
        println!("{} done", case.name);
    }

    let mut table = String::new();
    writeln!(
        table,
        "\nH = {HIDDEN}, I = {INTER}; weight bytes 2 per weight (bf16) or 1 (fp8); copy bandwidth {copy_gbs:.0} GB/s"
    )?;
    writeln!(
        table,
        "{:<34} {:<30} {:>9} {:>9} {:>10} {:>8}",
        "case", "what", "ms", "TFLOP/s", "weight GB/s", "of copy"
    )?;
    for r in &rows_out {
        writeln!(
            table,
            "{:<34} {:<30} {:>9.3} {:>9.1} {:>10.0} {:>7.0}%",
            r.case,
            r.what,
            r.ms,
            r.tflops,
            r.weight_gbs,
            100.0 * r.weight_gbs / copy_gbs
        )?;
    }
    print!("{table}");
    if let Ok(path) = std::env::var("EP_BENCH_OUT") {
        let mut f = std::fs::File::create(path)?;
        writeln!(f, "{{\"copy_gbs\": {copy_gbs:.1}}}")?;
        for r in &rows_out {
            writeln!(
                f,
                "{{\"case\": {:?}, \"what\": {:?}, \"ms\": {:.4}, \"tflops\": {:.2}, \"weight_gbs\": {:.1}, \"bytes_per_weight\": {}}}",
                r.case, r.what, r.ms, r.tflops, r.weight_gbs, r.weight_byte
            )?;
        }
    }
    Ok(())
}
