//! [`ExpertMap`]: a layer's logical-to-physical expert map on its device, for redundant
//! experts ([`crate::placement`]). The router picks logical experts; the map turns each pick
//! into one of the expert's physical slots, and dispatch, GEMMs and combine then work on slots
//! as they work on experts without replicas (same weights in every replica: the combined output
//! is the same).
//!
//! Which replica: token `t`'s pick of expert `e` takes replica `(t + e) mod count(e)`. A token
//! picks an expert at most once, so an expert's tokens take its replicas in turn and each
//! replica gets its share of the expert's load within one (whatever position the router's
//! top-k gives the expert); the `+ e` spreads even a single token's picks over the replicas of
//! different experts. Tensor ops on the device (no host step, capturable in a graph), the same
//! on the CPU.
//!
//! The tables are sized for any placement of the same slots (an expert holds at most
//! `P - E + 1` of them), so [`ExpertMap::set_placement`] rewrites them in place: steps
//! captured before a re-placement read the new map.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::placement::Placement;

/// Largest pick index and table entry the map's f32 arithmetic keeps exact (2^24).
const EXACT_F32: usize = 1 << 24;

/// A [`Placement`] on a device (see the module docs).
#[derive(Debug)]
pub struct ExpertMap {
    placement: Placement,
    /// `[E * R]` i64: logical expert `e`'s replica `r` at `e * R + r` (`R = P - E + 1`, the
    /// most replicas an expert can have; rows padded with the expert's first slot).
    slots: Tensor,
    /// `[E]` f32: each logical expert's replica count.
    counts: Tensor,
    max_replicas: usize,
}

impl ExpertMap {
    /// The map of `placement` on `device`. Every logical expert needs a slot.
    pub fn new(placement: Placement, device: &Device) -> Result<Self> {
        check(&placement)?;
        let e = placement.log_to_phy.len();
        let max_replicas = placement.num_physical() - e + 1;
        if e * max_replicas >= EXACT_F32 {
            return Err(Error::invalid(
                "placement",
                format!("{e} experts of up to {max_replicas} replicas"),
                "at most 2^24 table entries",
            ));
        }
        let (table, counts) = tables(&placement, max_replicas);
        Ok(Self {
            slots: Tensor::from_vec(table, e * max_replicas, device)?,
            counts: Tensor::from_vec(counts, e, device)?,
            placement,
            max_replicas,
        })
    }

    /// Replaces the placement by `placement` (the same logical experts and slots), writing the
    /// device tables in place (see the module docs).
    pub fn set_placement(&mut self, placement: Placement) -> Result<()> {
        check(&placement)?;
        let (e, p) = (self.num_logical(), self.num_physical());
        if placement.log_to_phy.len() != e || placement.num_physical() != p {
            return Err(Error::invalid(
                "placement",
                format!(
                    "{} logical experts in {} slots",
                    placement.log_to_phy.len(),
                    placement.num_physical()
                ),
                format!("must be the map's {e} in {p}"),
            ));
        }
        let (table, counts) = tables(&placement, self.max_replicas);
        let dev = self.slots.device().clone();
        self.slots
            .slice_set(&Tensor::from_vec(table, e * self.max_replicas, &dev)?, 0, 0)?;
        self.counts
            .slice_set(&Tensor::from_vec(counts, e, &dev)?, 0, 0)?;
        self.placement = placement;
        Ok(())
    }

    /// The placement.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Logical experts `E`.
    pub fn num_logical(&self) -> usize {
        self.placement.log_to_phy.len()
    }

    /// Physical slots `P`.
    pub fn num_physical(&self) -> usize {
        self.placement.num_physical()
    }

    /// The physical slots of the router's logical picks `topk_idx` (`[T, K]` integer ids
    /// below `E`), `[T, K]` i64 (see the module docs for which replica).
    pub fn to_physical(&self, topk_idx: &Tensor) -> Result<Tensor> {
        let (t, k) = topk_idx.dims2()?;
        if t == 0 {
            return Ok(topk_idx.to_dtype(DType::I64)?);
        }
        if t * k >= EXACT_F32 {
            return Err(Error::invalid(
                "topk_idx",
                format!("{t} x {k} picks"),
                "at most 2^24 picks a step with redundant experts",
            ));
        }
        let dev = topk_idx.device();
        let ids = topk_idx.flatten_all()?.to_dtype(DType::U32)?;
        let count = self.counts.index_select(&ids, 0)?.reshape((t, k))?;
        let ids_f = ids.to_dtype(DType::F32)?.reshape((t, k))?;
        let token = Tensor::arange(0u32, t as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((t, 1))?;
        // (t + e) mod count, in f32 (exact below 2^24).
        let n = ids_f.broadcast_add(&token)?;
        let replica = (&n - n.div(&count)?.floor()?.mul(&count)?)?;
        let entry = ((ids_f * self.max_replicas as f64)? + replica)?
            .flatten_all()?
            .to_dtype(DType::U32)?;
        Ok(self.slots.index_select(&entry, 0)?.reshape((t, k))?)
    }
}

/// Checks that `placement` holds together: every logical expert in at least one slot, every
/// slot below `P` and naming its expert.
fn check(placement: &Placement) -> Result<()> {
    if let Some(x) = placement.log_to_phy.iter().position(Vec::is_empty) {
        return Err(Error::invalid(
            "placement",
            format!("logical expert {x} without a slot"),
            "every logical expert needs at least one physical slot",
        ));
    }
    let p = placement.num_physical();
    if let Some((x, s)) = placement
        .log_to_phy
        .iter()
        .enumerate()
        .flat_map(|(x, v)| v.iter().map(move |&s| (x, s)))
        .find(|&(x, s)| s >= p || placement.phy_to_log[s] != x)
    {
        return Err(Error::invalid(
            "placement",
            format!("logical expert {x} in slot {s}"),
            format!("slots are below {p} and phy_to_log names their expert"),
        ));
    }
    if placement.log_to_phy.len() > p {
        return Err(Error::invalid(
            "placement",
            format!(
                "{} logical experts in {p} slots",
                placement.log_to_phy.len()
            ),
            "needs a slot per logical expert at least",
        ));
    }
    Ok(())
}

/// The slot table (`max_replicas` entries an expert) and the replica counts of `placement`.
fn tables(placement: &Placement, max_replicas: usize) -> (Vec<i64>, Vec<f32>) {
    let table = placement
        .log_to_phy
        .iter()
        .flat_map(|v| (0..max_replicas).map(move |r| *v.get(r).unwrap_or(&v[0]) as i64))
        .collect();
    let counts = placement
        .log_to_phy
        .iter()
        .map(|v| v.len() as f32)
        .collect();
    (table, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement() -> Placement {
        // 4 logical experts in 6 slots: expert 1 in slots 1, 4 and 5, the others alone.
        let phy_to_log = vec![0, 1, 2, 3, 1, 1];
        Placement {
            replica: vec![0, 0, 0, 0, 1, 2],
            log_to_phy: vec![vec![0], vec![1, 4, 5], vec![2], vec![3]],
            phy_to_log,
        }
    }

    #[test]
    fn picks_take_their_experts_replicas_in_turn() {
        let map = ExpertMap::new(placement(), &Device::Cpu).unwrap();
        let idx = Tensor::new(&[[1i64, 0], [1, 3], [1, 2], [2, 1]], &Device::Cpu).unwrap();
        let got: Vec<Vec<i64>> = map.to_physical(&idx).unwrap().to_vec2().unwrap();
        // Token t's pick of expert 1 takes replica (t + 1) mod 3: tokens 0-3 -> 1, 2, 0, 1.
        assert_eq!(got, vec![vec![4, 0], vec![5, 3], vec![1, 2], vec![2, 4]]);
        let empty = Tensor::zeros((0, 2), DType::I64, &Device::Cpu).unwrap();
        assert_eq!(map.to_physical(&empty).unwrap().dims(), &[0, 2]);
    }

    #[test]
    fn every_slot_of_a_hot_expert_takes_its_share() {
        let map = ExpertMap::new(placement(), &Device::Cpu).unwrap();
        let idx = Tensor::ones((300, 1), DType::I64, &Device::Cpu).unwrap();
        let got: Vec<i64> = map
            .to_physical(&idx)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for s in [1, 4, 5] {
            assert_eq!(got.iter().filter(|&&x| x == s).count(), 100, "slot {s}");
        }
    }

    #[test]
    fn a_new_placement_is_written_in_place() {
        let mut map = ExpertMap::new(placement(), &Device::Cpu).unwrap();
        // Expert 2 takes the replicas now: slots 2, 4 and 5.
        let next = Placement {
            phy_to_log: vec![0, 1, 2, 3, 2, 2],
            replica: vec![0, 0, 0, 0, 1, 2],
            log_to_phy: vec![vec![0], vec![1], vec![2, 4, 5], vec![3]],
        };
        map.set_placement(next.clone()).unwrap();
        assert_eq!(map.placement(), &next);
        let idx = Tensor::new(&[[1i64, 2], [2, 0], [2, 1]], &Device::Cpu).unwrap();
        let got: Vec<Vec<i64>> = map.to_physical(&idx).unwrap().to_vec2().unwrap();
        // Token t's pick of expert 2 takes replica (t + 2) mod 3: tokens 0-2 -> 5, 2, 4.
        assert_eq!(got, vec![vec![1, 5], vec![2, 0], vec![4, 1]]);
        // Other slot counts are refused.
        let err = map
            .set_placement(Placement::identity(4))
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be the map's 4 in 6"), "{err}");
    }

    #[test]
    fn a_placement_that_does_not_hold_together_is_refused() {
        let mut p = placement();
        p.log_to_phy[2].clear();
        let err = ExpertMap::new(p, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("logical expert 2 without a slot"), "{err}");
        let mut p = placement();
        p.phy_to_log[4] = 3;
        let err = ExpertMap::new(p, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("slot 4"), "{err}");
    }
}
