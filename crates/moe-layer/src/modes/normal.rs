//! [`MoeLayer`]'s normal mode (prefill): layout, dispatch, the experts over what arrived,
//! combine, with the shared experts beside the dispatch; as two micro-batches; pipelined over
//! groups of each rank's experts (the groups' routing masks: `expert_groups`); and at one rank
//! without any transfer.

use crate::error::Result;
use crate::experts::ExpertInput;
use crate::layer::{join_parts, two_micro_batches, MoeLayer};
use crate::modes::expert_groups::ExpertGroups;
use candle_core::{DType, Device, Tensor};
use ep_runtime::cast::per_token_cast_to_fp8;
use ep_runtime::{CombineArgs, DispatchArgs, EventOverlap};

impl MoeLayer {
    /// Normal mode; returns the combined routed output and the shared experts' output.
    ///
    /// Stream timeline on CUDA (see `docs/design.md`): routing, layout and the fp8 cast on the
    /// compute stream, then the shared experts on the compute stream while the dispatch runs
    /// on the (high-priority) communication stream (it waits only for the layout's event); the
    /// host waits once, for the received-token count; the expert GEMMs wait for the dispatch's
    /// event; the combine waits for the GEMMs' event and adds the shared experts' output to
    /// its sums (its bias), and the compute stream waits for the combine. The shared output is
    /// then returned as `None` (already in the sum).
    ///
    /// `worst`: the dispatches' worst-case rows per rank
    /// ([`crate::MoeLayerOptions::normal_max_tokens_per_rank`], decided for the whole step), or
    /// `None` for exact outputs.
    pub(crate) fn routed_normal(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
        worst: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        // At one rank the fp8 wire format keeps the buffer's path (its rounding is the same at
        // any rank count), unless the experts are fp8: their GEMMs quantize the rows as the
        // wire does (1 x 128, the same cast), so the local path gives the same numbers.
        if self.buffer.topology().num_ranks == 1
            && (!self.options.fp8_dispatch || self.experts.is_fp8())
        {
            return self.routed_local(x, idx, w);
        }
        if self.options.two_batch_overlap {
            return self.routed_normal_two_batches(x, idx, w, worst);
        }
        if let Some(groups) = &self.expert_groups {
            return self.routed_normal_expert_groups(groups, x, idx, w, worst);
        }
        let dev = x.device();
        // By default the dispatch is issued (its kernel grabs its SMs) before the shared experts
        // are queued; `shared_before_dispatch` queues them first, on the SMs the transfer
        // leaves (docs/benchmarks.md, "Shared experts beside the dispatch").
        let send = self.prepare_dispatch(x, idx)?;
        let ready = EventOverlap::record(dev)?;
        let (tokens, first) = (x.dims()[0] > 0, self.options.shared_before_dispatch);
        let early = if tokens && first {
            self.shared_beside_transfer(x)?
        } else {
            None
        };
        let out = self.dispatch_normal(&send, idx, w, &ready, worst)?;
        let shared = if tokens && !first {
            self.shared_forward(x)?
        } else {
            early
        };
        let y = self.experts_normal(&out, dev, x.dtype())?;
        let computed = EventOverlap::record(dev)?;
        // The shared experts' output joins the combine's sums as its bias (DeepEP's `bias`):
        // no separate add after the combine, one rounding of the token's whole sum.
        let bias = shared.as_ref().filter(|s| s.dtype() == y.dtype());
        let mut args = CombineArgs::new(&y, &out.handle).previous_event(&computed);
        if let Some(b) = bias {
            args = args.bias(b);
        }
        let combined = self.buffer.combine(&args)?;
        let shared = if bias.is_some() { None } else { shared };
        Ok((combined.combined_x, shared))
    }

    /// The shared experts on the compute stream while a normal-mode transfer runs beside them:
    /// on CUDA with cuBLAS targeting the SMs the transfer's kernels leave (`Config::num_sms`),
    /// so that the transfer, queued after them on its high-priority stream, finds its SMs free
    /// instead of waiting behind the GEMMs' later waves.
    fn shared_beside_transfer(&self, x: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let (Some(_), Device::Cuda(dev)) = (&self.shared, x.device()) {
            use ep_kernels::cublas_sms::sms_left;
            let left = sms_left(
                dev.cuda_stream().context(),
                self.buffer.config().config.num_sms,
            )?;
            return ep_kernels::cublas_sms::with_sm_count_target(
                &dev.cublas_handle(),
                left,
                || self.shared_forward(x),
            )?;
        }
        self.shared_forward(x)
    }

    /// What a normal-mode dispatch of `x` routed by `idx` sends, computed on the compute
    /// stream: the layout and, with [`MoeLayerOptions::fp8_dispatch`], the fp8 rows and scales.
    fn prepare_dispatch(&self, x: &Tensor, idx: &Tensor) -> Result<SendRows> {
        let (rows, scales) = self.wire_rows(x)?;
        self.send_rows(idx, &rows, scales.as_ref())
    }

    /// The rows of `x` as they travel: as they are, or with
    /// [`MoeLayerOptions::fp8_dispatch`] cast to fp8 with their scales (on the compute stream).
    fn wire_rows(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        Ok(if self.options.fp8_dispatch {
            let (q, s) = per_token_cast_to_fp8(x, false)?;
            (q, Some(s))
        } else {
            (x.clone(), None)
        })
    }

    /// What a dispatch of the wire rows `rows` (and `scales`) routed by `idx` sends: their
    /// layout, computed on the compute stream.
    fn send_rows(&self, idx: &Tensor, rows: &Tensor, scales: Option<&Tensor>) -> Result<SendRows> {
        Ok(SendRows {
            layout: self.buffer.get_dispatch_layout(idx, self.num_experts)?,
            x: rows.clone(),
            scales: scales.cloned(),
        })
    }

    /// The normal-mode dispatch of `send` routed by `idx`, `w` on the communication stream
    /// after `ready`; returns once it is issued: the host has read the received count (or, with
    /// `worst`, sized the outputs for that many rows from every rank), the rows are not yet in.
    fn dispatch_normal(
        &self,
        send: &SendRows,
        idx: &Tensor,
        w: &Tensor,
        ready: &EventOverlap,
        worst: Option<usize>,
    ) -> Result<ep_runtime::DispatchOutput> {
        let mut args = DispatchArgs::new(&send.x)
            .topk(idx, w)
            .layout(&send.layout)
            .expert_alignment(self.options.expert_alignment)
            .previous_event(ready)
            .async_finish(true);
        if let Some(max) = worst {
            args = args.num_worst_tokens(max * self.buffer.topology().num_ranks);
        }
        if let Some(s) = &send.scales {
            args = args.x_scales(s);
        }
        Ok(self.buffer.dispatch(&args)?)
    }

    /// The routed experts over what `out` received, on the compute stream once it is in: fp8
    /// rows go to fp8 experts as they arrived and are cast back to `dtype` for float experts.
    fn experts_normal(
        &self,
        out: &ep_runtime::DispatchOutput,
        dev: &Device,
        dtype: DType,
    ) -> Result<Tensor> {
        out.event.compute_wait(dev)?;
        let input = ExpertInput {
            x: out.recv_x.clone(),
            scales: out.recv_x_scales.clone(),
        };
        let recv_idx = out.recv_topk_idx.as_ref().expect("routing was dispatched");
        let recv_w = out
            .recv_topk_weights
            .as_ref()
            .expect("routing was dispatched");
        // A grid of one CTA per tile is sized by the rows the host learned with the count (every
        // slot's rows would launch about three times the tiles at EP4, as empty CTAs). The
        // persistent grid keeps the tiles `GemmTiles::Auto` picks for every slot's rows
        // (docs/benchmarks.md, "Pipelined over expert groups"). Worst-case outputs come without
        // counts: a per-tile grid is then sized for every slot.
        let counted = !out.num_recv_tokens_per_expert.is_empty();
        let counts = (self.normal_gemm_grid == ep_kernels::gemm::GemmGrid::PerTile && counted)
            .then_some(out.num_recv_tokens_per_expert.as_slice());
        self.experts
            .forward_grouped_input(&input, recv_idx, recv_w, counts, dtype)
    }

    /// Normal mode as two micro-batches ([`MoeLayerOptions::two_batch_overlap`]): dispatch A;
    /// the shared experts while A travels; A's experts while B's dispatch travels (its count
    /// exchange and copy are on the communication stream behind A's); A's combine while B's
    /// experts compute; B's combine. Two host reads of a received count (one per dispatch).
    fn routed_normal_two_batches(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
        worst: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let dev = x.device();
        let t = x.dims()[0];
        let [(xa, ia, wa), (xb, ib, wb)] = two_micro_batches(x, idx, w)?;
        let send_a = self.prepare_dispatch(&xa, &ia)?;
        let send_b = self.prepare_dispatch(&xb, &ib)?;
        let ready = EventOverlap::record(dev)?;
        let shared = if t == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        let out_a = self.dispatch_normal(&send_a, &ia, &wa, &ready, worst)?;
        let ya = self.experts_normal(&out_a, dev, x.dtype())?;
        let computed_a = EventOverlap::record(dev)?;
        let out_b = self.dispatch_normal(&send_b, &ib, &wb, &ready, worst)?;
        let comb_a = self.buffer.combine(
            &CombineArgs::new(&ya, &out_a.handle)
                .previous_event(&computed_a)
                .async_finish(true),
        )?;
        let yb = self.experts_normal(&out_b, dev, x.dtype())?;
        let computed_b = EventOverlap::record(dev)?;
        let comb_b = self
            .buffer
            .combine(&CombineArgs::new(&yb, &out_b.handle).previous_event(&computed_b))?;
        comb_a.event.compute_wait(dev)?;
        Ok((join_parts(comb_a.combined_x, comb_b.combined_x)?, shared))
    }

    /// Normal mode pipelined over `groups` (the `expert_groups` module, `docs/design.md`):
    /// dispatch `g + 1` and combine `g - 1` travel while group `g`'s experts compute; the shared
    /// experts run while the first dispatch travels. One host read of a received count per
    /// group.
    fn routed_normal_expert_groups(
        &self,
        groups: &ExpertGroups,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
        worst: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let dev = x.device();
        let tokens = x.dims()[0] > 0;
        let (rows, scales) = self.wire_rows(x)?;
        let mut sends = Vec::with_capacity(groups.len());
        for g in 0..groups.len() {
            let idx_g = groups.routing(idx, g)?;
            let send = self.send_rows(&idx_g, &rows, scales.as_ref())?;
            sends.push((idx_g, send));
        }
        let ready = EventOverlap::record(dev)?;
        let first = self.options.shared_before_dispatch;
        let early = if tokens && first {
            self.shared_beside_transfer(x)?
        } else {
            None
        };
        let mut out = self.dispatch_normal(&sends[0].1, &sends[0].0, w, &ready, worst)?;
        let shared = if tokens && !first {
            self.shared_forward(x)?
        } else {
            early
        };
        // Every group's received rows and expert outputs stay alive until the compute stream
        // has waited for the last combine: they are read on the communication stream.
        let mut kept = Vec::with_capacity(groups.len());
        for g in 0..groups.len() {
            let y = self.experts_normal(&out, dev, x.dtype())?;
            let computed = EventOverlap::record(dev)?;
            let next = match sends.get(g + 1) {
                Some((idx_n, send_n)) => {
                    Some(self.dispatch_normal(send_n, idx_n, w, &ready, worst)?)
                }
                None => None,
            };
            let combined = self.buffer.combine(
                &CombineArgs::new(&y, &out.handle)
                    .previous_event(&computed)
                    .async_finish(true),
            )?;
            kept.push((out, y, combined));
            match next {
                Some(n) => out = n,
                None => break,
            }
        }
        for (_, _, c) in &kept {
            c.event.compute_wait(dev)?;
        }
        let parts: Vec<&Tensor> = kept.iter().map(|(_, _, c)| &c.combined_x).collect();
        Ok((sum_parts(&parts, tokens)?, shared))
    }

    /// Normal mode at one rank: every expert is local and there is nothing to send, so the
    /// routed experts run on this rank's tokens as they are: no layout, dispatch or combine,
    /// and no host synchronisation (the fp8 wire format keeps the buffer's path, so that its
    /// rounding is the same at any rank count, except with fp8 experts, which round their rows
    /// the same way). The shared MLP runs first, on the same stream.
    fn routed_local(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let shared = if x.dims()[0] == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        Ok((self.experts.forward_grouped(x, idx, w)?, shared))
    }
}

/// The groups' combined outputs summed: two in their dtype (one rounding of the exact sum),
/// more in f32, rounded once.
fn sum_parts(parts: &[&Tensor], tokens: bool) -> Result<Tensor> {
    let dtype = parts[0].dtype();
    Ok(match parts {
        [only] => (*only).clone(),
        _ if !tokens => parts[0].clone(),
        [a, b] => (*a + *b)?,
        _ if dtype == DType::F32 || dtype == DType::F64 => {
            let mut sum = parts[0].clone();
            for p in &parts[1..] {
                sum = (sum + *p)?;
            }
            sum
        }
        _ => {
            let mut sum = parts[0].to_dtype(DType::F32)?;
            for p in &parts[1..] {
                sum = (sum + p.to_dtype(DType::F32)?)?;
            }
            sum.to_dtype(dtype)?
        }
    })
}

/// What a normal-mode dispatch sends: the layout of its routing and its rows (bf16, or fp8
/// with their scales).
struct SendRows {
    layout: ep_runtime::DispatchLayout,
    x: Tensor,
    scales: Option<Tensor>,
}
