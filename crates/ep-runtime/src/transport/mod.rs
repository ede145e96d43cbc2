//! Point-to-point byte transports between the ranks of the host backend.
//!
//! The host backend moves every payload through a [`Transport`]: ranks that are threads of one
//! process use [`LocalTransport`] (channels), ranks that are processes use [`TcpTransport`]
//! (a TCP mesh whose addresses are swapped through the bootstrap store). Messages carry a
//! tag (the op's sequence number) so that a late message of a timed-out op is never mistaken
//! for the next op's.
//!
//! With the `nvshmem` feature, `init_nvshmem` starts NVSHMEM (the GPU transport for peers on
//! other nodes) on every rank of the store, bootstrapped by a unique id that the store carries
//! (see the module `nvshmem`); CUDA buffers across nodes start it over their own group
//! (`nvshmem_group`).

mod local;
#[cfg(any(feature = "nvshmem", test))]
pub mod nvshmem;
#[cfg(feature = "nvshmem")]
mod nvshmem_group;
mod tcp;

pub use local::LocalTransport;

/// What NVSHMEM (and NCCL inside it) needs to treat GPUs of one host as several nodes: NVLink
/// multicast off, no remote transport (the P2P transport carries the "network"), and the
/// unique-id bootstrap over the loopback interface. For launchers of tests and benchmarks.
pub const ONE_HOST_NODES_ENV: [(&str, &str); 4] = [
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("NVSHMEM_REMOTE_TRANSPORT", "none"),
    ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
    ("NCCL_NVLS_ENABLE", "0"),
];
#[cfg(feature = "nvshmem")]
pub use nvshmem::init_nvshmem;
#[cfg(feature = "nvshmem")]
pub(crate) use nvshmem_group::nvshmem_for_group;
pub use tcp::TcpTransport;

use crate::error::Result;
use std::time::Instant;

/// Ordered, tagged, reliable byte messages between ranks.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn num_ranks(&self) -> usize;
    /// Sends `data` to `peer` under `tag`. Never blocks for long: delivery is buffered.
    /// Sending to oneself is allowed and lands in one's own inbox.
    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<()>;
    /// Receives the message `peer` sent under `tag`, waiting until `deadline`.
    /// Errors name `peer`: [`crate::Error::Timeout`] when the deadline passes,
    /// [`crate::Error::PeerLost`] when its connection is gone. Messages with a smaller tag
    /// that were never received are dropped.
    fn recv(&self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>>;
}

/// Sends `send[p]` to every other rank `p` of `t` under `tag` (`None`: a bare marker, so every
/// peer hears from every rank) and returns what each sent this rank (index = sender; this
/// rank's own entry `None`), waiting until `deadline`: a collective over a transport of its
/// own, e.g. bulk data moving beside a buffer's ops. The marker is appended and taken off
/// without copying the payload; errors name the peer.
pub fn exchange(
    t: &dyn Transport,
    tag: u64,
    send: Vec<Option<Vec<u8>>>,
    deadline: Instant,
) -> Result<Vec<Option<Vec<u8>>>> {
    let me = t.rank();
    for (p, m) in send.into_iter().enumerate().filter(|(p, _)| *p != me) {
        let framed = match m {
            Some(mut m) => {
                m.push(1);
                m
            }
            None => vec![0],
        };
        t.send(p, tag, framed)?;
    }
    let mut out = vec![None; t.num_ranks()];
    for (p, slot) in out.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        let mut m = t.recv(p, tag, deadline)?;
        *slot = (m.pop() == Some(1)).then_some(m);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_exchange_delivers_every_message_and_tells_none_from_empty() {
        let group = LocalTransport::group(3);
        let got: Vec<Vec<Option<Vec<u8>>>> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|t| {
                    s.spawn(move || {
                        let me = t.rank() as u8;
                        // Rank r sends [r, p] to p, but nothing to rank 0 and an empty message
                        // to rank 1.
                        let send = (0..3u8)
                            .map(|p| match p {
                                0 => None,
                                1 => Some(Vec::new()),
                                _ => Some(vec![me, p]),
                            })
                            .collect();
                        let deadline = Instant::now() + Duration::from_secs(10);
                        exchange(t, 7, send, deadline).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got[0], vec![None, None, None]);
        assert_eq!(got[1], vec![Some(vec![]), None, Some(vec![])]);
        assert_eq!(got[2], vec![Some(vec![0, 2]), Some(vec![1, 2]), None]);
    }
}
