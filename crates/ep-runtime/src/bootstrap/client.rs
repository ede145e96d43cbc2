//! [`Store`]: the blocking client every rank uses (rank 0 also hosts the server).

use super::config::StoreConfig;
use super::server::StoreServer;
use super::wire::{Request, Response, MAGIC, MAX_FRAME_BYTES, MAX_KEY_BYTES, VERSION};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Extra time a client gives the server to answer, beyond the wait it asked for, before it
/// declares the server unresponsive.
const REPLY_SLACK: Duration = Duration::from_secs(10);
/// Longest single connection attempt while retrying to reach the server.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// Framing overhead allowed for in the value size limit.
const FRAME_OVERHEAD: usize = 1024;

/// A rank's handle on the bootstrap store. Blocking, `Send + Sync`: share it behind an
/// [`std::sync::Arc`]. Each call borrows an idle connection to the server (opening one if all
/// are busy), so a thread blocked in [`Store::get`] never holds up another thread's
/// [`Store::set`].
///
/// On rank 0 the store also owns the server, which stops when this `Store` is dropped: rank 0
/// should leave last (a final [`Store::barrier`] is enough: waits that are already satisfied
/// are still answered while the server shuts down).
pub struct Store {
    cfg: StoreConfig,
    /// The server address this client reached.
    endpoint: SocketAddr,
    /// Local IP of the store connection: an address of this host that reaches rank 0.
    local_ip: IpAddr,
    /// Idle connections to the server.
    idle: Mutex<Vec<TcpStream>>,
    /// How many times this rank has entered each barrier / all-gather name.
    generations: Mutex<HashMap<String, u64>>,
    /// The server, on rank 0 only. Declared last so client connections close first.
    server: Option<StoreServer>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("rank", &self.cfg.rank)
            .field("world_size", &self.cfg.world_size)
            .field("endpoint", &self.endpoint)
            .field("local_ip", &self.local_ip)
            .field("server", &self.server)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data (idle sockets, counters) stays valid even if a holder panicked.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The rank a key belongs to under the `"{name}/{rank}"` convention.
fn rank_of_key(key: &str, world_size: usize) -> Option<usize> {
    let (_, last) = key.rsplit_once('/')?;
    last.parse::<usize>().ok().filter(|r| *r < world_size)
}

fn is_disconnect(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe
            | ErrorKind::NotConnected
    )
}

impl Store {
    /// Joins the store described by `cfg`. Rank 0 first starts the server on
    /// `master_port` (all interfaces; port 0 picks a free port, see
    /// [`Store::server_addr`]); every rank then connects to `master_addr:master_port`,
    /// retrying until `cfg.timeout` (the server may start after the others).
    pub fn connect(cfg: StoreConfig) -> Result<Self> {
        cfg.validate()?;
        let server = if cfg.rank == 0 {
            let wildcard = if cfg.master_addr.trim().parse::<std::net::Ipv6Addr>().is_ok() {
                "::"
            } else {
                "0.0.0.0"
            };
            Some(StoreServer::bind(wildcard, cfg.master_port)?)
        } else {
            None
        };
        let port = server
            .as_ref()
            .map_or(cfg.master_port, |s| s.local_addr().port());
        let (stream, endpoint) = connect_with_retry(&cfg, port)?;
        let local_ip = stream
            .local_addr()
            .map_err(|e| Error::io("reading the local address of the store connection", e))?
            .ip();
        tracing::debug!(rank = cfg.rank, %endpoint, %local_ip, "joined bootstrap store");
        Ok(Self {
            cfg,
            endpoint,
            local_ip,
            idle: Mutex::new(vec![stream]),
            generations: Mutex::new(HashMap::new()),
            server,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.cfg.world_size
    }

    /// The configuration this store was joined with.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The local IP address of this rank's store connection: an address of this host that
    /// the rank-0 host can reach, to publish for peer-to-peer connections.
    pub fn local_addr(&self) -> IpAddr {
        self.local_ip
    }

    /// The server's address as this client reached it.
    pub fn endpoint(&self) -> SocketAddr {
        self.endpoint
    }

    /// On rank 0, the address the server is bound to (its port is the real one when
    /// `master_port` was 0); `None` on other ranks.
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(StoreServer::local_addr)
    }

    /// Stores `value` under `key`, replacing any previous value.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value.len())?;
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.call(&req, self.cfg.timeout, &format!("set {key:?}"))? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(&other, "set")),
        }
    }

    /// Returns the value under `key`, waiting for it up to the configured timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let mut values = self.wait_inner(
            None,
            &[key.to_string()],
            self.cfg.timeout,
            true,
            &format!("get {key:?}"),
        )?;
        Ok(values.pop().expect("one value per key"))
    }

    /// Returns the value under `key` if it is set, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        let req = Request::TryGet {
            key: key.to_string(),
        };
        match self.call(&req, self.cfg.timeout, &format!("try_get {key:?}"))? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected(&other, "try_get")),
        }
    }

    /// Waits until every key in `keys` is set, up to `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        self.wait_inner(None, &keys, timeout, false, "wait")?;
        Ok(())
    }

    /// Waits until every key in `keys` is set, up to `timeout`, and returns their values in
    /// the order of `keys`.
    pub fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        self.wait_inner(None, &keys, timeout, true, "multi_get")
    }

    /// Atomically adds `delta` to the counter under `key` (an absent key counts as 0) and
    /// returns the new value. Counters are stored as 8-byte little-endian values.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.call(&req, self.cfg.timeout, &format!("add {key:?}"))? {
            Response::Int(v) => Ok(v),
            other => Err(self.unexpected(&other, "add")),
        }
    }

    /// Removes `key`; returns whether it was set.
    pub fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        let req = Request::Delete {
            key: key.to_string(),
        };
        match self.call(&req, self.cfg.timeout, &format!("delete {key:?}"))? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected(&other, "delete")),
        }
    }

    /// Blocks until every rank has entered the barrier `name`, up to the configured timeout.
    /// The same name may be used again: each use is a new generation, counted by this
    /// `Store` (so every rank must use one `Store` for the whole job).
    pub fn barrier(&self, name: &str) -> Result<()> {
        self.barrier_timeout(name, self.cfg.timeout)
    }

    /// [`Store::barrier`] with an explicit time limit. On timeout the error names every rank
    /// that did not arrive.
    pub fn barrier_timeout(&self, name: &str, timeout: Duration) -> Result<()> {
        let prefix = format!("__barrier/{name}/{}", self.next_generation("barrier", name));
        let keys = self.rank_keys(&prefix);
        let mine = keys[self.cfg.rank].clone();
        self.wait_inner(
            Some((mine, Vec::new())),
            &keys,
            timeout,
            false,
            &format!("barrier {name:?}"),
        )?;
        Ok(())
    }

    /// Every rank contributes `data`; returns all contributions, indexed by rank, once every
    /// rank has contributed (up to the configured timeout). The same name may be reused.
    pub fn all_gather(&self, name: &str, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.all_gather_timeout(name, data, self.cfg.timeout)
    }

    /// [`Store::all_gather`] with an explicit time limit. On timeout the error names every
    /// rank that did not contribute.
    pub fn all_gather_timeout(
        &self,
        name: &str,
        data: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        check_value(data.len())?;
        let prefix = format!("__gather/{name}/{}", self.next_generation("gather", name));
        let keys = self.rank_keys(&prefix);
        let mine = keys[self.cfg.rank].clone();
        self.wait_inner(
            Some((mine, data.to_vec())),
            &keys,
            timeout,
            true,
            &format!("all_gather {name:?}"),
        )
    }

    fn next_generation(&self, kind: &str, name: &str) -> u64 {
        let mut gens = lock(&self.generations);
        let g = gens.entry(format!("{kind}:{name}")).or_insert(0);
        let current = *g;
        *g += 1;
        current
    }

    fn rank_keys(&self, prefix: &str) -> Vec<String> {
        (0..self.cfg.world_size)
            .map(|r| format!("{prefix}/{r}"))
            .collect()
    }

    /// Sets `set` (if any), then waits for `keys`; on timeout names the missing ranks.
    fn wait_inner(
        &self,
        set: Option<(String, Vec<u8>)>,
        keys: &[String],
        timeout: Duration,
        want_values: bool,
        what: &str,
    ) -> Result<Vec<Vec<u8>>> {
        for k in keys {
            check_key(k)?;
        }
        if let Some((_, v)) = &set {
            check_value(v.len())?;
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let req = Request::Wait {
            set,
            keys: keys.to_vec(),
            timeout_ms,
            want_values,
        };
        let started = Instant::now();
        match self.call(&req, timeout, what)? {
            Response::Values(values) if !want_values || values.len() == keys.len() => Ok(values),
            Response::Missing(missing) => Err(self.missing_error(what, missing, started.elapsed())),
            other => Err(self.unexpected(&other, what)),
        }
    }

    fn missing_error(&self, what: &str, missing: Vec<String>, waited: Duration) -> Error {
        let ranks: Option<Vec<usize>> = missing
            .iter()
            .map(|k| rank_of_key(k, self.cfg.world_size))
            .collect();
        match ranks {
            Some(mut ranks) if !ranks.is_empty() => {
                ranks.sort_unstable();
                ranks.dedup();
                Error::Timeout {
                    rank: ranks[0],
                    what: format!(
                        "{what} on the bootstrap store: ranks {ranks:?} never wrote keys \
                         {missing:?}"
                    ),
                    waited,
                }
            }
            _ => Error::Store(format!(
                "timed out after {waited:?} in {what}: keys {missing:?} were never set"
            )),
        }
    }

    fn unexpected(&self, resp: &Response, what: &str) -> Error {
        match resp {
            Response::Err(msg) => Error::Store(format!("{what} failed on the server: {msg}")),
            other => Error::Protocol {
                rank: 0,
                what: format!("unexpected answer to {what} from the bootstrap store: {other:?}"),
            },
        }
    }

    /// Sends one request on an idle connection and reads the answer, allowing `expected`
    /// (plus slack) for it.
    fn call(&self, req: &Request, expected: Duration, what: &str) -> Result<Response> {
        let taken = lock(&self.idle).pop();
        let mut stream = match taken {
            Some(s) => s,
            None => self.open_extra(what)?,
        };
        let reply_within = expected.saturating_add(REPLY_SLACK);
        let io_result = (|| {
            stream.set_write_timeout(Some(self.cfg.timeout.saturating_add(REPLY_SLACK)))?;
            stream.set_read_timeout(Some(reply_within))?;
            write_frame(&mut stream, &req.encode())?;
            read_frame(&mut stream)
        })();
        let body = io_result.map_err(|e| self.io_error(e, what, reply_within))?;
        let resp = Response::decode(&body).map_err(|e| Error::Protocol {
            rank: 0,
            what: format!("malformed answer to {what} from the bootstrap store: {e}"),
        })?;
        lock(&self.idle).push(stream);
        Ok(resp)
    }

    /// Opens one more connection when every existing one is busy (one attempt: the server is
    /// known to be up, so failure means it is gone).
    fn open_extra(&self, what: &str) -> Result<TcpStream> {
        let stream =
            TcpStream::connect_timeout(&self.endpoint, CONNECT_ATTEMPT.min(self.cfg.timeout))
                .map_err(|e| Error::PeerLost {
                    rank: 0,
                    what: format!(
                        "cannot reach the bootstrap store at {} for {what}: {e}",
                        self.endpoint
                    ),
                })?;
        handshake(&stream, &self.cfg).map_err(|e| match e {
            HandshakeError::Io(e) => self.io_error(e, what, self.cfg.timeout),
            HandshakeError::Refused(msg) => Error::Store(msg),
        })?;
        Ok(stream)
    }

    fn io_error(&self, e: std::io::Error, what: &str, waited: Duration) -> Error {
        let addr = self.endpoint;
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            Error::Timeout {
                rank: 0,
                what: format!("answer of the bootstrap store at {addr} to {what}"),
                waited,
            }
        } else if is_disconnect(e.kind()) {
            Error::PeerLost {
                rank: 0,
                what: format!(
                    "the bootstrap store at {addr} closed the connection during {what} ({e})"
                ),
            }
        } else {
            Error::io(format!("{what} on the bootstrap store at {addr}"), e)
        }
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::invalid(
            "key",
            format!("<{} bytes>", key.len()),
            format!("must be at most {MAX_KEY_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn check_value(len: usize) -> Result<()> {
    let limit = MAX_FRAME_BYTES as usize - FRAME_OVERHEAD;
    if len > limit {
        return Err(Error::invalid(
            "value",
            format!("<{len} bytes>"),
            format!("must be at most {limit} bytes"),
        ));
    }
    Ok(())
}

enum HandshakeError {
    Io(std::io::Error),
    Refused(String),
}

/// Sends the hello and checks the answer.
fn handshake(stream: &TcpStream, cfg: &StoreConfig) -> std::result::Result<(), HandshakeError> {
    let mut s = stream;
    let io = |e| HandshakeError::Io(e);
    stream.set_nodelay(true).map_err(io)?;
    stream
        .set_read_timeout(Some(CONNECT_ATTEMPT.max(cfg.timeout.min(REPLY_SLACK))))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(CONNECT_ATTEMPT.max(cfg.timeout.min(REPLY_SLACK))))
        .map_err(io)?;
    let hello = Request::Hello {
        magic: MAGIC,
        version: VERSION,
        rank: cfg.rank as u64,
        world_size: cfg.world_size as u64,
    };
    write_frame(&mut s, &hello.encode()).map_err(io)?;
    let body = read_frame(&mut s).map_err(io)?;
    match Response::decode(&body) {
        Ok(Response::Ok) => Ok(()),
        Ok(Response::Err(msg)) => Err(HandshakeError::Refused(format!(
            "the bootstrap store at {}:{} refused rank {}: {msg}",
            cfg.master_addr, cfg.master_port, cfg.rank
        ))),
        Ok(other) => Err(HandshakeError::Refused(format!(
            "the service at {}:{} is not an ep-moe bootstrap store (answered {other:?})",
            cfg.master_addr, cfg.master_port
        ))),
        Err(e) => Err(HandshakeError::Refused(format!(
            "the service at {}:{} is not an ep-moe bootstrap store ({e})",
            cfg.master_addr, cfg.master_port
        ))),
    }
}

/// Connects to `cfg.master_addr:port`, retrying until `cfg.timeout`.
fn connect_with_retry(cfg: &StoreConfig, port: u16) -> Result<(TcpStream, SocketAddr)> {
    let host = cfg.master_addr.trim();
    let started = Instant::now();
    let deadline = started + cfg.timeout;
    let mut backoff = Duration::from_millis(10);
    let mut last_error = String::from("no attempt made");
    loop {
        match (host, port).to_socket_addrs() {
            Err(e) => last_error = format!("cannot resolve {host:?}: {e}"),
            Ok(addrs) => {
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    match TcpStream::connect_timeout(&addr, CONNECT_ATTEMPT.min(left)) {
                        Err(e) => last_error = format!("{addr}: {e}"),
                        Ok(stream) => match handshake(&stream, cfg) {
                            Ok(()) => return Ok((stream, addr)),
                            Err(HandshakeError::Refused(msg)) => return Err(Error::Store(msg)),
                            Err(HandshakeError::Io(e)) => {
                                last_error = format!("{addr}: hello failed: {e}")
                            }
                        },
                    }
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                rank: 0,
                what: format!(
                    "rank {} connecting to the bootstrap store at MASTER_ADDR={host} \
                     MASTER_PORT={port} (last error: {last_error})",
                    cfg.rank
                ),
                waited: now - started,
            });
        }
        std::thread::sleep(backoff.min(deadline - now));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

fn write_frame(mut w: impl Write, body: &[u8]) -> std::io::Result<()> {
    w.write_all(&(body.len() as u64).to_le_bytes())?;
    w.write_all(body)?;
    w.flush()
}

fn read_frame(mut r: impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME_BYTES {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES}"),
        ));
    }
    let mut body = Vec::new();
    r.take(len).read_to_end(&mut body)?;
    if body.len() as u64 != len {
        return Err(std::io::Error::new(
            ErrorKind::UnexpectedEof,
            format!("connection closed after {} of {len} bytes", body.len()),
        ));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::rank_of_key;

    #[test]
    fn rank_of_key_follows_the_name_rank_convention() {
        assert_eq!(rank_of_key("__barrier/x/0/3", 4), Some(3));
        assert_eq!(rank_of_key("addr/0", 4), Some(0));
        assert_eq!(rank_of_key("addr/4", 4), None);
        assert_eq!(rank_of_key("addr", 4), None);
        assert_eq!(rank_of_key("addr/x", 4), None);
    }
}
