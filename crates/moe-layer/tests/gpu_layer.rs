//! GPU tests of the layer a user calls: `MoeLayer` on one CUDA device (a one-rank CUDA buffer)
//! against the CPU reference, in both modes, and a captured decode step against eager runs.
//!
//! The reference is the CPU `Experts` (f32, on the bf16-rounded weights) run with the routing
//! the GPU router chose (the router is tested bit for bit against its host twin in
//! `ep-kernels`' `gpu_expert_path`; near-ties in f32 scores computed by two backends could
//! otherwise pick different experts), plus the shared experts. Tolerance: `||got - ref|| /
//! ||ref|| <= 1e-2` over the batch and `<= 3e-2` per token (bf16 activations between the
//! GEMMs and in the combine). Captured replays must equal eager runs within 1e-3 relative on
//! fresh inputs every step.
//!
//! Run on one GPU: prints one line per case, then `N passed, N failed`. A first argument
//! filters cases by name.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use moe_layer::config::MoeConfig;
use moe_layer::ep_runtime::{graph, Buffer, BufferConfig};
use moe_layer::{Mode, MoeLayer, MoeLayerOptions, SharedPlacement};

mod gpu_common;
use gpu_common::{cfg, on_device, rel, weights, R};

/// The GPU layer (bf16, one-rank CUDA buffer) and the CPU reference layer (f32) over the same
/// weights.
struct Pair {
    gpu: MoeLayer,
    cpu: MoeLayer,
    dev: Device,
}

fn pair(
    c: &MoeConfig,
    hot: bool,
    ll_tokens: usize,
    fp8: bool,
    shared_placement: SharedPlacement,
) -> R<Pair> {
    let dev = Device::new_cuda(0)?;
    let w = weights(c, hot)?;
    let to_dev = on_device(&w, &dev)?;
    let bcfg =
        BufferConfig::default().with_low_latency(ll_tokens, c.hidden_size, c.n_routed_experts);
    let opts = MoeLayerOptions {
        mode: Mode::Auto,
        low_latency_max_tokens: ll_tokens,
        fp8_dispatch: fp8,
        expert_alignment: 1,
        shared_placement,
        low_latency_tiles: None,
        low_latency_reduction: moe_layer::ep_runtime::Reduction::PerRank,
        two_batch_overlap: false,
        prefill_in_low_latency_chunks: false,
        shared_before_dispatch: false,
        expert_groups: 1,
        normal_gemm_grid: None,
        normal_max_tokens_per_rank: None,
    };
    let gbuf = Arc::new(Buffer::single(&dev, bcfg.clone())?);
    let gpu = MoeLayer::load(
        VarBuilder::from_tensors(to_dev, DType::BF16, &dev),
        c,
        gbuf,
        opts,
    )?;
    let cbuf = Arc::new(Buffer::single(&Device::Cpu, bcfg)?);
    let cpu_opts = MoeLayerOptions {
        fp8_dispatch: false,
        ..opts
    };
    let cpu = MoeLayer::load(
        VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
        c,
        cbuf,
        cpu_opts,
    )?;
    if !gpu.experts().uses_grouped_gemm() {
        return Err("the GPU layer does not use the grouped GEMMs".into());
    }
    // `Grouped` places the shared experts in the grouped GEMMs (their inner width is a
    // multiple of the routed experts' in every setup here); `Auto` at one rank (every setup
    // here) in steps of up to 64 tokens.
    for tokens in [1, 2, 3, 64, 65] {
        let grouped = match shared_placement {
            SharedPlacement::Grouped => true,
            SharedPlacement::Auto => tokens <= moe_layer::SHARED_GROUPED_MAX_ROWS_ONE_RANK,
            SharedPlacement::Overlap => false,
        };
        if gpu.shared_in_grouped_gemm(tokens) != grouped {
            return Err(format!(
                "{shared_placement:?}, {tokens} tokens: shared experts in the grouped GEMMs = {}, want {grouped}",
                gpu.shared_in_grouped_gemm(tokens)
            )
            .into());
        }
    }
    Ok(Pair { gpu, cpu, dev })
}

/// The reference output for GPU input `x` (`gpu_common::reference`).
fn reference(p: &Pair, x: &Tensor) -> R<Tensor> {
    gpu_common::reference(&p.gpu, &p.cpu, x)
}

fn layer_case(p: &Pair, t: usize, mode: Mode) -> R<()> {
    let h = p.gpu.router().hidden_size();
    let x = if t == 0 {
        // CUDA refuses zero-byte allocations: an empty view of a real tensor.
        Tensor::zeros((1, h), DType::BF16, &p.dev)?.narrow(0, 0, 0)?
    } else {
        Tensor::randn(0f32, 1.0, (t, h), &p.dev)?.to_dtype(DType::BF16)?
    };
    let y = p.gpu.forward_with_mode(&x, mode)?;
    if y.dims() != [t, h] {
        return Err(format!("output shape {:?}", y.dims()).into());
    }
    if t == 0 {
        return Ok(());
    }
    let want = reference(p, &x)?;
    let (all, worst) = rel(&y, &want)?;
    if all > 1e-2 || worst > 3e-2 {
        return Err(format!("relative error {all:.2e} (worst token {worst:.2e})").into());
    }
    println!("       T={t} {mode:?}: rel {all:.1e}, worst token {worst:.1e}");
    Ok(())
}

/// Normal mode at one rank reads nothing back to the host (no dispatch, no count): the step
/// captures as a CUDA graph (a synchronisation inside would fail the capture), and replays on
/// new inputs equal eager runs.
fn captured_normal_case(p: &Pair, t: usize) -> R<()> {
    let h = p.gpu.router().hidden_size();
    let x = Tensor::randn(0f32, 1.0, (t, h), &p.dev)?.to_dtype(DType::BF16)?;
    let forward = || {
        p.gpu
            .forward_with_mode(&x, Mode::Normal)
            .map_err(|e| moe_layer::ep_runtime::Error::Unsupported(e.to_string()))
    };
    graph::warm_up(&p.dev, forward)?;
    let (g, y) = graph::capture(&p.dev, forward)?;
    for step in 0..3 {
        let fresh =
            Tensor::randn(0f32, 1.0 + step as f32 * 0.2, (t, h), &p.dev)?.to_dtype(DType::BF16)?;
        x.slice_set(&fresh, 0, 0)?;
        g.launch()?;
        let eager = p.gpu.forward_with_mode(&x, Mode::Normal)?;
        let (all, worst) = rel(&y, &eager)?;
        if all > 1e-3 || worst > 1e-3 {
            return Err(format!(
                "step {step}: replay differs from eager by {all:.2e} (worst {worst:.2e})"
            )
            .into());
        }
    }
    let (r, _) = rel(&y, &reference(p, &x)?)?;
    if r > 1e-2 {
        return Err(format!("replay differs from the reference by {r:.2e}").into());
    }
    Ok(())
}

fn graph_case(p: &Pair, t: usize, steps: usize) -> R<()> {
    let h = p.gpu.router().hidden_size();
    let g = p.gpu.capture_decode(t, DType::BF16)?;
    for step in 0..steps {
        let x =
            Tensor::randn(0f32, 1.0 + step as f32 * 0.1, (t, h), &p.dev)?.to_dtype(DType::BF16)?;
        let replayed = g.replay(&x)?;
        let eager = p.gpu.forward_with_mode(&x, Mode::LowLatency)?;
        let (all, worst) = rel(&replayed, &eager)?;
        if all > 1e-3 || worst > 1e-3 {
            return Err(format!(
                "step {step}: replay differs from eager by {all:.2e} (worst {worst:.2e})"
            )
            .into());
        }
        if step == steps - 1 {
            let (r, _) = rel(&replayed, &reference(p, &x)?)?;
            if r > 1e-2 {
                return Err(
                    format!("step {step}: replay differs from the reference by {r:.2e}").into(),
                );
            }
        }
    }
    p.gpu.buffer().low_latency_check()?;
    Ok(())
}

/// `forward_decode` (cached captured steps, padded to powers of two) against eager runs, over
/// changing token counts (each size captured on first use, then replayed with stale padding).
fn decode_cache_case(p: &Pair) -> R<()> {
    let h = p.gpu.router().hidden_size();
    for (step, t) in [3usize, 1, 16, 3, 64, 5, 16, 1].into_iter().enumerate() {
        let x = Tensor::randn(0f32, 1.0, (t, h), &p.dev)?.to_dtype(DType::BF16)?;
        let got = p.gpu.forward_decode(&x)?;
        let eager = p.gpu.forward_with_mode(&x, Mode::LowLatency)?;
        let (all, worst) = rel(&got, &eager)?;
        if got.dims() != [t, h] || all > 1e-3 || worst > 1e-3 {
            return Err(format!(
                "step {step} (T={t}): {:?} differs from eager by {all:.2e} (worst {worst:.2e})",
                got.dims()
            )
            .into());
        }
    }
    Ok(())
}

fn main() {
    let filter = std::env::args().nth(1);
    let mut suite = gpu_test_suite::Suite::from_args();
    let mut run = |name: &str, f: &mut dyn FnMut() -> R<()>| suite.run(name, f);
    let two_shared = MoeConfig {
        n_shared_experts: Some(2),
        ..cfg(1024, 128, 32, 4, (4, 2))
    };
    // (name, config, hot expert, fp8 dispatch, shared placement); hidden sizes that are not
    // whole 128-channel groups travel zero-padded in low-latency mode.
    let (overlap, grouped, auto) = (
        SharedPlacement::Overlap,
        SharedPlacement::Grouped,
        SharedPlacement::Auto,
    );
    let setups: Vec<(&str, MoeConfig, bool, bool, SharedPlacement)> = vec![
        (
            "h1024-e32-fp8",
            cfg(1024, 128, 32, 4, (4, 2)),
            false,
            true,
            grouped,
        ),
        (
            "h1024-e32-bf16",
            cfg(1024, 128, 32, 4, (4, 2)),
            false,
            false,
            overlap,
        ),
        (
            "h1000-not-multiple-of-128",
            cfg(1000, 200, 16, 4, (4, 2)),
            false,
            false,
            auto,
        ),
        (
            "gpt-oss-h2880",
            cfg(2880, 2880, 32, 4, (1, 1)),
            false,
            false,
            auto,
        ),
        ("hot-expert", cfg(512, 64, 16, 4, (1, 1)), true, false, auto),
        (
            "shared-auto-bf16",
            cfg(1024, 128, 32, 4, (4, 2)),
            false,
            false,
            auto,
        ),
        (
            "ds-v3-shapes-e32",
            cfg(7168, 2048, 32, 8, (8, 4)),
            false,
            true,
            grouped,
        ),
        (
            "shared-grouped-bf16",
            cfg(1024, 128, 32, 4, (4, 2)),
            false,
            false,
            grouped,
        ),
        (
            "two-shared-blocks-grouped",
            two_shared,
            false,
            true,
            SharedPlacement::Grouped,
        ),
    ];
    for (name, c, hot, fp8, placement) in setups {
        if filter
            .as_deref()
            .is_some_and(|f| !f.starts_with(name) && !name.contains(f))
        {
            continue;
        }
        let p = match pair(&c, hot, 64, fp8, placement) {
            Ok(p) => p,
            Err(e) => {
                run(&format!("{name}/setup"), &mut || Err(e.to_string().into()));
                continue;
            }
        };
        for t in [0usize, 1, 300] {
            run(&format!("{name}/normal/T={t}"), &mut || {
                layer_case(&p, t, Mode::Normal)
            });
        }
        if !fp8 {
            run(&format!("{name}/normal/captured"), &mut || {
                captured_normal_case(&p, 300)
            });
        }
        for t in [0usize, 1, 2, 7, 64] {
            run(&format!("{name}/low-latency/T={t}"), &mut || {
                layer_case(&p, t, Mode::LowLatency)
            });
        }
        run(&format!("{name}/auto/T=65"), &mut || {
            layer_case(&p, 65, Mode::Auto)
        });
        run(&format!("{name}/graph/T=16x8-steps"), &mut || {
            graph_case(&p, 16, 8)
        });
        run(&format!("{name}/graph/forward-decode-cache"), &mut || {
            decode_cache_case(&p)
        });
    }
    suite.finish();
}
