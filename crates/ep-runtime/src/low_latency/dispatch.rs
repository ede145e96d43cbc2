//! Low-latency dispatch.

use super::RecvHook;
use crate::backend::Backend;
use crate::buffer::{check_dtype, check_shape, Buffer, Posted};
use crate::codec::{i32_bytes, i32s, pack, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::layout::read_topk_idx;
use candle_core::{DType, Tensor};
use ep_kernels::fp8::{self, ScaleFormat};
use ep_kernels::layout::ExpertPlacement;
use ep_kernels::low_latency::{self as kll, RecvLayout};
use ep_kernels::FP8_GROUP;
use std::sync::Arc;

/// The inputs of [`Buffer::low_latency_dispatch`].
#[derive(Debug, Clone)]
pub struct LowLatencyDispatchArgs<'a> {
    /// `[T, H]` tokens (bf16; f16/f32 also on the host backend), `T <= max tokens per rank`.
    pub x: &'a Tensor,
    /// `[T, K]` i64 expert ids, `-1` = none.
    pub topk_idx: &'a Tensor,
    /// `[T, K]` f32 gate weights, sent along for a per-rank combine
    /// ([`Reduction::PerRank`](crate::Reduction)); `None`: DeepEP's dispatch. Every rank must
    /// pass them or none.
    pub topk_weights: Option<&'a Tensor>,
    /// Slots per (expert, source); at most what the buffer was sized for, and >= `T`.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// Number of routed experts (a multiple of the number of ranks).
    pub num_experts: usize,
    /// Cast to fp8 e4m3 with 1x128 scales on the way (`hidden % 128 == 0`).
    pub use_fp8: bool,
    /// With `use_fp8`: power-of-two (UE8M0) scales.
    pub use_ue8m0: bool,
    /// Return before the work is done (GPU buffers).
    pub async_finish: bool,
}

impl<'a> LowLatencyDispatchArgs<'a> {
    /// bf16 dispatch of `x` routed by `topk_idx`.
    pub fn new(
        x: &'a Tensor,
        topk_idx: &'a Tensor,
        num_max_dispatch_tokens_per_rank: usize,
        num_experts: usize,
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights: None,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            use_fp8: false,
            use_ue8m0: false,
            async_finish: false,
        }
    }

    /// Sends fp8 with per-128-channel scales (`ue8m0`: power-of-two scales).
    pub fn fp8(mut self, ue8m0: bool) -> Self {
        self.use_fp8 = true;
        self.use_ue8m0 = ue8m0;
        self
    }

    /// Sends the gate weights `[T, K]` f32 along, so that the combine can reduce per rank
    /// ([`Reduction::PerRank`](crate::Reduction)).
    pub fn weights(mut self, topk_weights: &'a Tensor) -> Self {
        self.topk_weights = Some(topk_weights);
        self
    }
}

/// What [`Buffer::low_latency_dispatch`] returns.
#[derive(Debug, Clone)]
pub struct LowLatencyDispatchOutput {
    /// `[L, R * M, H]` received tokens per local expert (bf16, or f8e4m3 with `use_fp8`);
    /// rows past `recv_count[l]` are unspecified.
    pub recv_x: Tensor,
    /// `[L, R * M, H / 128]` f32 scales with `use_fp8`.
    pub recv_x_scales: Option<Tensor>,
    /// `[L]` i32 tokens received per local expert (on the buffer's device; CUDA buffers never
    /// read it back: see [`LowLatencyDispatchOutput::recv_count_host`]).
    pub recv_count: Tensor,
    /// The record of this dispatch, for combine.
    pub handle: LowLatencyHandle,
    /// Completion of the dispatch.
    pub event: EventOverlap,
}

impl LowLatencyDispatchOutput {
    /// A host copy of `recv_count` (for CUDA buffers a device-to-host read that waits for the
    /// dispatch: keep it off the hot path).
    pub fn recv_count_host(&self) -> Result<Vec<usize>> {
        let counts = self.recv_count.to_vec1::<i32>()?;
        Ok(counts.iter().map(|&c| c.max(0) as usize).collect())
    }
}

/// The record of a low-latency dispatch.
#[derive(Debug, Clone)]
pub struct LowLatencyHandle {
    pub(crate) inner: Arc<LlHandleInner>,
}

#[derive(Debug)]
pub(crate) struct LlHandleInner {
    pub buffer_id: u64,
    pub placement: ExpertPlacement,
    pub num_tokens: usize,
    pub num_topk: usize,
    pub hidden: usize,
    pub max_tokens: usize,
    /// This rank's routing, `[T, K]` (host backend only; empty for CUDA buffers).
    pub topk_idx: Vec<i64>,
    /// Slot of each `(t, k)` in its expert's region for this source (host backend only).
    pub slots: Vec<i32>,
    /// `[E]` tokens this rank sent to each expert (host backend only).
    pub send_counts: Vec<i32>,
    /// Where each source's tokens sit in `recv_x` (host backend only).
    pub layout: Option<RecvLayout>,
    /// Whether the dispatch carried the top-k weights (a per-rank combine can answer it).
    pub carries_weights: bool,
    /// Host backend, dispatches that carried the weights: per source, its tokens with a
    /// selection here in token order, each with its selections here in k order.
    pub rank_entries: Vec<Vec<RankToken>>,
    pub src_info: Tensor,
    /// `[L, R]` packed ranges (host backend; CUDA handles compute it on request).
    pub layout_range: Option<Tensor>,
    /// The receive buffers the CUDA combine reads (handles made by CUDA buffers).
    #[cfg(feature = "cuda")]
    pub cuda: Option<Arc<crate::cuda::CudaLlDispatchData>>,
}

impl LowLatencyHandle {
    /// `[L, R * M]` i32: source token index of each received row (`-1` past the count).
    pub fn src_info(&self) -> &Tensor {
        &self.inner.src_info
    }

    /// `[L, R]` i64: `offset << 32 | count` of each source's rows in `recv_x[l]`, on the
    /// buffer's device. For CUDA buffers this reads the kernel's ranges back to the host (it
    /// waits for the dispatch): an inspection call, not for the hot path.
    pub fn layout_range(&self) -> Result<Tensor> {
        if let Some(t) = &self.inner.layout_range {
            return Ok(t.clone());
        }
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.inner.cuda {
            return c.layout_range(self.inner.src_info.device());
        }
        Err(Error::invalid(
            "handle",
            "a handle without ranges",
            "made by neither backend",
        ))
    }

    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }
}

/// One source token's selections of this rank's experts (host backend, per-rank combine).
#[derive(Debug, Clone)]
pub(crate) struct RankToken {
    /// The token's index at its source.
    pub token: usize,
    /// `(k, row of recv_x as [L * R * M], weight)`, in k order.
    pub entries: Vec<(usize, usize, f32)>,
}

pub(crate) struct LlDispatchPlan {
    placement: ExpertPlacement,
    num_tokens: usize,
    num_topk: usize,
    hidden: usize,
    max_tokens: usize,
    fp8: bool,
    out_dtype: DType,
    topk_idx: Vec<i64>,
    slots: Vec<i32>,
    send_counts: Vec<i32>,
    carries_weights: bool,
}

impl Buffer {
    pub(crate) fn check_low_latency_sizing(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
    ) -> Result<()> {
        let Some(ll) = self.config.low_latency else {
            return Err(Error::invalid(
                "low_latency",
                "None",
                "build the buffer with BufferConfig::with_low_latency(..) to use low-latency ops",
            ));
        };
        if max_tokens == 0 || max_tokens > ll.max_tokens_per_rank {
            return Err(Error::invalid(
                "num_max_dispatch_tokens_per_rank",
                max_tokens,
                format!(
                    "must be in [1, {}] (the buffer's low-latency sizing)",
                    ll.max_tokens_per_rank
                ),
            ));
        }
        if hidden > ll.hidden {
            return Err(Error::invalid(
                "hidden",
                hidden,
                format!("must be <= {} (the buffer's low-latency sizing)", ll.hidden),
            ));
        }
        if num_experts > ll.num_experts {
            return Err(Error::invalid(
                "num_experts",
                num_experts,
                format!(
                    "must be <= {} (the buffer's low-latency sizing)",
                    ll.num_experts
                ),
            ));
        }
        Ok(())
    }

    /// Low-latency dispatch: sends, waits for every active peer, and returns the packed
    /// per-expert tokens. See [`crate::low_latency`] for the layout and the masking rules.
    pub fn low_latency_dispatch(
        &self,
        args: &LowLatencyDispatchArgs<'_>,
    ) -> Result<LowLatencyDispatchOutput> {
        self.low_latency_dispatch_send(args)?.recv()
    }

    /// The send phase of [`Buffer::low_latency_dispatch`]; the returned hook receives.
    pub fn low_latency_dispatch_send<'b>(
        &'b self,
        args: &LowLatencyDispatchArgs<'_>,
    ) -> Result<RecvHook<'b, LowLatencyDispatchOutput>> {
        let (plan, msgs) = self.ll_dispatch_prepare(args)?;
        match &self.backend {
            Backend::Host => {
                let mut fails = Vec::new();
                let posted = self.post("low_latency_dispatch", msgs, Some(&mut fails))?;
                Ok(RecvHook {
                    finish: Box::new(move || self.ll_dispatch_finish(plan, posted, fails)),
                })
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                let ll = c.low_latency();
                let pending = ll.dispatch_send(
                    self,
                    args.x,
                    args.topk_idx,
                    args.topk_weights,
                    plan.num_topk,
                    args.use_fp8,
                    args.use_ue8m0,
                    args.async_finish,
                    crate::cuda::LlHostPlan {
                        placement: plan.placement,
                        max_tokens: plan.max_tokens,
                        hidden: plan.hidden,
                    },
                )?;
                Ok(RecvHook {
                    finish: Box::new(move || {
                        let d = ll.dispatch_recv(self, pending)?;
                        self.ll_dispatch_output_cuda(plan, d)
                    }),
                })
            }
        }
    }

    /// The public output of a CUDA dispatch (its handle holds no host routing).
    #[cfg(feature = "cuda")]
    fn ll_dispatch_output_cuda(
        &self,
        plan: LlDispatchPlan,
        d: crate::cuda::LlDispatched,
    ) -> Result<LowLatencyDispatchOutput> {
        let inner = LlHandleInner {
            buffer_id: self.id,
            placement: plan.placement,
            num_tokens: plan.num_tokens,
            num_topk: plan.num_topk,
            hidden: plan.hidden,
            max_tokens: plan.max_tokens,
            topk_idx: Vec::new(),
            slots: Vec::new(),
            send_counts: Vec::new(),
            src_info: d.src_info,
            layout_range: None,
            layout: None,
            carries_weights: plan.carries_weights,
            rank_entries: Vec::new(),
            cuda: Some(d.data),
        };
        Ok(LowLatencyDispatchOutput {
            recv_x: d.recv_x,
            recv_x_scales: d.recv_x_scales,
            recv_count: d.recv_count,
            handle: LowLatencyHandle {
                inner: Arc::new(inner),
            },
            event: d.event,
        })
    }

    fn ll_dispatch_prepare(
        &self,
        args: &LowLatencyDispatchArgs<'_>,
    ) -> Result<(LlDispatchPlan, Vec<Option<Vec<u8>>>)> {
        let x = args.x;
        self.check_device("x", x)?;
        check_shape("x", x, &[None, None])?;
        let float = [DType::BF16, DType::F16, DType::F32];
        check_dtype("x", x, &float, "bf16, f16 or f32")?;
        let (t, h) = x.dims2()?;
        let m = args.num_max_dispatch_tokens_per_rank;
        let r = self.topology.num_ranks;
        if args.num_experts == 0 || args.num_experts % r != 0 {
            return Err(Error::invalid(
                "num_experts",
                args.num_experts,
                format!("must be a positive multiple of num_ranks = {r}"),
            ));
        }
        self.check_low_latency_sizing(m, h, args.num_experts)?;
        if t > m {
            return Err(Error::invalid(
                "x",
                format!("{t} tokens"),
                format!("at most num_max_dispatch_tokens_per_rank = {m} tokens per rank"),
            ));
        }
        if args.use_fp8 && h % FP8_GROUP != 0 {
            return Err(Error::invalid(
                "hidden",
                h,
                format!("fp8 needs a multiple of {FP8_GROUP}"),
            ));
        }
        if args.use_ue8m0 && !args.use_fp8 {
            return Err(Error::invalid(
                "use_ue8m0",
                true,
                "only meaningful with use_fp8",
            ));
        }
        self.check_device("topk_idx", args.topk_idx)?;
        check_shape("topk_idx", args.topk_idx, &[Some(t), None])?;
        let k = args.topk_idx.dims2()?.1;
        if let Some(w) = args.topk_weights {
            self.check_device("topk_weights", w)?;
            check_shape("topk_weights", w, &[Some(t), Some(k)])?;
            check_dtype("topk_weights", w, &[DType::F32], "f32")?;
        }
        let carries_weights = args.topk_weights.is_some();
        let placement = self.placement(args.num_experts)?;
        // CUDA buffers send from the device and never read the routing back: no host plan.
        if !self.backend.is_host() {
            check_dtype("topk_idx", args.topk_idx, &[DType::I64], "i64")?;
            let plan = LlDispatchPlan {
                placement,
                num_tokens: t,
                num_topk: k,
                hidden: h,
                max_tokens: m,
                fp8: args.use_fp8,
                out_dtype: x.dtype(),
                topk_idx: Vec::new(),
                slots: Vec::new(),
                send_counts: Vec::new(),
                carries_weights,
            };
            return Ok((plan, Vec::new()));
        }
        let (topk_idx, _, k) = read_topk_idx(args.topk_idx, &placement)?;
        let (slots, send_counts) = kll::send_slots(&topk_idx, t, k, &placement)?;
        let weights = match args.topk_weights {
            Some(w) => w.flatten_all()?.to_vec1::<f32>()?,
            None => Vec::new(),
        };

        // Payload rows: fp8 bytes + scales, or the tokens in their own dtype.
        let (payload, scales, row, out_dtype) = if args.use_fp8 {
            let xb = x
                .to_dtype(DType::BF16)?
                .flatten_all()?
                .to_vec1::<half::bf16>()?;
            let format = if args.use_ue8m0 {
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
        let groups = if args.use_fp8 { h / FP8_GROUP } else { 0 };
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
        Ok((
            LlDispatchPlan {
                placement,
                num_tokens: t,
                num_topk: k,
                hidden: h,
                max_tokens: m,
                fp8: args.use_fp8,
                out_dtype,
                topk_idx,
                slots,
                send_counts,
                carries_weights,
            },
            msgs,
        ))
    }

    fn ll_dispatch_finish(
        &self,
        plan: LlDispatchPlan,
        posted: Posted,
        mut fails: Vec<Error>,
    ) -> Result<LowLatencyDispatchOutput> {
        let got = self.complete(posted, Some(&mut fails))?;
        let r = self.topology.num_ranks;
        let l = plan.placement.experts_per_rank();
        let (m, h) = (plan.max_tokens, plan.hidden);
        let row = h * plan.out_dtype.size_in_bytes();
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
        let out = LowLatencyDispatchOutput {
            recv_x: tensor_from_bytes(&recv, plan.out_dtype, &[l, r * m, h])?,
            recv_x_scales: if plan.fp8 {
                Some(Tensor::from_vec(recv_scales, (l, r * m, groups), dev)?)
            } else {
                None
            },
            recv_count: Tensor::from_slice(&layout.recv_count, l, dev)?,
            handle: LowLatencyHandle {
                inner: Arc::new(LlHandleInner {
                    buffer_id: self.id,
                    placement: plan.placement,
                    num_tokens: plan.num_tokens,
                    num_topk: plan.num_topk,
                    hidden: h,
                    max_tokens: m,
                    topk_idx: plan.topk_idx,
                    slots: plan.slots,
                    send_counts: plan.send_counts,
                    src_info: Tensor::from_vec(src_info, (l, r * m), dev)?,
                    layout_range: Some(Tensor::from_vec(ranges, (l, r), dev)?),
                    layout: Some(layout),
                    carries_weights: plan.carries_weights,
                    rank_entries,
                    #[cfg(feature = "cuda")]
                    cuda: None,
                }),
            },
            event: EventOverlap::complete(),
        };
        match fails.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}
