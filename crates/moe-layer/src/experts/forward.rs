//! The forward passes of [`Experts`]: routed rows (normal mode) and per-expert blocks with
//! counts (low-latency mode), on the device grouped GEMMs where they run (`grouped`,
//! `grouped_fp8`), else grouped on the host.

use candle_core::{DType, Tensor, D};

use super::input::ExpertInput;
use super::shard::Experts;
use crate::error::{Error, Result};

impl Experts {
    /// Checks `x: [N, H]`, `topk_idx_local: [N, K]`, `topk_weights: [N, K]`; returns `(N, K)`.
    fn check_routed(&self, x: &Tensor, idx: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
        let h = self.hidden_size();
        let n = match x.dims2() {
            Ok((n, xh)) if xh == h => n,
            _ => {
                return Err(Error::invalid(
                    "x",
                    format!("shape {:?}", x.dims()),
                    format!("must be [tokens, hidden_size = {h}]"),
                ))
            }
        };
        let k = match idx.dims2() {
            Ok((ni, k)) if ni == n => k,
            _ => {
                return Err(Error::invalid(
                    "topk_idx_local",
                    format!("shape {:?}", idx.dims()),
                    format!("must be [{n}, K] like x"),
                ))
            }
        };
        if w.dims() != [n, k] {
            return Err(Error::invalid(
                "topk_weights",
                format!("shape {:?}", w.dims()),
                format!("must be [{n}, {k}] like topk_idx_local"),
            ));
        }
        Ok((n, k))
    }

    /// Normal-mode grouped GEMM. `x` `[N, H]`, `topk_idx_local` `[N, K]` (i64 local expert ids,
    /// `-1` = not here) and `topk_weights` `[N, K]` (f32). Returns `[N, H]` in `x`'s dtype with
    /// row `n = sum_{k: idx>=0} w[n,k] * expert_{idx[n,k]}(x[n])`.
    ///
    /// With grouped GEMMs ([`Experts::uses_grouped_gemm`]) the rows are permuted to expert-major
    /// order, run through the contiguous grouped GEMMs and summed back on the device (an id
    /// outside `-1..L` traps there); otherwise rows are grouped on the host.
    pub fn forward_grouped(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
    ) -> Result<Tensor> {
        self.forward_grouped_rows(x, topk_idx_local, topk_weights, None)
    }

    /// [`Experts::forward_grouped`] when the rows each local expert receives are known on the
    /// host, as a normal-mode dispatch reports them
    /// (`DispatchOutput::num_recv_tokens_per_expert`, DeepEP's `num_recv_tokens_per_expert_list`):
    /// the grouped GEMMs are then sized for those rows instead of every (token, slot) pair
    /// `topk_idx_local` could hold (at EP4 about a third of them), which matters to a grid of
    /// one CTA per tile ([`ep_kernels::gemm::GemmGrid::PerTile`]). `counts` must be the routing's
    /// own counts, one per local expert: too few rows for the routing stop the GEMMs on the
    /// device (a trap naming the group), which a caller must not risk with counts of other
    /// routing.
    pub fn forward_grouped_counted(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        counts: &[usize],
    ) -> Result<Tensor> {
        if counts.len() != self.num_local() {
            return Err(Error::invalid(
                "counts",
                format!("{} counts", counts.len()),
                format!("must hold one per local expert ({})", self.num_local()),
            ));
        }
        self.forward_grouped_rows(x, topk_idx_local, topk_weights, Some(counts.iter().sum()))
    }

    /// [`Experts::forward_grouped`] over `input`: e4m3 rows with their scales (an fp8
    /// dispatch's) go to fp8 experts as they are and are dequantized to `dtype` for float
    /// experts; float rows go to fp8 experts quantized once on the device. `counts`: the rows
    /// each local expert receives when known on the host (as for
    /// [`Experts::forward_grouped_counted`]). Returns `[N, H]` in `dtype`.
    pub fn forward_grouped_input(
        &self,
        input: &ExpertInput,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        counts: Option<&[usize]>,
        dtype: DType,
    ) -> Result<Tensor> {
        if let Some(c) = counts.filter(|c| c.len() != self.num_local()) {
            return Err(Error::invalid(
                "counts",
                format!("{} counts", c.len()),
                format!("must hold one per local expert ({})", self.num_local()),
            ));
        }
        let rows = counts.map(|c| c.iter().sum());
        if !self.is_fp8() {
            let x = input.to_dtype(dtype)?;
            return self.forward_grouped_rows(&x, topk_idx_local, topk_weights, rows);
        }
        self.forward_fp8_routed(input, topk_idx_local, topk_weights, rows, dtype)
    }

    /// The fp8 experts' normal-mode forward (CUDA), `rows` the routing's pairs when known.
    fn forward_fp8_routed(
        &self,
        input: &ExpertInput,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        rows: Option<usize>,
        dtype: DType,
    ) -> Result<Tensor> {
        let (n, k) = self.check_routed(&input.x, topk_idx_local, topk_weights)?;
        let (h, dev) = (self.hidden_size(), input.x.device());
        if n == 0 {
            return Ok(crate::empty::empty((0, h), dtype, dev)?);
        }
        if k == 0 {
            return Ok(Tensor::zeros((n, h), dtype, dev)?);
        }
        #[cfg(feature = "cuda")]
        {
            let y = super::grouped_fp8::forward_routed(
                self,
                input,
                topk_idx_local,
                topk_weights,
                rows,
            )?;
            Ok(y.to_dtype(dtype)?)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = rows;
            unreachable!("fp8 experts exist on CUDA only")
        }
    }

    /// [`Experts::forward_grouped`] with the rows of the routing when known.
    fn forward_grouped_rows(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        rows: Option<usize>,
    ) -> Result<Tensor> {
        if self.is_fp8() {
            return self.forward_fp8_routed(
                &ExpertInput::plain(x),
                topk_idx_local,
                topk_weights,
                rows,
                x.dtype(),
            );
        }
        let (n, k) = self.check_routed(x, topk_idx_local, topk_weights)?;
        if n == 0 {
            return Ok(crate::empty::empty(
                (0, self.hidden_size()),
                x.dtype(),
                x.device(),
            )?);
        }
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() && k > 0 {
            let y = super::grouped::forward_routed(self, x, topk_idx_local, topk_weights, rows)?;
            return Ok(y.to_dtype(x.dtype())?);
        }
        let _ = rows; // the host path groups the rows it finds
        let y = self.host_grouped_f32(x, topk_idx_local, topk_weights, n, k)?;
        Ok(y.to_dtype(x.dtype())?)
    }

    /// [`Experts::forward_grouped`] returning f32.
    pub fn forward_grouped_f32(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
    ) -> Result<Tensor> {
        if self.is_fp8() {
            return self.forward_fp8_routed(
                &ExpertInput::plain(x),
                topk_idx_local,
                topk_weights,
                None,
                DType::F32,
            );
        }
        let (n, k) = self.check_routed(x, topk_idx_local, topk_weights)?;
        if n == 0 {
            return Ok(crate::empty::empty(
                (0, self.hidden_size()),
                DType::F32,
                x.device(),
            )?);
        }
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() && k > 0 {
            let y = super::grouped::forward_routed(self, x, topk_idx_local, topk_weights, None)?;
            return Ok(y.to_dtype(DType::F32)?);
        }
        self.host_grouped_f32(x, topk_idx_local, topk_weights, n, k)
    }

    /// Rows grouped by local expert on the host; each expert runs its SwiGLU once on its rows,
    /// the outputs are scaled by their weights and summed into the result with one `index_add`.
    fn host_grouped_f32(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        n: usize,
        k: usize,
    ) -> Result<Tensor> {
        let (h, dev) = (self.hidden_size(), x.device());
        if k == 0 {
            return Ok(Tensor::zeros((n, h), DType::F32, dev)?);
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
            if e == -1 {
                continue;
            }
            if e < 0 || e as usize >= num_local {
                return Err(Error::invalid(
                    "topk_idx_local",
                    format!("topk_idx_local[{}, {}] = {e}", pos / k, pos % k),
                    format!("must be -1 or a local expert id below num_local = {num_local}"),
                ));
            }
            rows[e as usize].push((pos / k) as u32);
            row_w[e as usize].push(wt);
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
        Ok(acc.index_add(&ids, &ys, 0)?)
    }

    /// Checks `x: [L, M, H]`; returns `M`.
    fn check_blocks(&self, x: &Tensor, what: &'static str) -> Result<usize> {
        match x.dims3() {
            Ok((l, m, h)) if l == self.num_local() && h == self.hidden_size() => Ok(m),
            _ => Err(Error::invalid(
                what,
                format!("shape {:?}", x.dims()),
                format!(
                    "must be [num_local = {}, max_rows, hidden_size = {}]",
                    self.num_local(),
                    self.hidden_size()
                ),
            )),
        }
    }

    /// Low-latency-mode expert GEMM on packed blocks with host counts: `x` `[L, M, H]`,
    /// `counts[l]` valid rows of block `l`. Returns `[L, M, H]` in `x`'s dtype where row
    /// `m < counts[l]` of block `l` is `expert_l(x[l, m])` and the rows past `counts[l]` are
    /// zero.
    pub fn forward_packed(&self, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let m = self.check_blocks(x, "x")?;
        let l = self.num_local();
        if counts.len() != l {
            return Err(Error::invalid(
                "counts",
                format!("{} entries", counts.len()),
                format!("must have num_local = {l}"),
            ));
        }
        if let Some((e, &c)) = counts.iter().enumerate().find(|(_, &c)| c > m) {
            return Err(Error::invalid(
                "counts",
                format!("counts[{e}] = {c}"),
                format!("must be <= the block size max_rows = {m}"),
            ));
        }
        let dev = x.device();
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() {
            let c: Vec<i32> = counts.iter().map(|&c| c as i32).collect();
            let counts_dev = Tensor::from_vec(c, l, dev)?;
            let most = counts.iter().copied().max().unwrap_or(0);
            let tiles = super::grouped::masked_tiles(dev, most)?;
            let y =
                self.forward_masked_input(&ExpertInput::plain(x), &counts_dev, tiles, DType::BF16)?;
            // Rows past the counts: zero, as documented.
            let rows = Tensor::arange(0u32, m as u32, dev)?.reshape((1, m, 1))?;
            let limit = Tensor::from_vec(
                counts.iter().map(|&c| c as u32).collect::<Vec<_>>(),
                (l, 1, 1),
                dev,
            )?;
            let keep = rows.broadcast_lt(&limit)?;
            let zeros = Tensor::zeros(y.dims(), y.dtype(), dev)?;
            return Ok(keep
                .broadcast_as(y.dims())?
                .where_cond(&y, &zeros)?
                .to_dtype(x.dtype())?);
        }
        let h = self.hidden_size();
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
        Ok(Tensor::stack(&blocks, 0)?)
    }

    /// Low-latency-mode expert GEMM with the counts on the device (the low-latency dispatch's
    /// `recv_count`): `x` `[L, M, H]`, `counts` `[L]` i32 on `x`'s device. Returns `[L, M, H]` (bf16 with grouped
    /// GEMMs, else `x`'s dtype) where row `m < counts[l]` of block `l` is `expert_l(x[l, m])`;
    /// **rows past the counts are not written** (their content is unspecified). Nothing is read
    /// back to the host with grouped GEMMs; otherwise the counts are read first.
    pub fn forward_masked(&self, x: &Tensor, counts: &Tensor) -> Result<Tensor> {
        let m = x.dims().get(1).copied().unwrap_or(0);
        self.forward_masked_expecting(x, counts, m)
    }

    /// [`Experts::forward_masked`] told how many valid rows each block is expected to hold at
    /// most (a low-latency step: the tokens per rank times the ranks). The result is the same
    /// for any counts; the hint picks the kernel
    /// ([`ep_kernels::gemm::GemmTiles::for_masked_rows`]: on GPUs of moderate bandwidth per SM,
    /// up to [`ep_kernels::gemm::GEMV_ROWS_PER_PASS`] rows, the grouped GEMMs stream each
    /// active expert's weights once without tiles).
    pub fn forward_masked_expecting(
        &self,
        x: &Tensor,
        counts: &Tensor,
        expected_rows: usize,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() {
            let tiles = super::grouped::masked_tiles(x.device(), expected_rows)?;
            return self.forward_masked_tiled(x, counts, tiles);
        }
        let _ = expected_rows;
        self.forward_masked_tiled(x, counts, ep_kernels::gemm::GemmTiles::Auto)
    }

    /// [`Experts::forward_masked`] over `input` (`[L, M, H]`: e4m3 rows with `[L, M, H / 128]`
    /// scales, or float rows; converted as for [`Experts::forward_grouped_input`]) with the
    /// grouped GEMMs' configuration `tiles`. Returns `[L, M, H]` in `dtype` (rows past the
    /// counts unwritten).
    pub fn forward_masked_input(
        &self,
        input: &ExpertInput,
        counts: &Tensor,
        tiles: ep_kernels::gemm::GemmTiles,
        dtype: DType,
    ) -> Result<Tensor> {
        if !self.is_fp8() {
            let x = input.to_dtype(dtype)?;
            return Ok(self
                .forward_masked_tiled(&x, counts, tiles)?
                .to_dtype(dtype)?);
        }
        self.check_blocks(&input.x, "x")?;
        let l = self.num_local();
        if counts.dims() != [l] || counts.dtype() != DType::I32 {
            return Err(Error::invalid(
                "counts",
                format!("a {:?} tensor of shape {:?}", counts.dtype(), counts.dims()),
                format!("must be i32 [num_local = {l}]"),
            ));
        }
        #[cfg(feature = "cuda")]
        {
            let (y, _) = super::grouped_fp8::forward_masked(self, input, counts, None, tiles)?;
            Ok(y.to_dtype(dtype)?)
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("fp8 experts exist on CUDA only")
    }

    /// [`Experts::forward_masked`] with the grouped GEMMs' configuration `tiles` (used on CUDA
    /// with grouped GEMMs only).
    pub(crate) fn forward_masked_tiled(
        &self,
        x: &Tensor,
        counts: &Tensor,
        tiles: ep_kernels::gemm::GemmTiles,
    ) -> Result<Tensor> {
        if self.is_fp8() {
            return self.forward_masked_input(&ExpertInput::plain(x), counts, tiles, DType::BF16);
        }
        super::input::float_rows(x)?;
        let m = self.check_blocks(x, "x")?;
        let l = self.num_local();
        if counts.dims() != [l] || counts.dtype() != DType::I32 {
            return Err(Error::invalid(
                "counts",
                format!("a {:?} tensor of shape {:?}", counts.dtype(), counts.dims()),
                format!("must be i32 [num_local = {l}]"),
            ));
        }
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() {
            return super::grouped::forward_masked(self, x, counts, tiles);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = tiles;
        let host: Vec<i32> = counts.to_vec1()?;
        let host = host
            .iter()
            .enumerate()
            .map(|(e, &c)| {
                usize::try_from(c).ok().filter(|&c| c <= m).ok_or_else(|| {
                    Error::invalid(
                        "counts",
                        format!("counts[{e}] = {c}"),
                        format!("must be in 0..={m}"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.forward_packed(x, &host)
    }
}
