//! The geometry of one forward step over a batch of sequences of different lengths, built once
//! per step and used by every layer: token positions and their rotary rows, the gather that
//! pads the concatenated tokens to `[b, t_max]` and the one that takes them back, the attention
//! mask (causal within the new tokens, and no key past a sequence's length), and the scatter
//! indices of one-token steps.

use candle_core::{DType, Device, Result, Tensor};

use crate::kv_cache::{KvCache, SeqKey};
use crate::rotary::{RopeRows, Rotary};

/// Key positions a step's attention reads are a multiple of (where the cache holds them): rows of
/// 16 bytes in bf16, which cuBLAS needs for its sm_90 kernels on the scores (an odd key count
/// sent the prefill's batched GEMMs to sm_75 kernels; `docs/design.md`, "MLA attention").
pub const KEY_ALIGN: usize = 8;

/// Shortest key length a captured decode step reads (`decode_graph`; smaller steps share its
/// graph).
const MIN_KEYS: usize = 256;

/// Finest step between the key lengths of captured decode steps.
const KEY_STEP: usize = 128;

/// Keys a captured decode step (`decode_graph`) reads when its longest sequence (with the new
/// token) has `longest` tokens, in a cache of `capacity` positions: `longest` rounded up to a
/// multiple of an eighth of its next power of two (at least [`KEY_STEP`]), at least
/// [`MIN_KEYS`], at most `capacity`. Eight shapes an octave: attention reads less than a
/// quarter more keys than the longest sequence has (up to twice as many with powers of two),
/// and the number of graphs grows with the log of the context.
pub fn captured_keys(longest: usize, capacity: usize) -> usize {
    let step = (longest.next_power_of_two() / 8).max(KEY_STEP);
    longest.next_multiple_of(step).max(MIN_KEYS).min(capacity)
}

/// One sequence of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// Positions already in the cache.
    pub offset: usize,
    /// New tokens in this step.
    pub new_tokens: usize,
}

/// One step's batch layout. Sequences are ordered by cache slot (a contiguous run starting at
/// [`BatchPlan::first_slot`]); the concatenated tokens follow the same order.
#[derive(Debug)]
pub struct BatchPlan {
    first_slot: usize,
    seqs: Vec<SeqSpan>,
    max_new: usize,
    max_len: usize,
    /// Caller index of each sequence in slot order.
    order: Vec<usize>,
    rope: RopeRows,
    /// `[b * t_max]` rows of the concatenated tokens (a short sequence repeats its last
    /// token); `None` when every sequence has exactly one new token.
    pad: Option<Tensor>,
    /// `[total]` rows of the padded `[b * t_max]` layout that hold real tokens.
    unpad: Option<Tensor>,
    /// Additive mask `[b, 1, t_max, max_len]`: 0 where a query may see a key, else -inf.
    mask: Tensor,
    /// Scatter indices `[b, 1, latent]` / `[b, 1, rope]` of one-token steps (each sequence's
    /// offset), `None` otherwise.
    scatter_latent: Option<Tensor>,
    scatter_rope: Option<Tensor>,
    /// Row of each sequence's last token in the concatenation, in caller order.
    last: Tensor,
}

impl BatchPlan {
    /// Lays out `batch` (`(sequence, new tokens)`, in the caller's order) over `cache`. The
    /// sequences must fill a contiguous run of slots (every live sequence, or the ones added
    /// last) and each must bring at least one token that fits its capacity. Returns the plan and
    /// the token ids concatenated in slot order.
    pub fn new(
        batch: &[(SeqKey, &[u32])],
        cache: &KvCache,
        rotary: &Rotary,
        dtype: DType,
        device: &Device,
    ) -> Result<(Self, Vec<u32>)> {
        let mut slotted = Vec::with_capacity(batch.len());
        for (i, (key, tokens)) in batch.iter().enumerate() {
            let slot = cache.slot_of(*key).ok_or_else(|| {
                candle_core::Error::Msg(format!("sequence {key} is not in the KV cache"))
            })?;
            if tokens.is_empty() {
                candle_core::bail!("sequence {key} has no new token in this step");
            }
            slotted.push((slot, i));
        }
        slotted.sort_unstable();
        let first_slot = slotted.first().map_or(0, |s| s.0);
        if let Some((pos, (slot, _))) = slotted
            .iter()
            .enumerate()
            .find(|(j, (slot, _))| *slot != first_slot + j)
        {
            candle_core::bail!(
                "a batch must be a contiguous run of cache slots: slot {slot} at place {pos} of a run from {first_slot}"
            );
        }
        let order: Vec<usize> = slotted.iter().map(|s| s.1).collect();
        let mut seqs = Vec::with_capacity(order.len());
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for &i in &order {
            let (key, tokens) = batch[i];
            let offset = cache.len_of(key).unwrap_or(0);
            if offset + tokens.len() > cache.capacity() {
                candle_core::bail!(
                    "sequence {key} of {} tokens exceeds the model's context of {}",
                    offset + tokens.len(),
                    cache.capacity()
                );
            }
            seqs.push(SeqSpan {
                offset,
                new_tokens: tokens.len(),
            });
            ids.extend_from_slice(tokens);
            positions.extend((offset..offset + tokens.len()).map(|p| p as u32));
        }
        let b = seqs.len();
        let max_new = seqs.iter().map(|s| s.new_tokens).max().unwrap_or(0);
        // Keys attention reads: the longest sequence's, rounded up to `KEY_ALIGN` within the
        // cache (the mask hides the extra keys; the cache is zeroed, so they hold finite values).
        let max_len = seqs
            .iter()
            .map(|s| s.offset + s.new_tokens)
            .max()
            .unwrap_or(0)
            .next_multiple_of(KEY_ALIGN)
            .min(cache.capacity());

        let positions = Tensor::new(positions.as_slice(), device)?;
        let rope = rotary.rows(&positions)?;

        // Row in the concatenation of each sequence's first token.
        let starts: Vec<usize> = seqs
            .iter()
            .scan(0, |acc, s| {
                let start = *acc;
                *acc += s.new_tokens;
                Some(start)
            })
            .collect();
        // Sequences of equal new tokens (every decode step, prefills of equal prompts) are laid
        // out padded already.
        let (pad, unpad) = if seqs.iter().all(|s| s.new_tokens == max_new) {
            (None, None)
        } else {
            let mut pad = Vec::with_capacity(b * max_new);
            let mut unpad = Vec::with_capacity(ids.len());
            for (i, s) in seqs.iter().enumerate() {
                for t in 0..max_new {
                    pad.push((starts[i] + t.min(s.new_tokens - 1)) as u32);
                    if t < s.new_tokens {
                        unpad.push((i * max_new + t) as u32);
                    }
                }
            }
            (
                Some(Tensor::new(pad.as_slice(), device)?),
                Some(Tensor::new(unpad.as_slice(), device)?),
            )
        };

        // Query t of sequence i sees keys 0..=offset + t (a padded query repeats the last one).
        let limits: Vec<u32> = seqs
            .iter()
            .flat_map(|s| (0..max_new).map(move |t| (s.offset + t.min(s.new_tokens - 1)) as u32))
            .collect();
        let limits = Tensor::from_vec(limits, (b, max_new, 1, 1), device)?;
        let keys = Tensor::arange(0u32, max_len as u32, device)?.reshape((1, 1, 1, max_len))?;
        let allowed = keys.broadcast_le(&limits)?.to_dtype(DType::F32)?;
        // 0 where allowed, -1e9 elsewhere (computed in f32, -inf once in a 16-bit dtype).
        let mask = ((allowed - 1.0)? * 1e9)?.to_dtype(dtype)?;

        let (scatter_latent, scatter_rope) = if max_new == 1 {
            let shape = cache.shape();
            let offsets: Vec<u32> = seqs.iter().map(|s| s.offset as u32).collect();
            let offsets = Tensor::from_vec(offsets, (b, 1, 1), device)?;
            let index = |d: usize| offsets.broadcast_as((b, 1, d))?.contiguous();
            (Some(index(shape.latent)?), Some(index(shape.rope)?))
        } else {
            (None, None)
        };

        let mut last = vec![0u32; b];
        for (j, &i) in order.iter().enumerate() {
            last[i] = (starts[j] + seqs[j].new_tokens - 1) as u32;
        }
        let last = Tensor::new(last.as_slice(), device)?;
        Ok((
            Self {
                first_slot,
                seqs,
                max_new,
                max_len,
                order,
                rope,
                pad,
                unpad,
                mask,
                scatter_latent,
                scatter_rope,
                last,
            },
            ids,
        ))
    }

    /// The plan of a decode step over slots `0..b` (one token each) that is being captured
    /// into a CUDA graph: built from device tensors only, so that every replay recomputes it
    /// from the graph's inputs. `positions` `[b]` u32 holds each token's position (its
    /// sequence's cached length), `keys` `[1, 1, 1, len]` u32 the key positions `0..len` that
    /// attention reads, `rows` `[b]` u32 `0..b`; the last two are made before the capture
    /// (creating them copies from the host). The host-side sequence list is a placeholder:
    /// the caller advances the cache itself.
    #[cfg(feature = "cuda")]
    pub(crate) fn captured_decode(
        positions: &Tensor,
        keys: &Tensor,
        rows: &Tensor,
        cache: &KvCache,
        rotary: &Rotary,
        dtype: DType,
    ) -> Result<Self> {
        let b = positions.dim(0)?;
        let len = keys.dim(3)?;
        let rope = rotary.rows(positions)?;
        let limits = positions.reshape((b, 1, 1, 1))?;
        let allowed = keys.broadcast_le(&limits)?.to_dtype(DType::F32)?;
        let mask = ((allowed - 1.0)? * 1e9)?.to_dtype(dtype)?;
        let shape = cache.shape();
        let index = |d: usize| {
            positions
                .reshape((b, 1, 1))?
                .broadcast_as((b, 1, d))?
                .contiguous()
        };
        Ok(Self {
            first_slot: 0,
            seqs: vec![
                SeqSpan {
                    offset: 0,
                    new_tokens: 1
                };
                b
            ],
            max_new: 1,
            max_len: len,
            order: (0..b).collect(),
            rope,
            pad: None,
            unpad: None,
            mask,
            scatter_latent: Some(index(shape.latent)?),
            scatter_rope: Some(index(shape.rope)?),
            last: rows.clone(),
        })
    }

    /// Slot of the first sequence.
    pub fn first_slot(&self) -> usize {
        self.first_slot
    }

    /// Sequences in slot order.
    pub fn seqs(&self) -> &[SeqSpan] {
        &self.seqs
    }

    /// Number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Most new tokens of one sequence (`t_max`).
    pub fn max_new(&self) -> usize {
        self.max_new
    }

    /// Keys attention reads: the longest sequence after this step, rounded up to [`KEY_ALIGN`]
    /// within the cache.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Caller index of each sequence, in slot order.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// Rotary rows of the concatenated tokens.
    pub fn rotary_rows(&self) -> &RopeRows {
        &self.rope
    }

    /// The additive attention mask `[b, t_max, 1, max_len]` (shared by a query's heads).
    pub fn mask(&self) -> &Tensor {
        &self.mask
    }

    pub(crate) fn scatter_latent(&self) -> Option<&Tensor> {
        self.scatter_latent.as_ref()
    }

    pub(crate) fn scatter_rope(&self) -> Option<&Tensor> {
        self.scatter_rope.as_ref()
    }

    /// Concatenated per-token rows `[total, heads, d]` -> padded `[b, t_max, heads, d]`, still
    /// token-major (a copy only when the sequences' new tokens differ).
    pub fn pad(&self, x: &Tensor) -> Result<Tensor> {
        let (total, heads, d) = x.dims3()?;
        let b = self.num_seqs();
        match &self.pad {
            None => x.reshape((b, self.max_new, heads, d)),
            Some(index) => x
                .reshape((total, heads * d))?
                .index_select(index, 0)?
                .reshape((b, self.max_new, heads, d)),
        }
    }

    /// Padded `[b, t_max, heads, d]` -> concatenated rows `[total, heads * d]`.
    pub fn unpad(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, heads, d) = x.dims4()?;
        let rows = x.reshape((b * t, heads * d))?;
        match &self.unpad {
            None => Ok(rows),
            Some(index) => rows.index_select(index, 0),
        }
    }

    /// The rows of each sequence's last token, `[b, hidden]` in the caller's order.
    pub fn last_rows(&self, x: &Tensor) -> Result<Tensor> {
        x.index_select(&self.last, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::captured_keys;

    #[test]
    fn key_buckets_round_up_to_an_eighth_of_an_octave() {
        // (longest, capacity) -> keys read
        for ((longest, capacity), want) in [
            ((1, 4096), 256),
            ((256, 4096), 256),
            ((257, 4096), 384),
            ((513, 4096), 640),
            ((640, 4096), 640),
            ((641, 4096), 768),
            ((1025, 4096), 1280),
            ((3000, 4096), 3072),
            ((600, 600), 600),
            ((100, 200), 200),
        ] {
            assert_eq!(
                captured_keys(longest, capacity),
                want,
                "{longest} in {capacity}"
            );
        }
    }
}
