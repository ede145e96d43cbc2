//! Helpers shared by the host-backend tests: run a closure on every rank of a thread group,
//! and build random routings.

#![allow(dead_code)]

use candle_core::{Device, Tensor};
use ep_runtime::{Buffer, BufferConfig};
use rand::seq::SliceRandom;
use rand::Rng;

/// A seed for a randomised test: `$EP_TEST_SEED` if set (decimal or `0x` hex), else a fresh
/// random one. Printed with `what`, so that a failure (whose output the harness shows) can be
/// replayed with `EP_TEST_SEED=<seed>`.
pub fn test_seed(what: &str) -> u64 {
    let seed = match std::env::var("EP_TEST_SEED") {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|e| panic!("EP_TEST_SEED={v:?}: {e}"))
        }
        Err(_) => rand::random(),
    };
    println!("{what}: seed {seed:#x} (replay with EP_TEST_SEED={seed:#x})");
    seed
}

/// Runs `f(buffer)` on `n` ranks (threads) and returns the results in rank order.
pub fn run_ranks<T: Send + 'static>(
    n: usize,
    gpus_per_node: usize,
    cfg: BufferConfig,
    f: impl Fn(Buffer) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let bufs = Buffer::local_group(n, gpus_per_node, cfg).expect("group");
    let hs: Vec<_> = bufs
        .into_iter()
        .map(|b| {
            let f = f.clone();
            std::thread::spawn(move || f(b))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Routing styles exercised by the tests.
#[derive(Debug, Clone, Copy)]
pub enum Style {
    /// K distinct random experts, some entries -1.
    Random,
    /// Every token picks expert 0 (plus -1s).
    HotExpert,
    /// Only experts of rank 0 are used (every other rank receives nothing).
    EmptyRanks,
}

/// A random `[t, k]` routing over `e` experts of `r` ranks.
pub fn routing(
    rng: &mut impl Rng,
    t: usize,
    k: usize,
    e: usize,
    r: usize,
    style: Style,
) -> Vec<i64> {
    let per_rank = e / r;
    let mut out = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<i64> = match style {
            Style::Random => {
                let mut all: Vec<i64> = (0..e as i64).collect();
                all.shuffle(rng);
                all.truncate(k);
                all
            }
            Style::HotExpert => {
                let mut v = vec![-1; k];
                v[0] = 0;
                v
            }
            Style::EmptyRanks => {
                let mut all: Vec<i64> = (0..per_rank as i64).collect();
                all.shuffle(rng);
                all.resize(k, -1);
                all
            }
        };
        for v in row.iter_mut() {
            if rng.random_bool(0.15) {
                *v = -1;
            }
        }
        out.extend(row);
    }
    out
}

/// Tokens whose values encode (rank, token, channel) so misrouting shows: f32, `[t, h]`.
pub fn tagged_tokens(rank: usize, t: usize, h: usize) -> Vec<f32> {
    (0..t * h)
        .map(|i| (rank * 1000 + i / h) as f32 + (i % h) as f32 / 1024.0)
        .collect()
}

/// CPU tensor helper.
pub fn tensor<T: candle_core::WithDType>(v: Vec<T>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor")
}
