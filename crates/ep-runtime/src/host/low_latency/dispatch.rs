//! Low-latency dispatch on the host backend: the sender plans every (token, expert) slot with
//! the host twins of `ep_kernels::low_latency` and sends each rank one message; the receiver
//! packs the rows per local expert in the layout of `crate::low_latency`. A peer that fails is
//! masked and its rows stay empty.

use super::super::layout::read_topk_idx;
use crate::backend::{LlDispatchParts, LlDispatchShape, LlHandleRecord, RankToken};
use crate::buffer::{Buffer, Posted};
use crate::codec::{i32_bytes, i32s, pack, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};
use ep_kernels::fp8::{self, ScaleFormat};
use ep_kernels::low_latency::{self as kll, RecvLayout};
use ep_kernels::FP8_GROUP;

/// A host dispatch whose messages are on their way.
pub(crate) struct HostLlDispatch {
    shape: LlDispatchShape,
    /// The rows' dtype on arrival (f8e4m3 with fp8).
    out_dtype: DType,
    topk_idx: Vec<i64>,
    slots: Vec<i32>,
    send_counts: Vec<i32>,
    posted: Posted,
    fails: Vec<Error>,
}

impl Buffer {
    /// The send phase of a host dispatch of `x` routed by `topk_idx` (arguments checked into
    /// `shape`): reads the routing back, checks it, plans the slots and posts one message per
    /// rank.
    pub(crate) fn host_ll_dispatch_send(
        &self,
        x: &Tensor,
        topk_idx: &Tensor,
        topk_weights: Option<&Tensor>,
        shape: LlDispatchShape,
    ) -> Result<HostLlDispatch> {
        let (t, h) = (shape.num_tokens, shape.hidden);
        let r = self.topology.num_ranks;
        let placement = &shape.placement;
        let carries_weights = shape.carries_weights;
        let (topk_idx, _, k) = read_topk_idx(topk_idx, placement)?;
        let (slots, send_counts) = kll::send_slots(&topk_idx, t, k, placement)?;
        let weights = match topk_weights {
            Some(w) => w.flatten_all()?.to_vec1::<f32>()?,
            None => Vec::new(),
        };

        // Payload rows: fp8 bytes + scales, or the tokens in their own dtype.
        let (payload, scales, row, out_dtype) = if shape.fp8 {
            let xb = x
                .to_dtype(DType::BF16)?
                .flatten_all()?
                .to_vec1::<half::bf16>()?;
            let format = if shape.ue8m0 {
                ScaleFormat::Ue8m0
            } else {
                ScaleFormat::Float
            };
            let (q, s) = fp8::quantize(&xb, t, h, format)?;
            (bytemuck::cast_slice(&q).to_vec(), s, h, DType::F8E4M3)
        } else {
            (
                crate::codec::tensor_bytes(x)?,
                Vec::new(),
                h * x.dtype().size_in_bytes(),
                x.dtype(),
            )
        };
        let groups = if shape.fp8 { h / FP8_GROUP } else { 0 };
        let l = placement.experts_per_rank();
        let msgs = (0..r)
            .map(|d| {
                let mut counts = vec![0i32; l];
                let mut src = Vec::new();
                let mut rows = Vec::new();
                let mut sc: Vec<f32> = Vec::new();
                // With the weights: each selection's k and weight.
                let mut ks = Vec::new();
                let mut ws: Vec<f32> = Vec::new();
                for (le, count) in counts.iter_mut().enumerate() {
                    let e = (d * l + le) as i64;
                    // One message per (token, k) pair, in (token, k) order: the slot order.
                    for (j, _) in topk_idx.iter().enumerate().filter(|(_, &v)| v == e) {
                        let ti = j / k;
                        *count += 1;
                        src.push(ti as i32);
                        rows.extend_from_slice(&payload[ti * row..(ti + 1) * row]);
                        sc.extend_from_slice(&scales[ti * groups..(ti + 1) * groups]);
                        if carries_weights {
                            ks.push((j % k) as i32);
                            ws.push(weights[j]);
                        }
                    }
                }
                Some(pack(&[
                    &i32_bytes(&counts),
                    &i32_bytes(&src),
                    &rows,
                    bytemuck::cast_slice(&sc),
                    &i32_bytes(&ks),
                    bytemuck::cast_slice(&ws),
                ]))
            })
            .collect();
        let mut fails = Vec::new();
        let posted = self.post("low_latency_dispatch", msgs, Some(&mut fails))?;
        Ok(HostLlDispatch {
            shape,
            out_dtype,
            topk_idx,
            slots,
            send_counts,
            posted,
            fails,
        })
    }

    /// The receive phase of a host dispatch: waits for every active peer (masking the ones
    /// that fail) and packs what arrived per local expert.
    pub(crate) fn host_ll_dispatch_recv(&self, d: HostLlDispatch) -> Result<LlDispatchParts> {
        let HostLlDispatch {
            shape: plan,
            out_dtype,
            topk_idx,
            slots,
            send_counts,
            posted,
            mut fails,
        } = d;
        let got = self.complete(posted, Some(&mut fails))?;
        let r = self.topology.num_ranks;
        let l = plan.placement.experts_per_rank();
        let (m, h) = (plan.max_tokens, plan.hidden);
        let row = h * out_dtype.size_in_bytes();
        let groups = if plan.fp8 { h / FP8_GROUP } else { 0 };
        let mut counts = vec![0i32; l * r];
        let mut parsed = Vec::with_capacity(r);
        for (s, msg) in got.iter().enumerate() {
            let Some(msg) = msg else {
                parsed.push(None);
                continue;
            };
            let parts = unpack(msg, 6, s)?;
            let c = i32s(parts[0]);
            let total: usize = c.iter().map(|&v| v.max(0) as usize).sum();
            let weighed = if plan.carries_weights { total } else { 0 };
            if c.len() != l
                || c.iter().any(|&v| v < 0 || v as usize > m)
                || parts[1].len() != total * 4
                || parts[2].len() != total * row
                || parts[3].len() != total * groups * 4
                || parts[4].len() != weighed * 4
                || parts[5].len() != weighed * 4
            {
                return Err(Error::Protocol {
                    rank: s,
                    what: format!(
                        "low-latency dispatch message does not match {l} experts x {m} slots of {row} bytes{} (same hidden, dtype, sizing and weights on every rank?)",
                        if plan.carries_weights { " with weights" } else { "" }
                    ),
                });
            }
            for (le, &v) in c.iter().enumerate() {
                counts[le * r + s] = v;
            }
            parsed.push(Some(parts));
        }
        let layout = RecvLayout::from_counts(counts, r);
        let mut recv = vec![0u8; l * r * m * row];
        let mut recv_scales = vec![0f32; l * r * m * groups];
        let mut src_info = vec![-1i32; l * r * m];
        let mut rank_entries: Vec<Vec<RankToken>> = vec![Vec::new(); r];
        for (s, parts) in parsed.iter().enumerate() {
            let Some(parts) = parts else { continue };
            let src = i32s(parts[1]);
            let ks = i32s(parts[4]);
            let ws: &[f32] = bytemuck::try_cast_slice(parts[5]).map_err(|_| Error::Protocol {
                rank: s,
                what: "misaligned weights".into(),
            })?;
            // Per token of s: its selections here (k, row, weight).
            let mut by_token: std::collections::BTreeMap<usize, Vec<(usize, usize, f32)>> =
                Default::default();
            let sc: &[f32] = bytemuck::try_cast_slice(parts[3]).map_err(|_| Error::Protocol {
                rank: s,
                what: "misaligned scales".into(),
            })?;
            let mut j = 0;
            for le in 0..l {
                for slot in 0..layout.counts[le * r + s] as usize {
                    let dst = le * r * m + layout.packed_row(le, s, slot);
                    recv[dst * row..(dst + 1) * row]
                        .copy_from_slice(&parts[2][j * row..(j + 1) * row]);
                    recv_scales[dst * groups..(dst + 1) * groups]
                        .copy_from_slice(&sc[j * groups..(j + 1) * groups]);
                    src_info[dst] = src[j];
                    if plan.carries_weights {
                        by_token.entry(src[j] as usize).or_default().push((
                            ks[j] as usize,
                            dst,
                            ws[j],
                        ));
                    }
                    j += 1;
                }
            }
            rank_entries[s] = by_token
                .into_iter()
                .map(|(token, mut entries)| {
                    entries.sort_by_key(|e| e.0);
                    RankToken { token, entries }
                })
                .collect();
        }
        let dev = &self.device;
        let ranges: Vec<i64> = layout
            .offsets
            .iter()
            .zip(&layout.counts)
            .map(|(&o, &c)| ((o as i64) << 32) | c as i64)
            .collect();
        let out = LlDispatchParts {
            recv_x: tensor_from_bytes(&recv, out_dtype, &[l, r * m, h])?,
            recv_x_scales: if plan.fp8 {
                Some(Tensor::from_vec(recv_scales, (l, r * m, groups), dev)?)
            } else {
                None
            },
            recv_count: Tensor::from_slice(&layout.recv_count, l, dev)?,
            handle: LlHandleRecord {
                placement: plan.placement,
                num_tokens: plan.num_tokens,
                num_topk: plan.num_topk,
                hidden: h,
                max_tokens: m,
                topk_idx,
                slots,
                send_counts,
                src_info: Tensor::from_vec(src_info, (l, r * m), dev)?,
                layout_range: Some(Tensor::from_vec(ranges, (l, r), dev)?),
                layout: Some(layout),
                carries_weights: plan.carries_weights,
                rank_entries,
                #[cfg(feature = "cuda")]
                cuda: None,
            },
            event: EventOverlap::complete(),
        };
        match fails.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}
