//! Per-token 1x128 fp8 e4m3 quantisation, as sent on the wire by fp8 dispatch.
//!
//! For every token and every group of [`crate::FP8_GROUP`] hidden channels:
//! `amax = max(|x|)` clamped to at least [`AMAX_MIN`], `scale = amax / 448`
//! (optionally rounded up to a power of two, "UE8M0"), `q = e4m3(x / scale)` with
//! round-to-nearest-even and saturation to ±448. Dequantisation is `bf16(q * scale)`.

pub mod host;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use host::{dequantize, quantize, round_scale_ue8m0, ScaleFormat, AMAX_MIN, E4M3_MAX};
