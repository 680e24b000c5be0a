//! [`ResourceKey`]: the name of a distributed lock, and its stable mapping to the 64-bit key of
//! a PostgreSQL advisory lock.
//!
//! # The advisory-key algorithm (stable; part of the contract)
//!
//! `advisory_key(key)` = the first 8 bytes of SHA-256 over the key's UTF-8 bytes, read as a
//! big-endian two's-complement signed 64-bit integer.
//!
//! It never changes between releases (two versions of an application must agree on it during
//! a rolling deploy), and is easy to recompute anywhere. In SQL (PostgreSQL 11+):
//!
//! ```sql
//! SELECT ('x' || substr(encode(sha256(convert_to(:key, 'UTF8')), 'hex'), 1, 16))::bit(64)::bigint;
//! ```
//!
//! In Python: `struct.unpack('>q', hashlib.sha256(key.encode()).digest()[:8])[0]`.
//!
//! Two different keys share an advisory key with probability about 2⁻⁶⁴ per pair; a collision
//! would only make two unrelated writers queue behind each other, never break exclusion.
//! `std`'s `DefaultHasher` is not used: it is neither specified nor stable across releases.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result, ValidationError};

/// The name of a lock resource, e.g. `relay:aggregate:StockItem:0123…`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceKey(String);

impl ResourceKey {
    /// The longest key accepted, in bytes.
    pub const MAX_BYTES: usize = 1024;

    /// Validates a key: not empty, at most [`ResourceKey::MAX_BYTES`] bytes, no NUL.
    pub fn new(key: impl Into<String>) -> Result<ResourceKey> {
        let key = key.into();
        if key.is_empty() {
            return Err(Error::from(ValidationError::EmptyResourceKey));
        }
        if key.len() > Self::MAX_BYTES {
            return Err(Error::from(ValidationError::ResourceKeyTooLong {
                bytes: key.len(),
                max: Self::MAX_BYTES,
            }));
        }
        if key.contains('\0') {
            return Err(Error::from(ValidationError::ContainsNul {
                field: "resource key",
            }));
        }
        Ok(ResourceKey(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `bigint` advisory-lock key for this resource (see the module docs for the algorithm).
    pub fn advisory_key(&self) -> i64 {
        advisory_key(&self.0)
    }
}

impl fmt::Display for ResourceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for ResourceKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// The advisory-lock key of any string: first 8 bytes of SHA-256(UTF-8), big-endian `i64`.
pub fn advisory_key(key: &str) -> i64 {
    let digest = Sha256::digest(key.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// Golden vectors for [`advisory_key`], computed independently (Python `hashlib` and the SQL
/// above). Backends test their SQL function against these.
pub const ADVISORY_KEY_GOLDEN_VECTORS: &[(&str, i64)] = &[
    ("a", -3_848_465_438_864_589_366),
    ("lockstep", -5_484_812_053_145_824_084),
    (
        "relay:aggregate:StockItem:0123456789abcdef0123456789abcdef",
        -935_116_733_042_422_241,
    ),
    (
        "relay:aggregate:Order:00000000000000000000000000000000",
        -6_291_226_942_238_632_698,
    ),
    (
        "relay:aggregate:Ünïcödé:ffffffffffffffffffffffffffffffff",
        -3_921_295_659_005_468_687,
    ),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    #[test]
    fn advisory_key_matches_the_golden_vectors() {
        for (key, expected) in ADVISORY_KEY_GOLDEN_VECTORS {
            assert_eq!(advisory_key(key), *expected, "key {key:?}");
            assert_eq!(
                typed(ResourceKey::new(*key).map(|k| k.advisory_key())),
                Ok(*expected)
            );
        }
    }

    #[test]
    fn keys_are_validated() {
        assert_eq!(
            typed(ResourceKey::new("")),
            Err(ValidationError::EmptyResourceKey)
        );
        assert!(ResourceKey::new("x".repeat(1025)).is_err());
        assert!(ResourceKey::new("x".repeat(1024)).is_ok());
        assert!(ResourceKey::new("a\0").is_err());
    }
}
