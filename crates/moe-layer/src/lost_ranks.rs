//! Serving around lost ranks: a layer with redundant experts keeps answering when ranks are
//! masked out of its buffer, by routing every logical expert to its replicas on the ranks that
//! remain ([`MoeLayer::exclude_ranks`]).

use crate::error::{Error, Result};
use crate::layer::MoeLayer;
use crate::placement::Placement;

impl MoeLayer {
    /// Routes around the ranks marked `lost` (one flag per rank): masks them on the layer's
    /// buffer (no collective waits for them again) and drops their slots from the expert map,
    /// so that each logical expert is served by its replicas on the other ranks; the results
    /// are those of the layer without the lost ranks' tokens. Nothing changes when it fails: a
    /// layer without redundant experts, or a logical expert whose every replica was on a lost
    /// rank (the error names them).
    ///
    /// Every surviving rank calls it with the same flags, between steps. Re-placements
    /// ([`MoeLayer::replace_experts`]) keep the lost ranks' slots out of the map. On CUDA
    /// buffers the layer then runs its low-latency mode only (normal mode refuses while a
    /// rank is masked).
    pub fn exclude_ranks(&mut self, lost: &[bool]) -> Result<()> {
        let topo = self.buffer.topology();
        if lost.len() != topo.num_ranks {
            return Err(Error::invalid(
                "lost",
                format!("{} flags", lost.len()),
                format!("one per rank ({})", topo.num_ranks),
            ));
        }
        if lost[topo.rank] {
            return Err(Error::invalid(
                "lost",
                format!("rank {} (this one)", topo.rank),
                "a rank cannot exclude itself",
            ));
        }
        let Some(map) = self.expert_map.as_mut() else {
            let ranks: Vec<usize> = (0..lost.len()).filter(|&r| lost[r]).collect();
            if ranks.is_empty() {
                return Ok(());
            }
            return Err(Error::invalid(
                "lost ranks",
                format!("{ranks:?}"),
                "the layer holds no redundant experts, so their experts have no other replica \
                 (build it with MoeLayer::with_placement)",
            ));
        };
        let placement = map.placement().without_gpus(lost)?;
        map.set_placement(placement)?;
        for (r, _) in lost.iter().enumerate().filter(|(_, &l)| l) {
            self.buffer.mask_rank(r)?;
        }
        Ok(())
    }

    /// `placement` with the slots of the ranks masked on the layer's buffer taking no token.
    pub(crate) fn routed_around_masked(&self, placement: Placement) -> Result<Placement> {
        let active = self.buffer.active_ranks();
        if active.iter().all(|&a| a) {
            return Ok(placement);
        }
        let lost: Vec<bool> = active.iter().map(|&a| !a).collect();
        placement.without_gpus(&lost)
    }
}
