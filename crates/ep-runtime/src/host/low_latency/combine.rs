//! Low-latency combine on the host backend: each expert rank sends every source its rows (per
//! expert, or one partial sum per token and rank), and the home sums them in f32. Masked ranks
//! contribute nothing.

use crate::backend::{LlCombineParts, LlHandleRecord, RankToken};
use crate::buffer::{Buffer, Posted};
use crate::codec::{i32_bytes, pack, tensor_bytes, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};
use ep_kernels::low_latency::{rank_order, Reduction};
use std::sync::Arc;

/// A combine whose arguments the op module checked.
pub(crate) struct LlCombineInput<'a> {
    /// `[L, R * M, H]` expert outputs.
    pub x: &'a Tensor,
    /// `[T, K]` i64, the dispatch's routing.
    pub topk_idx: &'a Tensor,
    /// `[T, K]` f32.
    pub topk_weights: &'a Tensor,
    pub handle: &'a Arc<LlHandleRecord>,
    pub reduction: Reduction,
    pub out: Option<&'a Tensor>,
}

/// A host combine whose messages are on their way.
pub(crate) struct HostLlCombine {
    handle: Arc<LlHandleRecord>,
    weights: Vec<f32>,
    dtype: DType,
    reduction: Reduction,
    out: Option<Tensor>,
    posted: Posted,
    fails: Vec<Error>,
}

impl Buffer {
    /// The send phase of a combine on the host backend (arguments checked): checks the
    /// routing against the dispatch's and posts each source its rows.
    pub(crate) fn host_ll_combine_send(&self, args: LlCombineInput<'_>) -> Result<HostLlCombine> {
        let h = &**args.handle;
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
            Reduction::PerExpert => self.ll_per_expert_rows(args.x, h)?,
            Reduction::PerRank => self.ll_per_rank_rows(args.x, &h.rank_entries)?,
        };
        let mut fails = Vec::new();
        let posted = self.post("low_latency_combine", msgs, Some(&mut fails))?;
        Ok(HostLlCombine {
            handle: args.handle.clone(),
            weights,
            dtype: args.x.dtype(),
            reduction: args.reduction,
            out: args.out.cloned(),
            posted,
            fails,
        })
    }

    /// Per expert: to each source, for each local expert, its rows of that source in slot
    /// order.
    fn ll_per_expert_rows(&self, x: &Tensor, h: &LlHandleRecord) -> Result<Vec<Option<Vec<u8>>>> {
        let r = self.topology.num_ranks;
        let l = h.placement.experts_per_rank();
        let (m, hid) = (h.max_tokens, h.hidden);
        let layout = h.layout.as_ref().expect("checked by host_ll_combine_send");
        let xb = tensor_bytes(x)?;
        let row = hid * x.dtype().size_in_bytes();
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

    /// The receive phase of a host combine: waits for every active peer (masking the ones that
    /// fail) and sums each token's rows in f32.
    pub(crate) fn host_ll_combine_recv(&self, plan: HostLlCombine) -> Result<LlCombineParts> {
        let mut fails = plan.fails;
        let got = self.complete(plan.posted, Some(&mut fails))?;
        if plan.reduction == Reduction::PerRank {
            let out = self.ll_per_rank_finish(&plan.handle, plan.dtype, plan.out, &got)?;
            return match fails.into_iter().next() {
                Some(e) => Err(e),
                None => Ok(out),
            };
        }
        let h = &plan.handle;
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
        let out = LlCombineParts {
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
        h: &LlHandleRecord,
        dtype: DType,
        out: Option<Tensor>,
        got: &[Option<Vec<u8>>],
    ) -> Result<LlCombineParts> {
        let (t, k, hid) = (h.num_tokens, h.num_topk, h.hidden);
        let row = hid * dtype.size_in_bytes();
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
            let v = tensor_from_bytes(parts[1], dtype, &[ids.len(), hid])?
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
        let mut sums = vec![0f32; t * hid];
        for ti in 0..t {
            let acc = &mut sums[ti * hid..(ti + 1) * hid];
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
        let combined = Tensor::from_vec(sums, (t, hid), &self.device)?.to_dtype(dtype)?;
        let combined_x = match out {
            Some(o) => {
                o.slice_set(&combined, 0, 0)?;
                o
            }
            None => combined,
        };
        Ok(LlCombineParts {
            combined_x,
            event: EventOverlap::complete(),
        })
    }
}
