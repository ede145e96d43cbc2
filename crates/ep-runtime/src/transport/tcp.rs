//! [`TcpTransport`]: a full TCP mesh between ranks that are separate processes (or threads).
//!
//! Setup: each rank listens on an ephemeral port of the address that reaches the bootstrap
//! store, publishes `host:port` through [`Store::all_gather`] under a name derived from the
//! group, connects to every higher rank and accepts every lower one. Both ends of each
//! connection exchange a hello (`magic | rank | world | group`) so a stray or misrouted
//! connection is caught. One reader thread per peer then moves frames
//! `u64 tag | u64 len | bytes` (little-endian) into that peer's inbox, where [`Transport::recv`]
//! finds them by tag.

use super::Transport;
use crate::bootstrap::Store;
use crate::error::{Error, Result};
use std::collections::{BTreeMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// First word of the hello frame: "EPTCPv01" in ASCII.
const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"EPTCPv01");
/// Longest group name accepted in a hello.
const MAX_GROUP_BYTES: usize = 4096;
/// Largest single message accepted from a peer (64 GiB), a guard against corrupt lengths.
const MAX_MESSAGE_BYTES: u64 = 1 << 36;
/// Messages up to this size are written with their header in one call (one TCP segment
/// train, thanks to `TCP_NODELAY`); larger ones are written in place, without a copy.
const COALESCE_BYTES: usize = 64 * 1024;
/// Pause between polls of the non-blocking listener while accepting.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Inboxes and sockets stay consistent across a panicking holder (every update is whole).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Messages received from one peer, by tag, plus whether its connection is gone.
#[derive(Default)]
struct InboxState {
    frames: BTreeMap<u64, VecDeque<Vec<u8>>>,
    /// Why the connection ended, once it has.
    closed: Option<String>,
}

#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

impl Inbox {
    fn push(&self, tag: u64, data: Vec<u8>) {
        lock(&self.state)
            .frames
            .entry(tag)
            .or_default()
            .push_back(data);
        self.arrived.notify_all();
    }

    fn close(&self, reason: String) {
        let mut st = lock(&self.state);
        if st.closed.is_none() {
            st.closed = Some(reason);
        }
        drop(st);
        self.arrived.notify_all();
    }
}

/// The connection to one peer.
struct Peer {
    /// Serializes writers so frames never interleave.
    writer: Mutex<TcpStream>,
    /// A handle on the same socket, to shut it down without taking the write lock.
    control: TcpStream,
    addr: SocketAddr,
}

/// A [`Transport`] over a full TCP mesh, set up through the bootstrap store.
///
/// Sends write straight to the socket (the peer's reader thread drains it into its inbox at
/// once, so a send waits only for the network); a peer that accepts no bytes for the `timeout`
/// given to [`TcpTransport::connect`] makes the send fail with [`Error::Timeout`] naming it.
/// Dropping the transport shuts every socket down, so peers see [`Error::PeerLost`] promptly.
pub struct TcpTransport {
    rank: usize,
    num_ranks: usize,
    group: String,
    /// `None` at this rank's own index.
    peers: Vec<Option<Peer>>,
    /// One per rank, this rank's own included (self-sends land there).
    inboxes: Vec<Arc<Inbox>>,
    readers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<Option<SocketAddr>> = self
            .peers
            .iter()
            .map(|p| p.as_ref().map(|p| p.addr))
            .collect();
        f.debug_struct("TcpTransport")
            .field("rank", &self.rank)
            .field("num_ranks", &self.num_ranks)
            .field("group", &self.group)
            .field("peers", &addrs)
            .finish()
    }
}

/// The hello both ends of a connection send first.
#[derive(Debug, PartialEq, Eq)]
struct Hello {
    rank: usize,
    world: usize,
    group: String,
}

impl Hello {
    fn write(&self, mut w: impl Write) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(32 + self.group.len());
        buf.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        buf.extend_from_slice(&(self.rank as u64).to_le_bytes());
        buf.extend_from_slice(&(self.world as u64).to_le_bytes());
        buf.extend_from_slice(&(self.group.len() as u64).to_le_bytes());
        buf.extend_from_slice(self.group.as_bytes());
        w.write_all(&buf)?;
        w.flush()
    }

    /// Reads a hello; `Ok(Err(why))` when the bytes are not a valid hello.
    fn read(mut r: impl Read) -> std::io::Result<std::result::Result<Hello, String>> {
        let mut head = [0u8; 32];
        r.read_exact(&mut head)?;
        let word = |i: usize| u64::from_le_bytes(head[i * 8..i * 8 + 8].try_into().expect("8"));
        if word(0) != HELLO_MAGIC {
            return Ok(Err(format!("bad magic {:#x}", word(0))));
        }
        let group_len = word(3);
        if group_len > MAX_GROUP_BYTES as u64 {
            return Ok(Err(format!("group name of {group_len} bytes")));
        }
        let mut group = vec![0u8; group_len as usize];
        r.read_exact(&mut group)?;
        let Ok(group) = String::from_utf8(group) else {
            return Ok(Err("group name is not UTF-8".into()));
        };
        Ok(Ok(Hello {
            rank: word(1) as usize,
            world: word(2) as usize,
            group,
        }))
    }
}

impl TcpTransport {
    /// Builds the mesh among all ranks of `store`. `group` namespaces the published
    /// addresses, so several transports can be built on one store (building the same group
    /// again is fine too: every build is a new generation of the all-gather). Every step
    /// (address exchange, connecting, accepting, hellos) finishes within `timeout` or fails
    /// naming the rank that did not show up.
    pub fn connect(store: &Store, group: &str, timeout: Duration) -> Result<TcpTransport> {
        if group.len() > MAX_GROUP_BYTES {
            return Err(Error::invalid(
                "group",
                format!("<{} bytes>", group.len()),
                format!("must be at most {MAX_GROUP_BYTES} bytes"),
            ));
        }
        if timeout.is_zero() {
            return Err(Error::invalid("timeout", "0s", "must be positive"));
        }
        let rank = store.rank();
        let n = store.world_size();
        let deadline = Instant::now() + timeout;
        let ip = store.local_addr();
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::io(format!("binding a tcp transport listener on {ip}"), e))?;
        let my_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the tcp transport listener's address", e))?;
        let published = store.all_gather_timeout(
            &format!("tcp-transport/{group}"),
            my_addr.to_string().as_bytes(),
            timeout,
        )?;
        let addrs = published
            .iter()
            .enumerate()
            .map(|(p, bytes)| {
                std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.parse::<SocketAddr>().ok())
                    .ok_or_else(|| Error::Protocol {
                        rank: p,
                        what: format!(
                            "published tcp address {:?} for group {group:?} is not host:port",
                            String::from_utf8_lossy(bytes)
                        ),
                    })
            })
            .collect::<Result<Vec<_>>>()?;

        let me = Hello {
            rank,
            world: n,
            group: group.to_string(),
        };
        // Accept the lower ranks on a helper thread while this one connects to the higher.
        let acceptor = {
            let group = group.to_string();
            std::thread::Builder::new()
                .name(format!("ep-tcp-accept-{rank}"))
                .spawn(move || accept_lower(listener, rank, n, &group, deadline))
                .map_err(|e| Error::io("spawning the tcp transport accept thread", e))?
        };
        let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut connect_error = None;
        for (p, addr) in addrs.iter().enumerate().skip(rank + 1) {
            match connect_higher(*addr, p, &me, deadline) {
                Ok(s) => streams[p] = Some(s),
                Err(e) => {
                    connect_error = Some(e);
                    break;
                }
            }
        }
        let accepted = acceptor.join().map_err(|_| Error::Protocol {
            rank,
            what: "the tcp transport accept thread panicked".into(),
        })?;
        if let Some(e) = connect_error {
            return Err(e);
        }
        for (p, s) in accepted?.into_iter().enumerate() {
            if let Some(s) = s {
                streams[p] = Some(s);
            }
        }

        let inboxes: Vec<Arc<Inbox>> = (0..n).map(|_| Arc::new(Inbox::default())).collect();
        let mut peers = Vec::with_capacity(n);
        let mut readers = Vec::with_capacity(n.saturating_sub(1));
        for (p, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                peers.push(None);
                continue;
            };
            let addr = addrs[p];
            let setup = |e| {
                Error::io(
                    format!("configuring the tcp connection to rank {p} ({addr})"),
                    e,
                )
            };
            stream.set_read_timeout(None).map_err(setup)?;
            // A peer that stops reading for this long is treated as hung.
            stream.set_write_timeout(Some(timeout)).map_err(setup)?;
            let reader = stream.try_clone().map_err(setup)?;
            let control = stream.try_clone().map_err(setup)?;
            let inbox = inboxes[p].clone();
            let handle = std::thread::Builder::new()
                .name(format!("ep-tcp-{rank}<-{p}"))
                .spawn(move || read_loop(reader, inbox))
                .map_err(|e| Error::io(format!("spawning the reader thread for rank {p}"), e))?;
            readers.push(handle);
            peers.push(Some(Peer {
                writer: Mutex::new(stream),
                control,
                addr,
            }));
        }
        tracing::debug!(rank, n, group, %my_addr, "tcp transport connected");
        Ok(TcpTransport {
            rank,
            num_ranks: n,
            group: group.to_string(),
            peers,
            inboxes,
            readers,
        })
    }

    /// The group name this transport was built under.
    pub fn group(&self) -> &str {
        &self.group
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.num_ranks {
            return Err(Error::invalid(
                "peer",
                peer,
                format!("must be below num_ranks = {}", self.num_ranks),
            ));
        }
        Ok(())
    }
}

/// Connects to higher rank `p` at `addr`, swaps hellos, and checks the answer.
fn connect_higher(addr: SocketAddr, p: usize, me: &Hello, deadline: Instant) -> Result<TcpStream> {
    let started = Instant::now();
    let what = |detail: String| format!("tcp transport group {:?}: {detail}", me.group);
    let timeout_err = |detail: String| Error::Timeout {
        rank: p,
        what: what(detail),
        waited: started.elapsed(),
    };
    let mut backoff = Duration::from_millis(5);
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timeout_err(format!("connecting to {addr}")));
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => break s,
            Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
                return Err(timeout_err(format!("connecting to {addr} ({e})")))
            }
            Err(e) => {
                // The listener exists (its address was published), so refusals are transient
                // (e.g. a full backlog); retry until the deadline.
                tracing::debug!(peer = p, %addr, error = %e, "tcp transport connect retry");
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    };
    let io = |e: std::io::Error| {
        if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) {
            timeout_err(format!("hello from {addr}"))
        } else {
            Error::PeerLost {
                rank: p,
                what: what(format!("hello with {addr} failed: {e}")),
            }
        }
    };
    stream.set_nodelay(true).map_err(io)?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(io)?;
    stream.set_write_timeout(Some(left)).map_err(io)?;
    me.write(&mut stream).map_err(io)?;
    let theirs = Hello::read(&mut stream).map_err(io)?;
    match theirs {
        Ok(h) if h.rank == p && h.world == me.world && h.group == me.group => Ok(stream),
        Ok(h) => Err(Error::Protocol {
            rank: p,
            what: what(format!(
                "{addr} answered as rank {} of {} in group {:?}",
                h.rank, h.world, h.group
            )),
        }),
        Err(why) => Err(Error::Protocol {
            rank: p,
            what: what(format!("{addr} sent an invalid hello: {why}")),
        }),
    }
}

/// Accepts one connection from every rank below `rank`, by the deadline.
fn accept_lower(
    listener: TcpListener,
    rank: usize,
    n: usize,
    group: &str,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let started = Instant::now();
    let mut got: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut remaining = rank;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("making the tcp transport listener non-blocking", e))?;
    while remaining > 0 {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (0..rank).filter(|p| got[*p].is_none()).collect();
            return Err(Error::Timeout {
                rank: missing[0],
                what: format!(
                    "tcp transport group {group:?}: ranks {missing:?} never connected to rank \
                     {rank}"
                ),
                waited: now - started,
            });
        }
        let (mut stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io("accepting a tcp transport connection", e)),
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_nodelay(true))
            .and_then(|()| stream.set_read_timeout(Some(left)))
            .and_then(|()| stream.set_write_timeout(Some(left)))
            .and_then(|()| Hello::read(&mut stream));
        let hello = match hello {
            Ok(Ok(h)) if h.group == group && h.world == n => h,
            Ok(Ok(h)) => {
                tracing::warn!(
                    %from,
                    ?h,
                    group,
                    "tcp transport: connection for another group or job dropped"
                );
                continue;
            }
            Ok(Err(why)) => {
                tracing::warn!(%from, why, "tcp transport: stray connection dropped");
                continue;
            }
            Err(e) => {
                tracing::warn!(%from, error = %e, "tcp transport: connection lost during hello");
                continue;
            }
        };
        let p = hello.rank;
        if p >= rank || got[p].is_some() {
            return Err(Error::Protocol {
                rank: p,
                what: format!(
                    "tcp transport group {group:?}: rank {rank} got a connection claiming rank \
                     {p} from {from}, but only one connection from each rank below {rank} is \
                     expected"
                ),
            });
        }
        let me = Hello {
            rank,
            world: n,
            group: group.to_string(),
        };
        me.write(&mut stream).map_err(|e| Error::PeerLost {
            rank: p,
            what: format!("tcp transport group {group:?}: answering the hello of {from}: {e}"),
        })?;
        got[p] = Some(stream);
        remaining -= 1;
    }
    Ok(got)
}

/// Moves frames from one peer's socket into its inbox until the connection ends.
fn read_loop(mut stream: TcpStream, inbox: Arc<Inbox>) {
    let reason = loop {
        let mut head = [0u8; 16];
        if let Err(e) = stream.read_exact(&mut head) {
            break if e.kind() == ErrorKind::UnexpectedEof {
                "the connection was closed".to_string()
            } else {
                format!("the connection failed: {e}")
            };
        }
        let tag = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
        if len > MAX_MESSAGE_BYTES {
            break format!(
                "it announced a {len}-byte message (tag {tag}), over the limit of \
                 {MAX_MESSAGE_BYTES}; the stream is corrupt"
            );
        }
        let mut data = Vec::new();
        if data.try_reserve_exact(len as usize).is_err() {
            break format!("cannot allocate {len} bytes for its message with tag {tag}");
        }
        match (&mut stream).take(len).read_to_end(&mut data) {
            Ok(got) if got as u64 == len => inbox.push(tag, data),
            Ok(got) => {
                break format!(
                    "the connection was closed after {got} of {len} bytes of message tag {tag}"
                )
            }
            Err(e) => break format!("the connection failed inside message tag {tag}: {e}"),
        }
    };
    // Make sure the peer notices too, whatever ended the loop.
    let _ = stream.shutdown(Shutdown::Both);
    inbox.close(reason);
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<()> {
        self.check_peer(peer)?;
        let Some(conn) = &self.peers[peer] else {
            self.inboxes[peer].push(tag, data);
            return Ok(());
        };
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&tag.to_le_bytes());
        head[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        let result = {
            let mut w = lock(&conn.writer);
            if data.len() <= COALESCE_BYTES {
                let mut buf = Vec::with_capacity(16 + data.len());
                buf.extend_from_slice(&head);
                buf.extend_from_slice(&data);
                w.write_all(&buf)
            } else {
                w.write_all(&head).and_then(|()| w.write_all(&data))
            }
        };
        result.map_err(|e| {
            // A partly written frame leaves the stream unusable: close it so both sides know.
            let _ = conn.control.shutdown(Shutdown::Both);
            let what = format!(
                "sending {} bytes with tag {tag} over tcp group {:?} to {}: {e}",
                data.len(),
                self.group,
                conn.addr
            );
            if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) {
                Error::Timeout {
                    rank: peer,
                    what,
                    waited: conn.writer_timeout(),
                }
            } else {
                Error::PeerLost { rank: peer, what }
            }
        })
    }

    fn recv(&self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        let started = Instant::now();
        let inbox = &self.inboxes[peer];
        let mut st = lock(&inbox.state);
        loop {
            // Older tags belong to ops that are over (e.g. timed out); drop them.
            let keep = st.frames.split_off(&tag);
            st.frames = keep;
            if let Some(queue) = st.frames.get_mut(&tag) {
                if let Some(data) = queue.pop_front() {
                    if queue.is_empty() {
                        st.frames.remove(&tag);
                    }
                    return Ok(data);
                }
            }
            if let Some(reason) = &st.closed {
                return Err(Error::PeerLost {
                    rank: peer,
                    what: format!(
                        "waiting for tag {tag} over tcp group {:?}: {reason}",
                        self.group
                    ),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    rank: peer,
                    what: format!("message with tag {tag} over tcp group {:?}", self.group),
                    waited: now - started,
                });
            }
            st = inbox
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Peer {
    fn writer_timeout(&self) -> Duration {
        self.control
            .write_timeout()
            .ok()
            .flatten()
            .unwrap_or_default()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for peer in self.peers.iter().flatten() {
            let _ = peer.control.shutdown(Shutdown::Both);
        }
        for handle in self.readers.drain(..) {
            let _ = handle.join();
        }
    }
}
