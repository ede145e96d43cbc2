//! GPU tests of the layer with fp8 experts: `MoeLayer` loaded from a block-scaled fp8
//! checkpoint (e4m3 weights with `weight_scale_inv`, DeepSeek-V3's release format) on one
//! CUDA device, in both modes, with and without fp8 dispatch, against a CPU reference on the
//! same fp8 weights.
//!
//! The reference: the CPU layer loaded from the same checkpoint (its experts dequantized
//! exactly, DeepSeek's `weight_dequant`), run with the routing the GPU router chose, and with
//! the activations quantized where the fp8 experts quantize them: each token's row 1 x 128
//! (the per-token cast's host twin, bit for bit the device's), the gate_up product rounded to
//! bf16 (the GEMM's output), and `act = silu(gate) * up` quantized 1 x 128 (the host twin of
//! the SwiGLU pass); products in f32. The shared experts (fp8 too, on the GPU as blocks of the
//! routed experts' width: extra groups of their GEMMs in decode steps, a grouped GEMM of their
//! own otherwise) are emulated the same way, with weight 1. Tolerance: `||got - ref|| / ||ref|| <= 2.5e-2` over the batch and
//! `<= 5e-2` per token. What is left: the fp8 tensor cores' own accumulation (about 14 bits
//! of mantissa between two promotions to f32, every 128 channels) and summation order move
//! the gate_up products by a bf16 step here and there, and an `act` value that then rounds to
//! the neighbouring e4m3 value moves by up to 1/8 of itself (3 mantissa bits): measured on an
//! H200, 0.9-1.5e-2 over the batch and up to 3.4e-2 for a token. DeepGEMM's accuracy measure
//! `1 - 2<x, y> / (<x, x> + <y, y>)` of these bounds is below 3.2e-4, under its 1e-3.
//!
//! Run on one GPU: prints one line per case, then `N passed, N failed`. A first argument
//! filters cases by name.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ep_kernels::gemm::fp8::{quantize_weight, swiglu_quantize};
use half::bf16;
use moe_layer::config::MoeConfig;
use moe_layer::ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
use moe_layer::ep_runtime::{Buffer, BufferConfig};
use moe_layer::{Mode, MoeLayer, MoeLayerOptions};

mod gpu_common;
use gpu_common::{cfg, rel, weights, R};

/// `w` as a block-scaled fp8 checkpoint holds it: every projection e4m3 with its 128 x 128
/// scales (quantized from the random weights), the router as stored.
fn fp8_checkpoint(w: &HashMap<String, Tensor>) -> R<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (name, t) in w {
        if name.ends_with("_proj.weight") {
            let (n, k) = t.dims2()?;
            let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
            let (q, s) = quantize_weight(&v, n, k, 128)?;
            out.insert(name.clone(), Tensor::from_vec(q, (n, k), &Device::Cpu)?);
            out.insert(
                format!("{name}_scale_inv"),
                Tensor::from_vec(s, (n.div_ceil(128), k.div_ceil(128)), &Device::Cpu)?,
            );
        } else {
            out.insert(name.clone(), t.clone());
        }
    }
    Ok(out)
}

struct Pair {
    gpu: MoeLayer,
    cpu: MoeLayer,
    dev: Device,
}

fn pair(
    c: &MoeConfig,
    hot: bool,
    fp8_dispatch: bool,
    shared_placement: moe_layer::SharedPlacement,
) -> R<Pair> {
    let dev = Device::new_cuda(0)?;
    let ckpt = fp8_checkpoint(&weights(c, hot)?)?;
    let on_dev = ckpt
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_device(&dev)?)))
        .collect::<R<HashMap<_, _>>>()?;
    let bcfg = BufferConfig::default().with_low_latency(64, c.hidden_size, c.n_routed_experts);
    let opts = MoeLayerOptions {
        low_latency_max_tokens: 64,
        fp8_dispatch,
        shared_placement,
        ..Default::default()
    };
    let gpu = MoeLayer::load(
        VarBuilder::from_tensors(on_dev, DType::BF16, &dev),
        c,
        Arc::new(Buffer::single(&dev, bcfg.clone())?),
        opts,
    )?;
    let cpu = MoeLayer::load(
        VarBuilder::from_tensors(ckpt, DType::F32, &Device::Cpu),
        c,
        Arc::new(Buffer::single(&Device::Cpu, bcfg)?),
        MoeLayerOptions {
            fp8_dispatch: false,
            ..opts
        },
    )?;
    if !gpu.experts().is_fp8() {
        return Err("the GPU layer did not keep its experts in fp8".into());
    }
    if cpu.experts().is_fp8() {
        return Err("the CPU layer kept fp8 experts".into());
    }
    // What each layer holds is what its configuration plans (weight_plan's rules).
    for (layer, dtype, cuda) in [(&gpu, DType::BF16, true), (&cpu, DType::F32, false)] {
        let target = moe_layer::WeightTarget {
            num_ranks: 1,
            dtype,
            cuda,
            fp8_experts: true,
        };
        let (got, planned) = (
            layer.weight_bytes(),
            moe_layer::WeightBytes::planned(c, target)?,
        );
        if got != planned {
            return Err(format!("weights of {got:?} bytes, planned {planned:?}").into());
        }
    }
    Ok(Pair { gpu, cpu, dev })
}

/// The reference of the module docs for GPU input `x`.
fn reference(p: &Pair, x: &Tensor) -> R<Tensor> {
    let routing = p.gpu.router().forward(x)?;
    let idx: Vec<Vec<i64>> = routing
        .topk_idx
        .to_device(&Device::Cpu)?
        .to_dtype(DType::I64)?
        .to_vec2()?;
    let wts: Vec<Vec<f32>> = routing.topk_weights.to_device(&Device::Cpu)?.to_vec2()?;
    let xc = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let (q, s) = per_token_cast_to_fp8(&xc.to_dtype(DType::BF16)?, false)?;
    let xq = per_token_cast_back(&q, &s, DType::F32)?;
    let (t, h) = xq.dims2()?;
    let experts = p.cpu.experts();
    let i = experts.intermediate_size();
    // Rows `ids` of the quantized tokens through `mlp` as the fp8 path computes them, scaled by
    // `weights`.
    let emulate = |mlp: &moe_layer::Mlp, ids: &Tensor, weights: Vec<f32>| -> R<Tensor> {
        let n = weights.len();
        let width = mlp.intermediate_size();
        let xs = xq.index_select(ids, 0)?;
        // The gate_up GEMM's bf16 output, then SwiGLU quantized as the device pass does.
        let hu: Vec<bf16> = xs
            .matmul(&mlp.gate_up().t()?)?
            .to_dtype(DType::BF16)?
            .flatten_all()?
            .to_vec1()?;
        let mut aq = vec![float8::F8E4M3::ZERO; n * width];
        let mut asc = vec![0f32; n * width / 128];
        swiglu_quantize(&hu, n, width, None, &mut aq, &mut asc)?;
        let act = per_token_cast_back(
            &Tensor::from_vec(aq, (n, width), &Device::Cpu)?,
            &Tensor::from_vec(asc, (n, width / 128), &Device::Cpu)?,
            DType::F32,
        )?;
        let y = act.matmul(&mlp.down_proj().t()?)?;
        Ok(y.broadcast_mul(&Tensor::from_vec(weights, (n, 1), &Device::Cpu)?)?)
    };
    let mut out = Tensor::zeros((t, h), DType::F32, &Device::Cpu)?;
    for (e, mlp) in experts.experts().iter().enumerate() {
        let mut rows = Vec::new();
        let mut weights = Vec::new();
        for (tok, (ids, ws)) in idx.iter().zip(&wts).enumerate() {
            for (&id, &w) in ids.iter().zip(ws) {
                if id == e as i64 {
                    rows.push(tok as u32);
                    weights.push(w);
                }
            }
        }
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        let ids = Tensor::from_vec(rows, n, &Device::Cpu)?;
        out = out.index_add(&ids, &emulate(mlp, &ids, weights)?, 0)?;
    }
    // The shared experts, each block of the routed experts' width on its own (the blocks'
    // outputs add up to the MLP's; each block's act is quantized on its own 128 columns).
    let shared = p.cpu.shared().ok_or("no shared expert")?;
    let si = shared.intermediate_size();
    let all = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
    for j in 0..si / i {
        let gate = shared.gate_up().narrow(0, j * i, i)?;
        let up = shared.gate_up().narrow(0, si + j * i, i)?;
        let down = shared.down_proj().narrow(1, j * i, i)?.contiguous()?;
        let block = moe_layer::Mlp::new(gate, up, down)?;
        out = (out + emulate(&block, &all, vec![1.0; t])?)?;
    }
    Ok(out)
}

fn layer_case(p: &Pair, t: usize, mode: Mode) -> R<()> {
    let h = p.gpu.router().hidden_size();
    let x = if t == 0 {
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
    let (all, worst) = rel(&y, &reference(p, &x)?)?;
    if all > 2.5e-2 || worst > 5e-2 {
        return Err(format!("relative error {all:.2e} (worst token {worst:.2e})").into());
    }
    println!("       T={t} {mode:?}: rel {all:.1e}, worst token {worst:.1e}");
    Ok(())
}

fn main() {
    let mut suite = gpu_test_suite::Suite::from_args();
    let mut run = |name: &str, f: &mut dyn FnMut() -> R<()>| suite.run(name, f);
    let two_shared = MoeConfig {
        n_shared_experts: Some(2),
        ..cfg(1024, 256, 32, 4, (4, 2))
    };
    use moe_layer::SharedPlacement::{Auto, Grouped, Overlap};
    // (name, config, hot expert, fp8 dispatch, where the shared experts run in decode steps)
    let setups = [
        (
            "h1024-i256-e32",
            cfg(1024, 256, 32, 4, (4, 2)),
            false,
            false,
            Auto,
        ),
        (
            "h1024-i256-e32-fp8-dispatch",
            cfg(1024, 256, 32, 4, (4, 2)),
            false,
            true,
            Overlap,
        ),
        (
            "two-shared-blocks-grouped",
            two_shared,
            false,
            true,
            Grouped,
        ),
        (
            "hot-expert",
            cfg(1024, 128, 16, 4, (1, 1)),
            true,
            true,
            Auto,
        ),
        (
            "ds-v3-shapes-e32",
            cfg(7168, 2048, 32, 8, (8, 4)),
            false,
            true,
            Grouped,
        ),
    ];
    for (name, c, hot, fp8, placement) in setups {
        let p = match pair(&c, hot, fp8, placement) {
            Ok(p) => p,
            Err(e) => {
                run(&format!("{name}/setup"), &mut || Err(e.to_string().into()));
                continue;
            }
        };
        for t in [0usize, 1, 129, 777] {
            run(&format!("{name}/T={t}/normal"), &mut || {
                layer_case(&p, t, Mode::Normal)
            });
            if t <= 64 {
                run(&format!("{name}/T={t}/low-latency"), &mut || {
                    layer_case(&p, t, Mode::LowLatency)
                });
            }
        }
    }
    // Bad input: an fp8 expert whose scales have the wrong shape is refused at load.
    run("bad-scales-refused-at-load", &mut || {
        let c = cfg(256, 128, 4, 2, (1, 1));
        let mut ckpt = fp8_checkpoint(&weights(&c, false)?)?;
        ckpt.insert(
            "experts.1.gate_proj.weight_scale_inv".into(),
            Tensor::ones((2, 2), DType::F32, &Device::Cpu)?,
        );
        let dev = Device::new_cuda(0)?;
        let bcfg = BufferConfig::default().with_low_latency(8, 256, 4);
        let err = MoeLayer::load(
            VarBuilder::from_tensors(ckpt, DType::BF16, &dev),
            &c,
            Arc::new(Buffer::single(&dev, bcfg)?),
            MoeLayerOptions {
                low_latency_max_tokens: 8,
                ..Default::default()
            },
        )
        .err()
        .ok_or("accepted")?
        .to_string();
        if !err.contains("experts.1.gate_proj.weight_scale_inv") || !err.contains("[2, 2]") {
            return Err(format!("error does not name the tensor and shape: {err}").into());
        }
        Ok(())
    });
    suite.finish();
}
