//! A tiny harness shared by the GPU test binaries (`harness = false`, feature `cuda`).
//!
//! Each binary builds a [`Runner`], runs named cases (each compares a CUDA kernel with its host
//! twin on fresh random inputs, writing into [`poisoned`] outputs so that unwritten elements
//! show), and ends with [`Runner::finish`], which prints exactly `N passed, N failed` and exits
//! with 1 if any case failed or none ran (unless `EP_GPU_ALLOW_SKIP=1`). Environment:
//! - `EP_TEST_SEED`: base seed (default: from the clock; always printed so runs can be replayed);
//! - `EP_TEST_DEVICE`: CUDA ordinal (default 0);
//! - the first command-line argument, if any: only run cases whose name contains it.
#![allow(dead_code)]

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// What a case returns: any error fails it, with its message printed.
pub type CaseResult = Result<(), Box<dyn std::error::Error>>;

/// Runs named cases and counts the results.
pub struct Runner {
    filter: Option<String>,
    seed: u64,
    passed: usize,
    failed: usize,
    next_case: u64,
}

impl Runner {
    /// Reads the filter (first argument) and the seed (`EP_TEST_SEED`); prints the seed.
    pub fn from_env(binary: &str) -> Self {
        let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
        let seed = std::env::var("EP_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0)
            });
        println!("{binary}: EP_TEST_SEED={seed}");
        Self {
            filter,
            seed,
            passed: 0,
            failed: 0,
            next_case: 0,
        }
    }

    /// Runs `f` as case `name` with its own seeded rng, unless filtered out. A returned error
    /// or a panic fails the case; one line is printed either way.
    pub fn case(&mut self, name: &str, f: impl FnOnce(&mut StdRng) -> CaseResult) {
        let index = self.next_case;
        self.next_case += 1;
        if self
            .filter
            .as_deref()
            .is_some_and(|flt| !name.contains(flt))
        {
            return;
        }
        let mut rng = StdRng::seed_from_u64(self.seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let start = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| f(&mut rng)));
        let ms = start.elapsed().as_secs_f64() * 1e3;
        match outcome {
            Ok(Ok(())) => {
                self.passed += 1;
                println!("ok     {name} ({ms:.1} ms)");
            }
            Ok(Err(e)) => {
                self.failed += 1;
                println!("FAILED {name} ({ms:.1} ms): {e}");
            }
            Err(panic) => {
                self.failed += 1;
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "panic".into());
                println!("FAILED {name} ({ms:.1} ms): panicked: {msg}");
            }
        }
    }

    /// The seed the cases' rngs derive from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The name filter (the first argument), if any.
    pub fn filter(&self) -> Option<&str> {
        self.filter.as_deref()
    }

    /// Counts cases run elsewhere (e.g. by child processes, which printed them).
    pub fn add_counts(&mut self, passed: usize, failed: usize) {
        self.passed += passed;
        self.failed += failed;
    }

    /// Prints `N passed, N failed` and exits: code 1 if any case failed, or if none ran unless
    /// `EP_GPU_ALLOW_SKIP=1` (`gpu-test-suite`'s rule).
    pub fn finish(self) -> ! {
        gpu_test_suite::finish(self.passed, self.failed)
    }
}

/// The CUDA context and a fresh stream of device `EP_TEST_DEVICE` (default 0).
pub fn device() -> Result<(Arc<CudaContext>, Arc<CudaStream>), Box<dyn std::error::Error>> {
    let ordinal = std::env::var("EP_TEST_DEVICE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let ctx = CudaContext::new(ordinal)?;
    let stream = ctx.new_stream()?;
    Ok((ctx, stream))
}

/// The byte pattern outputs are filled with before a launch.
pub const POISON_BYTE: u8 = 0xAB;

/// A value made of [`POISON_BYTE`] bytes.
pub trait Poison: Copy {
    /// The poison value of this type.
    fn poison() -> Self;
}

macro_rules! poison_int {
    ($($t:ty),*) => {$(
        impl Poison for $t {
            fn poison() -> Self {
                <$t>::from_ne_bytes([POISON_BYTE; std::mem::size_of::<$t>()])
            }
        }
    )*};
}
poison_int!(u8, i8, u16, i16, u32, i32, u64, i64);

impl Poison for f32 {
    fn poison() -> Self {
        f32::from_bits(u32::poison())
    }
}

impl Poison for bf16 {
    fn poison() -> Self {
        bf16::from_bits(u16::poison())
    }
}

impl Poison for F8E4M3 {
    fn poison() -> Self {
        F8E4M3::from_bits(POISON_BYTE)
    }
}

/// A device buffer of `len` elements, every byte [`POISON_BYTE`].
pub fn poisoned<T: Poison + DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, Box<dyn std::error::Error>> {
    Ok(stream.clone_htod(&vec![T::poison(); len])?)
}

/// Compares element by element; on mismatch, the error names `what`, the number of
/// mismatches and the first few (index, got, want).
pub fn compare<T: PartialEq + Debug>(what: &str, got: &[T], want: &[T]) -> CaseResult {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != expected {}", got.len(), want.len()).into());
    }
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if bad.is_empty() {
        return Ok(());
    }
    let first: Vec<String> = bad
        .iter()
        .take(5)
        .map(|&i| format!("[{i}] got {:?} want {:?}", got[i], want[i]))
        .collect();
    Err(format!(
        "{what}: {} of {} elements differ; first: {}",
        bad.len(),
        got.len(),
        first.join(", ")
    )
    .into())
}

/// Compares bit patterns (f32, bf16, fp8: NaN-safe, -0 != +0).
pub fn compare_bits<T: Copy, B: PartialEq + Debug>(
    what: &str,
    got: &[T],
    want: &[T],
    bits: impl Fn(T) -> B,
) -> CaseResult {
    let g: Vec<B> = got.iter().map(|&v| bits(v)).collect();
    let w: Vec<B> = want.iter().map(|&v| bits(v)).collect();
    compare(what, &g, &w)
}

/// Milliseconds `f` takes on `stream`, measured with device events (median of `iters`, after
/// one warm-up call).
pub fn time_ms(
    stream: &Arc<CudaStream>,
    iters: usize,
    mut f: impl FnMut() -> CaseResult,
) -> Result<f32, Box<dyn std::error::Error>> {
    f()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)?);
    }
    times.sort_by(f32::total_cmp);
    Ok(times[times.len() / 2])
}
