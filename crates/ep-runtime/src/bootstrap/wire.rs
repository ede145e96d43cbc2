//! The store's wire format, shared by the server and the client.
//!
//! Every message is a frame `u64 body_len | body` (little-endian). A request body starts with
//! an op byte, a response body with a status byte; strings and byte strings are
//! `u64 len | bytes`, integers are little-endian. Encoding and decoding are pure functions on
//! byte buffers so that the async server and the blocking client share them.

/// First word of a client's hello: "EPST" in ASCII.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"EPST");
/// Version of this protocol; bumped on any incompatible change.
pub(crate) const VERSION: u32 = 1;
/// Largest key accepted, in bytes.
pub(crate) const MAX_KEY_BYTES: usize = 64 * 1024;
/// Largest frame accepted (a value plus its framing), in bytes.
pub(crate) const MAX_FRAME_BYTES: u64 = 1 << 31;

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// First message on every connection.
    Hello {
        magic: u32,
        version: u32,
        rank: u64,
        world_size: u64,
    },
    /// Stores `value` under `key`, replacing any previous value; wakes waiters.
    Set { key: String, value: Vec<u8> },
    /// Reads `key` without waiting.
    TryGet { key: String },
    /// Adds `delta` to the counter under `key` (absent = 0) and returns the new value.
    Add { key: String, delta: i64 },
    /// Optionally sets one key, then waits until all `keys` exist or `timeout_ms` passes.
    Wait {
        set: Option<(String, Vec<u8>)>,
        keys: Vec<String>,
        timeout_ms: u64,
        want_values: bool,
    },
    /// Removes `key`; answers whether it existed.
    Delete { key: String },
}

/// The server's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    /// Done, nothing to return.
    Ok,
    /// The value of a key, if present.
    Value(Option<Vec<u8>>),
    /// A counter's new value.
    Int(i64),
    /// All awaited keys exist; their values in request order (empty if not asked for).
    Values(Vec<Vec<u8>>),
    /// The wait timed out; these keys were still missing.
    Missing(Vec<String>),
    /// Answer to a delete: whether the key existed.
    Bool(bool),
    /// The request failed on the server.
    Err(String),
}

const OP_HELLO: u8 = 0;
const OP_SET: u8 = 1;
const OP_TRY_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_DELETE: u8 = 5;

const ST_OK: u8 = 0;
const ST_VALUE: u8 = 1;
const ST_INT: u8 = 2;
const ST_VALUES: u8 = 3;
const ST_MISSING: u8 = 4;
const ST_BOOL: u8 = 5;
const ST_ERR: u8 = 255;

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u64(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// Reads fields off a body, failing with a message naming what was cut short.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "truncated message: {what} needs {n} bytes, {} left",
                self.buf.len()
            ));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).map_err(|_| format!("{what} length {len} too large"))?;
        Ok(self.take(len, what)?.to_vec())
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let b = self.bytes(what)?;
        if b.len() > MAX_KEY_BYTES {
            return Err(format!(
                "{what} is {} bytes, more than the limit of {MAX_KEY_BYTES}",
                b.len()
            ));
        }
        String::from_utf8(b).map_err(|_| format!("{what} is not valid UTF-8"))
    }

    fn count(&mut self, what: &str) -> Result<usize, String> {
        let n = self.u64(what)?;
        // Each element takes at least 8 bytes, which bounds a believable count.
        if n > (self.buf.len() / 8) as u64 {
            return Err(format!(
                "{what} count {n} exceeds what {} remaining bytes can hold",
                self.buf.len()
            ));
        }
        Ok(n as usize)
    }

    fn finish(self) -> Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!("{} trailing bytes after message", self.buf.len()))
        }
    }
}

impl Request {
    /// Serializes the request body (without the frame length).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Request::Hello {
                magic,
                version,
                rank,
                world_size,
            } => {
                out.push(OP_HELLO);
                out.extend_from_slice(&magic.to_le_bytes());
                out.extend_from_slice(&version.to_le_bytes());
                put_u64(&mut out, *rank);
                put_u64(&mut out, *world_size);
            }
            Request::Set { key, value } => {
                out.reserve(key.len() + value.len() + 17);
                out.push(OP_SET);
                put_bytes(&mut out, key.as_bytes());
                put_bytes(&mut out, value);
            }
            Request::TryGet { key } => {
                out.push(OP_TRY_GET);
                put_bytes(&mut out, key.as_bytes());
            }
            Request::Add { key, delta } => {
                out.push(OP_ADD);
                put_bytes(&mut out, key.as_bytes());
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Wait {
                set,
                keys,
                timeout_ms,
                want_values,
            } => {
                out.push(OP_WAIT);
                match set {
                    Some((k, v)) => {
                        out.push(1);
                        put_bytes(&mut out, k.as_bytes());
                        put_bytes(&mut out, v);
                    }
                    None => out.push(0),
                }
                put_u64(&mut out, keys.len() as u64);
                for k in keys {
                    put_bytes(&mut out, k.as_bytes());
                }
                put_u64(&mut out, *timeout_ms);
                out.push(u8::from(*want_values));
            }
            Request::Delete { key } => {
                out.push(OP_DELETE);
                put_bytes(&mut out, key.as_bytes());
            }
        }
        out
    }

    /// Parses a request body.
    pub(crate) fn decode(body: &[u8]) -> Result<Self, String> {
        let mut c = Cursor { buf: body };
        let req = match c.u8("op")? {
            OP_HELLO => Request::Hello {
                magic: c.u32("magic")?,
                version: c.u32("version")?,
                rank: c.u64("rank")?,
                world_size: c.u64("world_size")?,
            },
            OP_SET => Request::Set {
                key: c.string("key")?,
                value: c.bytes("value")?,
            },
            OP_TRY_GET => Request::TryGet {
                key: c.string("key")?,
            },
            OP_ADD => Request::Add {
                key: c.string("key")?,
                delta: c.u64("delta")? as i64,
            },
            OP_WAIT => {
                let set = match c.u8("set flag")? {
                    0 => None,
                    1 => Some((c.string("key")?, c.bytes("value")?)),
                    f => return Err(format!("bad set flag {f}")),
                };
                let n = c.count("keys")?;
                let keys = (0..n)
                    .map(|_| c.string("key"))
                    .collect::<Result<Vec<_>, _>>()?;
                let timeout_ms = c.u64("timeout")?;
                let want_values = c.u8("want_values")? != 0;
                Request::Wait {
                    set,
                    keys,
                    timeout_ms,
                    want_values,
                }
            }
            OP_DELETE => Request::Delete {
                key: c.string("key")?,
            },
            op => return Err(format!("unknown op {op}")),
        };
        c.finish()?;
        Ok(req)
    }
}

impl Response {
    /// Serializes the response body (without the frame length).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Response::Ok => out.push(ST_OK),
            Response::Value(v) => {
                out.push(ST_VALUE);
                match v {
                    Some(v) => {
                        out.reserve(v.len() + 9);
                        out.push(1);
                        put_bytes(&mut out, v);
                    }
                    None => out.push(0),
                }
            }
            Response::Int(i) => {
                out.push(ST_INT);
                out.extend_from_slice(&i.to_le_bytes());
            }
            Response::Values(vs) => {
                out.reserve(vs.iter().map(|v| v.len() + 8).sum::<usize>() + 9);
                out.push(ST_VALUES);
                put_u64(&mut out, vs.len() as u64);
                for v in vs {
                    put_bytes(&mut out, v);
                }
            }
            Response::Missing(keys) => {
                out.push(ST_MISSING);
                put_u64(&mut out, keys.len() as u64);
                for k in keys {
                    put_bytes(&mut out, k.as_bytes());
                }
            }
            Response::Bool(b) => {
                out.push(ST_BOOL);
                out.push(u8::from(*b));
            }
            Response::Err(msg) => {
                out.push(ST_ERR);
                put_bytes(&mut out, msg.as_bytes());
            }
        }
        out
    }

    /// Parses a response body.
    pub(crate) fn decode(body: &[u8]) -> Result<Self, String> {
        let mut c = Cursor { buf: body };
        let resp = match c.u8("status")? {
            ST_OK => Response::Ok,
            ST_VALUE => match c.u8("presence flag")? {
                0 => Response::Value(None),
                1 => Response::Value(Some(c.bytes("value")?)),
                f => return Err(format!("bad presence flag {f}")),
            },
            ST_INT => Response::Int(c.u64("counter")? as i64),
            ST_VALUES => {
                let n = c.count("values")?;
                Response::Values(
                    (0..n)
                        .map(|_| c.bytes("value"))
                        .collect::<Result<Vec<_>, _>>()?,
                )
            }
            ST_MISSING => {
                let n = c.count("missing keys")?;
                Response::Missing(
                    (0..n)
                        .map(|_| c.string("key"))
                        .collect::<Result<Vec<_>, _>>()?,
                )
            }
            ST_BOOL => Response::Bool(c.u8("bool")? != 0),
            ST_ERR => Response::Err(String::from_utf8_lossy(&c.bytes("message")?).into_owned()),
            st => return Err(format!("unknown status {st}")),
        };
        c.finish()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_responses_round_trip() {
        let reqs = vec![
            Request::Hello {
                magic: MAGIC,
                version: VERSION,
                rank: 3,
                world_size: 8,
            },
            Request::Set {
                key: "a/1".into(),
                value: vec![1, 2, 3, 255],
            },
            Request::TryGet { key: "k".into() },
            Request::Add {
                key: "c".into(),
                delta: -42,
            },
            Request::Wait {
                set: Some(("x/0".into(), vec![9; 17])),
                keys: vec!["x/0".into(), "x/1".into()],
                timeout_ms: 1234,
                want_values: true,
            },
            Request::Wait {
                set: None,
                keys: vec![],
                timeout_ms: 0,
                want_values: false,
            },
            Request::Delete { key: "gone".into() },
        ];
        for r in reqs {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
        let resps = vec![
            Response::Ok,
            Response::Value(None),
            Response::Value(Some(vec![7; 33])),
            Response::Int(-5),
            Response::Values(vec![vec![], vec![1, 2]]),
            Response::Missing(vec!["b/2".into()]),
            Response::Bool(true),
            Response::Err("boom".into()),
        ];
        for r in resps {
            assert_eq!(Response::decode(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn truncated_and_trailing_bodies_are_rejected() {
        let body = Request::Set {
            key: "key".into(),
            value: vec![1, 2, 3],
        }
        .encode();
        for cut in 0..body.len() {
            assert!(Request::decode(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = body.clone();
        long.push(0);
        assert!(Request::decode(&long).unwrap_err().contains("trailing"));
        assert!(Response::decode(&[77])
            .unwrap_err()
            .contains("unknown status"));
    }
}
