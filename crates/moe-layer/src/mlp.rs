//! [`Mlp`]: a bias-free SwiGLU MLP, the shared experts and the dense layers of a model (and
//! one routed expert's view of the stacked weights, see [`crate::Experts`]).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::error::Error;

/// A bias-free SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`.
///
/// `gate_proj` and `up_proj` are kept stacked as one `[2I, H]` weight (`gate_proj` rows first),
/// the layout the grouped GEMMs read; [`Mlp::gate_proj`] and [`Mlp::up_proj`] are views of it.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[2I, H]`: gate rows, then up rows.
    gate_up: Tensor,
    /// `[I, H]`, a view of `gate_up`.
    gate_proj: Tensor,
    /// `[I, H]`, a view of `gate_up`.
    up_proj: Tensor,
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
                "must have an even number of rows (gate rows, then up rows)",
            )
            .into());
        }
        let i = two_i / 2;
        let gate_proj = gate_up.narrow(0, 0, i)?;
        let up_proj = gate_up.narrow(0, i, i)?;
        Self::check(&gate_proj, &up_proj, &down_proj)?;
        debug_assert_eq!(gate_proj.dims(), [i, h]);
        Ok(Self {
            gate_up,
            gate_proj,
            up_proj,
            down_proj,
        })
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
    pub fn load(vb: VarBuilder, hidden: usize, intermediate: usize) -> Result<Self> {
        let gate = vb.pp("gate_proj").get((intermediate, hidden), "weight")?;
        let up = vb.pp("up_proj").get((intermediate, hidden), "weight")?;
        let down = vb.pp("down_proj").get((hidden, intermediate), "weight")?;
        Self::new(gate, up, down)
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.gate_proj.dims()[1]
    }

    /// Inner width `I`.
    pub fn intermediate_size(&self) -> usize {
        self.gate_proj.dims()[0]
    }

    /// Weight dtype.
    pub fn dtype(&self) -> DType {
        self.gate_proj.dtype()
    }

    /// Weight device.
    pub fn device(&self) -> &Device {
        self.gate_proj.device()
    }

    /// `gate_proj` and `up_proj` stacked, `[2I, H]`.
    pub fn gate_up(&self) -> &Tensor {
        &self.gate_up
    }

    /// `gate_proj` weight `[I, H]`.
    pub fn gate_proj(&self) -> &Tensor {
        &self.gate_proj
    }

    /// `up_proj` weight `[I, H]`.
    pub fn up_proj(&self) -> &Tensor {
        &self.up_proj
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
        // Every operand contiguous (the weights are contiguous row blocks of `gate_up`): on
        // CUDA a strided candle op uploads its layout from host memory, which a CUDA graph
        // capture would record by address (the MLP runs inside captured decode steps).
        let gate = xs.matmul(&self.gate_proj.t()?)?.silu()?;
        let up = xs.matmul(&self.up_proj.t()?)?;
        let y = (gate * up)?.matmul(&self.down_proj.t()?)?;
        y.to_dtype(x.dtype())?.reshape(dims)
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Mlp::forward(self, xs)
    }
}
