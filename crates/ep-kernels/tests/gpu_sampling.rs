//! GPU tests: greedy sampling's argmax (`argmax.cu`) against its host twin, id for id, on
//! fresh random logits: rows from 1 to 300, vocabularies from 1 to DeepSeek-V3's 129280, the
//! largest value planted at the ends of rows and of the kernel's runs, ties (the first index
//! wins), rows of `-inf`, -0 beside +0; every case on f32 logits and again on the same logits
//! rounded to bf16 (more ties). Keys start poisoned: the launcher zeroes them.

mod common;

use std::sync::Arc;

use common::{device, poisoned, CaseResult, Runner};
use cudarc::driver::CudaStream;
use ep_kernels::sampling;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

fn argmax_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    in_bf16: bool,
    rows: usize,
    vocab: usize,
    plant: impl Fn(usize, &mut [f32]),
) -> CaseResult {
    let mut logits: Vec<f32> = (0..rows * vocab)
        .map(|_| rng.random_range(-10.0f32..10.0))
        .collect();
    for (r, row) in logits.chunks_mut(vocab).enumerate() {
        plant(r, row);
    }
    let mut keys = poisoned::<u64>(stream, rows)?;
    if in_bf16 {
        let b: Vec<bf16> = logits.iter().map(|&v| bf16::from_f32(v)).collect();
        // The twin sees the values the kernel reads.
        logits = b.iter().map(|v| v.to_f32()).collect();
        let dev = stream.clone_htod(&b)?;
        sampling::argmax_rows_bf16_cuda(stream, &dev, rows, vocab, &mut keys)?;
    } else {
        let dev = stream.clone_htod(&logits)?;
        sampling::argmax_rows_f32_cuda(stream, &dev, rows, vocab, &mut keys)?;
    }
    let got: Vec<u32> = stream
        .clone_dtoh(&keys)?
        .into_iter()
        .map(sampling::key_index)
        .collect();
    let want = sampling::argmax_rows(&logits, vocab)?;
    common::compare("argmax ids", &got, &want)
}

fn main() {
    let mut runner = Runner::from_env("gpu_sampling");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => gpu_test_suite::skip(&format!("no CUDA device: {e}")),
    };
    let v3 = 129_280;
    for (dt, in_bf16) in [("f32", false), ("bf16", true)] {
        runner.case(&format!("{dt}/ds-v3/one-row"), |rng| {
            argmax_case(&stream, rng, in_bf16, 1, v3, |_, _| {})
        });
        runner.case(&format!("{dt}/ds-v3/64-rows-planted-at-ends"), |rng| {
            let at = [0, v3 - 1, 1023, 1024, 4039, 4040, 77_777, 64_639, 64_640];
            argmax_case(&stream, rng, in_bf16, 64, v3, |r, row| {
                row[at[r % at.len()]] = 50.0
            })
        });
        runner.case(&format!("{dt}/ds-v3/ties-first-wins"), |rng| {
            argmax_case(&stream, rng, in_bf16, 33, v3, |r, row| {
                for k in 0..4 {
                    row[(r * 997 + k * 30_011) % v3] = 20.0;
                }
            })
        });
        runner.case(&format!("{dt}/odd/300-rows-vocab-1000"), |rng| {
            argmax_case(&stream, rng, in_bf16, 300, 1000, |_, _| {})
        });
        runner.case(&format!("{dt}/odd/vocab-1"), |rng| {
            argmax_case(&stream, rng, in_bf16, 5, 1, |_, _| {})
        });
        runner.case(&format!("{dt}/odd/negative-infinity-rows"), |rng| {
            argmax_case(&stream, rng, in_bf16, 4, 5000, |r, row| {
                row.fill(f32::NEG_INFINITY);
                if r == 1 {
                    row[4321] = -1e30;
                }
            })
        });
        runner.case(&format!("{dt}/odd/zero-signs-compare-equal"), |rng| {
            argmax_case(&stream, rng, in_bf16, 2, 3000, |r, row| {
                row.fill(-1.0);
                // -0 first in row 0, +0 first in row 1: the first zero wins either way.
                let (a, b) = if r == 0 { (-0.0, 0.0) } else { (0.0, -0.0) };
                row[2500] = a;
                row[2600] = b;
            })
        });
    }
    runner.case("bad-input/errors-before-launch", |_| {
        let logits = stream.alloc_zeros::<f32>(12)?;
        let mut keys = stream.alloc_zeros::<u64>(3)?;
        let err = sampling::argmax_rows_f32_cuda(&stream, &logits, 3, 5, &mut keys)
            .err()
            .ok_or("15 logits taken from 12")?;
        if !err.to_string().contains("logits") {
            return Err(format!("unexpected message: {err}").into());
        }
        Ok(())
    });
    runner.finish();
}
