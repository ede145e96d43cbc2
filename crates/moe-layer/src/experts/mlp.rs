//! [`Mlp`]: a bias-free SwiGLU MLP, the shared experts and the dense layers of a model (and
//! one routed expert's view of the stacked weights, see [`crate::Experts`]).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::error::Error;
use ep_kernels::gemm::fp8::FP8_GATE_UP_BLOCK;
use ep_kernels::gemm::GATE_UP_BLOCK;

/// How an [`Mlp`]'s stacked `gate_up` weight `[2I, H]` holds the `gate_proj` and `up_proj`
/// rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GateUpLayout {
    /// All `gate_proj` rows, then all `up_proj` rows.
    #[default]
    Stacked,
    /// Blocks of [`GATE_UP_BLOCK`] `gate_proj` rows, each followed by the `up_proj` rows of the
    /// same indices (`I` a multiple of [`GATE_UP_BLOCK`]): the layout the device grouped GEMMs'
    /// SwiGLU epilogue reads (`ep_kernels::gemm::gate_up_rows`).
    Blocked,
    /// Blocks of [`FP8_GATE_UP_BLOCK`] (128) `gate_proj` rows, each followed by the matching
    /// `up_proj` rows: one weight scale block each, the layout of fp8 expert shards, whose
    /// gate_up GEMM pairs a gate block's and its up block's tiles
    /// (`ep_kernels::gemm::fp8::grouped_gemm_swiglu_fp8`).
    ScaleBlocks,
}

impl GateUpLayout {
    /// Rows of `gate_proj`, then of `up_proj`, in turn; `None` for [`GateUpLayout::Stacked`].
    pub fn block(self) -> Option<usize> {
        match self {
            GateUpLayout::Stacked => None,
            GateUpLayout::Blocked => Some(GATE_UP_BLOCK),
            GateUpLayout::ScaleBlocks => Some(FP8_GATE_UP_BLOCK),
        }
    }
}

/// A bias-free SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`.
///
/// `gate_proj` and `up_proj` are kept stacked as one `[2I, H]` weight in a [`GateUpLayout`]
/// ([`GateUpLayout::Stacked`] unless made [`GateUpLayout::Blocked`] for the grouped GEMMs).
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[2I, H]` in `layout`.
    gate_up: Tensor,
    layout: GateUpLayout,
    /// `[H, I]`.
    down_proj: Tensor,
}

impl Mlp {
    /// Builds an MLP from `gate_proj` `[I, H]`, `up_proj` `[I, H]` and `down_proj` `[H, I]`,
    /// which must share one dtype and device.
    ///
    /// Returns candle's error type (a bad argument is an [`Error::InvalidArgument`] wrapped
    /// inside, see [`Error::from_candle`]): the experts build their per-expert views with it
    /// inside candle-typed tensor code.
    pub fn new(gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Result<Self> {
        Self::check(&gate_proj, &up_proj, &down_proj)?;
        let gate_up = Tensor::cat(&[&gate_proj, &up_proj], 0)?;
        Self::from_gate_up(gate_up, down_proj)
    }

    /// Builds an MLP from the stacked `gate_up` `[2I, H]` (gate rows, then up rows) and
    /// `down_proj` `[H, I]` without copying them (e.g. one expert's block of stacked expert
    /// weights). Errors as [`Mlp::new`].
    pub fn from_gate_up(gate_up: Tensor, down_proj: Tensor) -> Result<Self> {
        Self::from_parts(gate_up, GateUpLayout::Stacked, down_proj)
    }

    /// Builds an MLP from `gate_up` `[2I, H]` in `layout` and `down_proj` `[H, I]` without
    /// copying them. Errors as [`Mlp::new`], and for a blocked layout when `I` is not a
    /// multiple of its block ([`GateUpLayout::block`]).
    pub fn from_parts(gate_up: Tensor, layout: GateUpLayout, down_proj: Tensor) -> Result<Self> {
        let (two_i, h) = gate_up.dims2().map_err(|_| {
            Error::invalid(
                "gate_up",
                format!("shape {:?}", gate_up.dims()),
                "must be [2 * intermediate, hidden]",
            )
        })?;
        if two_i % 2 != 0 {
            return Err(Error::invalid(
                "gate_up",
                format!("shape {:?}", gate_up.dims()),
                "must have an even number of rows (gate rows and up rows)",
            )
            .into());
        }
        let i = two_i / 2;
        if let Some(b) = layout.block().filter(|b| i % b != 0) {
            return Err(Error::invalid(
                "gate_up",
                format!("shape {:?}", gate_up.dims()),
                format!(
                    "the {layout:?} layout needs an intermediate size that is a multiple of {b}"
                ),
            )
            .into());
        }
        let gate_proj = gate_up.narrow(0, 0, i)?;
        let up_proj = gate_up.narrow(0, i, i)?;
        Self::check(&gate_proj, &up_proj, &down_proj)?;
        debug_assert_eq!(gate_proj.dims(), [i, h]);
        Ok(Self {
            gate_up,
            layout,
            down_proj,
        })
    }

    /// The same MLP with its `gate_up` weight in `layout`: itself (no copy) when it already is,
    /// else with a re-laid copy of `gate_up` (`down_proj` shared). Errors as
    /// [`Mlp::from_parts`].
    pub fn with_layout(&self, layout: GateUpLayout) -> Result<Self> {
        if layout == self.layout {
            return Ok(self.clone());
        }
        let gate_up = relaid_gate_up(&self.gate_up, self.layout, layout)?;
        Self::from_parts(gate_up, layout, self.down_proj.clone())
    }

    fn check(gate_proj: &Tensor, up_proj: &Tensor, down_proj: &Tensor) -> Result<()> {
        let shape = |t: &Tensor| format!("shape {:?}", t.dims());
        let (i, h) = gate_proj.dims2().map_err(|_| {
            Error::invalid(
                "gate_proj",
                shape(gate_proj),
                "must be [intermediate, hidden]",
            )
        })?;
        if up_proj.dims() != [i, h] {
            return Err(Error::invalid(
                "up_proj",
                shape(up_proj),
                format!("must be [{i}, {h}] like gate_proj"),
            )
            .into());
        }
        if down_proj.dims() != [h, i] {
            return Err(Error::invalid(
                "down_proj",
                shape(down_proj),
                format!("must be [{h}, {i}] (gate_proj is [{i}, {h}])"),
            )
            .into());
        }
        for (name, t) in [("up_proj", up_proj), ("down_proj", down_proj)] {
            if t.dtype() != gate_proj.dtype() {
                return Err(Error::invalid(
                    name,
                    format!("dtype {:?}", t.dtype()),
                    format!("must be {:?} like gate_proj", gate_proj.dtype()),
                )
                .into());
            }
            if !t.device().same_device(gate_proj.device()) {
                return Err(Error::invalid(
                    name,
                    format!("device {:?}", t.device()),
                    format!("must be {:?} like gate_proj", gate_proj.device()),
                )
                .into());
            }
        }
        Ok(())
    }

    /// Loads `gate_proj.weight` `[I, H]`, `up_proj.weight` `[I, H]` and `down_proj.weight`
    /// `[H, I]` under `vb` (e.g. the layer's `mlp.shared_experts`, or `mlp` of a dense layer).
    /// A mis-shaped tensor gives an error naming its full path, the expected and the found shape.
    /// A block-scaled fp8 projection (with its `weight_scale_inv`) is dequantized to the
    /// builder's dtype ([`crate::fp8::load_weight`]).
    pub fn load(vb: VarBuilder, hidden: usize, intermediate: usize) -> Result<Self> {
        let load = |name: &str, n: usize, k: usize| -> Result<Tensor> {
            Ok(crate::fp8::load_weight(&vb.pp(name), n, k)?)
        };
        let gate = load("gate_proj", intermediate, hidden)?;
        let up = load("up_proj", intermediate, hidden)?;
        let down = load("down_proj", hidden, intermediate)?;
        Self::new(gate, up, down)
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.gate_up.dims()[1]
    }

    /// Bytes of its weights.
    pub fn weight_bytes(&self) -> usize {
        tensor_bytes(&self.gate_up) + tensor_bytes(&self.down_proj)
    }

    /// Inner width `I`.
    pub fn intermediate_size(&self) -> usize {
        self.down_proj.dims()[1]
    }

    /// Weight dtype.
    pub fn dtype(&self) -> DType {
        self.gate_up.dtype()
    }

    /// Weight device.
    pub fn device(&self) -> &Device {
        self.gate_up.device()
    }

    /// `gate_proj` and `up_proj` stacked, `[2I, H]`, in [`Mlp::gate_up_layout`].
    pub fn gate_up(&self) -> &Tensor {
        &self.gate_up
    }

    /// How [`Mlp::gate_up`] holds the gate and up rows.
    pub fn gate_up_layout(&self) -> GateUpLayout {
        self.layout
    }

    /// `gate_proj` weight `[I, H]`: a view of `gate_up` when stacked, else a copy.
    pub fn gate_proj(&self) -> Result<Tensor> {
        self.half(0)
    }

    /// `up_proj` weight `[I, H]`: a view of `gate_up` when stacked, else a copy.
    pub fn up_proj(&self) -> Result<Tensor> {
        self.half(1)
    }

    /// Gate (`which` 0) or up (1) rows of `gate_up`.
    fn half(&self, which: usize) -> Result<Tensor> {
        let (i, h) = (self.intermediate_size(), self.hidden_size());
        match self.layout.block() {
            None => self.gate_up.narrow(0, which * i, i),
            Some(b) => self
                .gate_up
                .reshape((i / b, 2, b, h))?
                .narrow(1, which, 1)?
                .contiguous()?
                .reshape((i, h)),
        }
    }

    /// `down_proj` weight `[H, I]`.
    pub fn down_proj(&self) -> &Tensor {
        &self.down_proj
    }

    /// Applies the MLP to `x` `[..., H]` of any float dtype: computed in the weights' dtype,
    /// returned in `x`'s dtype and shape. Returns candle's error type, as a [`Module`] does
    /// (a bad `x` is an [`Error::InvalidArgument`] wrapped inside).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.hidden_size();
        let dims = x.dims().to_vec();
        if dims.last() != Some(&h) {
            return Err(Error::invalid(
                "x",
                format!("shape {dims:?}"),
                format!("last dimension must be hidden_size = {h}"),
            )
            .into());
        }
        let rows: usize = dims[..dims.len() - 1].iter().product();
        if rows == 0 {
            return crate::empty::empty(dims, x.dtype(), x.device());
        }
        let xs = x.reshape((rows, h))?.to_dtype(self.dtype())?;
        let i = self.intermediate_size();
        let act = match self.layout.block() {
            // Every operand contiguous (the weights are contiguous row blocks of `gate_up`).
            None => {
                let gate = xs.matmul(&self.gate_up.narrow(0, 0, i)?.t()?)?.silu()?;
                let up = xs.matmul(&self.gate_up.narrow(0, i, i)?.t()?)?;
                (gate * up)?
            }
            // One GEMM over [2I, H], then SwiGLU of each block's gate and up columns: one
            // kernel on CUDA (bf16), strided views elsewhere.
            Some(b) => {
                let hu = xs.matmul(&self.gate_up.t()?)?;
                #[cfg(feature = "cuda")]
                if self.layout == GateUpLayout::Blocked
                    && hu.device().is_cuda()
                    && hu.dtype() == DType::BF16
                {
                    return swiglu_rows_cuda(&hu)?
                        .matmul(&self.down_proj.t()?)?
                        .to_dtype(x.dtype())?
                        .reshape(dims);
                }
                let hu = hu.reshape((rows, i / b, 2, b))?;
                let gate = hu.narrow(2, 0, 1)?.silu()?;
                (gate * hu.narrow(2, 1, 1)?)?.reshape((rows, i))?
            }
        };
        let y = act.matmul(&self.down_proj.t()?)?;
        y.to_dtype(x.dtype())?.reshape(dims)
    }
}

/// A `[2I, H]` gate_up weight in layout `from`, re-laid (copied) into layout `to` (the same
/// tensor when they agree). Errors when either is blocked and `I` is not a multiple of its
/// block.
pub(crate) fn relaid_gate_up(
    gate_up: &Tensor,
    from: GateUpLayout,
    to: GateUpLayout,
) -> Result<Tensor> {
    if from == to {
        return Ok(gate_up.clone());
    }
    let (two_i, h) = gate_up.dims2()?;
    let i = two_i / 2;
    for b in [from.block(), to.block()].into_iter().flatten() {
        if two_i % 2 != 0 || i % b != 0 {
            return Err(Error::invalid(
                "layout",
                format!("{to:?}"),
                format!("needs an intermediate size that is a multiple of {b}, not {i}"),
            )
            .into());
        }
    }
    // Stacked is [2, I/B, B, H] and blocked [I/B, 2, B, H] for any B: a swap of the first two
    // dims goes between them.
    let stacked = match from.block() {
        None => gate_up.clone(),
        Some(b) => gate_up
            .reshape((i / b, 2, b, h))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((two_i, h))?,
    };
    match to.block() {
        None => Ok(stacked),
        Some(b) => stacked
            .reshape((2, i / b, b, h))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((two_i, h)),
    }
}

/// SwiGLU of `h` (`[rows, 2I]` bf16 on CUDA, contiguous, columns in the blocked gate_up order)
/// into a new `[rows, I]` tensor on candle's stream (`ep_kernels::gemm::swiglu_rows_bf16_cuda`).
#[cfg(feature = "cuda")]
fn swiglu_rows_cuda(h: &Tensor) -> crate::error::Result<Tensor> {
    use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
    use half::bf16;
    let Device::Cuda(dev) = h.device() else {
        return Err(Error::invalid(
            "h",
            format!("a tensor on {:?}", h.device()),
            "must be on CUDA",
        ));
    };
    let (rows, two_i) = h.dims2()?;
    let i = two_i / 2;
    let stream = dev.cuda_stream();
    let mut act = alloc_uninit::<bf16>(&stream, rows * i)?;
    {
        let h_d = DeviceTensor::new("h", h)?;
        let mut act_v = act.slice_mut(0..rows * i);
        ep_kernels::gemm::swiglu_rows_bf16_cuda(
            &stream,
            &h_d.view::<bf16>()?,
            rows,
            i,
            &mut act_v,
        )?;
    }
    Ok(wrap(act, (rows, i), dev))
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Mlp::forward(self, xs)
    }
}

/// Bytes of a tensor's elements.
pub(crate) fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn blocked_layout_holds_the_same_mlp() -> Result<()> {
        let dev = Device::Cpu;
        let (h, i) = (12, 24);
        let gate = Tensor::randn(0f32, 1.0, (i, h), &dev)?;
        let up = Tensor::randn(0f32, 1.0, (i, h), &dev)?;
        let down = Tensor::randn(0f32, 1.0, (h, i), &dev)?;
        let stacked = Mlp::new(gate.clone(), up.clone(), down)?;
        let blocked = stacked.with_layout(GateUpLayout::Blocked)?;
        assert_eq!(blocked.gate_up_layout(), GateUpLayout::Blocked);
        // Row 16b + r of the blocked weight is gate row 8b + r, row 16b + 8 + r up row 8b + r.
        let rows = blocked.gate_up().to_vec2::<f32>()?;
        let (g, u) = (gate.to_vec2::<f32>()?, up.to_vec2::<f32>()?);
        for j in 0..i {
            let (gr, ur) = ep_kernels::gemm::gate_up_rows(j);
            assert_eq!(rows[gr], g[j], "gate row {j}");
            assert_eq!(rows[ur], u[j], "up row {j}");
        }
        assert_eq!(max_abs_diff(&blocked.gate_proj()?, &gate), 0.0);
        assert_eq!(max_abs_diff(&blocked.up_proj()?, &up), 0.0);
        let back = blocked.with_layout(GateUpLayout::Stacked)?;
        assert_eq!(max_abs_diff(back.gate_up(), stacked.gate_up()), 0.0);
        let x = Tensor::randn(0f32, 1.0, (3, 5, h), &dev)?;
        let (ys, yb) = (stacked.forward(&x)?, blocked.forward(&x)?);
        assert_eq!(yb.dims(), [3, 5, h]);
        assert!(max_abs_diff(&ys, &yb) < 1e-4);
        Ok(())
    }

    #[test]
    fn scale_blocks_alternate_128_gate_rows_and_128_up_rows() -> Result<()> {
        let dev = Device::Cpu;
        let (h, i) = (3, 256);
        let gate = Tensor::randn(0f32, 1.0, (i, h), &dev)?;
        let up = Tensor::randn(0f32, 1.0, (i, h), &dev)?;
        let down = Tensor::randn(0f32, 1.0, (h, i), &dev)?;
        let blocked =
            Mlp::new(gate.clone(), up.clone(), down)?.with_layout(GateUpLayout::Blocked)?;
        let scaled = blocked.with_layout(GateUpLayout::ScaleBlocks)?;
        let rows = scaled.gate_up().to_vec2::<f32>()?;
        let (g, u) = (gate.to_vec2::<f32>()?, up.to_vec2::<f32>()?);
        for j in 0..i {
            assert_eq!(rows[j / 128 * 256 + j % 128], g[j], "gate row {j}");
            assert_eq!(rows[j / 128 * 256 + 128 + j % 128], u[j], "up row {j}");
        }
        assert_eq!(max_abs_diff(&scaled.up_proj()?, &up), 0.0);
        let x = Tensor::randn(0f32, 1.0, (4, h), &dev)?;
        assert!(max_abs_diff(&blocked.forward(&x)?, &scaled.forward(&x)?) < 1e-4);
        Ok(())
    }

    #[test]
    fn blocked_layout_needs_a_multiple_of_the_block() -> Result<()> {
        let dev = Device::Cpu;
        let (h, i) = (4, 6);
        let m = Mlp::new(
            Tensor::zeros((i, h), DType::F32, &dev)?,
            Tensor::zeros((i, h), DType::F32, &dev)?,
            Tensor::zeros((h, i), DType::F32, &dev)?,
        )?;
        let err = m
            .with_layout(GateUpLayout::Blocked)
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of 8"), "{err}");
        let gu = Tensor::zeros((2 * i, h), DType::F32, &dev)?;
        let down = Tensor::zeros((h, i), DType::F32, &dev)?;
        assert!(Mlp::from_parts(gu, GateUpLayout::Blocked, down).is_err());
        Ok(())
    }
}
