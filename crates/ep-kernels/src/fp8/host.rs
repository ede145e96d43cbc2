//! Host twin of the fp8 cast kernels.

use crate::error::{Error, Result};
use crate::FP8_GROUP;
use float8::F8E4M3;
use half::bf16;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest `amax` used to derive a scale (avoids a zero scale for all-zero groups).
pub const AMAX_MIN: f32 = 1e-4;

/// How per-group scales are represented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u32)]
pub enum ScaleFormat {
    /// Any positive f32: `amax / 448`.
    #[default]
    Float = 0,
    /// A power of two (an unsigned 8-bit exponent, "UE8M0"): `amax / 448` rounded up.
    Ue8m0 = 1,
}

/// Rounds a positive normal f32 up to the next power of two (exact powers stay).
/// Bit-level, so host and device agree exactly.
pub fn round_scale_ue8m0(scale: f32) -> f32 {
    let bits = scale.to_bits();
    let mut exp = (bits >> 23) & 0xff;
    if bits & 0x7f_ffff != 0 {
        exp += 1;
    }
    f32::from_bits(exp << 23)
}

/// The scale of one group from its absolute maximum.
pub fn group_scale(amax: f32, format: ScaleFormat) -> f32 {
    let s = amax.max(AMAX_MIN) / E4M3_MAX;
    match format {
        ScaleFormat::Float => s,
        ScaleFormat::Ue8m0 => round_scale_ue8m0(s),
    }
}

fn check_hidden(hidden: usize) -> Result<()> {
    if hidden == 0 || hidden % FP8_GROUP != 0 {
        return Err(Error::invalid(
            "hidden",
            hidden,
            format!("fp8 needs a positive multiple of {FP8_GROUP}"),
        ));
    }
    Ok(())
}

/// Quantises `x: [num_tokens, hidden]` (row-major) into `q: [num_tokens, hidden]` and
/// `scales: [num_tokens, hidden / 128]`.
pub fn quantize(
    x: &[bf16],
    num_tokens: usize,
    hidden: usize,
    format: ScaleFormat,
) -> Result<(Vec<F8E4M3>, Vec<f32>)> {
    check_hidden(hidden)?;
    Error::check_len("x", num_tokens * hidden, x.len())?;
    let groups = hidden / FP8_GROUP;
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(num_tokens * groups);
    for chunk in x.chunks_exact(FP8_GROUP) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let scale = group_scale(amax, format);
        scales.push(scale);
        q.extend(chunk.iter().map(|v| F8E4M3::from_f32(v.to_f32() / scale)));
    }
    Ok((q, scales))
}

/// Dequantises `q: [num_tokens, hidden]` with `scales: [num_tokens, hidden / 128]` into bf16.
pub fn dequantize(
    q: &[F8E4M3],
    scales: &[f32],
    num_tokens: usize,
    hidden: usize,
) -> Result<Vec<bf16>> {
    check_hidden(hidden)?;
    Error::check_len("x", num_tokens * hidden, q.len())?;
    Error::check_len("scales", num_tokens * (hidden / FP8_GROUP), scales.len())?;
    Ok(q.chunks_exact(FP8_GROUP)
        .zip(scales)
        .flat_map(|(chunk, &s)| chunk.iter().map(move |v| bf16::from_f32(v.to_f32() * s)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn ue8m0_rounds_up_to_powers_of_two() {
        assert_eq!(round_scale_ue8m0(1.0), 1.0);
        assert_eq!(round_scale_ue8m0(1.5), 2.0);
        assert_eq!(round_scale_ue8m0(0.3), 0.5);
        assert_eq!(round_scale_ue8m0(0.25), 0.25);
    }

    #[test]
    fn round_trip_error_is_within_e4m3_precision() {
        let mut rng = rand::rng();
        let (t, h) = (7, 256);
        let x: Vec<bf16> = (0..t * h)
            .map(|_| {
                bf16::from_f32(rng.random_range(-3.0f32..3.0) * 10f32.powi(rng.random_range(-2..2)))
            })
            .collect();
        for format in [ScaleFormat::Float, ScaleFormat::Ue8m0] {
            let (q, s) = quantize(&x, t, h, format).unwrap();
            let y = dequantize(&q, &s, t, h).unwrap();
            for g in 0..t * h / FP8_GROUP {
                let xs = &x[g * FP8_GROUP..(g + 1) * FP8_GROUP];
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                for (a, b) in xs.iter().zip(&y[g * FP8_GROUP..(g + 1) * FP8_GROUP]) {
                    // e4m3 has 3 mantissa bits: relative step 1/8, half of it when rounding,
                    // plus subnormal steps relative to the group's amax, plus bf16 rounding.
                    let err = (a.to_f32() - b.to_f32()).abs();
                    let tol = a.to_f32().abs() / 16.0 + amax * 2f32.powi(-9) * 2.0 + 1e-6;
                    assert!(err <= tol, "{a} vs {b} (amax {amax}, {format:?})");
                }
            }
        }
    }

    #[test]
    fn rejects_hidden_not_multiple_of_128() {
        let e = quantize(&[bf16::ONE; 100], 1, 100, ScaleFormat::Float)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hidden") && e.contains("100") && e.contains("128"),
            "{e}"
        );
    }
}
