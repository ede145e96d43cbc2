//! Where a rank sits: its index, the world size, and how ranks group into nodes.

use crate::error::{Error, Result};

/// The position of one rank in an expert-parallel group.
///
/// Ranks are grouped into nodes of `gpus_per_node` consecutive ranks:
/// `rank = node * gpus_per_node + local_rank`. Inside a node, ranks reach each other
/// directly (NVLink on GPUs); across nodes only ranks with the same `local_rank` talk.
/// A `gpus_per_node` smaller than the real GPU count lets one host play several nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    /// This rank's index in `[0, num_ranks)`.
    pub rank: usize,
    /// Number of ranks in the group.
    pub num_ranks: usize,
    /// Ranks per node; must divide `num_ranks`.
    pub gpus_per_node: usize,
}

impl Topology {
    /// Checks the invariants: `num_ranks > 0`, `rank < num_ranks`,
    /// `gpus_per_node > 0` and `num_ranks % gpus_per_node == 0`.
    pub fn new(rank: usize, num_ranks: usize, gpus_per_node: usize) -> Result<Self> {
        if num_ranks == 0 {
            return Err(Error::invalid("num_ranks", 0, "must be at least 1"));
        }
        if rank >= num_ranks {
            return Err(Error::invalid(
                "rank",
                rank,
                format!("must be < num_ranks = {num_ranks}"),
            ));
        }
        ep_kernels::layout::host::check_gpus_per_node(num_ranks, gpus_per_node)?;
        Ok(Self {
            rank,
            num_ranks,
            gpus_per_node,
        })
    }

    /// A single node holding every rank.
    pub fn single_node(rank: usize, num_ranks: usize) -> Result<Self> {
        Self::new(rank, num_ranks, num_ranks.max(1))
    }

    /// Number of nodes, `num_ranks / gpus_per_node`.
    pub fn num_nodes(&self) -> usize {
        self.num_ranks / self.gpus_per_node
    }

    /// The node this rank is on.
    pub fn node(&self) -> usize {
        self.rank / self.gpus_per_node
    }

    /// This rank's index inside its node.
    pub fn local_rank(&self) -> usize {
        self.rank % self.gpus_per_node
    }

    /// The node that `rank` is on.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.gpus_per_node
    }

    /// Whether `rank` is on this rank's node.
    pub fn same_node(&self, rank: usize) -> bool {
        self.node_of(rank) == self.node()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_arithmetic() {
        let t = Topology::new(5, 8, 4).unwrap();
        assert_eq!(t.num_nodes(), 2);
        assert_eq!(t.node(), 1);
        assert_eq!(t.local_rank(), 1);
        assert!(t.same_node(4) && !t.same_node(3));
    }

    #[test]
    fn rejects_bad_topologies() {
        let e = Topology::new(0, 6, 4).unwrap_err().to_string();
        assert!(e.contains("gpus_per_node") && e.contains('4'), "{e}");
        assert!(Topology::new(3, 3, 1).is_err());
        assert!(Topology::new(0, 0, 1).is_err());
    }
}
