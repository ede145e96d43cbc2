//! GPU tests of the layer with fp8 experts: `MoeLayer` loaded from a block-scaled fp8
//! checkpoint (e4m3 weights with `weight_scale_inv`, DeepSeek-V3's release format) on one
//! CUDA device, in both modes, with and without fp8 dispatch, against a CPU reference on the
//! same fp8 weights that quantizes the activations where the fp8 path does, within
//! `gpu_common::fp8::TOLERANCE` (the reference and why that tolerance: `gpu_common/fp8.rs`).
//! The shared experts are fp8 too (on the GPU as blocks of the routed experts' width: extra
//! groups of their GEMMs in decode steps, a grouped GEMM of their own otherwise).
//!
//! Run on one GPU: prints one line per case, then `N passed, N failed`. A first argument
//! filters cases by name.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use moe_layer::config::MoeConfig;
use moe_layer::ep_runtime::{Buffer, BufferConfig};
use moe_layer::{Mode, MoeLayer, MoeLayerOptions};

mod gpu_common;
use gpu_common::fp8::{checkpoint as fp8_checkpoint, reference as fp8_reference, within};
use gpu_common::{cfg, rel, weights, R};

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
            redundant_experts: 0,
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
    let (all, worst) = rel(&y, &fp8_reference(&p.gpu, &p.cpu, &x)?)?;
    if !within(t, all, worst) {
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
