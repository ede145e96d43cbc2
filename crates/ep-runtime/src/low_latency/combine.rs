//! Low-latency combine.

use super::dispatch::RankToken;
use super::{LowLatencyHandle, RecvHook};
use crate::backend::Backend;
use crate::buffer::{check_dtype, check_shape, Buffer, Posted};
use crate::codec::{i32_bytes, pack, tensor_bytes, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};
use ep_kernels::low_latency::{rank_order, Reduction};

/// The inputs of [`Buffer::low_latency_combine`].
#[derive(Debug, Clone)]
pub struct LowLatencyCombineArgs<'a> {
    /// `[L, R * M, H]` expert outputs, row for row the dispatch's `recv_x` (bf16; f16/f32
    /// also on the host backend).
    pub x: &'a Tensor,
    /// `[T, K]` i64: the routing given to the dispatch.
    pub topk_idx: &'a Tensor,
    /// `[T, K]` f32 gate weights (read per expert; per rank the dispatch's count).
    pub topk_weights: &'a Tensor,
    /// The dispatch's handle.
    pub handle: &'a LowLatencyHandle,
    /// How the expert outputs are reduced: DeepEP's per-expert rows (the default), or one
    /// partial sum per (token, rank), which needs a dispatch that carried the weights
    /// ([`LowLatencyDispatchArgs::weights`](crate::LowLatencyDispatchArgs::weights)). Every rank
    /// must use the same.
    pub reduction: Reduction,
    /// Write the result into this `[T, H]` tensor (same dtype as `x`) instead of a new one.
    pub out: Option<&'a Tensor>,
    /// Return before the work is done (GPU buffers).
    pub async_finish: bool,
}

impl<'a> LowLatencyCombineArgs<'a> {
    /// Combine of `x` for the tokens routed by `topk_idx` / `topk_weights`.
    pub fn new(
        x: &'a Tensor,
        topk_idx: &'a Tensor,
        topk_weights: &'a Tensor,
        handle: &'a LowLatencyHandle,
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights,
            handle,
            reduction: Reduction::PerExpert,
            out: None,
            async_finish: false,
        }
    }

    /// Reduces as `reduction` says.
    pub fn reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// Writes into `out`.
    pub fn out(mut self, out: &'a Tensor) -> Self {
        self.out = Some(out);
        self
    }
}

/// What [`Buffer::low_latency_combine`] returns.
#[derive(Debug, Clone)]
pub struct LowLatencyCombineOutput {
    /// `[T, H]`: `sum_k w_k * y_k` in f32, in `x`'s dtype (the `out` tensor if one was given).
    pub combined_x: Tensor,
    /// Completion of the combine.
    pub event: EventOverlap,
}

pub(crate) struct LlCombinePlan {
    handle: LowLatencyHandle,
    weights: Vec<f32>,
    dtype: DType,
    reduction: Reduction,
    out: Option<Tensor>,
}

impl Buffer {
    /// Low-latency combine: every expert output row goes back to its token's home rank,
    /// which computes the weighted sum. Masked ranks contribute zero.
    pub fn low_latency_combine(
        &self,
        args: &LowLatencyCombineArgs<'_>,
    ) -> Result<LowLatencyCombineOutput> {
        self.low_latency_combine_send(args)?.recv()
    }

    /// The send phase of [`Buffer::low_latency_combine`]; the returned hook receives.
    pub fn low_latency_combine_send<'b>(
        &'b self,
        args: &LowLatencyCombineArgs<'_>,
    ) -> Result<RecvHook<'b, LowLatencyCombineOutput>> {
        let h = &args.handle.inner;
        if h.buffer_id != self.id {
            return Err(Error::HandleMismatch(format!(
                "the low-latency handle was made by another buffer (id {}, this buffer is {})",
                h.buffer_id, self.id
            )));
        }
        let r = self.topology.num_ranks;
        let l = h.placement.experts_per_rank();
        let (t, k, m, hid) = (h.num_tokens, h.num_topk, h.max_tokens, h.hidden);
        self.check_device("x", args.x)?;
        check_shape("x", args.x, &[Some(l), Some(r * m), Some(hid)])?;
        check_dtype(
            "x",
            args.x,
            &[DType::BF16, DType::F16, DType::F32],
            "bf16, f16 or f32",
        )?;
        self.check_device("topk_idx", args.topk_idx)?;
        check_shape("topk_idx", args.topk_idx, &[Some(t), Some(k)])?;
        check_dtype("topk_idx", args.topk_idx, &[DType::I64], "i64")?;
        self.check_device("topk_weights", args.topk_weights)?;
        check_shape("topk_weights", args.topk_weights, &[Some(t), Some(k)])?;
        check_dtype("topk_weights", args.topk_weights, &[DType::F32], "f32")?;
        if let Some(o) = args.out {
            self.check_device("out", o)?;
            check_shape("out", o, &[Some(t), Some(hid)])?;
            check_dtype("out", o, &[args.x.dtype()], "the dtype of x")?;
        }
        if args.reduction == Reduction::PerRank && !h.carries_weights {
            return Err(Error::HandleMismatch(
                "a per-rank combine needs a dispatch that carried topk_weights \
                 (LowLatencyDispatchArgs::weights)"
                    .into(),
            ));
        }
        match &self.backend {
            Backend::Host => self.ll_combine_send_host(args),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                let ll = c.low_latency();
                let dims = crate::cuda::LlCombineDims {
                    num_tokens: t,
                    num_topk: k,
                    hidden: hid,
                    max_tokens: m,
                    num_experts: h.placement.num_experts,
                };
                let pending = ll.combine_send(
                    self,
                    args.x,
                    args.topk_idx,
                    args.topk_weights,
                    h.cuda.as_ref(),
                    dims,
                    args.reduction,
                    args.out,
                    args.async_finish,
                )?;
                Ok(RecvHook {
                    finish: Box::new(move || {
                        let c = ll.combine_recv(self, pending)?;
                        Ok(LowLatencyCombineOutput {
                            combined_x: c.combined_x,
                            event: c.event,
                        })
                    }),
                })
            }
        }
    }

    /// The send phase of a combine on the host backend (arguments checked).
    fn ll_combine_send_host<'b>(
        &'b self,
        args: &LowLatencyCombineArgs<'_>,
    ) -> Result<RecvHook<'b, LowLatencyCombineOutput>> {
        let h = &args.handle.inner;
        // Host backend: the routing must be the dispatch's (CUDA buffers never read it back).
        if args.topk_idx.flatten_all()?.to_vec1::<i64>()? != h.topk_idx {
            return Err(Error::HandleMismatch(
                "topk_idx differs from the routing of the dispatch that made the handle".into(),
            ));
        }
        if h.layout.is_none() {
            return Err(Error::HandleMismatch(
                "the low-latency handle was made by a CUDA buffer".into(),
            ));
        }
        let weights = args.topk_weights.flatten_all()?.to_vec1::<f32>()?;
        let msgs = match args.reduction {
            Reduction::PerExpert => self.ll_per_expert_rows(args)?,
            Reduction::PerRank => self.ll_per_rank_rows(args.x, &h.rank_entries)?,
        };
        let mut fails = Vec::new();
        let posted = self.post("low_latency_combine", msgs, Some(&mut fails))?;
        let plan = LlCombinePlan {
            handle: args.handle.clone(),
            weights,
            dtype: args.x.dtype(),
            reduction: args.reduction,
            out: args.out.cloned(),
        };
        Ok(RecvHook {
            finish: Box::new(move || self.ll_combine_finish(plan, posted, fails)),
        })
    }

    /// Per expert: to each source, for each local expert, its rows of that source in slot
    /// order.
    fn ll_per_expert_rows(&self, args: &LowLatencyCombineArgs<'_>) -> Result<Vec<Option<Vec<u8>>>> {
        let h = &args.handle.inner;
        let r = self.topology.num_ranks;
        let l = h.placement.experts_per_rank();
        let (m, hid) = (h.max_tokens, h.hidden);
        let layout = h.layout.as_ref().expect("checked by ll_combine_send_host");
        let xb = tensor_bytes(args.x)?;
        let row = hid * args.x.dtype().size_in_bytes();
        Ok((0..r)
            .map(|s| {
                let mut rows = Vec::new();
                for le in 0..l {
                    let off = layout.offsets[le * r + s] as usize;
                    let c = layout.counts[le * r + s] as usize;
                    let base = le * r * m;
                    rows.extend_from_slice(&xb[(base + off) * row..(base + off + c) * row]);
                }
                Some(pack(&[&rows]))
            })
            .collect())
    }

    /// Per rank: to each source, the tokens it sent here (token order) and for each the
    /// partial sum of its selections here (`w * y` in k order, in f32, rounded to `x`'s dtype),
    /// as the host twin `partial_row`.
    fn ll_per_rank_rows(
        &self,
        x: &Tensor,
        entries: &[Vec<RankToken>],
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let hid = x.dims3()?.2;
        let dtype = x.dtype();
        let xf = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        entries
            .iter()
            .map(|tokens| {
                let mut ids = Vec::with_capacity(tokens.len());
                let mut acc = vec![0f32; tokens.len() * hid];
                for (tok, a) in tokens.iter().zip(acc.chunks_exact_mut(hid.max(1))) {
                    ids.push(tok.token as i32);
                    for &(_, row, w) in &tok.entries {
                        for (o, v) in a.iter_mut().zip(&xf[row * hid..(row + 1) * hid]) {
                            *o += w * v;
                        }
                    }
                }
                // Rounded once to x's dtype (to nearest even), as the twin.
                let partials = Tensor::from_vec(acc, (tokens.len(), hid), &self.device)?;
                let rows = tensor_bytes(&partials.to_dtype(dtype)?)?;
                Ok(Some(pack(&[&i32_bytes(&ids), &rows])))
            })
            .collect()
    }

    fn ll_combine_finish(
        &self,
        plan: LlCombinePlan,
        posted: Posted,
        mut fails: Vec<Error>,
    ) -> Result<LowLatencyCombineOutput> {
        let got = self.complete(posted, Some(&mut fails))?;
        if plan.reduction == Reduction::PerRank {
            let out = self.ll_per_rank_finish(&plan, &got)?;
            return match fails.into_iter().next() {
                Some(e) => Err(e),
                None => Ok(out),
            };
        }
        let h = &plan.handle.inner;
        let r = self.topology.num_ranks;
        let l = h.placement.experts_per_rank();
        let (t, k, hid) = (h.num_tokens, h.num_topk, h.hidden);
        let row = hid * plan.dtype.size_in_bytes();
        // rows[d]: f32 rows from expert rank d, per local expert in slot order.
        let mut rows: Vec<Option<Vec<f32>>> = Vec::with_capacity(r);
        let mut block_start = vec![0usize; r * l];
        for (d, msg) in got.iter().enumerate() {
            let Some(msg) = msg else {
                rows.push(None);
                continue;
            };
            let parts = unpack(msg, 1, d)?;
            let mut acc = 0;
            for le in 0..l {
                block_start[d * l + le] = acc;
                acc += h.send_counts[d * l + le] as usize;
            }
            if parts[0].len() != acc * row {
                return Err(Error::Protocol {
                    rank: d,
                    what: format!(
                        "low-latency combine sent {} bytes, expected {acc} rows of {row} bytes",
                        parts[0].len()
                    ),
                });
            }
            let v = tensor_from_bytes(parts[0], plan.dtype, &[acc, hid])?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            rows.push(Some(v));
        }
        let active: Vec<bool> = (0..r).map(|d| rows[d].is_some()).collect();
        let mut out = vec![0f32; t * hid];
        for ti in 0..t {
            let acc = &mut out[ti * hid..(ti + 1) * hid];
            for kk in 0..k {
                let e = h.topk_idx[ti * k + kk];
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let d = h.placement.rank_of(e);
                if !active[d] {
                    continue;
                }
                let Some(rs) = &rows[d] else { continue };
                let j = block_start[e] + h.slots[ti * k + kk] as usize;
                let w = plan.weights[ti * k + kk];
                for (a, v) in acc.iter_mut().zip(&rs[j * hid..(j + 1) * hid]) {
                    *a += w * v;
                }
            }
        }
        let combined = Tensor::from_vec(out, (t, hid), &self.device)?.to_dtype(plan.dtype)?;
        let combined_x = match plan.out {
            Some(o) => {
                o.slice_set(&combined, 0, 0)?;
                o
            }
            None => combined,
        };
        let out = LowLatencyCombineOutput {
            combined_x,
            event: EventOverlap::complete(),
        };
        match fails.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// The home's side of a per-rank combine: for each token, the partial rows of its ranks
    /// (in the order of [`rank_order`]) added in f32 and rounded once, as the host twin
    /// `combine_per_rank`; ranks that sent nothing (masked) contribute nothing.
    fn ll_per_rank_finish(
        &self,
        plan: &LlCombinePlan,
        got: &[Option<Vec<u8>>],
    ) -> Result<LowLatencyCombineOutput> {
        let h = &plan.handle.inner;
        let (t, k, hid) = (h.num_tokens, h.num_topk, h.hidden);
        let row = hid * plan.dtype.size_in_bytes();
        // partials[d][token]: rank d's partial row of that token, as f32.
        let mut partials: Vec<Option<std::collections::HashMap<usize, Vec<f32>>>> =
            Vec::with_capacity(got.len());
        for (d, msg) in got.iter().enumerate() {
            let Some(msg) = msg else {
                partials.push(None);
                continue;
            };
            let parts = unpack(msg, 2, d)?;
            let ids = crate::codec::i32s(parts[0]);
            if parts[1].len() != ids.len() * row || ids.iter().any(|&v| v < 0 || v as usize >= t) {
                return Err(Error::Protocol {
                    rank: d,
                    what: format!(
                        "per-rank combine sent {} bytes for {} tokens of {row} bytes (tokens < {t})",
                        parts[1].len(),
                        ids.len()
                    ),
                });
            }
            let v = tensor_from_bytes(parts[1], plan.dtype, &[ids.len(), hid])?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            partials.push(Some(
                ids.iter()
                    .enumerate()
                    .map(|(i, &tok)| (tok as usize, v[i * hid..(i + 1) * hid].to_vec()))
                    .collect(),
            ));
        }
        let mut out = vec![0f32; t * hid];
        for ti in 0..t {
            let acc = &mut out[ti * hid..(ti + 1) * hid];
            for d in rank_order(&h.topk_idx[ti * k..(ti + 1) * k], &h.placement) {
                let Some(from_d) = &partials[d] else { continue };
                let p = from_d.get(&ti).ok_or_else(|| Error::Protocol {
                    rank: d,
                    what: format!(
                        "per-rank combine sent no row for token {ti}, which has experts there"
                    ),
                })?;
                for (a, v) in acc.iter_mut().zip(p) {
                    *a += v;
                }
            }
        }
        let combined = Tensor::from_vec(out, (t, hid), &self.device)?.to_dtype(plan.dtype)?;
        let combined_x = match &plan.out {
            Some(o) => {
                o.slice_set(&combined, 0, 0)?;
                o.clone()
            }
            None => combined,
        };
        Ok(LowLatencyCombineOutput {
            combined_x,
            event: EventOverlap::complete(),
        })
    }
}
