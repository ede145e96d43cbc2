//! Normal-mode dispatch.

use super::handle::{Handle, HandleInner, HandleTensors};
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::codec::{i32_bytes, i32s, pack, tensor_bytes, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::layout::{read_topk_idx, DispatchLayout};
use candle_core::{DType, Tensor};
use ep_kernels::intranode as ki;
use ep_kernels::FP8_GROUP;
use std::sync::Arc;

/// The inputs of [`Buffer::dispatch`], built with [`DispatchArgs::new`] and its setters.
#[derive(Debug, Clone)]
pub struct DispatchArgs<'a> {
    /// `[T, H]` tokens: bf16 (f16 and f32 on the host backend), or f8e4m3 with `x_scales`.
    pub x: &'a Tensor,
    /// `[T, H / 128]` f32 scales when `x` is fp8.
    pub x_scales: Option<&'a Tensor>,
    /// `[T, K]` i64 expert ids, `-1` = none. Sent along rewritten to the receiver's local ids.
    pub topk_idx: Option<&'a Tensor>,
    /// `[T, K]` f32 gate weights, sent along (zeroed where the expert is elsewhere).
    pub topk_weights: Option<&'a Tensor>,
    /// The layout from [`Buffer::get_dispatch_layout`]; computed here from `topk_idx` and
    /// `num_experts` when absent.
    pub layout: Option<&'a DispatchLayout>,
    /// Number of routed experts (needed when `layout` is absent).
    pub num_experts: Option<usize>,
    /// Cached mode: the handle of an earlier dispatch with the same routing.
    pub handle: Option<&'a Handle>,
    /// Round each local expert's receive count up to a multiple of this (>= 1).
    pub expert_alignment: usize,
    /// Work to wait for before starting (GPU buffers).
    pub previous_event: Option<&'a EventOverlap>,
    /// Return before the work is done; wait on the output's event (GPU buffers).
    pub async_finish: bool,
}

impl<'a> DispatchArgs<'a> {
    /// Dispatch of `x` with nothing else set.
    pub fn new(x: &'a Tensor) -> Self {
        Self {
            x,
            x_scales: None,
            topk_idx: None,
            topk_weights: None,
            layout: None,
            num_experts: None,
            handle: None,
            expert_alignment: 1,
            previous_event: None,
            async_finish: false,
        }
    }

    /// Sets fp8 scales (`x` must be f8e4m3).
    pub fn x_scales(mut self, scales: &'a Tensor) -> Self {
        self.x_scales = Some(scales);
        self
    }

    /// Sets the routing sent along with the tokens.
    pub fn topk(mut self, topk_idx: &'a Tensor, topk_weights: &'a Tensor) -> Self {
        self.topk_idx = Some(topk_idx);
        self.topk_weights = Some(topk_weights);
        self
    }

    /// Sets a precomputed layout.
    pub fn layout(mut self, layout: &'a DispatchLayout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// Sets the number of routed experts.
    pub fn num_experts(mut self, num_experts: usize) -> Self {
        self.num_experts = Some(num_experts);
        self
    }

    /// Cached mode: reuse the routing of `handle`.
    pub fn cached(mut self, handle: &'a Handle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Sets the per-expert receive-count alignment.
    pub fn expert_alignment(mut self, alignment: usize) -> Self {
        self.expert_alignment = alignment;
        self
    }

    /// Waits for `event` before starting.
    pub fn previous_event(mut self, event: &'a EventOverlap) -> Self {
        self.previous_event = Some(event);
        self
    }

    /// Returns before completion (see [`EventOverlap`]).
    pub fn async_finish(mut self, async_finish: bool) -> Self {
        self.async_finish = async_finish;
        self
    }
}

/// What [`Buffer::dispatch`] returns: exactly-sized received tensors and the handle.
#[derive(Debug, Clone)]
pub struct DispatchOutput {
    /// `[N, H]` received tokens, ordered by source rank, then token order.
    pub recv_x: Tensor,
    /// `[N, H / 128]` f32 scales, when `x` was fp8.
    pub recv_x_scales: Option<Tensor>,
    /// `[N, K]` i64 local expert ids (`-1`: expert not on this rank), when routing was sent.
    pub recv_topk_idx: Option<Tensor>,
    /// `[N, K]` f32 weights (0 where the id is `-1`), when routing was sent.
    pub recv_topk_weights: Option<Tensor>,
    /// `[N]` i32 index of each received token on its source rank.
    pub recv_src_idx: Tensor,
    /// Tokens each local expert receives, rounded up to `expert_alignment` (empty in cached
    /// mode, where the counts are not exchanged).
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// The record of this dispatch, for combine and cached dispatch.
    pub handle: Handle,
    /// Completion of the dispatch.
    pub event: EventOverlap,
}

struct CheckedX {
    num_tokens: usize,
    hidden: usize,
    fp8: bool,
}

fn check_x(buf: &Buffer, x: &Tensor, x_scales: Option<&Tensor>) -> Result<CheckedX> {
    buf.check_device("x", x)?;
    check_shape("x", x, &[None, None])?;
    check_dtype(
        "x",
        x,
        &[DType::BF16, DType::F16, DType::F32, DType::F8E4M3],
        "bf16, f16, f32 or f8e4m3",
    )?;
    let (num_tokens, hidden) = x.dims2()?;
    let fp8 = x.dtype() == DType::F8E4M3;
    match (fp8, x_scales) {
        (true, None) => {
            return Err(Error::invalid(
                "x_scales",
                "None",
                "fp8 x needs [num_tokens, hidden / 128] f32 scales",
            ))
        }
        (false, Some(_)) => {
            return Err(Error::invalid(
                "x_scales",
                "Some",
                format!("only allowed when x is f8e4m3 (x is {:?})", x.dtype()),
            ))
        }
        (true, Some(s)) => {
            if hidden % FP8_GROUP != 0 {
                return Err(Error::invalid(
                    "hidden",
                    hidden,
                    format!("fp8 needs a multiple of {FP8_GROUP}"),
                ));
            }
            buf.check_device("x_scales", s)?;
            check_shape("x_scales", s, &[Some(num_tokens), Some(hidden / FP8_GROUP)])?;
            check_dtype("x_scales", s, &[DType::F32], "f32")?;
        }
        (false, None) => {}
    }
    Ok(CheckedX {
        num_tokens,
        hidden,
        fp8,
    })
}

impl Buffer {
    /// Normal-mode dispatch (see [`crate::normal`]): every rank sends each token once to
    /// each rank holding one of its experts, and receives exactly the tokens sent to it.
    ///
    /// Without a handle, the layout counts are exchanged first; with
    /// [`DispatchArgs::cached`], the handle's routing is reused and only `x` (and its scales)
    /// move. All inputs are checked before anything is sent.
    pub fn dispatch(&self, args: &DispatchArgs<'_>) -> Result<DispatchOutput> {
        let cx = check_x(self, args.x, args.x_scales)?;
        if args.expert_alignment == 0 {
            return Err(Error::invalid("expert_alignment", 0, "must be >= 1"));
        }
        // CUDA buffers order `previous_event` on their stream instead of waiting here.
        #[cfg(feature = "cuda")]
        if !self.backend.is_host() {
            return match args.handle {
                Some(h) => self.dispatch_cached(args, &cx, h),
                None => self.dispatch_fresh(args, &cx),
            };
        }
        if let Some(e) = args.previous_event {
            e.wait()?;
        }
        match args.handle {
            Some(h) => self.dispatch_cached(args, &cx, h),
            None => self.dispatch_fresh(args, &cx),
        }
    }

    fn dispatch_fresh(&self, args: &DispatchArgs<'_>, cx: &CheckedX) -> Result<DispatchOutput> {
        let r = self.topology.num_ranks;
        let me = self.topology.rank;
        let t = cx.num_tokens;
        // Routing and layout.
        let num_experts = match (args.layout, args.num_experts) {
            (Some(l), Some(n)) if l.num_experts != n => {
                return Err(Error::invalid(
                    "num_experts",
                    n,
                    format!("must match the layout's {}", l.num_experts),
                ))
            }
            (Some(l), _) => l.num_experts,
            (None, Some(n)) => n,
            (None, None) => {
                return Err(Error::invalid(
                    "layout",
                    "None",
                    "give a layout from get_dispatch_layout, or topk_idx and num_experts",
                ))
            }
        };
        if num_experts == 0 || num_experts % r != 0 {
            return Err(Error::invalid(
                "num_experts",
                num_experts,
                format!("must be a positive multiple of num_ranks = {r}"),
            ));
        }
        let placement = self.placement(num_experts)?;
        // CUDA buffers: shapes and dtypes only; the routing stays on the device.
        #[cfg(feature = "cuda")]
        if let Some(c) = self.backend.cuda() {
            let num_topk = match args.topk_idx {
                Some(idx) => {
                    self.check_device("topk_idx", idx)?;
                    check_shape("topk_idx", idx, &[Some(t), None])?;
                    check_dtype("topk_idx", idx, &[DType::I64], "i64")?;
                    idx.dims2()?.1
                }
                None => 0,
            };
            match (args.topk_weights, args.topk_idx) {
                (Some(_), None) => {
                    return Err(Error::invalid(
                        "topk_weights",
                        "Some",
                        "needs topk_idx as well",
                    ))
                }
                (Some(w), Some(_)) => {
                    self.check_device("topk_weights", w)?;
                    check_shape("topk_weights", w, &[Some(t), Some(num_topk)])?;
                    check_dtype("topk_weights", w, &[DType::F32], "f32")?;
                }
                _ => {}
            }
            match args.layout {
                Some(l) if l.num_tokens != t => {
                    return Err(Error::invalid(
                        "layout",
                        format!("a layout of {} tokens", l.num_tokens),
                        format!("must be for x's {t} tokens"),
                    ))
                }
                None if args.topk_idx.is_none() => {
                    return Err(Error::invalid(
                        "topk_idx",
                        "None",
                        "needed to compute the layout when none is given",
                    ))
                }
                _ => {}
            }
            return c.dispatch_fresh(crate::cuda::FreshDispatch {
                args,
                num_tokens: t,
                hidden: cx.hidden,
                fp8: cx.fp8,
                num_experts,
                placement,
                num_topk,
            });
        }
        let topk = match args.topk_idx {
            Some(idx) => {
                self.check_device("topk_idx", idx)?;
                check_shape("topk_idx", idx, &[Some(t), None])?;
                let (v, _, k) = read_topk_idx(idx, &placement)?;
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
        let layout = match args.layout {
            Some(l) => {
                if l.num_tokens != t {
                    return Err(Error::invalid(
                        "layout",
                        format!("a layout of {} tokens", l.num_tokens),
                        format!("must be for x's {t} tokens"),
                    ));
                }
                l.host.as_ref().ok_or_else(|| {
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
                computed = ep_kernels::layout::get_dispatch_layout(idx, t, *k, &placement)?;
                &computed
            }
        };

        // Notify: every rank learns every rank's counts.
        let mut counts = layout.num_tokens_per_rank.clone();
        counts.extend_from_slice(&layout.num_tokens_per_expert);
        let msg = i32_bytes(&counts);
        let all = self.exchange("notify", (0..r).map(|_| Some(msg.clone())).collect(), None)?;
        let mut per_rank_all = Vec::with_capacity(r * r);
        let mut per_expert_all = Vec::with_capacity(r * num_experts);
        for (src, m) in all.into_iter().enumerate() {
            let v = i32s(&m.unwrap_or_default());
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
            &placement,
            args.expert_alignment,
        )?;
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
        let x_bytes = tensor_bytes(args.x)?;
        let scale_bytes = match args.x_scales {
            Some(s) => Some(tensor_bytes(s)?),
            None => None,
        };
        let row = cx.hidden * args.x.dtype().size_in_bytes();
        let srow = if cx.fp8 { cx.hidden / FP8_GROUP * 4 } else { 0 };
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
                        &placement,
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
        let got = self.exchange("dispatch", msgs, None)?;

        let recv_counts = super::handle::recv_counts(&notify.rank_prefix_matrix, r, me);
        let n = notify.num_recv_tokens;
        let mut rx = Vec::with_capacity(n * row);
        let mut rs = Vec::with_capacity(n * srow);
        let mut rsrc = Vec::with_capacity(n);
        let mut rids: Vec<i64> = Vec::with_capacity(n * k);
        let mut rws: Vec<f32> = Vec::with_capacity(n * k);
        for (s, m) in got.into_iter().enumerate() {
            let m = m.unwrap_or_default();
            let parts = unpack(&m, 5, s)?;
            let c = recv_counts[s];
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
        let dev = &self.device;
        let recv_x = tensor_from_bytes(&rx, args.x.dtype(), &[n, cx.hidden])?;
        let recv_x_scales = if cx.fp8 {
            Some(tensor_from_bytes(
                &rs,
                DType::F32,
                &[n, cx.hidden / FP8_GROUP],
            )?)
        } else {
            None
        };
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
            recv_src_idx: recv_src_idx.clone(),
            is_token_in_rank: Tensor::from_vec(in_rank_u8, (t, r), dev)?,
            send_head: Tensor::from_slice(&send_slots, (t, r), dev)?,
        };
        let handle = Handle {
            inner: Arc::new(HandleInner {
                buffer_id: self.id,
                num_ranks: r,
                num_tokens: t,
                num_recv_tokens: n,
                rank_prefix_matrix: notify.rank_prefix_matrix,
                is_token_in_rank: layout.is_token_in_rank.clone(),
                tensors,
                #[cfg(feature = "cuda")]
                cuda: None,
            }),
        };
        Ok(DispatchOutput {
            recv_x,
            recv_x_scales,
            recv_topk_idx,
            recv_topk_weights,
            recv_src_idx,
            num_recv_tokens_per_expert: notify
                .num_recv_tokens_per_expert
                .iter()
                .map(|&c| c as usize)
                .collect(),
            handle,
            event: EventOverlap::complete(),
        })
    }

    /// Checks that `handle` was made by this buffer.
    pub(crate) fn check_handle(&self, handle: &Handle) -> Result<()> {
        if handle.inner.buffer_id != self.id {
            return Err(Error::HandleMismatch(format!(
                "the handle was made by another buffer (id {}, this buffer is {})",
                handle.inner.buffer_id, self.id
            )));
        }
        Ok(())
    }

    fn dispatch_cached(
        &self,
        args: &DispatchArgs<'_>,
        cx: &CheckedX,
        h: &Handle,
    ) -> Result<DispatchOutput> {
        self.check_handle(h)?;
        if args.topk_idx.is_some() || args.topk_weights.is_some() || args.layout.is_some() {
            return Err(Error::invalid(
                "handle",
                "Some",
                "cached dispatch reuses the handle's routing: do not pass topk_idx, topk_weights or layout",
            ));
        }
        let hi = &h.inner;
        if cx.num_tokens != hi.num_tokens {
            return Err(Error::HandleMismatch(format!(
                "x has {} tokens but the handle was made for {}",
                cx.num_tokens, hi.num_tokens
            )));
        }
        #[cfg(feature = "cuda")]
        if let Some(c) = self.backend.cuda() {
            return c.dispatch_cached(args, cx.hidden, cx.fp8, h);
        }
        let r = self.topology.num_ranks;
        let me = self.topology.rank;
        let t = cx.num_tokens;
        let x_bytes = tensor_bytes(args.x)?;
        let scale_bytes = match args.x_scales {
            Some(s) => Some(tensor_bytes(s)?),
            None => None,
        };
        let row = cx.hidden * args.x.dtype().size_in_bytes();
        let srow = if cx.fp8 { cx.hidden / FP8_GROUP * 4 } else { 0 };
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
        let got = self.exchange("cached_dispatch", msgs, None)?;
        let counts = h.recv_counts_from(me);
        let n = hi.num_recv_tokens;
        let mut rx = Vec::with_capacity(n * row);
        let mut rs = Vec::with_capacity(n * srow);
        for (s, m) in got.into_iter().enumerate() {
            let m = m.unwrap_or_default();
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
        Ok(DispatchOutput {
            recv_x: tensor_from_bytes(&rx, args.x.dtype(), &[n, cx.hidden])?,
            recv_x_scales: if cx.fp8 {
                Some(tensor_from_bytes(
                    &rs,
                    DType::F32,
                    &[n, cx.hidden / FP8_GROUP],
                )?)
            } else {
                None
            },
            recv_topk_idx: None,
            recv_topk_weights: None,
            recv_src_idx: hi.tensors.recv_src_idx.clone(),
            num_recv_tokens_per_expert: Vec::new(),
            handle: h.clone(),
            event: EventOverlap::complete(),
        })
    }
}
