//! Dense layers on block-scaled fp8 weights, for the parts of a model outside the experts that
//! DeepSeek's checkpoints ship in fp8 (the attention projections, the dense layers' MLPs):
//! [`Fp8Linear`] `y = x W^T (+ b)`, [`Fp8Mlp`], a SwiGLU MLP whose gate and up projections
//! run as one GEMM, and [`Fp8BatchedLinear`], one weight per batch of rows (MLA's per-head
//! slices of `kv_b_proj` in its absorbed form).
//!
//! A call quantizes its rows 1 x 128 once (as the experts' rows, `per_token_cast_to_fp8`) and
//! runs the experts' block-scaled fp8 GEMM (`ep_kernels::gemm::fp8`) with one group: the
//! tile-less GEMV for at most [`GEMV_ROWS_PER_PASS`] rows (a decode step: the weights are read
//! once, K split over several warps when the output rows are few), CUTLASS tiles beyond
//! ([`Fp8Linear::tiles_for`]; measured in `docs/benchmarks.md`, "Dense fp8 projections"). Output in bf16 on CUDA. On the CPU the same functions run on the
//! kernels' host twins (the tests' reference; a CPU model dequantizes at load instead).

use candle_core::{DType, Device, Tensor};
use ep_kernels::gemm::fp8::{self as gemm_fp8, FP8_BLOCK, GEMV_K_MULTIPLE, GEMV_ROWS_PER_PASS};
use ep_kernels::gemm::{GemmTiles, GroupLayout, GroupedGemmShape};

use crate::error::{Error, Result};
use crate::fp8::Fp8Weight;

mod batched;
#[cfg(feature = "cuda")]
mod cuda;
mod host;

pub use batched::Fp8BatchedLinear;

/// A layer's GEMM workspace (CUDA: created at its first call).
#[cfg(feature = "cuda")]
type Workspace = cuda::Workspace;
/// A layer's GEMM workspace (nothing on the CPU).
#[cfg(not(feature = "cuda"))]
#[derive(Debug, Default)]
struct Workspace(());

/// Most rows [`Fp8Linear::tiles_for`] gives the masked 64 x 128 tiles (one block of the rows);
/// more take the contiguous 128 x 256 tiles.
pub const NARROW_MAX_ROWS: usize = 64;

/// A linear layer on a block-scaled fp8 weight `[n, k]` (and a float bias `[n]`).
#[derive(Debug)]
pub struct Fp8Linear {
    weight: Fp8Weight,
    bias: Option<Tensor>,
    workspace: Workspace,
}

impl Fp8Linear {
    /// Whether a `[n, k]` weight runs on the fp8 GEMMs: `k` a multiple of 128 (the rows' 1 x 128
    /// scales), `n` of 16 (16-byte rows of e4m3). Other shapes stay dequantized.
    pub fn takes(n: usize, k: usize) -> bool {
        n > 0 && k > 0 && k % FP8_BLOCK == 0 && n % 16 == 0
    }

    /// The layer of `weight` (and `bias`, `[n]`, any float dtype); an error when
    /// [`Fp8Linear::takes`] refuses the shape or the bias does not fit.
    pub fn new(weight: Fp8Weight, bias: Option<Tensor>) -> Result<Self> {
        let (n, k) = weight.dims();
        if !Self::takes(n, k) {
            return Err(Error::invalid(
                "fp8 weight",
                format!("[{n}, {k}]"),
                "the fp8 GEMMs take k a multiple of 128 and n of 16",
            ));
        }
        if let Some(b) = &bias {
            if b.dims() != [n] {
                return Err(Error::invalid(
                    "bias",
                    format!("{:?}", b.dims()),
                    format!("must be [{n}]"),
                ));
            }
        }
        Ok(Self {
            weight,
            bias,
            workspace: Workspace::default(),
        })
    }

    /// The fp8 weight.
    pub fn weight(&self) -> &Fp8Weight {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Bytes of the e4m3 values, their scales and the bias.
    pub fn weight_bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        b(self.weight.q()) + b(self.weight.scale()) + self.bias.as_ref().map_or(0, b)
    }

    /// The kernel [`Fp8Linear::forward`] runs for `rows` rows of reduction length `k`: the
    /// tile-less GEMV up to [`GEMV_ROWS_PER_PASS`] rows (one pass over the weights), the masked
    /// 64 x 128 tiles up to [`NARROW_MAX_ROWS`], the contiguous tiles beyond
    /// (`docs/benchmarks.md`, "Dense fp8 projections").
    pub fn tiles_for(rows: usize, k: usize) -> GemmTiles {
        if rows <= GEMV_ROWS_PER_PASS && k % GEMV_K_MULTIPLE == 0 {
            GemmTiles::Gemv
        } else if rows <= NARROW_MAX_ROWS {
            GemmTiles::Narrow
        } else {
            GemmTiles::Auto
        }
    }

    /// `x [.., k]` (any float dtype) times the weight: `[.., n]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let k = self.weight.dims().1;
        let rows = x.elem_count() / k.max(1);
        self.forward_tiles(x, Self::tiles_for(rows, k))
    }

    /// [`Fp8Linear::forward`] with the kernel chosen by the caller (benchmarks):
    /// [`GemmTiles::Gemv`] or [`GemmTiles::Narrow`] over one masked block of the rows, the
    /// other tiles over the contiguous layout.
    pub fn forward_tiles(&self, x: &Tensor, tiles: GemmTiles) -> Result<Tensor> {
        let (n, k) = self.weight.dims();
        let mut dims = x.dims().to_vec();
        if dims.last() != Some(&k) {
            return Err(Error::invalid(
                "x",
                format!("{dims:?}"),
                format!("the last dimension must be the weight's k = {k}"),
            ));
        }
        let rows = x.elem_count() / k;
        let x2 = x.reshape((rows, k))?;
        let (q, s) = quantize(&x2)?;
        let y = self.gemm(&q, &s, tiles)?;
        let y = match &self.bias {
            Some(b) => y
                .to_dtype(x.dtype())?
                .broadcast_add(&b.to_dtype(x.dtype())?)?,
            None => y.to_dtype(x.dtype())?,
        };
        if let Some(last) = dims.last_mut() {
            *last = n;
        }
        Ok(y.reshape(dims)?)
    }

    /// The bf16 `[rows, n]` product of cast rows `q`, `s` and the weight (no bias).
    fn gemm(&self, q: &Tensor, s: &Tensor, tiles: GemmTiles) -> Result<Tensor> {
        let w = &self.weight;
        gemm(w.q(), w.scale(), &self.workspace, 1, q, s, tiles)
    }
}

/// A SwiGLU MLP `down(silu(gate(x)) * up(x))` on block-scaled fp8 weights: the gate and up
/// rows as one `[2I, H]` GEMM, then SwiGLU and the down GEMM's 1 x 128 row cast in one pass,
/// then the down GEMM (the experts' recipe, one group).
#[derive(Debug)]
pub struct Fp8Mlp {
    gate_up: Fp8Linear,
    down: Fp8Linear,
}

impl Fp8Mlp {
    /// Whether an MLP of hidden size `h` and inner width `i` runs on the fp8 GEMMs (`h` and `i`
    /// multiples of 128: no scale block mixes gate and up rows).
    pub fn takes(h: usize, i: usize) -> bool {
        Fp8Linear::takes(2 * i, h) && Fp8Linear::takes(h, i) && i % FP8_BLOCK == 0
    }

    /// The MLP of `gate` and `up` (`[I, H]`) and `down` (`[H, I]`); an error when
    /// [`Fp8Mlp::takes`] refuses the sizes or they disagree.
    pub fn new(gate: &Fp8Weight, up: &Fp8Weight, down: Fp8Weight) -> Result<Self> {
        let (i, h) = gate.dims();
        if up.dims() != (i, h) || down.dims() != (h, i) || !Self::takes(h, i) {
            return Err(Error::invalid(
                "fp8 mlp",
                format!(
                    "gate {:?}, up {:?}, down {:?}",
                    gate.dims(),
                    up.dims(),
                    down.dims()
                ),
                "needs gate and up [I, H], down [H, I], H and I multiples of 128",
            ));
        }
        // Joined on the host at load (candle has no e4m3 copy kernels on CUDA).
        let device = gate.q().device().clone();
        let cat = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
            let (a, b) = (a.to_device(&Device::Cpu)?, b.to_device(&Device::Cpu)?);
            Ok(Tensor::cat(&[a, b], 0)?.to_device(&device)?)
        };
        let gate_up = Fp8Weight::new(
            "gate_up_proj",
            cat(gate.q(), up.q())?,
            cat(gate.scale(), up.scale())?,
        )?;
        Ok(Self {
            gate_up: Fp8Linear::new(gate_up, None)?,
            down: Fp8Linear::new(down, None)?,
        })
    }

    /// `(hidden, intermediate)`.
    pub fn dims(&self) -> (usize, usize) {
        let (h, i) = self.down.weight.dims();
        (h, i)
    }

    /// Bytes of the weights and scales.
    pub fn weight_bytes(&self) -> usize {
        self.gate_up.weight_bytes() + self.down.weight_bytes()
    }

    /// `x [.., H]` (any float dtype) through the MLP: `[.., H]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (h, i) = self.dims();
        let dims = x.dims().to_vec();
        if dims.last() != Some(&h) {
            return Err(Error::invalid(
                "x",
                format!("{dims:?}"),
                format!("the last dimension must be the hidden size {h}"),
            ));
        }
        let rows = x.elem_count() / h;
        let (q, s) = quantize(&x.reshape((rows, h))?)?;
        let gu = self.gate_up.gemm(&q, &s, Fp8Linear::tiles_for(rows, h))?;
        let (aq, as_) = swiglu_quantize(&gu, i)?;
        let y = self.down.gemm(&aq, &as_, Fp8Linear::tiles_for(rows, i))?;
        Ok(y.to_dtype(x.dtype())?.reshape(dims)?)
    }
}

/// `x [rows, k]` as e4m3 rows with `[rows, k / 128]` f32 scales (bf16 rounding first, as the
/// device cast reads bf16).
fn quantize(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = x.to_dtype(DType::BF16)?.contiguous()?;
    Ok(ep_runtime::cast::per_token_cast_to_fp8(&x, false)?)
}

/// The bf16 `[rows, n]` product of rows `q` (`[rows, k]` e4m3, scales `s`) and the weights
/// `w_q` (`[groups, n, k]` or `[n, k]` e4m3, scales `w_s`): `groups` groups of `rows / groups`
/// rows each, every row valid. [`GemmTiles::Gemv`] and [`GemmTiles::Narrow`] run over the
/// masked layout (a block of `rows / groups` rows a group), the other tiles over the contiguous
/// one (the same rows in memory).
fn gemm(
    w_q: &Tensor,
    w_s: &Tensor,
    workspace: &Workspace,
    groups: usize,
    q: &Tensor,
    s: &Tensor,
    tiles: GemmTiles,
) -> Result<Tensor> {
    let dims = w_q.dims();
    let (n, k) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let rows = q.dims2()?.0;
    if rows == 0 {
        return Ok(Tensor::zeros((0, n), DType::BF16, q.device())?);
    }
    let layout = match tiles {
        GemmTiles::Gemv | GemmTiles::Narrow => GroupLayout::Masked {
            m_max: rows / groups,
        },
        _ => GroupLayout::Contiguous { alignment: 1 },
    };
    let shape = GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout,
    };
    gemm_fp8::check_shape(&shape)?;
    match q.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => cuda::gemm(dev, workspace, w_q, w_s, q, s, &shape, tiles),
        _ => {
            let _ = workspace;
            host::gemm(w_q, w_s, q, s, &shape)
        }
    }
}

/// SwiGLU of `gu` (`[rows, 2I]` bf16: gate columns, then up) quantized 1 x 128 for the down
/// GEMM: (`[rows, I]` e4m3, `[rows, I / 128]` f32).
fn swiglu_quantize(gu: &Tensor, i: usize) -> Result<(Tensor, Tensor)> {
    match gu.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => cuda::swiglu_quantize(dev, gu, i),
        _ => host::swiglu_quantize(gu, i),
    }
}
