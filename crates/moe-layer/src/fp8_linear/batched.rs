//! [`Fp8BatchedLinear`]: one block-scaled fp8 weight per batch of rows, run as one grouped fp8
//! GEMM with a group a batch (MLA's absorbed `kv_b_proj`: a group a head).

use candle_core::{DType, Device, Tensor};
use ep_kernels::gemm::fp8::{weight_scale_dims, FP8_BLOCK};
use ep_kernels::gemm::{GemmTiles, MAX_GROUPS};

use super::{gemm, quantize, Fp8Linear, Workspace};
use crate::error::{Error, Result};
use crate::fp8::Fp8Weight;

/// `groups` linear maps on block-scaled fp8 weights `[groups, n, k]` (scales
/// `[groups, ceil(n / 128), ceil(k / 128)]`), map `g` applied to batch `g` of the rows:
/// `y[g] = x[g] W[g]^T`, as a batched matmul on the dequantized weights.
#[derive(Debug)]
pub struct Fp8BatchedLinear {
    q: Tensor,
    scale: Tensor,
    workspace: Workspace,
}

impl Fp8BatchedLinear {
    /// Whether `groups` weights `[n, k]` run on the fp8 GEMMs (as [`Fp8Linear::takes`], at
    /// most `ep_kernels::gemm::MAX_GROUPS` groups).
    pub fn takes(groups: usize, n: usize, k: usize) -> bool {
        (1..=MAX_GROUPS).contains(&groups) && Fp8Linear::takes(n, k)
    }

    /// The maps of `q` (e4m3 `[groups, n, k]`) and `scale` (f32
    /// `[groups, ceil(n / 128), ceil(k / 128)]`) on one device; an error names what does not fit.
    pub fn new(q: Tensor, scale: Tensor) -> Result<Self> {
        let (groups, n, k) = q.dims3().map_err(|_| {
            Error::invalid(
                "fp8 batched weight",
                format!("{:?}", q.dims()),
                "must be [groups, n, k]",
            )
        })?;
        let (sr, sc) = weight_scale_dims(n, k, FP8_BLOCK);
        if q.dtype() != DType::F8E4M3
            || scale.dtype() != DType::F32
            || scale.dims() != [groups, sr, sc]
            || !q.device().same_device(scale.device())
        {
            return Err(Error::invalid(
                "fp8 batched weight",
                format!(
                    "{:?} {:?} and scales {:?} {:?}",
                    q.dtype(),
                    q.dims(),
                    scale.dtype(),
                    scale.dims()
                ),
                format!("needs F8E4M3 values and F32 scales [{groups}, {sr}, {sc}] on one device"),
            ));
        }
        if !Self::takes(groups, n, k) {
            return Err(Error::invalid(
                "fp8 batched weight",
                format!("[{groups}, {n}, {k}]"),
                format!(
                    "the fp8 GEMMs take 1..={MAX_GROUPS} groups, k a multiple of 128 and n of 16"
                ),
            ));
        }
        Ok(Self {
            q,
            scale,
            workspace: Workspace::default(),
        })
    }

    /// The maps cut from `w` (`[groups * stride, k]`, `groups` blocks of `stride` rows): rows
    /// `first .. first + rows` of each block, as `[groups, rows, k]`, or transposed block by
    /// block when `transpose` (`[groups, k, rows]`, each 128 x 128 scale block moving with its
    /// values: exact). `first`, `rows` and `stride` must be multiples of 128 (whole scale
    /// blocks), and `k` too when transposing. Prepared on the host, once at load.
    pub fn from_row_blocks(
        w: &Fp8Weight,
        groups: usize,
        first: usize,
        rows: usize,
        transpose: bool,
    ) -> Result<Self> {
        let (n_all, k) = w.dims();
        let stride = n_all.checked_div(groups).unwrap_or(0);
        let b = FP8_BLOCK;
        let fits = groups > 0
            && stride * groups == n_all
            && stride % b == 0
            && first % b == 0
            && rows % b == 0
            && rows > 0
            && first + rows <= stride
            && (!transpose || k % b == 0);
        if !fits {
            return Err(Error::invalid(
                "fp8 row blocks",
                format!(
                    "rows {first}..{} of {groups} blocks of the [{n_all}, {k}] weight",
                    first + rows
                ),
                "needs whole 128-row blocks inside each of the equal blocks (and k a multiple \
                 of 128 to transpose)",
            ));
        }
        let device = w.q().device().clone();
        // Candle has no e4m3 copy kernels on CUDA: cut on the host.
        let cut = |t: &Tensor, div: usize| -> Result<Tensor> {
            let cols = t.dim(1)?;
            let t = t
                .to_device(&Device::Cpu)?
                .reshape((groups, stride / div, cols))?
                .narrow(1, first / div, rows / div)?;
            let t = if transpose { t.transpose(1, 2)? } else { t };
            Ok(t.contiguous()?.to_device(&device)?)
        };
        Self::new(cut(w.q(), 1)?, cut(w.scale(), b)?)
    }

    /// `(groups, n, k)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        let d = self.q.dims();
        (d[0], d[1], d[2])
    }

    /// Bytes of the e4m3 values and their scales.
    pub fn weight_bytes(&self) -> usize {
        self.q.elem_count() + 4 * self.scale.elem_count()
    }

    /// The weights in `dtype`, `[groups, n, k]` (what the maps multiply by, exactly as
    /// [`Fp8Weight::dequantize`] per group).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let (groups, n, k) = self.dims();
        let each = (0..groups)
            .map(|g| {
                Fp8Weight::new("batched", self.q.get(g)?, self.scale.get(g)?)?.dequantize(dtype)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::stack(&each, 0)?.reshape((groups, n, k))?)
    }

    /// `x [groups, m, k]` (any float dtype) through the maps: `[groups, m, n]` in `x`'s dtype,
    /// on the kernel [`Fp8Linear::tiles_for`] picks for `m` rows a group.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, k) = self.dims();
        let m = x.dims().get(1).copied().unwrap_or(0);
        self.forward_tiles(x, Fp8Linear::tiles_for(m, k))
    }

    /// [`Fp8BatchedLinear::forward`] on the kernel the caller names (benchmarks).
    pub fn forward_tiles(&self, x: &Tensor, tiles: GemmTiles) -> Result<Tensor> {
        let (groups, n, k) = self.dims();
        let m = match x.dims() {
            &[g, m, xk] if g == groups && xk == k => m,
            d => {
                return Err(Error::invalid(
                    "x",
                    format!("{d:?}"),
                    format!("must be [{groups}, rows, {k}]"),
                ))
            }
        };
        let (q, s) = quantize(&x.reshape((groups * m, k))?)?;
        let y = gemm(&self.q, &self.scale, &self.workspace, groups, &q, &s, tiles)?;
        Ok(y.to_dtype(x.dtype())?.reshape((groups, m, n))?)
    }
}
