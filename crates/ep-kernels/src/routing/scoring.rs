//! The scoring functions of the router (sigmoid, softmax over a token's expert logits), as
//! IEEE f32 operations in a fixed order so that the routing kernel (`routing.cu`, which mirrors
//! every function here) and the host twin give the same bits.
//!
//! Neither side uses its platform `exp` (CUDA's `expf` and the C library's `expf` may differ in
//! the last bit): [`exp_f32`] is a range reduction plus a polynomial built only from correctly
//! rounded `*`, `+`, fused multiply-add and exact scalings, so both sides agree exactly. Its
//! error is within 2 ulp of `e^x` (tested against f64 below).

// The constants as bit patterns, written the same way in `routing.cu`.
/// `log2(e)` rounded to f32.
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
/// High part of `ln 2` (`0.693145751953125`: few mantissa bits, so `k * LN2_HI` is exact).
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
/// `ln 2 - LN2_HI` rounded to f32.
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// Taylor coefficients `1/7!, 1/6!, ..., 1/2!` of `e^r` rounded to f32 (then `1`, `1`).
const TAYLOR: [f32; 6] = [
    f32::from_bits(0x3950_0d01),
    f32::from_bits(0x3ab6_0b61),
    f32::from_bits(0x3c08_8889),
    f32::from_bits(0x3d2a_aaab),
    f32::from_bits(0x3e2a_aaab),
    0.5,
];
/// Inputs are clamped to this range first (outside it the result is already `0` or `inf`).
const CLAMP: (f32, f32) = (-110.0, 100.0);
/// Lanes of the routing kernel's warp: the softmax sum is reduced in their order.
const LANES: usize = 32;

/// `e^x` in f32 (NaN for NaN, `0` far below zero, `inf` above `ln(f32::MAX)`); the device's
/// `exp_f32` in `routing.cu` returns the same bits.
pub fn exp_f32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.max(CLAMP.0).min(CLAMP.1);
    // x = k ln2 + r, |r| <= ln2 / 2 (plus rounding).
    let kf = (x * LOG2E).round_ties_even();
    let r = (-kf).mul_add(LN2_HI, x);
    let r = (-kf).mul_add(LN2_LO, r);
    let mut p = TAYLOR[0];
    for c in &TAYLOR[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // 2^k in two exact factors, each a normal f32 (|k| <= 159): only the last product rounds
    // (into subnormals or to infinity where it must).
    let k = kf as i32;
    let k1 = k / 2;
    p * pow2(k1) * pow2(k - k1)
}

/// `2^k` for `-126 <= k <= 127`.
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// Softmax of one token's `logits` into `out` (same length): `e^(l - max) / sum`, the sum
/// taken as the kernel's warp takes it: lane `i` adds the terms `j = i, i + 32, ...` in order,
/// then the 32 partial sums are combined by a butterfly (`p[i] + p[i ^ off]`, `off` = 16, 8,
/// 4, 2, 1).
pub fn softmax(logits: &[f32], out: &mut [f32]) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let mut part = [0f32; LANES];
    for (j, (&l, o)) in logits.iter().zip(out.iter_mut()).enumerate() {
        *o = exp_f32(l - max);
        part[j % LANES] += *o;
    }
    let mut off = LANES / 2;
    while off > 0 {
        let prev = part;
        for (i, p) in part.iter_mut().enumerate() {
            *p = prev[i] + prev[i ^ off];
        }
        off /= 2;
    }
    let sum = part[0];
    for o in out.iter_mut() {
        *o /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the f64 `want` (rounded).
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w {
            return 0.0;
        }
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst: f64 = 0.0;
        let mut x = -103.0f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            if want >= f32::MIN_POSITIVE as f64 {
                worst = worst.max(ulps(exp_f32(x), want));
            }
            x += 0.000_913;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        // Subnormal results: close to f64 in absolute terms.
        let x = -100.0f32;
        assert!((exp_f32(x) as f64 - (x as f64).exp()).abs() < 2e-45);
        assert!(exp_f32(-100.0) > 0.0);
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }

    #[test]
    fn softmax_matches_f64_and_sums_to_one() {
        let logits: Vec<f32> = (0..77)
            .map(|i| ((i * 37 % 101) as f32) * 0.13 - 6.0)
            .collect();
        let mut out = vec![0f32; logits.len()];
        softmax(&logits, &mut out);
        let max = logits
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, |m, l| m.max(l as f64));
        let ex: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let sum: f64 = ex.iter().sum();
        for (o, e) in out.iter().zip(&ex) {
            let want = e / sum;
            assert!(((*o as f64) - want).abs() <= 1e-6 * want, "{o} vs {want}");
        }
        let total: f64 = out.iter().map(|&o| o as f64).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
