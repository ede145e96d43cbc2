//! The gate's logits for a few tokens: `logits[T, E] = x[T, H] W[E, H]^T` in f32, with `x` in
//! bf16, f16 or f32 (converted to f32 as it is read) and `W` in f32. Kernel `gate.cu`, typed
//! launcher `gate_logits_cuda`, host twin [`gate_logits`].
//!
//! For decode batches the product is a matrix-vector product bounded by reading `W` once; the
//! kernel streams `W` with 16-byte loads and reuses each load for a chunk of tokens. Past a
//! few tokens a GEMM library does better: [`gate_uses_kernel`] is the one place that decides.

use half::{bf16, f16};

use super::MAX_EXPERTS;
use crate::error::{Error, Result};

/// Most tokens for which the router computes its logits with the gate kernel rather than a
/// GEMM when the tensor-core GEMM cannot run (an f32 `x` or gate weight).
///
/// The kernel reads `W` once per chunk of 8 tokens and `x` once per block of up to 4 experts,
/// so at DeepSeek-V3 shapes (`E = 256`, `H = 7168`) and `T = 64` it moves about 8 x 7.3 MB of
/// `W` plus 64 x 0.9 MB of `x` through L2, comparable with an f32 GEMM of that size; below
/// it the kernel's traffic shrinks towards one read of `W`, while a GEMM's tiles stay mostly
/// idle and it needs a conversion kernel for bf16 `x` first.
pub const GATE_KERNEL_MAX_TOKENS: usize = 64;

/// Most tokens for which the router takes the gate kernel when the tensor-core GEMM
/// (`gate_gemm`, a bf16 `x` and a gate weight that is exactly bf16) can run instead: at 16 to
/// 64 tokens the kernel's reads of `W` per chunk of 8 tokens measured slower than the GEMM
/// (`docs/benchmarks.md`, "The MoE layer (one GPU)").
pub const GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM: usize = 8;

/// Whether the router computes the logits of `tokens` tokens with the gate kernel, when the
/// tensor-core GEMM `gemm_available` to it or not.
pub fn gate_uses_kernel(tokens: usize, gemm_available: bool) -> bool {
    if gemm_available {
        tokens <= GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM
    } else {
        tokens <= GATE_KERNEL_MAX_TOKENS
    }
}

/// Element type of the gate's input `x`: converted to f32 (exactly) as it is read.
pub trait GateInput: Copy + Send + Sync + 'static {
    /// The element as f32.
    fn to_f32(self) -> f32;
    /// Name of the type in the kernel's symbols (`bf16`, `f16`, `f32`).
    const NAME: &'static str;
}

impl GateInput for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    const NAME: &'static str = "bf16";
}

impl GateInput for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    const NAME: &'static str = "f16";
}

impl GateInput for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    const NAME: &'static str = "f32";
}

/// The sizes of a gate: `E` experts over `H` hidden channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateShape {
    /// Number of experts `E` (rows of `W`).
    pub num_experts: usize,
    /// Hidden size `H` (columns of `W` and `x`).
    pub hidden: usize,
}

impl GateShape {
    /// Checks the sizes (and the kernel's limits when `device`: `E <= MAX_EXPERTS`, `H` fits
    /// an i32) and the lengths of a call (`x` `[T, H]`, `weight` `[E, H]`, `logits` `[T, E]`);
    /// returns `T`.
    pub fn check(&self, device: bool, x: usize, weight: usize, logits: usize) -> Result<usize> {
        let (e, h) = (self.num_experts, self.hidden);
        if e == 0 {
            return Err(Error::invalid("num_experts", e, "must be positive"));
        }
        if h == 0 {
            return Err(Error::invalid("hidden", h, "must be positive"));
        }
        if device && e > MAX_EXPERTS {
            return Err(Error::invalid(
                "num_experts",
                e,
                format!("the CUDA gate handles at most {MAX_EXPERTS}"),
            ));
        }
        if device && i32::try_from(h).is_err() {
            return Err(Error::invalid(
                "hidden",
                h,
                format!("the CUDA gate handles at most {}", i32::MAX),
            ));
        }
        if x % h != 0 {
            return Err(Error::invalid(
                "x",
                format!("{x} values"),
                format!("must be whole rows of hidden = {h}"),
            ));
        }
        let t = x / h;
        Error::check_len("weight", e * h, weight)?;
        Error::check_len("logits", t * e, logits)?;
        Ok(t)
    }
}

/// Host twin of the gate kernel: `logits[t, e] = sum_i x[t, i] W[e, i]`, accumulated in f64
/// and rounded once to f32 (the reference the kernel's f32 sums are held to; see the GPU
/// tests for the tolerance).
pub fn gate_logits<T: GateInput>(
    x: &[T],
    weight: &[f32],
    shape: GateShape,
    logits: &mut [f32],
) -> Result<()> {
    shape.check(false, x.len(), weight.len(), logits.len())?;
    let (e, h) = (shape.num_experts, shape.hidden);
    let mut row = vec![0f64; h];
    for (xt, out) in x.chunks_exact(h).zip(logits.chunks_exact_mut(e)) {
        for (r, &v) in row.iter_mut().zip(xt) {
            *r = f64::from(v.to_f32());
        }
        for (o, w) in out.iter_mut().zip(weight.chunks_exact(h)) {
            let dot: f64 = row.iter().zip(w).map(|(a, &b)| a * f64::from(b)).sum();
            *o = dot as f32;
        }
    }
    Ok(())
}

/// The kernel's tile: tokens per chunk and experts per block (the instantiations of
/// `gate.cu`), chosen for `t` tokens and `e` experts on a device of `sm_count` SMs.
///
/// One token, two, or up to four: a chunk of exactly that many, one expert per block (the
/// grid is `E x chunks` blocks, which at `E = 256` covers 132 SMs). More: chunks of 8 tokens
/// and the most experts per block (4, 2 or 1) that still gives every SM a block, as more
/// experts per block read `x` fewer times.
pub fn gate_tile(t: usize, e: usize, sm_count: usize) -> (usize, usize) {
    match t {
        0 | 1 => (1, 1),
        2 => (2, 1),
        3 | 4 => (4, 1),
        _ => {
            let chunks = t.div_ceil(8);
            let eb = [4, 2]
                .into_iter()
                .find(|&eb| e.div_ceil(eb) * chunks >= sm_count)
                .unwrap_or(1);
            (8, eb)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twin_matches_a_naive_product() {
        let shape = GateShape {
            num_experts: 5,
            hidden: 7,
        };
        let x: Vec<bf16> = (0..3 * 7)
            .map(|i| bf16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let w: Vec<f32> = (0..5 * 7).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut logits = vec![f32::NAN; 3 * 5];
        gate_logits(&x, &w, shape, &mut logits).unwrap();
        for t in 0..3 {
            for e in 0..5 {
                let mut want = 0f64;
                for i in 0..7 {
                    want += x[t * 7 + i].to_f64() * f64::from(w[e * 7 + i]);
                }
                assert_eq!(logits[t * 5 + e], want as f32, "[{t}, {e}]");
            }
        }
    }

    #[test]
    fn bad_lengths_name_the_argument() {
        let shape = GateShape {
            num_experts: 4,
            hidden: 8,
        };
        let err =
            |x: usize, w: usize, l: usize| shape.check(true, x, w, l).unwrap_err().to_string();
        assert!(err(12, 32, 4).contains("`x`"));
        assert!(err(16, 31, 8).contains("`weight`"));
        assert!(err(16, 32, 9).contains("`logits`"));
        let wide = GateShape {
            num_experts: MAX_EXPERTS + 1,
            hidden: 8,
        };
        assert!(wide
            .check(true, 8, 8 * (MAX_EXPERTS + 1), MAX_EXPERTS + 1)
            .is_err());
        assert!(wide
            .check(false, 8, 8 * (MAX_EXPERTS + 1), MAX_EXPERTS + 1)
            .is_ok());
        assert_eq!(shape.check(true, 0, 32, 0).unwrap(), 0);
    }

    #[test]
    fn tiles_fill_the_device_and_stop_at_the_threshold() {
        assert_eq!(gate_tile(1, 256, 132), (1, 1));
        assert_eq!(gate_tile(3, 256, 132), (4, 1));
        // 8 tokens: one chunk; 256 blocks of one expert cover 132 SMs.
        assert_eq!(gate_tile(8, 256, 132), (8, 1));
        assert_eq!(gate_tile(16, 256, 132), (8, 2));
        assert_eq!(gate_tile(64, 256, 132), (8, 4));
        assert!(gate_uses_kernel(GATE_KERNEL_MAX_TOKENS, false));
        assert!(!gate_uses_kernel(GATE_KERNEL_MAX_TOKENS + 1, false));
        assert!(gate_uses_kernel(GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM, true));
        assert!(!gate_uses_kernel(
            GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM + 1,
            true
        ));
    }
}
