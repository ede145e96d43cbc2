//! [`UniqueId`]: the bytes that join processes into one NVSHMEM job (UID bootstrap).

use crate::error::{Error, Result};
use std::fmt;

/// The unique id's size: `sizeof(nvshmemx_uniqueid_t)` in NVSHMEM 3.x (checked against the shim
/// when it is loaded).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The version word that starts every id `nvshmemx_get_uniqueid` writes:
/// `(1 << 16) + sizeof(nvshmemx_uniqueid_v1)`.
pub const UNIQUE_ID_VERSION: u32 = (1 << 16) + UNIQUE_ID_BYTES as u32;

/// An NVSHMEM unique id (`nvshmemx_uniqueid_t`): made once ([`UniqueId::new`], usually on rank
/// 0), sent to every rank (as [`UniqueId::to_bytes`] or [`UniqueId::to_hex`]), and passed to
/// `Nvshmem::init` by all of them.
///
/// It holds the address of a bootstrap listener that NVSHMEM starts in the process that made
/// the id (a thread of NVSHMEM's UID plugin): that process must stay alive until every rank has
/// initialised.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl UniqueId {
    /// The id from its bytes, as written by [`UniqueId::to_bytes`]: exactly
    /// [`UNIQUE_ID_BYTES`] bytes starting with the version word [`UNIQUE_ID_VERSION`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bytes: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| Error::UniqueIdLength {
            expected: UNIQUE_ID_BYTES,
            got: bytes.len(),
        })?;
        let found = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if found != UNIQUE_ID_VERSION {
            return Err(Error::UniqueIdVersion {
                expected: UNIQUE_ID_VERSION,
                found,
            });
        }
        Ok(Self { bytes })
    }

    /// The id's bytes (send these to the other ranks).
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.bytes
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.bytes
    }

    /// The id as `2 * UNIQUE_ID_BYTES` lowercase hex digits (for an environment variable or a
    /// key-value store).
    pub fn to_hex(&self) -> String {
        use fmt::Write as _;
        let mut s = String::with_capacity(2 * UNIQUE_ID_BYTES);
        for b in self.bytes {
            // Writing to a String cannot fail.
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// The id from [`UniqueId::to_hex`]'s form (either case).
    pub fn from_hex(hex: &str) -> Result<Self> {
        let hex = hex.trim();
        if hex.len() != 2 * UNIQUE_ID_BYTES {
            return Err(Error::UniqueIdHex {
                reason: format!(
                    "{} characters, expected {} (two per byte)",
                    hex.len(),
                    2 * UNIQUE_ID_BYTES
                ),
            });
        }
        let digit = |i: usize, c: u8| -> Result<u8> {
            (c as char)
                .to_digit(16)
                .map(|d| d as u8)
                .ok_or_else(|| Error::UniqueIdHex {
                    reason: format!(
                        "character {:?} at position {i} is not a hex digit",
                        c as char
                    ),
                })
        };
        let raw = hex.as_bytes();
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (k, b) in bytes.iter_mut().enumerate() {
            *b = digit(2 * k, raw[2 * k])? << 4 | digit(2 * k + 1, raw[2 * k + 1])?;
        }
        Self::from_bytes(&bytes)
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first 32 bytes hold the version, the listener's address and the magic; the rest
        // is padding.
        write!(f, "UniqueId({}..)", &self.to_hex()[..64])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> [u8; UNIQUE_ID_BYTES] {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..4].copy_from_slice(&UNIQUE_ID_VERSION.to_le_bytes());
        for (i, x) in b.iter_mut().enumerate().skip(4) {
            *x = (i * 7 % 256) as u8;
        }
        b
    }

    #[test]
    fn bytes_round_trip() {
        let id = UniqueId::from_bytes(&sample()).unwrap();
        assert_eq!(id.to_bytes(), sample());
        assert_eq!(id.as_bytes(), &sample());
        assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
    }

    #[test]
    fn wrong_lengths_are_rejected_with_both_sizes() {
        for len in [0, 1, 127, 129, 256] {
            let bytes = vec![0u8; len];
            match UniqueId::from_bytes(&bytes) {
                Err(e @ Error::UniqueIdLength { expected: 128, got }) if got == len => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("128") && msg.contains(&len.to_string()),
                        "{msg}"
                    );
                }
                other => panic!("len {len}: {other:?}"),
            }
        }
    }

    #[test]
    fn wrong_version_is_rejected() {
        let mut b = sample();
        b[0] ^= 1;
        match UniqueId::from_bytes(&b) {
            Err(e @ Error::UniqueIdVersion { expected, found }) => {
                assert_eq!(expected, 0x10080);
                assert_eq!(found, 0x10081);
                assert!(e.to_string().contains("0x10081"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            UniqueId::from_bytes(&[0u8; UNIQUE_ID_BYTES]),
            Err(Error::UniqueIdVersion { found: 0, .. })
        ));
    }

    #[test]
    fn hex_round_trip_and_errors() {
        let id = UniqueId::from_bytes(&sample()).unwrap();
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("80000100"), "{hex}");
        assert_eq!(UniqueId::from_hex(&hex).unwrap(), id);
        assert_eq!(UniqueId::from_hex(&hex.to_uppercase()).unwrap(), id);
        assert_eq!(UniqueId::from_hex(&format!(" {hex}\n")).unwrap(), id);

        let short = UniqueId::from_hex(&hex[..10]).unwrap_err().to_string();
        assert!(
            short.contains("10 characters") && short.contains("256"),
            "{short}"
        );
        let mut bad = hex.clone();
        bad.replace_range(9..10, "g");
        let msg = UniqueId::from_hex(&bad).unwrap_err().to_string();
        assert!(msg.contains("'g'") && msg.contains("position 9"), "{msg}");
    }

    #[test]
    fn debug_shows_the_head_only() {
        let id = UniqueId::from_bytes(&sample()).unwrap();
        let s = format!("{id:?}");
        assert!(
            s.starts_with("UniqueId(80000100") && s.ends_with("..)"),
            "{s}"
        );
    }
}
