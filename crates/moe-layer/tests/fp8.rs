//! Block-scaled fp8 checkpoints on the CPU: weights dequantized exactly as DeepSeek's
//! `weight_dequant` (the host twin), so a layer loaded from fp8 weights gives the same numbers,
//! bit for bit in f32, as the layer loaded from the dequantized weights; and fp8 tensors that
//! cannot be read right are refused with a message naming the tensor.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use ep_kernels::gemm::fp8::{dequantize_weight, quantize_weight};
use moe_layer::config::{MoeConfig, ScoringFunc, TopkMethod};
use moe_layer::ep_runtime::{Buffer, BufferConfig};
use moe_layer::fp8::{load_weight, Fp8Weight};
use moe_layer::{Experts, Mode, MoeLayer, MoeLayerOptions, WeightBytes, WeightTarget};
use rand::Rng;

// Hidden not a multiple of 128 and experts' width below it: partial scale blocks everywhere.
const H: usize = 200;
const I: usize = 96;
const E: usize = 8;

fn cfg() -> MoeConfig {
    MoeConfig {
        hidden_size: H,
        moe_intermediate_size: I,
        n_routed_experts: E,
        num_experts_per_tok: 3,
        n_shared_experts: Some(1),
        n_group: 4,
        topk_group: 2,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        scoring_func: ScoringFunc::Sigmoid,
        topk_method: TopkMethod::NoauxTc,
    }
}

/// A random `[n, k]` weight quantized as DeepSeek's release weights are: the e4m3 values and
/// scales, and the f32 weight they stand for.
fn fp8_weight(rng: &mut impl Rng, n: usize, k: usize) -> (Tensor, Tensor, Tensor) {
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.3f32..0.3)).collect();
    let (q, s) = quantize_weight(&w, n, k, 128).expect("valid shape");
    let deq = dequantize_weight(&q, &s, n, k, 128).expect("valid shape");
    let (sr, sc) = (n.div_ceil(128), k.div_ceil(128));
    (
        Tensor::from_vec(q, (n, k), &Device::Cpu).unwrap(),
        Tensor::from_vec(s, (sr, sc), &Device::Cpu).unwrap(),
        Tensor::from_vec(deq, (n, k), &Device::Cpu).unwrap(),
    )
}

/// A layer's tensors twice: as an fp8 checkpoint (linear weights e4m3 + `weight_scale_inv`, the
/// gate and its bias as stored) and as the same model's dequantized f32 weights.
fn checkpoints(rng: &mut impl Rng) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let mut fp8 = HashMap::new();
    let mut deq = HashMap::new();
    let mut linear = |name: String, n: usize, k: usize| {
        let (q, s, d) = fp8_weight(rng, n, k);
        fp8.insert(format!("{name}.weight"), q);
        fp8.insert(format!("{name}.weight_scale_inv"), s);
        deq.insert(format!("{name}.weight"), d);
    };
    for e in 0..E {
        linear(format!("experts.{e}.gate_proj"), I, H);
        linear(format!("experts.{e}.up_proj"), I, H);
        linear(format!("experts.{e}.down_proj"), H, I);
    }
    linear("shared_experts.gate_proj".into(), I, H);
    linear("shared_experts.up_proj".into(), I, H);
    linear("shared_experts.down_proj".into(), H, I);
    let gate = Tensor::randn(0f32, 0.5, (E, H), &Device::Cpu).unwrap();
    let bias = Tensor::randn(0f32, 0.1, E, &Device::Cpu).unwrap();
    for m in [&mut fp8, &mut deq] {
        m.insert("gate.weight".into(), gate.clone());
        m.insert("gate.e_score_correction_bias".into(), bias.clone());
    }
    (fp8, deq)
}

fn layer(tensors: HashMap<String, Tensor>) -> Result<MoeLayer> {
    let buffer = Arc::new(
        Buffer::local_group(1, 1, BufferConfig::default().with_low_latency(16, H, E))?.remove(0),
    );
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let opts = MoeLayerOptions {
        low_latency_max_tokens: 16,
        ..Default::default()
    };
    Ok(MoeLayer::load(vb, &cfg(), buffer, opts)?)
}

#[test]
fn an_fp8_layer_equals_the_layer_on_its_dequantized_weights() -> Result<()> {
    let mut rng = rand::rng();
    let (fp8, deq) = checkpoints(&mut rng);
    let a = layer(fp8)?;
    let b = layer(deq)?;
    assert!(!a.experts().is_fp8(), "the CPU dequantizes at load");
    // What the layers hold is what their configuration plans for the CPU.
    for (l, fp8_experts) in [(&a, true), (&b, false)] {
        let target = WeightTarget {
            num_ranks: 1,
            dtype: DType::F32,
            cuda: false,
            fp8_experts,
            redundant_experts: 0,
        };
        assert_eq!(l.weight_bytes(), WeightBytes::planned(&cfg(), target)?);
    }
    let x = Tensor::randn(0f32, 1.0, (13, H), &Device::Cpu)?;
    for mode in [Mode::Normal, Mode::LowLatency] {
        let ya: Vec<f32> = a.forward_with_mode(&x, mode)?.flatten_all()?.to_vec1()?;
        let yb: Vec<f32> = b.forward_with_mode(&x, mode)?.flatten_all()?.to_vec1()?;
        assert_eq!(ya, yb, "{mode:?}");
    }
    Ok(())
}

#[test]
fn load_weight_dequantizes_exactly_and_reads_plain_weights_as_stored() -> Result<()> {
    let mut rng = rand::rng();
    let (q, s, d) = fp8_weight(&mut rng, 300, 130);
    let plain = Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu)?;
    let tensors = HashMap::from([
        ("a.weight".to_string(), q),
        ("a.weight_scale_inv".to_string(), s),
        ("b.weight".to_string(), plain.clone()),
    ]);
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let got = load_weight(&vb.pp("a"), 300, 130)?;
    assert_eq!(
        got.flatten_all()?.to_vec1::<f32>()?,
        d.flatten_all()?.to_vec1::<f32>()?
    );
    let got = load_weight(&vb.pp("b"), 4, 8)?;
    assert_eq!(
        got.flatten_all()?.to_vec1::<f32>()?,
        plain.flatten_all()?.to_vec1::<f32>()?
    );
    // bf16: the exact f32 product rounded once.
    let vb16 = vb.set_dtype(DType::BF16);
    let got = load_weight(&vb16.pp("a"), 300, 130)?;
    assert_eq!(
        got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        d.to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
    );
    Ok(())
}

#[test]
fn bad_fp8_tensors_are_refused_naming_them() -> Result<()> {
    let mut rng = rand::rng();
    let (q, s, _) = fp8_weight(&mut rng, 256, 256);
    // A scale of the wrong shape.
    let bad_scale = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
    let err = Fp8Weight::new("model.layers.3.mlp.experts.7.up_proj", q.clone(), bad_scale)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.3.mlp.experts.7.up_proj.weight_scale_inv")
            && err.contains("[1, 2]")
            && err.contains("[2, 2]"),
        "{err}"
    );
    // Values that are not e4m3.
    let err = Fp8Weight::new("w", q.to_dtype(DType::F32)?, s.clone())
        .unwrap_err()
        .to_string();
    assert!(err.contains("w.weight") && err.contains("F32"), "{err}");
    // An fp8 expert with one projection's scales missing.
    let (mut fp8, _) = checkpoints(&mut rng);
    fp8.remove("experts.2.down_proj.weight_scale_inv");
    let vb = VarBuilder::from_tensors(fp8, DType::F32, &Device::Cpu);
    let err = Experts::load(vb.pp("experts"), &cfg(), 0, E)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("experts.2.down_proj.weight_scale_inv") && err.contains("missing"),
        "{err}"
    );
    // e4m3 rows handed to the experts without their scales.
    let (fp8, _) = checkpoints(&mut rng);
    let vb = VarBuilder::from_tensors(fp8, DType::F32, &Device::Cpu);
    let experts = Experts::load(vb.pp("experts"), &cfg(), 0, E)?;
    let rows = Tensor::zeros((E, 2, H), DType::F8E4M3, &Device::Cpu)?;
    let counts = Tensor::new(&[1i32; E], &Device::Cpu)?;
    let err = experts
        .forward_masked(&rows, &counts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("F8E4M3 rows without scales"), "{err}");
    Ok(())
}

/// `||a - b|| / ||b||`.
fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let num = (a - b)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
    Ok(num / den)
}

/// The rows of `x` as the fp8 layers read them: bf16, then e4m3 with 1 x 128 scales.
fn fp8_rows(x: &Tensor) -> Result<Tensor> {
    use moe_layer::ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
    let (q, s) = per_token_cast_to_fp8(&x.to_dtype(DType::BF16)?, false)
        .map_err(candle_core::Error::wrap)?;
    per_token_cast_back(&q, &s, DType::F32).map_err(candle_core::Error::wrap)
}

#[test]
fn a_dense_fp8_linear_equals_the_product_of_its_dequantized_operands() -> Result<()> {
    use moe_layer::Fp8Linear;
    let mut rng = rand::rng();
    // n with a partial scale block, k two blocks.
    let (n, k) = (208, 256);
    let (q, s, w) = fp8_weight(&mut rng, n, k);
    let bias = Tensor::randn(0f32, 1.0, n, &Device::Cpu)?;
    let lin = Fp8Linear::new(
        Fp8Weight::new("p", q, s).map_err(candle_core::Error::wrap)?,
        Some(bias.clone()),
    )
    .map_err(candle_core::Error::wrap)?;
    for rows in [1usize, 7, 33] {
        let x = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu)?;
        let y = lin.forward(&x).map_err(candle_core::Error::wrap)?;
        assert_eq!(y.dims(), [rows, n]);
        // The exact product of the quantized rows and the dequantized weight, rounded to bf16
        // as the GEMM writes it (the summation order moves some products across a bf16 rounding
        // boundary: at most a bf16 step, 2^-8, of those).
        let want = fp8_rows(&x)?
            .matmul(&w.t()?)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?
            .broadcast_add(&bias)?;
        let err = rel(&y, &want)?;
        assert!(err < 4e-3, "rows {rows}: {err}");
        // Against the float product: only the rows' quantization (3 mantissa bits) is left.
        let float = x.matmul(&w.t()?)?.broadcast_add(&bias)?;
        let err = rel(&y, &float)?;
        assert!(err < 5e-2, "rows {rows}: {err}");
        // Leading dimensions are kept.
        let y3 = lin
            .forward(&x.reshape((1, rows, k))?)
            .map_err(candle_core::Error::wrap)?;
        assert_eq!(y3.dims(), [1, rows, n]);
    }
    // Bad input: a shape the GEMMs do not take, and rows of the wrong width.
    let (q, s, _) = fp8_weight(&mut rng, 64, 200);
    let err = Fp8Linear::new(
        Fp8Weight::new("p", q, s).map_err(candle_core::Error::wrap)?,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("[64, 200]") && err.contains("multiple of 128"),
        "{err}"
    );
    let err = lin
        .forward(&Tensor::zeros((2, 128), DType::F32, &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("k = 256"), "{err}");
    Ok(())
}

#[test]
fn a_dense_fp8_mlp_equals_the_mlp_on_its_dequantized_weights() -> Result<()> {
    use moe_layer::{Fp8Mlp, Mlp};
    let mut rng = rand::rng();
    let (h, i) = (256, 384);
    let (gq, gs, gw) = fp8_weight(&mut rng, i, h);
    let (uq, us, uw) = fp8_weight(&mut rng, i, h);
    let (dq, ds, dw) = fp8_weight(&mut rng, h, i);
    let fp8 = |q, s| Fp8Weight::new("p", q, s).map_err(candle_core::Error::wrap);
    let mlp = Fp8Mlp::new(&fp8(gq, gs)?, &fp8(uq, us)?, fp8(dq, ds)?)
        .map_err(candle_core::Error::wrap)?;
    assert_eq!(mlp.dims(), (h, i));
    let float = Mlp::new(gw, uw, dw).map_err(candle_core::Error::wrap)?;
    for rows in [1usize, 9, 40] {
        let x = Tensor::randn(0f32, 1.0, (rows, h), &Device::Cpu)?;
        let y = mlp.forward(&x).map_err(candle_core::Error::wrap)?;
        let want = float.forward(&x).map_err(candle_core::Error::wrap)?;
        // Two fp8 row casts (the input, the SwiGLU output) and the bf16 gate_up product.
        let err = rel(&y, &want)?;
        assert!(err < 6e-2, "rows {rows}: {err}");
    }
    Ok(())
}

#[test]
fn fp8_batched_maps_cut_from_kv_b_proj_equal_the_per_head_products() -> Result<()> {
    use moe_layer::Fp8BatchedLinear;
    let mut rng = rand::rng();
    // MLA's `kv_b_proj` `[heads * (nope + v), rank]` in miniature: 3 heads, nope = v = 128,
    // rank 256 (two scale blocks).
    let (heads, nope, v, rank) = (3usize, 128usize, 128usize, 256usize);
    let (q, s, w) = fp8_weight(&mut rng, heads * (nope + v), rank);
    let kv_b = Fp8Weight::new("kv_b_proj", q, s).map_err(candle_core::Error::wrap)?;
    let per_head = w.reshape((heads, nope + v, rank))?;
    // W_UK transposed per head (`[heads, rank, nope]`: the absorbed query's map) and W_UV as
    // stored (`[heads, v, rank]`).
    let uk_t = Fp8BatchedLinear::from_row_blocks(&kv_b, heads, 0, nope, true)
        .map_err(candle_core::Error::wrap)?;
    let uv = Fp8BatchedLinear::from_row_blocks(&kv_b, heads, nope, v, false)
        .map_err(candle_core::Error::wrap)?;
    assert_eq!(uk_t.dims(), (heads, rank, nope));
    assert_eq!(uv.dims(), (heads, v, rank));
    let want_uk_t = per_head.narrow(1, 0, nope)?.transpose(1, 2)?.contiguous()?;
    let want_uv = per_head.narrow(1, nope, v)?.contiguous()?;
    // The cut and transposed blocks dequantize to the same weights, exactly.
    let exact = |a: &Fp8BatchedLinear, b: &Tensor| -> Result<f32> {
        let d = a.dequantize(DType::F32).map_err(candle_core::Error::wrap)?;
        (d - b)?.abs()?.max_all()?.to_scalar::<f32>()
    };
    assert_eq!(exact(&uk_t, &want_uk_t)?, 0.0);
    assert_eq!(exact(&uv, &want_uv)?, 0.0);
    for m in [1usize, 5, 70] {
        let x = Tensor::randn(0f32, 1.0, (heads, m, nope), &Device::Cpu)?;
        let y = uk_t.forward(&x).map_err(candle_core::Error::wrap)?;
        assert_eq!(y.dims(), [heads, m, rank]);
        // As the example's bf16 form: `q_nope · W_UK` per head.
        let want = fp8_rows(&x.reshape((heads * m, nope))?)?
            .reshape((heads, m, nope))?
            .matmul(&per_head.narrow(1, 0, nope)?.contiguous()?)?;
        assert!(rel(&y, &want)? < 4e-3, "uk m {m}");
        let float = x.matmul(&per_head.narrow(1, 0, nope)?.contiguous()?)?;
        assert!(rel(&y, &float)? < 5e-2, "uk m {m}");
        let o = Tensor::randn(0f32, 1.0, (heads, m, rank), &Device::Cpu)?;
        let y = uv.forward(&o).map_err(candle_core::Error::wrap)?;
        let float = o.matmul(&want_uv.transpose(1, 2)?)?;
        assert!(rel(&y, &float)? < 5e-2, "uv m {m}");
    }
    // Bad input: a cut across scale blocks, rows of another width or group count.
    let err = Fp8BatchedLinear::from_row_blocks(&kv_b, heads, 64, 128, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("whole 128-row blocks"), "{err}");
    let err = uv
        .forward(&Tensor::zeros(
            (heads + 1, 2, rank),
            DType::F32,
            &Device::Cpu,
        )?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[3, rows, 256]"), "{err}");
    Ok(())
}
