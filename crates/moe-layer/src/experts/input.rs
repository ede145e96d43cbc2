//! [`ExpertInput`]: the rows the experts run over, float or e4m3 with their scales.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

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
            None => self.float_rows()?.to_dtype(dtype)?,
        })
    }

    /// The rows of an input without scales ([`float_rows`]).
    pub(crate) fn float_rows(&self) -> Result<&Tensor> {
        float_rows(&self.x)
    }
}

/// `x` as rows without scales, which must be in a float dtype: e4m3 rows mean nothing without
/// their scales.
pub(crate) fn float_rows(x: &Tensor) -> Result<&Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 | DType::F32 | DType::F64 => Ok(x),
        other => Err(Error::invalid(
            "x",
            format!("{other:?} rows without scales"),
            "rows without scales must be bf16, f16, f32 or f64 (e4m3 rows come with their \
             1 x 128 scales: `ExpertInput::scales`, as a fp8 dispatch delivers them)",
        )),
    }
}
