//! What the CUDA normal paths (one node: `normal.rs`; across nodes: `internode.rs`) leave
//! behind in a handle's record: its CUDA side, per transfer path.

use candle_core::Tensor;

/// What a handle made by a CUDA buffer holds besides the host backend's tensors: the state
/// its combine (and cached dispatches) need, for the transfer path its dispatch took.
#[derive(Debug)]
pub(crate) enum CudaHandleData {
    /// SM ring kernels.
    Rings {
        /// `[R, C]` i32: where each source's channel-`c` tokens start in this rank's `recv_x`.
        recv_channel_offset: Tensor,
        /// `[T, R]` i32: the kernel's send head (index among the channel's tokens sent to that
        /// destination, `-1` = not sent), what combine needs.
        kernel_send_head: Tensor,
        /// The dispatch wrote worst-case outputs (its rows are a capacity every rank shares):
        /// cached dispatches along it do the same.
        worst_case: bool,
    },
    /// Copy-engine path.
    CopyEngine {
        /// `[T, R]` i32: index of each token among this rank's tokens sent to each rank.
        send_index: Tensor,
        /// Rows this rank received from each source.
        recv_per_source: Vec<usize>,
    },
    /// Internode path (buffers across nodes).
    #[cfg(feature = "nvshmem")]
    Internode(InternodeHandle),
}

#[cfg(feature = "nvshmem")]
/// What a handle made by the internode path holds besides the shared tensors.
#[derive(Debug)]
pub(crate) struct InternodeHandle {
    /// `[T, N]` i32: each token's index among this rank's tokens for each node.
    pub(super) node_send_index: Tensor,
    /// `[P, N]` i32: the messages of each block this rank reads.
    pub(super) block_count: Tensor,
    /// `[P, N, M]` i32: the row of each block message in `recv_x` (`-1`: not this rank's).
    pub(super) dest: Tensor,
    /// `[N, M]` u8: the GPUs of this node holding each token of this rank's own blocks.
    pub(super) fwd_mask: Tensor,
    /// `[n]` i32: the block message each received row came from.
    pub(super) origin: Tensor,
}
