//! Low-latency (decode) mode: send without asking, into fixed per-(expert, source) slots.
//!
//! Every rank reserves, for each of its `L` local experts and each of the `R` source ranks,
//! `M = max_tokens_per_rank` message slots. A source writes the (token, expert) pair `(t, k)`
//! into slot [`send_slots`]`[t, k]` of expert `topk_idx[t, k]`'s region for this source: the
//! number of earlier tokens of the same source routed to the same expert, so slots are
//! deterministic. The receiver packs the regions of expert `l` by source rank into
//! `recv_x[l, offset(l, s) .. offset(l, s) + count(l, s)]`, with
//! `offset(l, s) = sum_{s' < s} count(l, s')`.
//!
//! Combine reduces in one of two ways ([`Reduction`]): DeepEP's, where every expert output row
//! goes back to its token's home ([`combine`]), or per rank, where the expert rank first sums
//! the weighted rows of all its experts that one token chose and sends one row per
//! (token, rank) ([`combine_per_rank`]): at top-8 over R uniformly used ranks a token touches
//! `R * (1 - (1 - 1/R)^8)` ranks (about 2 of 2, 3.6 of 4), so 8 rows back become that many.
//! The per-rank way needs the top-k weights on the expert side: the dispatch carries them.

pub mod host;
mod layout;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use host::*;
pub use layout::{buffer_size_hint, LowLatencyLayout, RecvI32Block, LL_MAX_TOPK, LL_RECORD_WORDS};
