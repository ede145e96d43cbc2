//! Normal-mode combine.

use super::handle::Handle;
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::codec::{pack, tensor_bytes, tensor_from_bytes, unpack};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};

/// The inputs of [`Buffer::combine`].
#[derive(Debug, Clone)]
pub struct CombineArgs<'a> {
    /// `[N, H]` one row per received token (already reduced over this rank's experts),
    /// in the order of the dispatch's `recv_x`. bf16 (f16 and f32 on the host backend).
    pub x: &'a Tensor,
    /// The handle of the dispatch being reversed.
    pub handle: &'a Handle,
    /// `[N, K]` f32 weights to sum back as well (e.g. the dispatch's `recv_topk_weights`).
    pub topk_weights: Option<&'a Tensor>,
    /// Work to wait for before starting (GPU buffers).
    pub previous_event: Option<&'a crate::event::EventOverlap>,
    /// Return before the work is done (GPU buffers).
    pub async_finish: bool,
}

impl<'a> CombineArgs<'a> {
    /// Combine of `x` along `handle`.
    pub fn new(x: &'a Tensor, handle: &'a Handle) -> Self {
        Self {
            x,
            handle,
            topk_weights: None,
            previous_event: None,
            async_finish: false,
        }
    }

    /// Also sums these `[N, K]` weights back to the home ranks.
    pub fn topk_weights(mut self, w: &'a Tensor) -> Self {
        self.topk_weights = Some(w);
        self
    }

    /// Waits for `event` before starting.
    pub fn previous_event(mut self, event: &'a EventOverlap) -> Self {
        self.previous_event = Some(event);
        self
    }

    /// Returns before completion.
    pub fn async_finish(mut self, async_finish: bool) -> Self {
        self.async_finish = async_finish;
        self
    }
}

/// What [`Buffer::combine`] returns.
#[derive(Debug, Clone)]
pub struct CombineOutput {
    /// `[T, H]`: for every token, the f32 sum in rank order of the rows the ranks holding it
    /// sent back, in `x`'s dtype. Tokens sent nowhere are zero.
    pub combined_x: Tensor,
    /// `[T, K]` f32 sums of the weights, when `topk_weights` was given.
    pub combined_topk_weights: Option<Tensor>,
    /// Completion of the combine.
    pub event: EventOverlap,
}

impl Buffer {
    /// Normal-mode combine: sends each received token's row back to its home rank, which sums
    /// the rows of every rank holding that token (in rank order, in f32).
    pub fn combine(&self, args: &CombineArgs<'_>) -> Result<CombineOutput> {
        let h = args.handle;
        self.check_handle(h)?;
        let hi = &h.inner;
        self.check_device("x", args.x)?;
        check_shape("x", args.x, &[Some(hi.num_recv_tokens), None])?;
        check_dtype(
            "x",
            args.x,
            &[DType::BF16, DType::F16, DType::F32],
            "bf16, f16 or f32",
        )?;
        let hidden = args.x.dims2()?.1;
        let k = match args.topk_weights {
            Some(w) => {
                self.check_device("topk_weights", w)?;
                check_shape("topk_weights", w, &[Some(hi.num_recv_tokens), None])?;
                check_dtype("topk_weights", w, &[DType::F32], "f32")?;
                Some(w.dims2()?.1)
            }
            None => None,
        };
        #[cfg(feature = "cuda")]
        if let Some(c) = self.backend.cuda() {
            return c.combine(args);
        }
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
        let counts = h.recv_counts_from(me);
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
        let got = self.exchange("combine", msgs, None)?;

        let mut acc = vec![0f32; t * hidden];
        let kk = k.unwrap_or(0);
        let mut wacc = vec![0f32; t * kk];
        for (d, m) in got.into_iter().enumerate() {
            let m = m.unwrap_or_default();
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
        Ok(CombineOutput {
            combined_x: Tensor::from_vec(acc, (t, hidden), dev)?.to_dtype(args.x.dtype())?,
            combined_topk_weights: match k {
                Some(k) => Some(Tensor::from_vec(wacc, (t, k), dev)?),
                None => None,
            },
            event: EventOverlap::complete(),
        })
    }
}
