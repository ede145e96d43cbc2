//! `bench_fp8_linear`: the dense projections of DeepSeek-V3 outside the experts (attention's
//! `q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `o_proj`; a dense layer's MLP) on their
//! block-scaled fp8 weights (`moe_layer::Fp8Linear` / `Fp8Mlp`: the rows' 1 x 128 cast and the
//! experts' fp8 GEMM with one group) against the same projections in bf16 on the dequantized
//! weights (candle's `Linear`, cuBLAS), from one row (a decode token) to 4096 (prefill), on one
//! GPU. Then MLA's absorbed `kv_b_proj` (`Fp8BatchedLinear`, a group a head: the query's
//! `q_nope · W_UK` and the latent outputs through `W_UV`) against candle's bf16 batched matmuls
//! (cuBLAS) as the example runs them, from one token to 4096.
//!
//! Each figure is the time of one call inside a CUDA graph of 20 back-to-back calls (as a
//! captured decode step runs them: no launch gaps), the median of `EP_BENCH_ITERS` (default 10)
//! replays after warm-up; the calls cycle through copies of the weights that together exceed
//! the L2 cache (a model's layers each read their own weights from DRAM). The fp8 rows time every kernel the layer can run (the default pick,
//! the GEMV up to 8 rows, the masked 64 x 128 tiles, both contiguous tile sets); the floor is
//! the weight bytes over the GPU's device-to-device copy bandwidth. Prints a table; writes JSON
//! lines to `$EP_BENCH_OUT` if set. `scripts/gpu/anchors/fp8_linear.py` times PyTorch's bf16
//! `F.linear` and `torch._scaled_mm` on the same cases (run it in the same device command).
//! `EP_BENCH_CASES` (comma-separated parts of case names, e.g. `kv_b`) runs only those cases.

#[path = "layer_common/timing.rs"]
#[allow(dead_code)]
mod timing;

use std::io::Write as _;

use candle_core::{DType, Device, Module, Tensor};
use moe_layer::ep_kernels::gemm::GemmTiles;
use moe_layer::ep_runtime::graph::{capture, warm_up};
use moe_layer::fp8::Fp8Weight;
use moe_layer::{Fp8BatchedLinear, Fp8Linear, Fp8Mlp};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Calls per captured graph.
const CALLS: usize = 20;

/// A projection of DeepSeek-V3: name, `[n, k]`.
const PROJECTIONS: [(&str, usize, usize); 4] = [
    ("q_a_proj", 1536, 7168),
    ("q_b_proj", 24576, 1536),
    ("kv_a_proj_with_mqa", 576, 7168),
    ("o_proj", 7168, 16384),
];

/// DeepSeek-V3's dense MLP (the first three layers): hidden, inner.
const DENSE_MLP: (usize, usize) = (7168, 18432);

const ROWS: [usize; 8] = [1, 4, 8, 16, 64, 256, 1024, 4096];

/// DeepSeek-V3's MLA: heads, `qk_nope_head_dim`, `v_head_dim`, `kv_lora_rank`; and
/// DeepSeek-V2-Lite's heads (the same widths).
const MLA: (usize, usize, usize, usize) = (128, 128, 128, 512);
const MLA_LITE_HEADS: usize = 16;

/// The kernels a row of the table times besides the default pick.
const KERNELS: [GemmTiles; 4] = [
    GemmTiles::Gemv,
    GemmTiles::Narrow,
    GemmTiles::Wide,
    GemmTiles::WideM,
];

/// Bytes of weights a graph's calls cycle through at least (when one weight is smaller): more
/// than the L2 cache, so that every call reads its weights from DRAM, as a model's layers do.
const CYCLE_BYTES: usize = 256 << 20;

/// `copies` random fp8 weights `[n, k]` on `dev` (the same values: a model's layers' weights
/// at different addresses) and their bf16 dequantizations.
fn weights(
    dev: &Device,
    n: usize,
    k: usize,
    copies: usize,
) -> Result<Vec<(Fp8Weight, Tensor)>, BoxError> {
    let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?;
    let v: Vec<f32> = w.flatten_all()?.to_vec1()?;
    // Quantized on the host (the host twin), as a checkpoint stores it.
    let (q, s) = moe_layer::ep_kernels::gemm::fp8::quantize_weight(&v, n, k, 128)?;
    let q = Tensor::from_vec(q, (n, k), &Device::Cpu)?;
    let s = Tensor::from_vec(s, (n.div_ceil(128), k.div_ceil(128)), &Device::Cpu)?;
    (0..copies)
        .map(|_| {
            let fp8 = Fp8Weight::new("bench_proj", q.to_device(dev)?, s.to_device(dev)?)?;
            let deq = fp8.dequantize(DType::BF16)?;
            Ok((fp8, deq))
        })
        .collect()
}

/// How many copies of a weight of `fp8_bytes` a graph cycles through ([`CYCLE_BYTES`]).
fn copies_for(fp8_bytes: usize) -> usize {
    CYCLE_BYTES.div_ceil(fp8_bytes.max(1)).clamp(1, CALLS)
}

/// Microseconds per call of `f(i)` (call `i` of the graph) inside a graph of [`CALLS`] calls
/// (median of `iters` replays).
fn graph_us(
    dev: &Device,
    iters: usize,
    f: &dyn Fn(usize) -> Result<Tensor, BoxError>,
) -> Result<f64, BoxError> {
    let run = || -> moe_layer::ep_runtime::Result<Vec<Tensor>> {
        (0..CALLS)
            .map(|i| f(i).map_err(|e| moe_layer::ep_runtime::Error::invalid("bench", e, "")))
            .collect()
    };
    warm_up(dev, run)?;
    let (graph, _out) = capture(dev, run)?;
    let stream = graph.stream().clone();
    let mut launch = || -> Result<(), BoxError> { Ok(graph.launch()?) };
    let ms = timing::time_ms(&stream, iters, &mut launch)?;
    Ok(ms * 1e3 / CALLS as f64)
}

/// Microseconds per call of `f(i, tiles)` for each of [`KERNELS`] (NaN where not timed: the
/// GEMV re-reads the weights every 8 rows, so it is timed up to 64).
fn kernel_us(
    dev: &Device,
    iters: usize,
    rows: usize,
    f: &dyn Fn(usize, GemmTiles) -> Result<Tensor, BoxError>,
) -> Result<[f64; 4], BoxError> {
    let mut out = [f64::NAN; 4];
    for (slot, tiles) in KERNELS.into_iter().enumerate() {
        if tiles == GemmTiles::Gemv && rows > 64 {
            continue;
        }
        out[slot] = graph_us(dev, iters, &|i| f(i, tiles))?;
    }
    Ok(out)
}

/// Device-to-device copy bandwidth (GB/s, bytes read + written) of 1 GiB copies.
fn copy_gbs(dev: &Device) -> Result<f64, BoxError> {
    let stream = timing::stream_of(dev);
    let bytes = 1usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    let mut copy = || -> Result<(), BoxError> { Ok(stream.memcpy_dtod(&src, &mut dst)?) };
    let ms = timing::time_ms(&stream, 5, &mut copy)?;
    Ok(2.0 * bytes as f64 / (ms * 1e6))
}

fn main() -> Result<(), BoxError> {
    let dev = Device::new_cuda(0)?;
    let iters: usize = std::env::var("EP_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mut out = std::env::var("EP_BENCH_OUT")
        .ok()
        .map(std::fs::File::create)
        .transpose()?;
    let copy = copy_gbs(&dev)?;
    println!("device-to-device copy {copy:.0} GB/s; one call in a graph of {CALLS}, us");
    print_header();
    let mut cases: Vec<(String, usize, usize)> = PROJECTIONS
        .iter()
        .map(|&(name, n, k)| (name.to_string(), n, k))
        .collect();
    cases.push(("dense_mlp".to_string(), DENSE_MLP.0, DENSE_MLP.1));
    cases.retain(|(name, _, _)| wanted(name));
    for (name, n, k) in cases {
        let mlp = name == "dense_mlp";
        // The MLP: gate and up `[I, H]`, down `[H, I]`; `n` = H, `k` = I here.
        let copies = copies_for(if mlp { 3 * n * k } else { n * k });
        let mut fp8_lins = Vec::new();
        let mut bf16_lins = Vec::new();
        let mut fp8_mlps = Vec::new();
        let mut bf16_mlps = Vec::new();
        if mlp {
            let (h, i) = (n, k);
            let (g, u, d) = (
                weights(&dev, i, h, copies)?,
                weights(&dev, i, h, copies)?,
                weights(&dev, h, i, copies)?,
            );
            for ((g, u), d) in g.into_iter().zip(u).zip(d) {
                fp8_mlps.push(Fp8Mlp::new(&g.0, &u.0, d.0)?);
                bf16_mlps.push(moe_layer::Mlp::new(g.1, u.1, d.1)?);
            }
        } else {
            for (w, deq) in weights(&dev, n, k, copies)? {
                fp8_lins.push(Fp8Linear::new(w, None)?);
                bf16_lins.push(candle_nn::Linear::new(deq, None));
            }
        }
        let in_k = if mlp { n } else { k };
        let weight_values = if mlp { 3 * n * k } else { n * k };
        for rows in ROWS {
            let x = Tensor::randn(0f32, 1.0, (rows, in_k), &dev)?.to_dtype(DType::BF16)?;
            let bf16_us = graph_us(&dev, iters, &|i| {
                Ok(if mlp {
                    bf16_mlps[i % copies].forward(&x)?
                } else {
                    bf16_lins[i % copies].forward(&x)?
                })
            })?;
            let fp8_us = graph_us(&dev, iters, &|i| {
                Ok(if mlp {
                    fp8_mlps[i % copies].forward(&x)?
                } else {
                    fp8_lins[i % copies].forward(&x)?
                })
            })?;
            let kernels = if mlp {
                [f64::NAN; 4]
            } else {
                kernel_us(&dev, iters, rows, &|i, tiles| {
                    Ok(fp8_lins[i % copies].forward_tiles(&x, tiles)?)
                })?
            };
            let row = Row {
                case: &name,
                n,
                k,
                rows,
                bf16_us,
                fp8_us,
                kernels,
                weight_values,
            };
            row.report(copy, out.as_mut())?;
        }
    }
    if wanted("kv_b_uk") || wanted("kv_b_uv") {
        bench_kv_b(&dev, iters, copy, out.as_mut())?;
    }
    Ok(())
}

/// Whether `EP_BENCH_CASES` (unset: every case) names a part of `case`.
fn wanted(case: &str) -> bool {
    match std::env::var("EP_BENCH_CASES") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .any(|part| !part.trim().is_empty() && case.contains(part.trim())),
        _ => true,
    }
}

fn print_header() {
    println!(
        "{:<22} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6}",
        "case",
        "rows",
        "bf16",
        "fp8",
        "gemv",
        "narrow",
        "wide",
        "wide-m",
        "floor16",
        "floor8",
        "fp8/bf"
    );
}

/// One line of the table (and of the JSON).
struct Row<'a> {
    case: &'a str,
    n: usize,
    k: usize,
    /// Rows of the call (per head for the batched maps).
    rows: usize,
    bf16_us: f64,
    fp8_us: f64,
    /// [`KERNELS`] in order, NaN where not timed.
    kernels: [f64; 4],
    /// Weight values a call reads.
    weight_values: usize,
}

impl Row<'_> {
    fn report(&self, copy: f64, out: Option<&mut std::fs::File>) -> Result<(), BoxError> {
        // The weight bytes at the copy bandwidth (as `bench_grouped_gemm`'s "of copy").
        let floor = |bytes: usize| bytes as f64 / copy / 1e3;
        let (f16, f8) = (floor(2 * self.weight_values), floor(self.weight_values));
        let (name, n, k, rows, kernels) = (self.case, self.n, self.k, self.rows, self.kernels);
        println!(
            "{:<22} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6.2}",
            format!("{name} [{n}, {k}]"),
            rows,
            self.bf16_us,
            self.fp8_us,
            kernels[0],
            kernels[1],
            kernels[2],
            kernels[3],
            f16,
            f8,
            self.fp8_us / self.bf16_us
        );
        if let Some(f) = out {
            let num = |v: f64| {
                if v.is_nan() {
                    "null".to_string()
                } else {
                    format!("{v:.2}")
                }
            };
            writeln!(
                f,
                "{{\"bench\":\"fp8_linear\",\"case\":\"{name}\",\"n\":{n},\"k\":{k},\"rows\":{rows},\"bf16_us\":{:.2},\"fp8_us\":{:.2},\"gemv_us\":{},\"narrow_us\":{},\"wide_us\":{},\"wide_m_us\":{},\"floor_bf16_us\":{:.2},\"floor_fp8_us\":{:.2},\"copy_gbs\":{copy:.0}}}",
                self.bf16_us,
                self.fp8_us,
                num(kernels[0]),
                num(kernels[1]),
                num(kernels[2]),
                num(kernels[3]),
                f16,
                f8
            )?;
        }
        Ok(())
    }
}

/// MLA's absorbed `kv_b_proj` of DeepSeek-V3 ([`MLA`]; `_h16`: V2-Lite's heads): `kv_b_uk` multiplies each head's
/// `q_nope` (`[heads, tokens, nope]`) into the latent space (fp8: W_UK transposed per head,
/// `[heads, rank, nope]`; bf16: `q_nope.matmul(W_UK)` as the example), `kv_b_uv` each head's
/// latent output (`[heads, tokens, rank]`) into values (fp8: W_UV as stored; bf16: matmul by
/// W_UV transposed). Rows are tokens (each head's).
fn bench_kv_b(
    dev: &Device,
    iters: usize,
    copy: f64,
    mut out: Option<&mut std::fs::File>,
) -> Result<(), BoxError> {
    for heads in [MLA.0, MLA_LITE_HEADS] {
        bench_kv_b_heads(dev, iters, copy, heads, out.as_deref_mut())?;
    }
    Ok(())
}

/// [`bench_kv_b`] with `heads` heads.
fn bench_kv_b_heads(
    dev: &Device,
    iters: usize,
    copy: f64,
    heads: usize,
    mut out: Option<&mut std::fs::File>,
) -> Result<(), BoxError> {
    let (_, nope, v, rank) = MLA;
    let suffix = if heads == MLA.0 {
        String::new()
    } else {
        format!("_h{heads}")
    };
    let copies = copies_for(heads * nope * rank);
    let mut uk = Vec::new();
    let mut uv = Vec::new();
    for (w, deq) in weights(dev, heads * (nope + v), rank, copies)? {
        let per_head = deq.reshape((heads, nope + v, rank))?;
        uk.push((
            Fp8BatchedLinear::from_row_blocks(&w, heads, 0, nope, true)?,
            per_head.narrow(1, 0, nope)?.contiguous()?,
        ));
        uv.push((
            Fp8BatchedLinear::from_row_blocks(&w, heads, nope, v, false)?,
            per_head.narrow(1, nope, v)?.transpose(1, 2)?.contiguous()?,
        ));
    }
    for (name, maps) in [("kv_b_uk", &uk), ("kv_b_uv", &uv)] {
        let name = format!("{name}{suffix}");
        if !wanted(&name) {
            continue;
        }
        let (_, n, k) = maps[0].0.dims();
        for rows in ROWS {
            let x = Tensor::randn(0f32, 1.0, (heads, rows, k), dev)?.to_dtype(DType::BF16)?;
            let bf16_us = graph_us(dev, iters, &|i| Ok(x.matmul(&maps[i % copies].1)?))?;
            let fp8_us = graph_us(dev, iters, &|i| Ok(maps[i % copies].0.forward(&x)?))?;
            let kernels = kernel_us(dev, iters, rows, &|i, tiles| {
                Ok(maps[i % copies].0.forward_tiles(&x, tiles)?)
            })?;
            let row = Row {
                case: &name,
                n,
                k,
                rows,
                bf16_us,
                fp8_us,
                kernels,
                weight_values: heads * n * k,
            };
            row.report(copy, out.as_deref_mut())?;
        }
    }
    Ok(())
}
