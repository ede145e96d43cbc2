//! The store server: a tokio key-value service on its own thread and runtime.
//!
//! One task per connection reads a request, answers it, and loops. Waits are served on the
//! server (a [`Notify`] wakes every waiter on each write), so a client never polls. Shutting
//! down stops accepting, answers every pending wait that can already be satisfied, and closes
//! every connection, so clients see an error rather than hang.

use super::wire::{Request, Response, MAGIC, MAX_FRAME_BYTES, VERSION};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;

/// How long shutdown waits for connection tasks to finish their last answer.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The shared key-value map.
#[derive(Default)]
struct State {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Notify,
    /// The world size announced by the first client, checked against later ones.
    world_size: Mutex<Option<u64>>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-updated (every update is a
        // single insert/remove), so a poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, key: String, value: Vec<u8>) {
        self.lock().insert(key, value);
        self.changed.notify_waiters();
    }
}

/// A running store server. Dropping it shuts it down (see [`StoreServer::shutdown`]).
pub struct StoreServer {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("running", &self.thread.is_some())
            .finish()
    }
}

impl StoreServer {
    /// Binds `host:port` (port 0 picks a free port; read it back with
    /// [`StoreServer::local_addr`]) and starts serving on a background thread.
    pub fn bind(host: &str, port: u16) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ep-store-server")
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::io("starting the bootstrap store's tokio runtime", e))?;
        // Bind with std so that this works from any thread, even one inside another tokio
        // runtime; the socket joins the server's runtime on the server thread.
        let listener = std::net::TcpListener::bind((host, port))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::io(format!("binding the bootstrap store to {host}:{port}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the bootstrap store's bound address", e))?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("ep-store-server".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(listener) => serve(listener, shutdown_rx).await,
                        Err(e) => {
                            tracing::error!(%addr, error = %e, "bootstrap store cannot serve")
                        }
                    }
                });
                // Tasks still stuck (e.g. writing to a client that stopped reading) are dropped.
                runtime.shutdown_background();
            })
            .map_err(|e| Error::io("spawning the bootstrap store thread", e))?;
        tracing::debug!(%addr, "bootstrap store listening");
        Ok(Self {
            addr,
            shutdown,
            thread: Some(thread),
        })
    }

    /// The address the server is bound to (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the server: no new connections; waits already satisfiable are answered, the
    /// others see their connection close (clients report [`Error::PeerLost`] for rank 0);
    /// then every connection is closed. Blocks until the server thread
    /// has exited (at most a few seconds). Idempotent.
    pub fn shutdown(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!(addr = %self.addr, "bootstrap store thread panicked");
            }
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn serve(listener: TcpListener, mut shutdown: watch::Receiver<bool>) {
    let state = Arc::new(State::default());
    let mut conns = JoinSet::new();
    // Each connection task gets its own receiver, cloned from this untouched one.
    let template = shutdown.clone();
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    conns.spawn(connection(stream, peer, state.clone(), template.clone()));
                }
                Err(e) => {
                    // Usually a transient resource problem (EMFILE); back off a little.
                    tracing::warn!(error = %e, "bootstrap store accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            // Reap finished connection tasks so the set does not grow without bound.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        tracing::warn!("bootstrap store: connections still busy at shutdown; dropping them");
    }
}

async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut greeted = false;
    loop {
        let body = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            body = read_frame(&mut stream) => match body {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "bootstrap store client dropped");
                    break;
                }
            },
        };
        let response = match Request::decode(&body) {
            Err(e) => Response::Err(format!("malformed request: {e}")),
            Ok(req) => {
                if !greeted && !matches!(req, Request::Hello { .. }) {
                    Response::Err("the first request must be a hello".into())
                } else {
                    if matches!(req, Request::Hello { .. }) {
                        greeted = true;
                    }
                    match handle(req, &state, &mut shutdown).await {
                        Some(resp) => resp,
                        // Shutting down with the wait unsatisfied: closing the connection is
                        // the answer (the client reports that the store is gone).
                        None => break,
                    }
                }
            }
        };
        let fatal = matches!(response, Response::Err(_)) && !greeted;
        if let Err(e) = write_frame(&mut stream, &response.encode()).await {
            tracing::debug!(%peer, error = %e, "bootstrap store: answer not delivered");
            break;
        }
        if fatal {
            break;
        }
    }
    let _ = stream.shutdown().await;
}

async fn handle(
    req: Request,
    state: &State,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Response> {
    let resp = match req {
        Request::Hello {
            magic,
            version,
            rank,
            world_size,
        } => {
            if magic != MAGIC {
                return Some(Response::Err(format!(
                    "bad magic {magic:#x}: this is an ep-moe bootstrap store"
                )));
            }
            if version != VERSION {
                return Some(Response::Err(format!(
                    "protocol version {version} not supported (server speaks {VERSION})"
                )));
            }
            let mut ws = state.world_size.lock().unwrap_or_else(|p| p.into_inner());
            match *ws {
                Some(expected) if expected != world_size => Response::Err(format!(
                    "rank {rank} announced world_size = {world_size}, but the job's \
                     world_size is {expected}"
                )),
                _ => {
                    *ws = Some(world_size);
                    Response::Ok
                }
            }
        }
        Request::Set { key, value } => {
            state.set(key, value);
            Response::Ok
        }
        Request::TryGet { key } => Response::Value(state.lock().get(&key).cloned()),
        Request::Add { key, delta } => {
            let result = {
                let mut map = state.lock();
                let current = match map.get(&key) {
                    None => Ok(0i64),
                    Some(v) => <[u8; 8]>::try_from(v.as_slice())
                        .map(i64::from_le_bytes)
                        .map_err(|_| v.len()),
                };
                match current {
                    Err(len) => Err(format!(
                        "key {key:?} holds a {len}-byte value, not an 8-byte counter"
                    )),
                    Ok(cur) => match cur.checked_add(delta) {
                        None => Err(format!(
                            "counter {key:?} = {cur} overflows when adding {delta}"
                        )),
                        Some(new) => {
                            map.insert(key, new.to_le_bytes().to_vec());
                            Ok(new)
                        }
                    },
                }
            };
            match result {
                Ok(new) => {
                    state.changed.notify_waiters();
                    Response::Int(new)
                }
                Err(msg) => Response::Err(msg),
            }
        }
        Request::Delete { key } => Response::Bool(state.lock().remove(&key).is_some()),
        Request::Wait {
            set,
            keys,
            timeout_ms,
            want_values,
        } => {
            if let Some((k, v)) = set {
                state.set(k, v);
            }
            return wait(state, &keys, timeout_ms, want_values, shutdown).await;
        }
    };
    Some(resp)
}

/// Waits until every key exists, the timeout passes (answering the missing keys), or the
/// server shuts down (answering the values if they are all there after all, `None` if not).
async fn wait(
    state: &State,
    keys: &[String],
    timeout_ms: u64,
    want_values: bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Response> {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        // Register interest before looking, so a write between the look and the wait wakes us.
        let notified = state.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let missing = {
            let map = state.lock();
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(*k))
                .cloned()
                .collect();
            if missing.is_empty() {
                let values = if want_values {
                    keys.iter().map(|k| map[k].clone()).collect()
                } else {
                    Vec::new()
                };
                return Some(Response::Values(values));
            }
            missing
        };
        if *shutdown.borrow() {
            tracing::debug!(
                ?missing,
                "bootstrap store shutting down with a wait unsatisfied"
            );
            return None;
        }
        tokio::select! {
            _ = &mut notified => {}
            _ = tokio::time::sleep_until(deadline) => {
                // One last look: a write may have landed just at the deadline.
                let map = state.lock();
                let missing: Vec<String> = keys
                    .iter()
                    .filter(|k| !map.contains_key(*k))
                    .cloned()
                    .collect();
                if missing.is_empty() {
                    let values = if want_values {
                        keys.iter().map(|k| map[k].clone()).collect()
                    } else {
                        Vec::new()
                    };
                    return Some(Response::Values(values));
                }
                return Some(Response::Missing(missing));
            }
            changed = shutdown.changed() => {
                if changed.is_err() {
                    return None;
                }
            }
        }
    }
}

async fn read_frame(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 8];
    match stream.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES}"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body).await?;
    Ok(Some(body))
}

async fn write_frame(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    stream.write_all(&(body.len() as u64).to_le_bytes()).await?;
    stream.write_all(body).await?;
    stream.flush().await
}
