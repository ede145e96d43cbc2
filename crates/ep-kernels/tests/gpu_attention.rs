//! GPU tests: MLA attention's kernels against their host twins, on fresh random bf16 inputs
//! written into poisoned outputs; every output must be written.
//! - The per-head GEMM (cuBLAS strided batched): each output within `2^-8 |ref| + 1e-3
//!   sum_i |x_i w_i|` (one bf16 rounding of the result plus f32 summation in another order),
//!   the twin summing the same bf16 values in f32. Rows are read from each head's slice in
//!   place (`first > 0`, widths that are not multiples of 8) and written token-major.
//! - The scores' softmax: each probability within `2^-8 p + 1e-6` of the twin's (one bf16
//!   rounding; f32 `expf` differs from Rust's `exp` by an ulp or two), over random scores,
//!   masks that hide a random tail of each sequence's keys (-1e9, as the model's plan writes
//!   them in bf16, and -inf), and a sequence masked everywhere (zeros).
//! - The rope columns' rotation: each value within `2^-7 (|x_a c| + |x_b s|)` of the twin's
//!   (the twin rounds both products to bf16, the kernel may fuse one into the sum as candle's
//!   does: one product's rounding, and the result's, apart), read where they lie in
//!   DeepSeek-V3's query and key rows, both pairings; every output written.

mod common;

use std::sync::Arc;

use common::{device, poisoned, CaseResult, Poison, Runner};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;
use ep_kernels::attention::{self, PerHeadShape, RopeShape, ScoresShape};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

fn random_bf16(rng: &mut StdRng, len: usize, scale: f32) -> Vec<bf16> {
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

fn per_head_case(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    rng: &mut StdRng,
    shape: PerHeadShape,
) -> CaseResult {
    let PerHeadShape {
        tokens,
        heads,
        x_width,
        first,
        k,
        n,
    } = shape;
    let x = random_bf16(rng, tokens * heads * x_width, 1.0);
    let w = random_bf16(rng, heads * k * n, 0.1);
    let len = tokens * heads * n;
    // One spare element past `y`: it must keep its poison.
    let mut y_dev = poisoned::<bf16>(stream, len + 1)?;
    let (x_dev, w_dev) = (stream.clone_htod(&x)?, stream.clone_htod(&w)?);
    attention::per_head_gemm_bf16_cuda(
        stream,
        blas,
        &x_dev,
        &w_dev,
        shape,
        &mut y_dev.slice_mut(0..len),
    )?;
    let got = stream.clone_dtoh(&y_dev)?;
    let poison = bf16::poison().to_bits();
    if got[len].to_bits() != poison {
        return Err("the element past y was written".into());
    }
    if let Some(i) = got[..len].iter().position(|v| v.to_bits() == poison) {
        return Err(format!("y[{i}] not written (poison)").into());
    }
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let mut want = vec![0f32; len];
    attention::per_head_gemm(&xf, &wf, shape, &mut want)?;
    for t in 0..tokens {
        for g in 0..heads {
            let xr = &xf[(t * heads + g) * x_width + first..][..k];
            for j in 0..n {
                let i = (t * heads + g) * n + j;
                let scale: f32 = (0..k)
                    .map(|c| (xr[c] * wf[(g * k + c) * n + j]).abs())
                    .sum();
                let (g_v, w_v) = (got[i].to_f32(), want[i]);
                let err = (g_v - w_v).abs();
                if err.is_nan() || err > w_v.abs() / 256.0 + 1e-3 * scale {
                    return Err(format!(
                        "y[{t}, {g}, {j}] = {g_v}, twin {w_v}: error {err:.3e} (scale {scale:.3e})"
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// Which masked value hides keys: the model's bf16 `-1e9`, or `-inf`.
#[derive(Clone, Copy)]
enum Hidden {
    Large,
    Infinite,
}

fn softmax_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    shape: ScoresShape,
    hidden: Hidden,
    all_masked_seq: Option<usize>,
) -> CaseResult {
    let ScoresShape {
        seqs, queries, len, ..
    } = shape;
    let elems = shape.rows() * len;
    let latent = random_bf16(rng, elems, 20.0);
    let rope = random_bf16(rng, elems, 5.0);
    let hide = match hidden {
        Hidden::Large => bf16::from_f32(-1e9),
        Hidden::Infinite => bf16::NEG_INFINITY,
    };
    // Each (sequence, query) sees a random prefix of the keys, at least one.
    let mut mask = vec![bf16::ZERO; seqs * queries * len];
    for (i, row) in mask.chunks_mut(len).enumerate() {
        let seen = if all_masked_seq == Some(i / queries) {
            0
        } else {
            rng.random_range(1..=len)
        };
        row[seen..].fill(hide);
    }
    let scale = 0.1352f32;
    let mut p_dev = poisoned::<bf16>(stream, elems + 1)?;
    let (l_dev, r_dev, m_dev) = (
        stream.clone_htod(&latent)?,
        stream.clone_htod(&rope)?,
        stream.clone_htod(&mask)?,
    );
    attention::scores_softmax_bf16_cuda(
        stream,
        &l_dev,
        &r_dev,
        &m_dev,
        scale,
        shape,
        &mut p_dev.slice_mut(0..elems),
    )?;
    let got = stream.clone_dtoh(&p_dev)?;
    let poison = bf16::poison().to_bits();
    if got[elems].to_bits() != poison {
        return Err("the element past probs was written".into());
    }
    if let Some(i) = got[..elems].iter().position(|v| v.to_bits() == poison) {
        return Err(format!("probs[{i}] not written (poison)").into());
    }
    let f = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let mut want = vec![0f32; elems];
    attention::scores_softmax(&f(&latent), &f(&rope), &f(&mask), scale, shape, &mut want)?;
    for (i, (g, w)) in got[..elems].iter().zip(&want).enumerate() {
        let g = g.to_f32();
        let err = (g - w).abs();
        if err.is_nan() || err > w.abs() / 256.0 + 1e-6 {
            return Err(format!("probs[{i}] = {g}, twin {w}: error {err:.3e}").into());
        }
    }
    Ok(())
}

fn rope_case(stream: &Arc<CudaStream>, rng: &mut StdRng, shape: RopeShape) -> CaseResult {
    let RopeShape {
        tokens,
        heads,
        x_width,
        dim,
        ..
    } = shape;
    let x = random_bf16(rng, tokens * heads * x_width, 4.0);
    // cos and sin of random angles, rounded to bf16 as the model's tables are.
    let angles: Vec<f32> = (0..tokens * dim / 2)
        .map(|_| rng.random_range(-3.2f32..3.2))
        .collect();
    let cos: Vec<bf16> = angles.iter().map(|a| bf16::from_f32(a.cos())).collect();
    let sin: Vec<bf16> = angles.iter().map(|a| bf16::from_f32(a.sin())).collect();
    let n = tokens * heads * dim;
    let mut o_dev = poisoned::<bf16>(stream, n + 1)?;
    let (x_dev, c_dev, s_dev) = (
        stream.clone_htod(&x)?,
        stream.clone_htod(&cos)?,
        stream.clone_htod(&sin)?,
    );
    attention::rope_bf16_cuda(
        stream,
        &x_dev,
        &c_dev,
        &s_dev,
        shape,
        &mut o_dev.slice_mut(0..n),
    )?;
    let got = stream.clone_dtoh(&o_dev)?;
    let poison = bf16::poison().to_bits();
    if got[n].to_bits() != poison {
        return Err("the element past out was written".into());
    }
    let mut want = vec![bf16::ZERO; n];
    attention::rope_rows(&x, &cos, &sin, shape, &mut want)?;
    for (i, (g, w)) in got[..n].iter().zip(&want).enumerate() {
        if g.to_bits() == poison {
            return Err(format!("out[{i}] not written (poison)").into());
        }
        // The terms of output i: its pair's two products.
        let (t, rest) = (i / (heads * dim), i % (heads * dim));
        let (h, col) = (rest / dim, rest % dim);
        let pair = (0..dim / 2)
            .find(|&p| {
                let (a, b) = shape.pair(p);
                a == col || b == col
            })
            .ok_or("column outside every pair")?;
        let (a, b) = shape.pair(pair);
        let xrow = &x[(t * heads + h) * x_width + shape.first..];
        let (c, sn) = (
            cos[t * dim / 2 + pair].to_f32(),
            sin[t * dim / 2 + pair].to_f32(),
        );
        let (xa, xb) = (xrow[a].to_f32(), xrow[b].to_f32());
        let terms = if col == a {
            (xa * c).abs() + (xb * sn).abs()
        } else {
            (xa * sn).abs() + (xb * c).abs()
        };
        let (gf, wf) = (g.to_f32(), w.to_f32());
        if (gf - wf).abs() > terms / 128.0 {
            return Err(format!("out[{i}] = {gf}, twin {wf} (terms {terms})").into());
        }
    }
    Ok(())
}

fn main() {
    let mut runner = Runner::from_env("gpu_attention");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => gpu_test_suite::skip(&format!("no CUDA device: {e}")),
    };
    let blas = match CudaBlas::new(stream.clone()) {
        Ok(b) => b,
        Err(e) => {
            println!("FAILED setup: cuBLAS handle: {e}");
            gpu_test_suite::finish(0, 1);
        }
    };
    let shape = |tokens, heads, x_width, first, k, n| PerHeadShape {
        tokens,
        heads,
        x_width,
        first,
        k,
        n,
    };
    let cases = [
        // DeepSeek-V3's query into the latent space: q [t, 128, 192], nope = the first 128.
        (
            "ds-v3/q-nope-to-latent/decode-64",
            shape(64, 128, 192, 0, 128, 512),
        ),
        // Its latent outputs back to values: [t, 128, 512] -> [t, 128, 128].
        (
            "ds-v3/latent-to-values/decode-64",
            shape(64, 128, 512, 0, 512, 128),
        ),
        (
            "ds-v3/q-nope-to-latent/one-token",
            shape(1, 128, 192, 0, 128, 512),
        ),
        (
            "ds-v3/latent-to-values/prefill-300",
            shape(300, 128, 512, 0, 512, 128),
        ),
        (
            "per-head/odd/slice-inside-each-head",
            shape(7, 3, 37, 5, 19, 23),
        ),
        (
            "per-head/odd/one-head-last-values",
            shape(13, 1, 40, 29, 11, 9),
        ),
    ];
    for (name, s) in cases {
        runner.case(name, |rng| per_head_case(&stream, &blas, rng, s));
    }
    let scores = |seqs, heads, queries, len| ScoresShape {
        seqs,
        heads,
        queries,
        len,
    };
    let softmax_cases = [
        // A DeepSeek-V3 decode step: 64 sequences of 128 heads, one query, ~600 keys.
        (
            "softmax/ds-v3/decode-64",
            scores(64, 128, 1, 601),
            Hidden::Large,
            None,
        ),
        (
            "softmax/ds-v3/prefill-3x17",
            scores(3, 128, 17, 40),
            Hidden::Large,
            None,
        ),
        // Multiples of 8 keys: the kernel's 8-value loads (the others: its scalar loop).
        (
            "softmax/ds-v3/decode-64-keys-1024",
            scores(64, 128, 1, 1024),
            Hidden::Large,
            None,
        ),
        (
            "softmax/ds-v3/prefill-2x64-keys-128",
            scores(2, 128, 64, 128),
            Hidden::Infinite,
            None,
        ),
        (
            "softmax/odd/keys-8-masked-everywhere",
            scores(3, 4, 2, 8),
            Hidden::Infinite,
            Some(2),
        ),
        (
            "softmax/odd/infinite-mask",
            scores(5, 3, 2, 67),
            Hidden::Infinite,
            None,
        ),
        (
            "softmax/odd/one-key",
            scores(4, 2, 1, 1),
            Hidden::Large,
            None,
        ),
        (
            "softmax/odd/sequence-masked-everywhere",
            scores(3, 4, 2, 33),
            Hidden::Infinite,
            Some(1),
        ),
    ];
    for (name, s, hidden, masked) in softmax_cases {
        runner.case(name, |rng| softmax_case(&stream, rng, s, hidden, masked));
    }
    let rope = |tokens, heads, x_width, first, interleave| RopeShape {
        tokens,
        heads,
        x_width,
        first,
        dim: 64,
        interleave,
    };
    let rope_cases = [
        // DeepSeek-V3: the query's rope columns (128 heads of 192), the key's (one block of 576).
        ("rope/ds-v3/query-64-tokens", rope(64, 128, 192, 128, true)),
        ("rope/ds-v3/key-300-tokens", rope(300, 1, 576, 512, true)),
        (
            "rope/ds-v3/query-non-interleaved",
            rope(7, 128, 192, 128, false),
        ),
        ("rope/odd/one-token-mid-block", rope(1, 3, 100, 17, true)),
    ];
    for (name, s) in rope_cases {
        runner.case(name, |rng| rope_case(&stream, rng, s));
    }
    runner.case("rope/bad-input/errors-before-launch", |_| {
        let v = stream.alloc_zeros::<bf16>(64)?;
        let mut o = stream.alloc_zeros::<bf16>(64)?;
        let s = rope(1, 1, 64, 8, true);
        let err = attention::rope_bf16_cuda(&stream, &v, &v, &v, s, &mut o)
            .err()
            .ok_or("64 columns from 8 of a 64-value block accepted")?;
        if !err.to_string().contains("rope shape") {
            return Err(format!("unexpected message: {err}").into());
        }
        Ok(())
    });
    runner.case("softmax/bad-input/errors-before-launch", |_| {
        let v = stream.alloc_zeros::<bf16>(2 * 3 * 4)?;
        let mut p = stream.alloc_zeros::<bf16>(2 * 3 * 4)?;
        let s = scores(2, 3, 1, 4);
        let err = attention::scores_softmax_bf16_cuda(&stream, &v, &v, &v, 1.0, s, &mut p)
            .err()
            .ok_or("a mask of every head's size was taken")?;
        if !err.to_string().contains("must hold 8") {
            return Err(format!("unexpected message: {err}").into());
        }
        let mask = stream.alloc_zeros::<bf16>(2 * 4)?;
        let err = attention::scores_softmax_bf16_cuda(&stream, &v, &v, &mask, f32::NAN, s, &mut p)
            .err()
            .ok_or("a NaN scale was taken")?;
        if !err.to_string().contains("must be finite") {
            return Err(format!("unexpected message: {err}").into());
        }
        Ok(())
    });
    runner.case("per-head/no-tokens/writes-nothing", |rng| {
        per_head_case(&stream, &blas, rng, shape(0, 4, 16, 0, 16, 8))
    });
    runner.case("per-head/bad-input/errors-before-launch", |_| {
        let x = stream.alloc_zeros::<bf16>(2 * 3 * 8)?;
        let w = stream.alloc_zeros::<bf16>(3 * 4 * 5)?;
        let mut y = stream.alloc_zeros::<bf16>(2 * 3 * 5)?;
        let past = shape(2, 3, 8, 5, 4, 5);
        let err = attention::per_head_gemm_bf16_cuda(&stream, &blas, &x, &w, past, &mut y)
            .err()
            .ok_or("a slice past the head was taken")?;
        if !err.to_string().contains("must lie in a head's 8 values") {
            return Err(format!("unexpected message: {err}").into());
        }
        let short = shape(2, 3, 8, 0, 4, 6);
        let err = attention::per_head_gemm_bf16_cuda(&stream, &blas, &x, &w, short, &mut y)
            .err()
            .ok_or("a short weight was taken")?;
        if !err.to_string().contains("must hold 72") {
            return Err(format!("unexpected message: {err}").into());
        }
        Ok(())
    });
    runner.finish();
}
