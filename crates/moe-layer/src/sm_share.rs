//! How many SMs the shared experts' GEMMs take beside the routed experts' grouped GEMMs
//! (normal mode at one rank, CUDA).
//!
//! With a few dozen rows per expert the routed GEMMs are bound by reading every expert's
//! weights: their tiles leave the tensor cores idle part of the time, and a few SMs given to
//! the shared MLP (which reads one expert's worth of weights and does all its math on every
//! token) cost them little. With many rows per expert the routed GEMMs are bound by their math
//! instead: every SM they give up slows them, and the shared MLP runs after them.

/// Rows per expert (on average) up to which the routed GEMMs count as bound by their weight
/// reads: one 128-row tile pass per expert, with room for the spread of the counts.
pub const BESIDE_MAX_ROWS_PER_EXPERT: usize = 96;

/// Tile rows of the routed GEMMs' one pass per expert.
const TILE_ROWS: usize = 128;

/// SMs for the shared MLP (inner width `shared_inter`) beside the routed GEMMs of
/// `local_experts` experts (inner width `inter`) over `tokens` tokens with `top_k` picks each,
/// out of `total_sms`; `None` when the routed GEMMs are not bound by their weight reads (or
/// there is nothing to run). The share is the shared MLP's part of the math, counting one
/// 128-row tile pass per routed expert, times 1.5 so that it finishes before the routed
/// GEMMs; at least 1 SM, at most a quarter of them.
pub fn shared_sms_beside(
    total_sms: u32,
    tokens: usize,
    top_k: usize,
    local_experts: usize,
    inter: usize,
    shared_inter: usize,
) -> Option<u32> {
    if tokens == 0 || local_experts == 0 || shared_inter == 0 || total_sms < 4 {
        return None;
    }
    let rows_per_expert = (tokens * top_k).div_ceil(local_experts);
    if rows_per_expert > BESIDE_MAX_ROWS_PER_EXPERT {
        return None;
    }
    let routed = (local_experts * TILE_ROWS * inter) as f64;
    let shared = (tokens * shared_inter) as f64;
    let sms = (1.5 * f64::from(total_sms) * shared / (routed + shared)).ceil() as u32;
    Some(sms.clamp(1, total_sms / 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepseek_v3_prefill_shares() {
        // 132 SMs (H100 / H200), 256 experts of inner width 2048, top-8, one shared expert.
        let s = |t| shared_sms_beside(132, t, 8, 256, 2048, 2048);
        assert_eq!(s(2048), Some(12)); // 64 rows per expert: 2048 / 34816 of the math
        assert_eq!(s(512), Some(4));
        assert_eq!(s(129), Some(1));
        assert_eq!(s(3072), Some(17)); // 96 rows per expert, the last shared step
        assert_eq!(s(3073), None); // bound by the math: the shared MLP runs after
        assert_eq!(s(4096), None);
        assert_eq!(s(0), None);
    }

    #[test]
    fn at_most_a_quarter_of_the_sms() {
        // Few experts and a wide shared MLP: the share is capped.
        assert_eq!(shared_sms_beside(132, 96, 1, 1, 128, 4096), Some(33));
        assert_eq!(shared_sms_beside(3, 10, 1, 1, 128, 128), None);
    }
}
