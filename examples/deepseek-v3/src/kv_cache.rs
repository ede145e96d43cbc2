//! The KV cache of one rank, allocated once, in MLA's compressed form: for every layer, the
//! normalised latent `[max_seqs, capacity, kv_lora_rank]` and the rotated shared key part
//! `[max_seqs, capacity, qk_rope_head_dim]` of each position. Every head reads the same entry
//! (attention runs in the absorbed form, see `attention.rs`), so a position takes
//! `kv_lora_rank + qk_rope_head_dim` values per layer (576 at DeepSeek's shapes) where keys and
//! values expanded per head would take `heads * (q_head_dim + v_head_dim)` (5120 at 16 heads).
//!
//! A sequence holds one slot. Live sequences always fill slots `0..n` (removing one moves the
//! last sequence into its slot), so a step over every sequence, or over the sequences added
//! last, reads its keys and values as views of the cache, without copies.

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::BatchPlan;

/// Key of a sequence in the cache (the engine's sequence id).
pub type SeqKey = u64;

/// Sizes of one layer's cache entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Decoder layers.
    pub layers: usize,
    /// Width of the compressed latent (`kv_lora_rank`).
    pub latent: usize,
    /// Width of the rotated key part shared by every head (`qk_rope_head_dim`).
    pub rope: usize,
}

/// The compressed keys and values of every live sequence, in slots.
pub struct KvCache {
    /// Per layer: latent `[max_seqs, capacity, latent]` and rope key `[max_seqs, capacity, rope]`.
    layers: Vec<(Tensor, Tensor)>,
    shape: KvShape,
    max_seqs: usize,
    capacity: usize,
    /// Key of the sequence in each occupied slot (`keys.len()` = live sequences).
    keys: Vec<SeqKey>,
    /// Cached positions of each occupied slot.
    lens: Vec<usize>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("shape", &self.shape)
            .field("max_seqs", &self.max_seqs)
            .field("capacity", &self.capacity)
            .field("keys", &self.keys)
            .field("lens", &self.lens)
            .finish()
    }
}

impl KvCache {
    /// Bytes a cache of these sizes takes on the device.
    pub fn bytes(shape: KvShape, max_seqs: usize, capacity: usize, dtype: DType) -> usize {
        shape.layers * max_seqs * capacity * (shape.latent + shape.rope) * dtype.size_in_bytes()
    }

    /// A zeroed cache for `max_seqs` sequences of up to `capacity` positions each.
    pub fn new(
        shape: KvShape,
        max_seqs: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if max_seqs == 0 || capacity == 0 {
            candle_core::bail!(
                "KvCache: max_seqs = {max_seqs} and capacity = {capacity} must both be at least 1"
            );
        }
        let layers = (0..shape.layers)
            .map(|_| {
                Ok((
                    Tensor::zeros((max_seqs, capacity, shape.latent), dtype, device)?,
                    Tensor::zeros((max_seqs, capacity, shape.rope), dtype, device)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            shape,
            max_seqs,
            capacity,
            keys: Vec::with_capacity(max_seqs),
            lens: Vec::with_capacity(max_seqs),
        })
    }

    /// The sizes of the entries.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Most sequences the cache holds at once.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// Most positions (prompt plus generated tokens) of one sequence.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Live sequences.
    pub fn num_seqs(&self) -> usize {
        self.keys.len()
    }

    /// Keys of the live sequences in slot order.
    pub fn keys(&self) -> &[SeqKey] {
        &self.keys
    }

    /// The slot of sequence `key`.
    pub fn slot_of(&self, key: SeqKey) -> Option<usize> {
        self.keys.iter().position(|&k| k == key)
    }

    /// Cached positions of sequence `key`.
    pub fn len_of(&self, key: SeqKey) -> Option<usize> {
        self.slot_of(key).map(|s| self.lens[s])
    }

    /// Adds an empty sequence in the first free slot (after every live one).
    pub fn insert(&mut self, key: SeqKey) -> Result<()> {
        if self.slot_of(key).is_some() {
            candle_core::bail!("KvCache: sequence {key} is already in the cache");
        }
        if self.keys.len() == self.max_seqs {
            candle_core::bail!(
                "KvCache: all {} slots are taken (--max-batch); cannot add sequence {key}",
                self.max_seqs
            );
        }
        self.keys.push(key);
        self.lens.push(0);
        Ok(())
    }

    /// Drops sequence `key`; the last sequence moves into its slot. Returns whether it was there.
    pub fn remove(&mut self, key: SeqKey) -> Result<bool> {
        let Some(slot) = self.slot_of(key) else {
            return Ok(false);
        };
        let last = self.keys.len() - 1;
        if slot != last {
            let len = self.lens[last];
            if len > 0 {
                for (k, v) in &self.layers {
                    for t in [k, v] {
                        // A copy: the view is contiguous and would share the cache's storage.
                        let src = t.narrow(0, last, 1)?.narrow(1, 0, len)?.copy()?;
                        t.narrow(0, slot, 1)?.slice_set(&src, 1, 0)?;
                    }
                }
            }
            self.keys[slot] = self.keys[last];
            self.lens[slot] = self.lens[last];
        }
        self.keys.pop();
        self.lens.pop();
        Ok(true)
    }

    /// Forgets sequence `key`'s positions from `len` on (a step rolled back); a no-op for a
    /// sequence not in the cache.
    pub fn truncate(&mut self, key: SeqKey, len: usize) -> Result<()> {
        if let Some(slot) = self.slot_of(key) {
            if len > self.lens[slot] {
                candle_core::bail!(
                    "KvCache: cannot truncate sequence {key} of {} positions to {len}",
                    self.lens[slot]
                );
            }
            self.lens[slot] = len;
        }
        Ok(())
    }

    /// Records that the sequences of `plan` grew by their new tokens (after a forward pass).
    pub(crate) fn advance(&mut self, plan: &BatchPlan) {
        for (i, seq) in plan.seqs().iter().enumerate() {
            self.lens[plan.first_slot() + i] = seq.offset + seq.new_tokens;
        }
    }

    /// Records that each of the first `n` slots' sequences grew by one token (after a captured
    /// decode step over all of them).
    #[cfg(feature = "cuda")]
    pub(crate) fn advance_all(&mut self, n: usize) {
        for len in &mut self.lens[..n] {
            *len += 1;
        }
    }

    /// Cached positions of each live sequence, in slot order.
    pub(crate) fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Writes layer `layer`'s new latents `[b, t_max, latent]` and rope keys `[b, t_max, rope]`
    /// (padded as [`BatchPlan::pad`] makes them) at each sequence's positions. One-token steps
    /// take one scatter per tensor; longer ones one copy per sequence.
    pub(crate) fn write(
        &self,
        layer: usize,
        latent: &Tensor,
        rope: &Tensor,
        plan: &BatchPlan,
    ) -> Result<()> {
        let (lc, rc) = &self.layers[layer];
        let (first, b) = (plan.first_slot(), plan.num_seqs());
        for (cache, new, index) in [
            (lc, latent, plan.scatter_latent()),
            (rc, rope, plan.scatter_rope()),
        ] {
            match index {
                Some(index) => {
                    let dst = cache.narrow(0, first, b)?;
                    dst.scatter_set(index, new, 1)?;
                }
                None => {
                    for (i, seq) in plan.seqs().iter().enumerate() {
                        let src = new.narrow(0, i, 1)?.narrow(1, 0, seq.new_tokens)?;
                        cache.narrow(0, first + i, 1)?.slice_set(
                            &src.contiguous()?,
                            1,
                            seq.offset,
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Layer `layer`'s latents `[b, max_len, latent]` and rope keys `[b, max_len, rope]` of the
    /// sequences of `plan` (views; positions past a sequence's length are masked).
    pub(crate) fn view(&self, layer: usize, plan: &BatchPlan) -> Result<(Tensor, Tensor)> {
        let (l, r) = &self.layers[layer];
        let (first, b, len) = (plan.first_slot(), plan.num_seqs(), plan.max_len());
        Ok((
            l.narrow(0, first, b)?.narrow(1, 0, len)?,
            r.narrow(0, first, b)?.narrow(1, 0, len)?,
        ))
    }
}
