//! Normal mode on the host backend: the transport moves the payloads.
//!
//! [`Buffer::dispatch`] and [`Buffer::combine`] check their arguments, then call these for CPU
//! buffers (CUDA buffers go to `crate::cuda` instead), which return the raw parts of the
//! outputs. Dispatch exchanges the layout counts
//! (notify), plans with the host twins of `ep_kernels::intranode`, and sends each destination
//! its tokens in one message; cached dispatch resends `x` along a handle's routing; combine
//! sends each source its rows back and sums them in rank order, in f32.

use super::layout::read_topk_idx;
use crate::backend::{
    recv_counts, CachedDispatch, CachedParts, CombineInput, CombineParts, DispatchParts,
    FreshDispatch, HandleRecord, HandleTensors,
};
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::codec::{i32_bytes, i32s, pack, tensor_bytes, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};
use ep_kernels::intranode as ki;
use ep_kernels::layout::{self as kl, ExpertPlacement};
use ep_kernels::FP8_GROUP;

impl Buffer {
    /// Fresh dispatch on the host backend (`x`, `num_experts` and the placement checked):
    /// reads and checks the routing, takes or computes the layout, exchanges the counts, then
    /// the tokens.
    pub(crate) fn host_dispatch_fresh(&self, args: FreshDispatch<'_>) -> Result<DispatchParts> {
        let r = self.topology.num_ranks;
        let me = self.topology.rank;
        let t = args.num_tokens;
        let num_experts = args.num_experts;
        let placement = &args.placement;
        let topk = match args.topk_idx {
            Some(idx) => {
                self.check_device("topk_idx", idx)?;
                check_shape("topk_idx", idx, &[Some(t), None])?;
                let (v, _, k) = read_topk_idx(idx, placement)?;
                Some((v, k))
            }
            None => None,
        };
        let weights = match (args.topk_weights, &topk) {
            (Some(_), None) => {
                return Err(Error::invalid(
                    "topk_weights",
                    "Some",
                    "needs topk_idx as well",
                ))
            }
            (Some(w), Some((_, k))) => {
                self.check_device("topk_weights", w)?;
                check_shape("topk_weights", w, &[Some(t), Some(*k)])?;
                check_dtype("topk_weights", w, &[DType::F32], "f32")?;
                Some(w.flatten_all()?.to_vec1::<f32>()?)
            }
            (None, _) => None,
        };
        let computed;
        let layout = match &args.layout {
            Some(l) => {
                if l.num_tokens != t {
                    return Err(Error::invalid(
                        "layout",
                        format!("a layout of {} tokens", l.num_tokens),
                        format!("must be for x's {t} tokens"),
                    ));
                }
                l.host.ok_or_else(|| {
                    Error::invalid(
                        "layout",
                        "a layout made by a CUDA buffer",
                        "a CPU buffer needs a layout of its own backend",
                    )
                })?
            }
            None => {
                let Some((idx, k)) = &topk else {
                    return Err(Error::invalid(
                        "topk_idx",
                        "None",
                        "needed to compute the layout when none is given",
                    ));
                };
                computed = ep_kernels::layout::get_dispatch_layout(idx, t, *k, placement)?;
                &computed
            }
        };
        // Masked ranks take no tokens: their experts contribute zero, as in low-latency mode.
        let active = self.active_ranks();
        let unmasked;
        let layout = if active.iter().all(|&a| a) {
            layout
        } else {
            unmasked = without_masked(layout, &active, placement);
            &unmasked
        };

        // Notify: every rank learns every rank's counts.
        let mut counts = layout.num_tokens_per_rank.clone();
        counts.extend_from_slice(&layout.num_tokens_per_expert);
        let msg = i32_bytes(&counts);
        let all = self.exchange_active("notify", (0..r).map(|_| Some(msg.clone())).collect())?;
        let mut per_rank_all = Vec::with_capacity(r * r);
        let mut per_expert_all = Vec::with_capacity(r * num_experts);
        for (src, m) in all.into_iter().enumerate() {
            // A masked rank sends nothing and is sent nothing.
            let v = match m {
                Some(m) => i32s(&m),
                None => vec![0; r + num_experts],
            };
            if v.len() != r + num_experts {
                return Err(Error::Protocol {
                    rank: src,
                    what: format!(
                        "notify carried {} counts, expected {} (do all ranks use num_experts = {num_experts}?)",
                        v.len(),
                        r + num_experts
                    ),
                });
            }
            per_rank_all.extend_from_slice(&v[..r]);
            per_expert_all.extend_from_slice(&v[r..]);
        }
        let notify = ki::notify(
            me,
            &per_rank_all,
            &per_expert_all,
            placement,
            args.expert_alignment,
        )?;
        // Worst-case outputs: every rank holds the whole matrix, so all of them stop here
        // together when one would receive more (before any payload moves), as on the GPU.
        let worst = args.num_worst_tokens;
        if worst > 0 {
            check_worst_case(&notify.rank_prefix_matrix, r, worst)?;
        }
        let send_slots = ki::send_slots(
            me,
            &layout.is_token_in_rank,
            t,
            &notify.rank_prefix_matrix,
            r,
        )?;
        let channel_prefix = ki::channel_prefix_matrix(
            &layout.is_token_in_rank,
            t,
            r,
            self.config.config.num_channels(),
        )?;

        // Payload.
        let SendRows {
            x_bytes,
            scale_bytes,
            row,
            srow,
        } = SendRows::new(args.x, args.x_scales, args.hidden)?;
        let k = topk.as_ref().map_or(0, |(_, k)| *k);
        let mut msgs = Vec::with_capacity(r);
        let mut local_idx = vec![0i64; k];
        let mut local_w = vec![0f32; k];
        for d in 0..r {
            let tokens: Vec<usize> = (0..t)
                .filter(|&i| layout.is_token_in_rank[i * r + d])
                .collect();
            let mut xs = Vec::with_capacity(tokens.len() * row);
            let mut ss = Vec::with_capacity(tokens.len() * srow);
            let mut src = Vec::with_capacity(tokens.len());
            let mut ids: Vec<i64> = Vec::with_capacity(tokens.len() * k);
            let mut ws: Vec<f32> = Vec::with_capacity(tokens.len() * k);
            for &i in &tokens {
                xs.extend_from_slice(&x_bytes[i * row..(i + 1) * row]);
                if let Some(sb) = &scale_bytes {
                    ss.extend_from_slice(&sb[i * srow..(i + 1) * srow]);
                }
                src.push(i as i32);
                if let Some((idx, _)) = &topk {
                    let zeros = vec![0f32; k];
                    let w = weights
                        .as_ref()
                        .map_or(&zeros[..], |w| &w[i * k..(i + 1) * k]);
                    ki::localize_topk(
                        &idx[i * k..(i + 1) * k],
                        w,
                        d,
                        placement,
                        &mut local_idx,
                        &mut local_w,
                    );
                    ids.extend_from_slice(&local_idx);
                    ws.extend_from_slice(&local_w);
                }
            }
            msgs.push(Some(pack(&[
                &xs,
                &ss,
                &i32_bytes(&src),
                bytemuck::cast_slice(&ids),
                bytemuck::cast_slice(&ws),
            ])));
        }
        let got = self.exchange_active("dispatch", msgs)?;

        let recv_counts = recv_counts(&notify.rank_prefix_matrix, r, me);
        let n = if worst > 0 {
            worst
        } else {
            notify.num_recv_tokens
        };
        let mut rx = Vec::with_capacity(n * row);
        let mut rs = Vec::with_capacity(n * srow);
        let mut rsrc = Vec::with_capacity(n);
        let mut rids: Vec<i64> = Vec::with_capacity(n * k);
        let mut rws: Vec<f32> = Vec::with_capacity(n * k);
        for (s, m) in got.into_iter().enumerate() {
            let c = recv_counts[s];
            let Some(m) = m else { continue };
            let parts = unpack(&m, 5, s)?;
            let expect = [c * row, c * srow, c * 4, c * k * 8, c * k * 4];
            for (i, (p, e)) in parts.iter().zip(expect).enumerate() {
                if p.len() != e {
                    return Err(Error::Protocol {
                        rank: s,
                        what: format!("dispatch section {i} has {} bytes, expected {e}", p.len()),
                    });
                }
            }
            rx.extend_from_slice(parts[0]);
            rs.extend_from_slice(parts[1]);
            rsrc.extend(i32s(parts[2]));
            rids.extend(
                parts[3]
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8"))),
            );
            rws.extend(
                parts[4]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4"))),
            );
        }
        // Worst-case outputs: the rows past the received ones are zeros, from nowhere, routed
        // nowhere (no-ops for exact outputs).
        rx.resize(n * row, 0);
        rs.resize(n * srow, 0);
        rsrc.resize(n, -1);
        rids.resize(n * k, -1);
        rws.resize(n * k, 0.0);
        let dev = &self.device;
        let (recv_x, recv_x_scales) = recv_rows(&rx, &rs, args.x.dtype(), n, args.hidden)?;
        let (recv_topk_idx, recv_topk_weights) = if topk.is_some() {
            (
                Some(Tensor::from_vec(rids, (n, k), dev)?),
                Some(Tensor::from_vec(rws, (n, k), dev)?),
            )
        } else {
            (None, None)
        };
        let recv_src_idx = Tensor::from_slice(&rsrc, n, dev)?;
        let nch = self.config.config.num_channels();
        let in_rank_u8: Vec<u8> = layout.is_token_in_rank.iter().map(|&b| b as u8).collect();
        let tensors = HandleTensors {
            rank_prefix_matrix: Tensor::from_slice(&notify.rank_prefix_matrix, (r, r), dev)?,
            channel_prefix_matrix: Tensor::from_slice(&channel_prefix, (r, nch), dev)?,
            recv_src_idx,
            is_token_in_rank: Tensor::from_vec(in_rank_u8, (t, r), dev)?,
            send_head: Tensor::from_slice(&send_slots, (t, r), dev)?,
        };
        let handle = HandleRecord {
            num_tokens: t,
            num_recv_tokens: n,
            rank_prefix_matrix: notify.rank_prefix_matrix,
            is_token_in_rank: layout.is_token_in_rank.clone(),
            tensors,
            #[cfg(feature = "cuda")]
            cuda: None,
        };
        Ok(DispatchParts {
            recv_x,
            recv_x_scales,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert: if worst > 0 {
                Vec::new()
            } else {
                notify
                    .num_recv_tokens_per_expert
                    .iter()
                    .map(|&c| c as usize)
                    .collect()
            },
            handle,
            event: EventOverlap::complete(),
        })
    }

    /// Cached dispatch on the host backend (arguments and handle checked): sends `x` (and its
    /// scales) along the handle's routing.
    pub(crate) fn host_dispatch_cached(&self, args: CachedDispatch<'_>) -> Result<CachedParts> {
        let hi = args.handle;
        let r = self.topology.num_ranks;
        let me = self.topology.rank;
        let t = hi.num_tokens;
        let SendRows {
            x_bytes,
            scale_bytes,
            row,
            srow,
        } = SendRows::new(args.x, args.x_scales, args.hidden)?;
        let msgs = (0..r)
            .map(|d| {
                let mut xs = Vec::new();
                let mut ss = Vec::new();
                for i in (0..t).filter(|&i| hi.is_token_in_rank[i * r + d]) {
                    xs.extend_from_slice(&x_bytes[i * row..(i + 1) * row]);
                    if let Some(sb) = &scale_bytes {
                        ss.extend_from_slice(&sb[i * srow..(i + 1) * srow]);
                    }
                }
                Some(pack(&[&xs, &ss]))
            })
            .collect();
        let got = self.exchange_active("cached_dispatch", msgs)?;
        let counts = hi.recv_counts_from(r, me);
        check_unmasked_since(&got, &counts)?;
        let n = hi.num_recv_tokens;
        let mut rx = Vec::with_capacity(n * row);
        let mut rs = Vec::with_capacity(n * srow);
        for (s, m) in got.into_iter().enumerate() {
            let Some(m) = m else { continue };
            let parts = unpack(&m, 2, s)?;
            if parts[0].len() != counts[s] * row || parts[1].len() != counts[s] * srow {
                return Err(Error::Protocol {
                    rank: s,
                    what: format!(
                        "cached dispatch sent {} bytes for {} tokens of {row} bytes (different hidden size or dtype on that rank?)",
                        parts[0].len(),
                        counts[s]
                    ),
                });
            }
            rx.extend_from_slice(parts[0]);
            rs.extend_from_slice(parts[1]);
        }
        // A worst-case handle's rows past the received ones (no-ops for exact ones).
        rx.resize(n * row, 0);
        rs.resize(n * srow, 0);
        let (recv_x, recv_x_scales) = recv_rows(&rx, &rs, args.x.dtype(), n, args.hidden)?;
        Ok(CachedParts {
            recv_x,
            recv_x_scales,
            event: EventOverlap::complete(),
        })
    }

    /// Combine on the host backend (arguments checked).
    pub(crate) fn host_combine(&self, args: CombineInput<'_>) -> Result<CombineParts> {
        let (hidden, k) = (args.hidden, args.num_topk);
        let hi = args.handle;
        if let Some(e) = args.previous_event {
            e.wait()?;
        }
        let r = self.topology.num_ranks;
        let me = self.topology.rank;
        let t = hi.num_tokens;
        let x_bytes = tensor_bytes(args.x)?;
        let row = hidden * args.x.dtype().size_in_bytes();
        let w_bytes = match args.topk_weights {
            Some(w) => tensor_bytes(w)?,
            None => Vec::new(),
        };
        let wrow = k.unwrap_or(0) * 4;
        let counts = hi.recv_counts_from(r, me);
        let mut off = 0;
        let msgs = (0..r)
            .map(|s| {
                let c = counts[s];
                let m = pack(&[
                    &x_bytes[off * row..(off + c) * row],
                    &w_bytes[off * wrow..(off + c) * wrow],
                ]);
                off += c;
                Some(m)
            })
            .collect();
        let got = self.exchange_active("combine", msgs)?;
        let sent: Vec<usize> = (0..r)
            .map(|d| (0..t).filter(|&i| hi.is_token_in_rank[i * r + d]).count())
            .collect();
        check_unmasked_since(&got, &sent)?;

        // The sums start from the bias rows (zero without a bias).
        let mut acc = match args.bias {
            Some(b) => b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0f32; t * hidden],
        };
        let kk = k.unwrap_or(0);
        let mut wacc = vec![0f32; t * kk];
        for (d, m) in got.into_iter().enumerate() {
            let Some(m) = m else { continue };
            let parts = unpack(&m, 2, d)?;
            let tokens: Vec<usize> = (0..t).filter(|&i| hi.is_token_in_rank[i * r + d]).collect();
            if parts[0].len() != tokens.len() * row || parts[1].len() != tokens.len() * wrow {
                return Err(Error::Protocol {
                    rank: d,
                    what: format!(
                        "combine sent {} bytes for {} tokens of {row} bytes (different hidden size, dtype or weights on that rank?)",
                        parts[0].len(),
                        tokens.len()
                    ),
                });
            }
            let rows = tensor_from_bytes(parts[0], args.x.dtype(), &[tokens.len(), hidden])?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (j, &i) in tokens.iter().enumerate() {
                for (a, v) in acc[i * hidden..(i + 1) * hidden]
                    .iter_mut()
                    .zip(&rows[j * hidden..(j + 1) * hidden])
                {
                    *a += v;
                }
                if kk > 0 {
                    let ws = &parts[1][j * wrow..(j + 1) * wrow];
                    for (a, c) in wacc[i * kk..(i + 1) * kk]
                        .iter_mut()
                        .zip(ws.chunks_exact(4))
                    {
                        *a += f32::from_le_bytes(c.try_into().expect("4 bytes"));
                    }
                }
            }
        }
        let dev = &self.device;
        Ok(CombineParts {
            combined_x: Tensor::from_vec(acc, (t, hidden), dev)?.to_dtype(args.x.dtype())?,
            combined_topk_weights: match k {
                Some(k) => Some(Tensor::from_vec(wacc, (t, k), dev)?),
                None => None,
            },
            event: EventOverlap::complete(),
        })
    }
}

/// `layout` with the masked ranks (`active[d] == false`) taking no token.
fn without_masked(
    layout: &kl::DispatchLayout,
    active: &[bool],
    placement: &ExpertPlacement,
) -> kl::DispatchLayout {
    let r = active.len();
    let mut out = layout.clone();
    for (d, _) in active.iter().enumerate().filter(|(_, &a)| !a) {
        out.num_tokens_per_rank[d] = 0;
        out.is_token_in_rank
            .iter_mut()
            .skip(d)
            .step_by(r)
            .for_each(|b| *b = false);
        let l = placement.experts_per_rank();
        out.num_tokens_per_expert[d * l..(d + 1) * l].fill(0);
    }
    // Per node: the tokens with a rank of that node still taking them.
    let p = placement.gpus_per_node;
    let t = out.is_token_in_rank.len() / r.max(1);
    for (n, c) in out.num_tokens_per_node.iter_mut().enumerate() {
        *c = (0..t)
            .filter(|&i| (n * p..(n + 1) * p).any(|d| out.is_token_in_rank[i * r + d]))
            .count() as i32;
    }
    out
}

/// Fails an op along a handle when a rank it exchanges rows with (`rows[s] > 0`) was masked
/// after the dispatch that made the handle: its rows are missing.
fn check_unmasked_since(got: &[Option<Vec<u8>>], rows: &[usize]) -> Result<()> {
    let ranks: Vec<usize> = got
        .iter()
        .zip(rows)
        .enumerate()
        .filter(|(_, (m, &n))| m.is_none() && n > 0)
        .map(|(s, _)| s)
        .collect();
    if ranks.is_empty() {
        Ok(())
    } else {
        Err(Error::RanksMasked { ranks })
    }
}

/// A dispatch's rows as bytes: `x` (`row` bytes a token) and its fp8 scales (`srow`).
struct SendRows {
    x_bytes: Vec<u8>,
    scale_bytes: Option<Vec<u8>>,
    row: usize,
    srow: usize,
}

impl SendRows {
    fn new(x: &Tensor, x_scales: Option<&Tensor>, hidden: usize) -> Result<Self> {
        Ok(Self {
            x_bytes: tensor_bytes(x)?,
            scale_bytes: x_scales.map(tensor_bytes).transpose()?,
            row: hidden * x.dtype().size_in_bytes(),
            srow: if x_scales.is_some() {
                hidden / FP8_GROUP * 4
            } else {
                0
            },
        })
    }
}

/// Checks every rank's received count (the last row of the `[r, r]` prefix matrix) against
/// the worst case `worst`.
fn check_worst_case(rank_prefix_matrix: &[i32], r: usize, worst: usize) -> Result<()> {
    let received = &rank_prefix_matrix[(r - 1) * r..r * r];
    match received
        .iter()
        .enumerate()
        .find(|&(_, &n)| n as usize > worst)
    {
        Some((rank, &n)) => Err(Error::RecvCapacity {
            rank,
            received: n as usize,
            capacity: worst,
        }),
        None => Ok(()),
    }
}

/// The received rows (`rx`, `[n, hidden]` of `dtype`) and, for fp8, their scales (`rs`) as
/// tensors.
fn recv_rows(
    rx: &[u8],
    rs: &[u8],
    dtype: DType,
    n: usize,
    hidden: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let recv_x = tensor_from_bytes(rx, dtype, &[n, hidden])?;
    let scales = if dtype == DType::F8E4M3 {
        Some(tensor_from_bytes(rs, DType::F32, &[n, hidden / FP8_GROUP])?)
    } else {
        None
    };
    Ok((recv_x, scales))
}
