//! [`MoeLayer`]'s low-latency mode (decode): fixed-slot dispatch and combine with the shared
//! experts between their send and receive phases or inside the grouped GEMMs, and its two
//! micro-batches.

use crate::error::Result;
use crate::experts::ExpertInput;
use crate::layer::{join_parts, two_micro_batches, MoeLayer};
use candle_core::{Device, Tensor};
use ep_runtime::{LowLatencyCombineArgs, LowLatencyDispatchArgs, Reduction};

impl MoeLayer {
    /// The expert stage of a low-latency step alone, as [`MoeLayer::forward`] runs it: the
    /// routed experts over the received blocks of `recv` (`recv_x` `[L, M, H]`, bf16 or fp8
    /// with its scales, and the device counts `recv_count` `[L]`), and, when they run inside
    /// the grouped GEMMs ([`MoeLayer::shared_in_grouped_gemm`]), the shared experts over this
    /// rank's tokens `x` `[T, H]` (else `None`). For benchmarks and custom pipelines.
    pub fn low_latency_experts(
        &self,
        recv: &ep_runtime::LowLatencyDispatchOutput,
        x: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.expert_blocks(&Self::low_latency_rows(recv), &recv.recv_count, x, None)
    }

    /// Whether the shared experts run inside the low-latency grouped GEMMs of a step of
    /// `tokens` tokens on this rank ([`crate::SharedPlacement`]).
    pub fn shared_in_grouped_gemm(&self, tokens: usize) -> bool {
        #[cfg(feature = "cuda")]
        {
            tokens > 0
                && (self.shared_groups.is_some() || self.shared_fp8.is_some())
                && match self.options.shared_placement {
                    crate::SharedPlacement::Grouped => true,
                    crate::SharedPlacement::Auto => {
                        let rows = self.expected_rows(tokens);
                        rows <= ep_kernels::gemm::GEMV_ROWS_PER_PASS
                            || (self.buffer.topology().num_ranks == 1
                                && rows <= crate::options::SHARED_GROUPED_MAX_ROWS_ONE_RANK)
                    }
                    crate::SharedPlacement::Overlap => false,
                }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = tokens;
            false
        }
    }

    /// The low-latency grouped GEMMs' configuration for `expected` rows per expert on `dev`.
    fn low_latency_tiles(
        &self,
        dev: &Device,
        expected: usize,
    ) -> Result<ep_kernels::gemm::GemmTiles> {
        if let Some(tiles) = self.options.low_latency_tiles {
            return Ok(tiles);
        }
        #[cfg(feature = "cuda")]
        if dev.is_cuda() {
            if self.experts.is_fp8() {
                let (h, i) = (self.experts.hidden_size(), self.experts.intermediate_size());
                return Ok(ep_kernels::gemm::fp8::masked_tiles(expected, &[h, i]));
            }
            return crate::experts::grouped::masked_tiles(dev, expected);
        }
        let _ = (dev, expected);
        Ok(ep_kernels::gemm::GemmTiles::Auto)
    }

    /// Rows an expert's low-latency block can expect in a step of `tokens` tokens per rank:
    /// one from each rank (a token picks an expert at most once).
    fn expected_rows(&self, tokens: usize) -> usize {
        tokens * self.buffer.topology().num_ranks
    }

    /// The routed experts over the received blocks (in `x`'s dtype), and the shared experts'
    /// output: `shared` as computed already, or computed here over `x` as extra groups of the
    /// grouped GEMMs.
    fn expert_blocks(
        &self,
        recv: &ExpertInput,
        recv_count: &Tensor,
        x: &Tensor,
        shared: Option<Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let expected = self.expected_rows(x.dims()[0]);
        #[cfg(feature = "cuda")]
        if let Some(blocks) = self
            .shared_fp8
            .as_ref()
            .filter(|_| self.shared_in_grouped_gemm(x.dims()[0]))
        {
            let (y, s) = crate::experts::grouped_fp8::forward_masked(
                &self.experts,
                recv,
                recv_count,
                Some((blocks, x)),
                self.low_latency_tiles(x.device(), expected)?,
            )?;
            return Ok((y.to_dtype(x.dtype())?, s));
        }
        #[cfg(feature = "cuda")]
        if let Some(groups) = self
            .shared_groups
            .as_ref()
            .filter(|_| self.shared_in_grouped_gemm(x.dims()[0]))
        {
            let (y, s) = crate::experts::grouped::forward_masked_with_shared(
                &self.experts,
                &recv.to_dtype(x.dtype())?,
                recv_count,
                x,
                groups,
                self.low_latency_tiles(x.device(), expected)?,
            )?;
            return Ok((y.to_dtype(x.dtype())?, Some(s)));
        }
        let tiles = self.low_latency_tiles(x.device(), expected)?;
        Ok((
            self.experts
                .forward_masked_input(recv, recv_count, tiles, x.dtype())?,
            shared,
        ))
    }

    /// Low-latency mode; the shared experts run between the send and receive phases, or inside
    /// the grouped GEMMs ([`crate::SharedPlacement`]). No host synchronisation: the expert GEMMs read
    /// the received counts on the device.
    pub(crate) fn routed_low_latency(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if self.options.two_batch_overlap && self.buffer.topology().num_ranks > 1 {
            return self.routed_low_latency_two_batches(x, idx, w);
        }
        let t = x.dims()[0];
        let hook = self
            .buffer
            .low_latency_dispatch_send(&self.low_latency_dispatch_args(x, idx, w))?;
        let shared = if t == 0 || self.shared_in_grouped_gemm(t) {
            None
        } else {
            self.shared_forward(x)?
        };
        let out = hook.recv()?;
        let recv = Self::low_latency_rows(&out);
        let (y, shared) = self.expert_blocks(&recv, &out.recv_count, x, shared)?;
        let combined = self.buffer.low_latency_combine(
            &LowLatencyCombineArgs::new(&y, idx, w, &out.handle)
                .reduction(self.options.low_latency_reduction),
        )?;
        Ok((combined.combined_x, shared))
    }

    /// The low-latency dispatch of `x` routed by `idx`, `w` (the weights travel for a per-rank
    /// combine).
    fn low_latency_dispatch_args<'a>(
        &self,
        x: &'a Tensor,
        idx: &'a Tensor,
        w: &'a Tensor,
    ) -> LowLatencyDispatchArgs<'a> {
        let mut args = LowLatencyDispatchArgs::new(
            x,
            idx,
            self.options.low_latency_max_tokens,
            self.num_experts,
        );
        if self.options.fp8_dispatch {
            args = args.fp8(false);
        }
        if self.options.low_latency_reduction == Reduction::PerRank {
            args = args.weights(w);
        }
        args
    }

    /// The received rows of a low-latency dispatch (fp8 rows with their scales).
    fn low_latency_rows(out: &ep_runtime::LowLatencyDispatchOutput) -> ExpertInput {
        ExpertInput {
            x: out.recv_x.clone(),
            scales: out.recv_x_scales.clone(),
        }
    }

    /// Low-latency mode as two micro-batches ([`MoeLayerOptions::two_batch_overlap`]): both
    /// dispatches are sent, the shared experts run while they travel, then A is received, its
    /// experts run and its combine is sent, while B's tokens are already in; then B; then both
    /// combines are received. The shared experts run as their own MLP.
    fn routed_low_latency_two_batches(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let t = x.dims()[0];
        let [(xa, ia, wa), (xb, ib, wb)] = two_micro_batches(x, idx, w)?;
        let red = self.options.low_latency_reduction;
        let hook_a = self
            .buffer
            .low_latency_dispatch_send(&self.low_latency_dispatch_args(&xa, &ia, &wa))?;
        let hook_b = self
            .buffer
            .low_latency_dispatch_send(&self.low_latency_dispatch_args(&xb, &ib, &wb))?;
        let shared = if t == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        let tiles = self.low_latency_tiles(x.device(), self.expected_rows(xa.dims()[0]))?;
        // A micro-batch's rows in, its experts, its combine sent.
        let experts = |out: &ep_runtime::LowLatencyDispatchOutput| -> Result<Tensor> {
            self.experts.forward_masked_input(
                &Self::low_latency_rows(out),
                &out.recv_count,
                tiles,
                x.dtype(),
            )
        };
        let out_a = hook_a.recv()?;
        let ya = experts(&out_a)?;
        let comb_a = self.buffer.low_latency_combine_send(
            &LowLatencyCombineArgs::new(&ya, &ia, &wa, &out_a.handle).reduction(red),
        )?;
        let out_b = hook_b.recv()?;
        let yb = experts(&out_b)?;
        let comb_b = self.buffer.low_latency_combine_send(
            &LowLatencyCombineArgs::new(&yb, &ib, &wb, &out_b.handle).reduction(red),
        )?;
        let (ca, cb) = (comb_a.recv()?, comb_b.recv()?);
        Ok((join_parts(ca.combined_x, cb.combined_x)?, shared))
    }
}
