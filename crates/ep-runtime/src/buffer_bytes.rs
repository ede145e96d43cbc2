//! The device memory a CUDA [`crate::Buffer`] of a [`BufferConfig`] allocates on each rank,
//! computed before anything is allocated (the same sizing the CUDA buffer applies): what a
//! server adds to its weights and caches to check that a rank fits its GPU.

use crate::config::BufferConfig;
use crate::error::Result;
use crate::topology::Topology;
use ep_kernels::internode::InternodeLayout;
use ep_kernels::intranode::{ce_buffer_size_hint, rings_buffer_bytes, RING_BASE};
use ep_kernels::low_latency::LowLatencyLayout;

/// Device bytes of one rank's buffers, by mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BufferBytes {
    /// The normal mode's NVLink buffer (one node only).
    pub nvlink: usize,
    /// The low-latency buffer (device memory, or NVSHMEM's heap across nodes).
    pub low_latency: usize,
    /// The internode normal mode's buffer on NVSHMEM's heap (across nodes only).
    pub internode: usize,
}

impl BufferBytes {
    /// All of them.
    pub fn total(&self) -> usize {
        self.nvlink + self.low_latency + self.internode
    }
}

impl BufferConfig {
    /// Bytes of the NVLink buffer a one-node CUDA buffer of `num_ranks` ranks allocates on each
    /// rank: [`BufferConfig::num_nvl_bytes`], or the default sizing its doc describes, rounded
    /// up to the header and to 128 bytes.
    pub fn nvl_buffer_bytes(&self, num_ranks: usize) -> usize {
        let c = &self.config;
        let bytes = self.num_nvl_bytes.unwrap_or_else(|| {
            let rings = rings_buffer_bytes(
                Self::DEFAULT_NVL_HIDDEN,
                Self::DEFAULT_NVL_TOPK,
                num_ranks,
                c.num_channels(),
                c.num_max_recv_tokens,
            );
            if self.nvl_transfer.uses_copy_engine(num_ranks) {
                let ce = ce_buffer_size_hint(
                    Self::DEFAULT_NVL_TOKENS,
                    Self::DEFAULT_NVL_HIDDEN,
                    Self::DEFAULT_NVL_TOPK,
                    num_ranks,
                );
                rings.max(ce)
            } else {
                rings
            }
        });
        bytes.max(RING_BASE).div_ceil(128) * 128
    }

    /// Device bytes a CUDA buffer of this configuration allocates on each of `num_ranks`
    /// ranks in nodes of `gpus_per_node`: the NVLink buffer on one node, the internode buffer
    /// (with [`BufferConfig::internode`]) across nodes, and the low-latency buffer (with
    /// [`BufferConfig::low_latency`]). NVSHMEM's own heap reserve is not included.
    pub fn device_bytes(&self, num_ranks: usize, gpus_per_node: usize) -> Result<BufferBytes> {
        self.validate()?;
        let topo = Topology::new(0, num_ranks, gpus_per_node)?;
        let across_nodes = topo.num_nodes() > 1;
        let low_latency = match &self.low_latency {
            Some(ll) => {
                let hidden = ll.hidden.div_ceil(ep_kernels::FP8_GROUP) * ep_kernels::FP8_GROUP;
                LowLatencyLayout::new(ll.max_tokens_per_rank, hidden, num_ranks, ll.num_experts)?
                    .total_bytes
            }
            None => 0,
        };
        let internode = match (&self.internode, across_nodes) {
            (Some(n), true) => {
                InternodeLayout::new(
                    num_ranks,
                    gpus_per_node,
                    n.max_tokens_per_rank,
                    n.hidden,
                    n.max_topk,
                )?
                .total_bytes
            }
            _ => 0,
        };
        Ok(BufferBytes {
            nvlink: if across_nodes {
                0
            } else {
                self.nvl_buffer_bytes(num_ranks)
            },
            low_latency,
            internode,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_has_an_nvlink_buffer_and_nodes_an_internode_one() {
        let cfg = BufferConfig::default()
            .with_low_latency(64, 7168, 256)
            .with_internode(4096, 7168, 8);
        let node = cfg.device_bytes(8, 8).unwrap();
        assert_eq!(node.internode, 0);
        assert_eq!(node.nvlink, cfg.nvl_buffer_bytes(8));
        let ll = LowLatencyLayout::new(64, 7168, 8, 256).unwrap().total_bytes;
        assert_eq!(node.low_latency, ll);
        let two = cfg.device_bytes(16, 8).unwrap();
        assert_eq!(two.nvlink, 0);
        assert!(two.internode > 0);
        assert_eq!(two.total(), two.low_latency + two.internode);
        // Set NVLink bytes are kept (rounded to 128), never below the header.
        assert_eq!(
            cfg.clone().with_nvl_bytes(1000).nvl_buffer_bytes(2),
            RING_BASE
        );
        assert_eq!(
            cfg.with_nvl_bytes(RING_BASE + 1).nvl_buffer_bytes(2),
            RING_BASE + 128
        );
        assert!(BufferConfig::default().device_bytes(6, 4).is_err());
    }
}
