//! GPU tests of the layer with fp8 experts: `MoeLayer` loaded from a block-scaled fp8
//! checkpoint (e4m3 weights with `weight_scale_inv`, DeepSeek-V3's release format) on one
//! CUDA device, in both modes, with and without fp8 dispatch, against a CPU reference on the
//! same fp8 weights that quantizes the activations where the fp8 path does, within
//! `gpu_common::fp8::TOLERANCE` (the reference and why that tolerance: `gpu_common/fp8.rs`).
//! The shared experts are fp8 too (on the GPU as blocks of the routed experts' width: extra
//! groups of their GEMMs in decode steps, a grouped GEMM of their own otherwise).
//!
//! The dense fp8 layers (`Fp8Linear`, `Fp8Mlp`: attention projections and dense MLPs of an
//! fp8 checkpoint) equal their host twins on the same weights and rows, with every kernel the
//! GPU path may run (the GEMV, the masked tiles, both contiguous tile sets), within the fp8
//! GEMMs' tolerance (`||got - ref|| / ||ref|| <= 1e-2`, every element within
//! `2e-2 * max|ref|`: f32 accumulation in another order, bf16 out; the MLP within the layer's
//! batch bound).
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
use gpu_common::fp8::{
    checkpoint as fp8_checkpoint, reference as fp8_reference, within, TOLERANCE,
};
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
    dense_cases(&mut run);
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

/// A random block-scaled fp8 weight `[n, k]` on `dev`.
fn dense_weight(n: usize, k: usize, dev: &Device) -> R<moe_layer::fp8::Fp8Weight> {
    let w = Tensor::randn(0f32, 0.05, (n, k), &Device::Cpu)?;
    let ckpt = fp8_checkpoint(&HashMap::from([("p_proj.weight".to_string(), w)]))?;
    Ok(moe_layer::fp8::Fp8Weight::new(
        "p_proj",
        ckpt["p_proj.weight"].to_device(dev)?,
        ckpt["p_proj.weight_scale_inv"].to_device(dev)?,
    )?)
}

/// `got` (device) against `want` (host twin): every element within `2e-2 * max|ref|`, and
/// `||got - ref|| / ||ref|| <= bound`.
fn close(got: &Tensor, want: &Tensor, bound: f32) -> R<String> {
    let g = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let w = want.to_dtype(DType::F32)?;
    if g.dims() != w.dims() {
        return Err(format!("shape {:?}, want {:?}", g.dims(), w.dims()).into());
    }
    let max_ref = w.abs()?.max_all()?.to_scalar::<f32>()?;
    let worst = (&g - &w)?.abs()?.max_all()?.to_scalar::<f32>()?;
    if !worst.is_finite() || worst > 2e-2 * max_ref + 1e-6 {
        return Err(format!("element off by {worst:.3e} (max |ref| {max_ref:.3e})").into());
    }
    let num = (&g - &w)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
    let den = w.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
    let rel = num / den.max(1e-30);
    if rel > bound {
        return Err(format!("relative error {rel:.2e} > {bound:.0e}").into());
    }
    Ok(format!("rel {rel:.1e}"))
}

/// Runs one named case.
type RunCase<'a> = dyn FnMut(&str, &mut dyn FnMut() -> R<()>) + 'a;

/// The dense fp8 layers on the GPU against their host twins.
fn dense_cases(run: &mut RunCase<'_>) {
    use moe_layer::ep_kernels::gemm::GemmTiles;
    use moe_layer::{Fp8BatchedLinear, Fp8Linear, Fp8Mlp};
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            run("dense/setup", &mut || Err(e.to_string().into()));
            return;
        }
    };
    // (name, n, k, bias): DeepSeek-V3's kv_a_proj_with_mqa (a partial scale block along n),
    // q_a_proj, and a q_b_proj / o_proj sized down.
    for (name, n, k, bias) in [
        ("kv_a-576x7168", 576, 7168, false),
        ("q_a-1536x7168-bias", 1536, 7168, true),
        ("4096x1536", 4096, 1536, false),
        ("1024x4096", 1024, 4096, false),
    ] {
        let lins = (|| -> R<(Fp8Linear, Fp8Linear)> {
            let w = dense_weight(n, k, &dev)?;
            let b = bias
                .then(|| Tensor::randn(0f32, 1.0, n, &Device::Cpu))
                .transpose()?;
            let host_w = moe_layer::fp8::Fp8Weight::new(
                "p_proj",
                w.q().to_device(&Device::Cpu)?,
                w.scale().to_device(&Device::Cpu)?,
            )?;
            let gpu_b = b.as_ref().map(|b| b.to_device(&dev)).transpose()?;
            Ok((Fp8Linear::new(w, gpu_b)?, Fp8Linear::new(host_w, b)?))
        })();
        let (gpu, cpu) = match lins {
            Ok(p) => p,
            Err(e) => {
                run(&format!("dense/{name}/setup"), &mut || {
                    Err(e.to_string().into())
                });
                continue;
            }
        };
        for rows in [1usize, 5, 8, 9, 64, 300] {
            let x = match Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu) {
                Ok(x) => x,
                Err(e) => {
                    run(&format!("dense/{name}/rows={rows}"), &mut || {
                        Err(e.to_string().into())
                    });
                    continue;
                }
            };
            let mut kernels = vec![None, Some(GemmTiles::Narrow), Some(GemmTiles::Wide)];
            if rows <= 8 {
                kernels.push(Some(GemmTiles::Gemv));
            }
            if rows >= 64 {
                kernels.push(Some(GemmTiles::WideM));
            }
            for tiles in kernels {
                let label = tiles.map_or("default".to_string(), |t| format!("{t:?}"));
                run(&format!("dense/{name}/rows={rows}/{label}"), &mut || {
                    let want = cpu.forward(&x)?;
                    let xd = x.to_device(&dev)?.to_dtype(DType::BF16)?;
                    let got = match tiles {
                        None => gpu.forward(&xd)?,
                        Some(t) => gpu.forward_tiles(&xd, t)?,
                    };
                    if got.dtype() != DType::BF16 {
                        return Err(format!("output dtype {:?}", got.dtype()).into());
                    }
                    println!("       {}", close(&got, &want, 1e-2)?);
                    Ok(())
                });
            }
        }
    }
    // A dense SwiGLU MLP: gate_up GEMM -> SwiGLU and cast -> down GEMM.
    let (h, i) = (1024, 768);
    let mlps = (|| -> R<(Fp8Mlp, Fp8Mlp)> {
        let ws = [
            dense_weight(i, h, &dev)?,
            dense_weight(i, h, &dev)?,
            dense_weight(h, i, &dev)?,
        ];
        let host = |w: &moe_layer::fp8::Fp8Weight| -> R<moe_layer::fp8::Fp8Weight> {
            Ok(moe_layer::fp8::Fp8Weight::new(
                "p_proj",
                w.q().to_device(&Device::Cpu)?,
                w.scale().to_device(&Device::Cpu)?,
            )?)
        };
        let cpu = Fp8Mlp::new(&host(&ws[0])?, &host(&ws[1])?, host(&ws[2])?)?;
        let [g, u, d] = ws;
        Ok((Fp8Mlp::new(&g, &u, d)?, cpu))
    })();
    match mlps {
        Err(e) => run("dense/mlp/setup", &mut || Err(e.to_string().into())),
        Ok((gpu, cpu)) => {
            for rows in [1usize, 9, 130] {
                run(&format!("dense/mlp-1024x768/rows={rows}"), &mut || {
                    let x = Tensor::randn(0f32, 1.0, (rows, h), &Device::Cpu)?;
                    let want = cpu.forward(&x)?;
                    let got = gpu.forward(&x.to_device(&dev)?.to_dtype(DType::BF16)?)?;
                    // The layer's bounds (`gpu_common::fp8::TOLERANCE`), over the batch and
                    // per row, and no element bound: a SwiGLU output next to an e4m3 rounding
                    // boundary may round the other way and move its column of the down GEMM's
                    // products by 1/8 of itself (one such flip put an element 2.1 % of the
                    // largest output off, where the one-GEMM cases hold 2 %).
                    let (all, worst) = rel(&got, &want)?;
                    if !within(rows, all, worst) {
                        return Err(format!(
                            "relative error {all:.2e} over the batch, {worst:.2e} worst row, \
                             above {TOLERANCE:?}"
                        )
                        .into());
                    }
                    println!("       rel {all:.1e}, worst row {worst:.1e}");
                    Ok(())
                });
            }
        }
    }
    // MLA's absorbed `kv_b_proj` (`Fp8BatchedLinear`, a group a head): W_UK transposed
    // (`[heads, rank, nope]`) and W_UV as stored (`[heads, v, rank]`), DeepSeek-V3's 128 heads
    // and widths, every kernel against the host twin.
    let (heads, nope, v, rank) = (128usize, 128usize, 128usize, 512usize);
    let maps = (|| -> R<Vec<(&str, Fp8BatchedLinear, Fp8BatchedLinear)>> {
        let w = dense_weight(heads * (nope + v), rank, &dev)?;
        let host_w = moe_layer::fp8::Fp8Weight::new(
            "kv_b_proj",
            w.q().to_device(&Device::Cpu)?,
            w.scale().to_device(&Device::Cpu)?,
        )?;
        let cut = |w: &moe_layer::fp8::Fp8Weight, first, rows, t| {
            Fp8BatchedLinear::from_row_blocks(w, heads, first, rows, t)
        };
        Ok(vec![
            (
                "uk_t",
                cut(&w, 0, nope, true)?,
                cut(&host_w, 0, nope, true)?,
            ),
            (
                "uv",
                cut(&w, nope, v, false)?,
                cut(&host_w, nope, v, false)?,
            ),
        ])
    })();
    match maps {
        Err(e) => run("dense/kv_b/setup", &mut || Err(e.to_string().into())),
        Ok(maps) => {
            for (name, gpu, cpu) in &maps {
                let k = gpu.dims().2;
                for m in [1usize, 3, 8, 20, 64, 150] {
                    let mut kernels = vec![None, Some(GemmTiles::Narrow), Some(GemmTiles::Wide)];
                    if m <= 8 {
                        kernels.push(Some(GemmTiles::Gemv));
                    }
                    if m >= 64 {
                        kernels.push(Some(GemmTiles::WideM));
                    }
                    for tiles in kernels {
                        let label = tiles.map_or("default".to_string(), |t| format!("{t:?}"));
                        run(&format!("dense/kv_b-{name}/m={m}/{label}"), &mut || {
                            let x = Tensor::randn(0f32, 1.0, (heads, m, k), &Device::Cpu)?;
                            let want = cpu.forward(&x)?;
                            let xd = x.to_device(&dev)?.to_dtype(DType::BF16)?;
                            let got = match tiles {
                                None => gpu.forward(&xd)?,
                                Some(t) => gpu.forward_tiles(&xd, t)?,
                            };
                            println!("       {}", close(&got, &want, 1e-2)?);
                            Ok(())
                        });
                    }
                }
            }
        }
    }
    // Bad input on the device: rows of the wrong width are refused before any kernel runs.
    run("dense/bad-rows-refused", &mut || {
        let lin = Fp8Linear::new(dense_weight(256, 512, &dev)?, None)?;
        let err = lin
            .forward(&Tensor::zeros((3, 256), DType::BF16, &dev)?)
            .err()
            .ok_or("accepted")?
            .to_string();
        if !err.contains("k = 512") {
            return Err(format!("error does not name k: {err}").into());
        }
        Ok(())
    });
}
