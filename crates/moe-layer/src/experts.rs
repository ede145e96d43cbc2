//! SwiGLU experts: the dense [`Mlp`] (shared experts, dense layers) and [`Experts`], the shard
//! of routed experts one rank holds, with the two expert-GEMM shapes of expert parallelism:
//! grouped rows with top-k routing (normal mode) and per-expert packed blocks (low-latency mode).

use candle_core::{DType, Device, Error, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::config::MoeConfig;

/// A bias-free SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[I, H]`.
    gate_proj: Tensor,
    /// `[I, H]`.
    up_proj: Tensor,
    /// `[H, I]`.
    down_proj: Tensor,
}

impl Mlp {
    /// Builds an MLP from `gate_proj` `[I, H]`, `up_proj` `[I, H]` and `down_proj` `[H, I]`,
    /// which must share one dtype and device.
    pub fn new(gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Result<Self> {
        let (i, h) = gate_proj.dims2().map_err(|_| {
            Error::Msg(format!(
                "Mlp::new: gate_proj has shape {:?}, expected [intermediate, hidden]",
                gate_proj.dims()
            ))
        })?;
        if up_proj.dims() != [i, h] {
            return Err(Error::Msg(format!(
                "Mlp::new: up_proj has shape {:?}, expected [{i}, {h}] like gate_proj",
                up_proj.dims()
            )));
        }
        if down_proj.dims() != [h, i] {
            return Err(Error::Msg(format!(
                "Mlp::new: down_proj has shape {:?}, expected [{h}, {i}] (gate_proj is [{i}, {h}])",
                down_proj.dims()
            )));
        }
        for (name, t) in [("up_proj", &up_proj), ("down_proj", &down_proj)] {
            if t.dtype() != gate_proj.dtype() {
                return Err(Error::Msg(format!(
                    "Mlp::new: {name} has dtype {:?}, expected {:?} like gate_proj",
                    t.dtype(),
                    gate_proj.dtype()
                )));
            }
            if !t.device().same_device(gate_proj.device()) {
                return Err(Error::Msg(format!(
                    "Mlp::new: {name} is on {:?}, expected {:?} like gate_proj",
                    t.device(),
                    gate_proj.device()
                )));
            }
        }
        Ok(Self {
            gate_proj,
            up_proj,
            down_proj,
        })
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
    /// returned in `x`'s dtype and shape.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.hidden_size();
        let dims = x.dims().to_vec();
        if dims.last() != Some(&h) {
            return Err(Error::Msg(format!(
                "Mlp: x has shape {dims:?}, expected last dimension hidden_size = {h}"
            )));
        }
        let rows: usize = dims[..dims.len() - 1].iter().product();
        if rows == 0 {
            return crate::empty::empty(dims, x.dtype(), x.device());
        }
        let xs = x.reshape((rows, h))?.to_dtype(self.dtype())?;
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

/// The routed experts `first_expert .. first_expert + num_local` that one rank holds.
#[derive(Clone, Debug)]
pub struct Experts {
    first_expert: usize,
    experts: Vec<Mlp>,
}

impl Experts {
    /// Builds the shard from its experts, local expert `l` being global expert
    /// `first_expert + l`. All experts must share shapes, dtype and device; at least one is needed.
    pub fn new(first_expert: usize, experts: Vec<Mlp>) -> Result<Self> {
        let Some(first) = experts.first() else {
            return Err(Error::Msg(
                "Experts::new: experts is empty, at least one local expert is needed".to_string(),
            ));
        };
        let (h, i, dtype) = (
            first.hidden_size(),
            first.intermediate_size(),
            first.dtype(),
        );
        for (l, m) in experts.iter().enumerate() {
            if m.hidden_size() != h || m.intermediate_size() != i {
                return Err(Error::Msg(format!(
                    "Experts::new: expert {} has [intermediate, hidden] = [{}, {}], expected [{i}, {h}] like expert {first_expert}",
                    first_expert + l,
                    m.intermediate_size(),
                    m.hidden_size()
                )));
            }
            if m.dtype() != dtype || !m.device().same_device(first.device()) {
                return Err(Error::Msg(format!(
                    "Experts::new: expert {} has dtype {:?} on {:?}, expected {dtype:?} on {:?} like expert {first_expert}",
                    first_expert + l,
                    m.dtype(),
                    m.device(),
                    first.device()
                )));
            }
        }
        Ok(Self {
            first_expert,
            experts,
        })
    }

    /// Loads global experts `first_expert .. first_expert + num_local` from `vb` at the layer's
    /// `mlp.experts` prefix, reading `{e}.gate_proj.weight`, `{e}.up_proj.weight` and
    /// `{e}.down_proj.weight` for those ids only: other experts' tensors are never touched.
    pub fn load(
        vb: VarBuilder,
        cfg: &MoeConfig,
        first_expert: usize,
        num_local: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        if num_local == 0 {
            return Err(Error::Msg(
                "Experts::load: num_local = 0, at least one local expert is needed".to_string(),
            ));
        }
        let end = first_expert.saturating_add(num_local);
        if end > cfg.n_routed_experts {
            return Err(Error::Msg(format!(
                "Experts::load: first_expert {first_expert} + num_local {num_local} = {end} exceeds n_routed_experts = {}",
                cfg.n_routed_experts
            )));
        }
        let experts = (first_expert..end)
            .map(|e| Mlp::load(vb.pp(e), cfg.hidden_size, cfg.moe_intermediate_size))
            .collect::<Result<Vec<_>>>()?;
        Self::new(first_expert, experts)
    }

    /// Global id of local expert 0.
    pub fn first_expert(&self) -> usize {
        self.first_expert
    }

    /// Number of local experts `L`.
    pub fn num_local(&self) -> usize {
        self.experts.len()
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.experts[0].hidden_size()
    }

    /// Inner width `I` of each expert.
    pub fn intermediate_size(&self) -> usize {
        self.experts[0].intermediate_size()
    }

    /// Weight dtype.
    pub fn dtype(&self) -> DType {
        self.experts[0].dtype()
    }

    /// Weight device.
    pub fn device(&self) -> &Device {
        self.experts[0].device()
    }

    /// The local experts, local id order.
    pub fn experts(&self) -> &[Mlp] {
        &self.experts
    }

    /// Normal-mode grouped GEMM. `x` `[N, H]`, `topk_idx_local` `[N, K]` (i64 local expert ids,
    /// `-1` = not here) and `topk_weights` `[N, K]` (f32). Returns `[N, H]` in `x`'s dtype with
    /// row `n = sum_{k: idx>=0} w[n,k] * expert_{idx[n,k]}(x[n])`.
    pub fn forward_grouped(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
    ) -> Result<Tensor> {
        let y = self.forward_grouped_f32(x, topk_idx_local, topk_weights)?;
        if y.elem_count() == 0 {
            return crate::empty::empty(y.dims(), x.dtype(), x.device());
        }
        y.to_dtype(x.dtype())
    }

    /// [`Experts::forward_grouped`] returning the f32 accumulator instead of casting to `x`'s dtype.
    ///
    /// Rows are grouped by local expert; each expert runs its SwiGLU once on its rows, the
    /// outputs are scaled by their weights and summed into the result with one `index_add`.
    pub fn forward_grouped_f32(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
    ) -> Result<Tensor> {
        let (n, h) = x.dims2().map_err(|_| {
            Error::Msg(format!(
                "Experts::forward_grouped: x has shape {:?}, expected [tokens, hidden_size = {}]",
                x.dims(),
                self.hidden_size()
            ))
        })?;
        if h != self.hidden_size() {
            return Err(Error::Msg(format!(
                "Experts::forward_grouped: x has hidden size {h}, expected hidden_size = {}",
                self.hidden_size()
            )));
        }
        let (ni, k) = topk_idx_local.dims2().map_err(|_| {
            Error::Msg(format!(
                "Experts::forward_grouped: topk_idx_local has shape {:?}, expected [{n}, K]",
                topk_idx_local.dims()
            ))
        })?;
        if ni != n {
            return Err(Error::Msg(format!(
                "Experts::forward_grouped: topk_idx_local has {ni} rows, expected {n} like x"
            )));
        }
        if topk_weights.dims() != [n, k] {
            return Err(Error::Msg(format!(
                "Experts::forward_grouped: topk_weights has shape {:?}, expected [{n}, {k}] like topk_idx_local",
                topk_weights.dims()
            )));
        }
        let dev = x.device();
        if n == 0 {
            return crate::empty::empty((0, h), DType::F32, dev);
        }
        if k == 0 {
            return Tensor::zeros((n, h), DType::F32, dev);
        }
        let idx: Vec<i64> = topk_idx_local
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1()?;
        let w: Vec<f32> = topk_weights
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;

        let num_local = self.num_local();
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); num_local];
        let mut row_w: Vec<Vec<f32>> = vec![Vec::new(); num_local];
        for (pos, (&e, &wt)) in idx.iter().zip(&w).enumerate() {
            if e < 0 {
                if e != -1 {
                    return Err(Error::Msg(format!(
                        "Experts::forward_grouped: topk_idx_local[{}, {}] = {e}, expected -1 or 0..{num_local}",
                        pos / k,
                        pos % k
                    )));
                }
                continue;
            }
            let l = e as usize;
            if l >= num_local {
                return Err(Error::Msg(format!(
                    "Experts::forward_grouped: topk_idx_local[{}, {}] = {e} is not below num_local = {num_local}",
                    pos / k,
                    pos % k
                )));
            }
            rows[l].push((pos / k) as u32);
            row_w[l].push(wt);
        }

        let mut all_rows = Vec::new();
        let mut outputs = Vec::new();
        for (l, (r, wl)) in rows.into_iter().zip(row_w).enumerate() {
            if r.is_empty() {
                continue;
            }
            let count = r.len();
            let ids = Tensor::from_vec(r, count, dev)?;
            let xs = x.index_select(&ids, 0)?;
            let ys = self.experts[l].forward(&xs)?.to_dtype(DType::F32)?;
            let scale = Tensor::from_vec(wl, (count, 1), dev)?;
            outputs.push(ys.broadcast_mul(&scale)?);
            all_rows.push(ids);
        }
        let acc = Tensor::zeros((n, h), DType::F32, dev)?;
        if outputs.is_empty() {
            return Ok(acc);
        }
        let ids = Tensor::cat(&all_rows, 0)?;
        let ys = Tensor::cat(&outputs, 0)?;
        acc.index_add(&ids, &ys, 0)
    }

    /// Low-latency-mode expert GEMM on packed blocks: `x` `[L, M, H]`, `counts[l]` valid rows of
    /// block `l`. Returns `[L, M, H]` in `x`'s dtype where row `m < counts[l]` of block `l` is
    /// `expert_l(x[l, m])` and the rows past `counts[l]` are zero.
    pub fn forward_packed(&self, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let (l, m, h) = x.dims3().map_err(|_| {
            Error::Msg(format!(
                "Experts::forward_packed: x has shape {:?}, expected [num_local = {}, max_rows, hidden_size = {}]",
                x.dims(),
                self.num_local(),
                self.hidden_size()
            ))
        })?;
        if l != self.num_local() || h != self.hidden_size() {
            return Err(Error::Msg(format!(
                "Experts::forward_packed: x has shape {:?}, expected [num_local = {}, max_rows, hidden_size = {}]",
                x.dims(),
                self.num_local(),
                self.hidden_size()
            )));
        }
        if counts.len() != l {
            return Err(Error::Msg(format!(
                "Experts::forward_packed: counts has {} entries, expected num_local = {l}",
                counts.len()
            )));
        }
        if let Some((e, &c)) = counts.iter().enumerate().find(|(_, &c)| c > m) {
            return Err(Error::Msg(format!(
                "Experts::forward_packed: counts[{e}] = {c} exceeds the block size max_rows = {m}"
            )));
        }
        let dev = x.device();
        let mut blocks = Vec::with_capacity(l);
        for (e, &c) in counts.iter().enumerate() {
            let block = if c == 0 {
                Tensor::zeros((m, h), x.dtype(), dev)?
            } else {
                let y = self.experts[e].forward(&x.get(e)?.narrow(0, 0, c)?)?;
                if c < m {
                    y.pad_with_zeros(D::Minus2, 0, m - c)?
                } else {
                    y
                }
            };
            blocks.push(block);
        }
        Tensor::stack(&blocks, 0)
    }
}
