//! Ranks as threads of one process: channels between every pair of ranks.

use super::Transport;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::Instant;

type Message = (u64, Vec<u8>);

/// One rank's end of an in-process group. Dropping it (e.g. its thread panics) makes its
/// peers' receives fail with [`Error::PeerLost`] naming it.
pub struct LocalTransport {
    rank: usize,
    /// `senders[p]` delivers into rank `p`'s inbox from this rank.
    senders: Vec<Mutex<Sender<Message>>>,
    /// `inboxes[p]`: what rank `p` sent to this rank, with early arrivals parked by tag.
    inboxes: Vec<Mutex<Inbox>>,
}

struct Inbox {
    rx: Receiver<Message>,
    parked: HashMap<u64, Vec<u8>>,
}

impl std::fmt::Debug for LocalTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTransport")
            .field("rank", &self.rank)
            .field("num_ranks", &self.senders.len())
            .finish()
    }
}

impl LocalTransport {
    /// Creates the endpoints of a group of `num_ranks` ranks; give element `i` to rank `i`'s
    /// thread.
    pub fn group(num_ranks: usize) -> Vec<LocalTransport> {
        // channels[src][dst]
        let mut txs: Vec<Vec<Option<Sender<Message>>>> = Vec::with_capacity(num_ranks);
        let mut rxs: Vec<Vec<Option<Receiver<Message>>>> = (0..num_ranks)
            .map(|_| (0..num_ranks).map(|_| None).collect())
            .collect();
        for src in 0..num_ranks {
            let mut row = Vec::with_capacity(num_ranks);
            for rx_row in rxs.iter_mut() {
                let (tx, rx) = channel();
                row.push(Some(tx));
                rx_row[src] = Some(rx);
            }
            txs.push(row);
        }
        txs.into_iter()
            .zip(rxs)
            .enumerate()
            .map(|(rank, (tx_row, rx_row))| LocalTransport {
                rank,
                senders: tx_row
                    .into_iter()
                    .map(|t| Mutex::new(t.expect("every channel is created")))
                    .collect(),
                inboxes: rx_row
                    .into_iter()
                    .map(|r| {
                        Mutex::new(Inbox {
                            rx: r.expect("every channel is created"),
                            parked: HashMap::new(),
                        })
                    })
                    .collect(),
            })
            .collect()
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.senders.len() {
            return Err(Error::invalid(
                "peer",
                peer,
                format!("must be < num_ranks = {}", self.senders.len()),
            ));
        }
        Ok(())
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn num_ranks(&self) -> usize {
        self.senders.len()
    }

    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<()> {
        self.check_peer(peer)?;
        let tx = self.senders[peer].lock().unwrap_or_else(|e| e.into_inner());
        tx.send((tag, data)).map_err(|_| Error::PeerLost {
            rank: peer,
            what: format!("sending message {tag}"),
        })
    }

    fn recv(&self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        let mut inbox = self.inboxes[peer].lock().unwrap_or_else(|e| e.into_inner());
        if let Some(data) = inbox.parked.remove(&tag) {
            return Ok(data);
        }
        let started = Instant::now();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match inbox.rx.recv_timeout(left) {
                Ok((t, data)) if t == tag => return Ok(data),
                Ok((t, data)) => {
                    if t > tag {
                        inbox.parked.insert(t, data);
                    }
                    // t < tag: a late message of an op that already gave up; drop it.
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout {
                        rank: peer,
                        what: format!("message {tag}"),
                        waited: started.elapsed(),
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::PeerLost {
                        rank: peer,
                        what: format!("waiting for message {tag}"),
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn exchanges_out_of_order_tags() {
        let mut g = LocalTransport::group(2);
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        a.send(1, 2, vec![2]).unwrap();
        a.send(1, 1, vec![1]).unwrap();
        let d = Instant::now() + Duration::from_secs(1);
        assert_eq!(b.recv(0, 1, d).unwrap(), vec![1]);
        assert_eq!(b.recv(0, 2, d).unwrap(), vec![2]);
        a.send(0, 7, vec![7]).unwrap();
        assert_eq!(a.recv(0, 7, d).unwrap(), vec![7]);
    }

    #[test]
    fn dead_and_silent_peers_are_named() {
        let mut g = LocalTransport::group(3);
        let c = g.pop().unwrap();
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        let e = a
            .recv(1, 0, Instant::now() + Duration::from_millis(50))
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { rank: 1, .. }), "{e}");
        drop(c);
        let e = b
            .recv(2, 0, Instant::now() + Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(e, Error::PeerLost { rank: 2, .. }), "{e}");
    }
}
