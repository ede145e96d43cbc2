//! [`ExpertInput`]: the rows the experts run over, float or e4m3 with their scales.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// The rows the experts run over: rows in a float dtype, or e4m3 rows with their 1 x 128 f32
/// scales (`[.., H / 128]`, what an fp8 dispatch delivers).
#[derive(Clone, Debug)]
pub struct ExpertInput {
    /// The rows (`[N, H]` or `[L, M, H]`).
    pub x: Tensor,
    /// With e4m3 rows: their scales, one per row per 128 channels.
    pub scales: Option<Tensor>,
}

impl ExpertInput {
    /// Rows in a float dtype.
    pub fn plain(x: &Tensor) -> Self {
        Self {
            x: x.clone(),
            scales: None,
        }
    }

    /// The rows in `dtype` (e4m3 rows dequantized).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        Ok(match &self.scales {
            Some(s) => ep_runtime::cast::per_token_cast_back(&self.x, s, dtype)?,
            None => self.x.to_dtype(dtype)?,
        })
    }
}
