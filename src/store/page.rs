//! The stored page format: a [`PageHeader`] followed by the page's bytes in page-first
//! order, bound to the key it is stored under and checked on every read.
//!
//! A value is *bound* to its full key: the store's identity (namespace, model id and
//! salt, as a SHA-256 digest: [`PageBinding`]), the page hash and the page format are
//! all in its header, and the header's seal (CRC-32, or HMAC-SHA-256 with a
//! [`MacKey`]) covers the header and the payload. A reader accepts a value only when its
//! seal verifies and it names the reader's own identity, page hash and format: a sound
//! value of another key ([`Invalid::Foreign`]), a value sealed another way
//! ([`Invalid::NoMac`], [`Invalid::Keyed`]) or a seal that does not verify
//! ([`Invalid::Checksum`], [`Invalid::Mac`]) is a miss.

use core::fmt;

use bytemuck::{Pod, Zeroable};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::StoreError;
use crate::kv::host::HostKvConfig;
use crate::radix::BlockHash;

/// The first four bytes of every stored page.
pub const PAGE_MAGIC: [u8; 4] = *b"KVPG";

/// The page format version this build writes and accepts. Version 2 binds a value to
/// its store identity and page hash and can seal it with a MAC; values of version 1 are
/// refused ([`Invalid::Version`]), so a store written by an older build reads as misses
/// until its pages are written again.
pub const FORMAT_VERSION: u32 = 2;

/// Bytes of a [`PageHeader`] on the wire (and in memory: `#[repr(C)]`, no padding).
pub const HEADER_BYTES: usize = core::mem::size_of::<PageHeader>();

/// What one stored page holds: `page_size` tokens of `bytes_per_token` bytes each (every
/// layer's K and V rows of a token: `row_bytes * layer_num * buffers`). Two engines share
/// pages only when their formats are equal; a page of another format is a miss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageFormat {
    /// Tokens per page.
    pub page_size: u32,
    /// Bytes per token across all layers and buffers.
    pub bytes_per_token: u64,
}

impl PageFormat {
    /// The format of the pages of a host pool (its [`HostKvConfig::page_bytes`] is
    /// [`page_bytes`](Self::page_bytes)).
    pub fn of(cfg: &HostKvConfig) -> PageFormat {
        let kv = &cfg.kv;
        PageFormat {
            page_size: kv.page_size,
            bytes_per_token: kv.row_bytes() as u64 * kv.layer_num as u64 * kv.layout.buffers() as u64,
        }
    }

    /// Bytes of one page's payload (`page_size * bytes_per_token`; saturates, and a
    /// format that large is refused by the store's constructor).
    pub fn page_bytes(&self) -> usize {
        usize::try_from(self.bytes_per_token.saturating_mul(self.page_size as u64)).unwrap_or(usize::MAX)
    }

    /// Bytes of one stored value: header and payload.
    pub fn value_bytes(&self) -> usize {
        self.page_bytes().saturating_add(HEADER_BYTES)
    }
}

/// How a value's header and payload are sealed ([`PageHeader::seal`] on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Seal {
    /// CRC-32 (`crc32fast`) in the first four bytes of [`PageHeader::tag`], the rest
    /// zero: catches damage and mis-keyed values, not a writer who means harm.
    Crc32 = 1,
    /// HMAC-SHA-256 under a [`MacKey`] in all 32 bytes of [`PageHeader::tag`]: also
    /// refuses values written by anyone without the key.
    HmacSha256 = 2,
}

impl Seal {
    /// The seal a header's field names (`None`: none this version has).
    pub(crate) fn from_wire(v: u32) -> Option<Seal> {
        match v {
            1 => Some(Seal::Crc32),
            2 => Some(Seal::HmacSha256),
            _ => None,
        }
    }
}

/// The secret of a store's MAC ([`Seal::HmacSha256`]): every reader and writer of the
/// store's pages must hold the same one. Its [`Debug`](fmt::Debug) output does not show
/// the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct MacKey(Vec<u8>);

impl MacKey {
    /// The fewest bytes a key may have (128 bits).
    pub const MIN_BYTES: usize = 16;

    /// A MAC key of `secret` (random bytes, at least [`MIN_BYTES`](Self::MIN_BYTES);
    /// 32 is what HMAC-SHA-256 can use in full).
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a secret shorter than [`MIN_BYTES`](Self::MIN_BYTES).
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<MacKey, StoreError> {
        let secret = secret.into();
        if secret.len() < Self::MIN_BYTES {
            return Err(StoreError::Config {
                detail: format!("a MAC key of {} bytes; at least {} are needed", secret.len(), Self::MIN_BYTES),
            });
        }
        Ok(MacKey(secret))
    }
}

impl fmt::Debug for MacKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacKey({} bytes)", self.0.len())
    }
}

/// The key identity a store's values are bound to, built once per store: its namespace,
/// model id and salt (as a SHA-256 digest, [`identity`](Self::identity)), its page
/// format, and its seal (CRC-32, or HMAC-SHA-256 under a [`MacKey`]).
/// [`PageHeader::new`] writes values bound to it and [`check_page`] accepts only those;
/// neither allocates.
///
/// Two bindings of different namespaces, model ids or salts have different identities
/// (each part is length-prefixed in the digest), so a value written under one is
/// [`Invalid::Foreign`] under the other.
#[derive(Clone)]
pub struct PageBinding {
    format: PageFormat,
    identity: [u8; 32],
    /// The MAC keyed with the store's secret (cloned per value: no allocation).
    mac: Option<Hmac<Sha256>>,
}

impl PageBinding {
    /// The binding of pages of `format` stored by `namespace` for `model_id` under
    /// `salt` (any text; the empty salt is a salt like any other), sealed with CRC-32.
    pub fn new(namespace: &str, model_id: &str, salt: &str, format: PageFormat) -> PageBinding {
        let mut d = Sha256::new();
        d.update(b"kvpool page binding\0");
        for part in [namespace, model_id, salt] {
            d.update((part.len() as u64).to_le_bytes());
            d.update(part.as_bytes());
        }
        PageBinding { format, identity: d.finalize().into(), mac: None }
    }

    /// The same binding, sealed with HMAC-SHA-256 under `key` instead of CRC-32.
    pub fn with_mac(mut self, key: &MacKey) -> PageBinding {
        let mac = <Hmac<Sha256> as Mac>::new_from_slice(&key.0).expect("HMAC takes a key of any length");
        self.mac = Some(mac);
        self
    }

    /// The page format.
    pub fn format(&self) -> PageFormat {
        self.format
    }

    /// The digest of the namespace, model id and salt that every value's header names
    /// ([`PageHeader::binding`]).
    pub fn identity(&self) -> &[u8; 32] {
        &self.identity
    }

    /// How values are sealed.
    pub fn seal(&self) -> Seal {
        if self.mac.is_some() {
            Seal::HmacSha256
        } else {
            Seal::Crc32
        }
    }

    /// The tag of `header` (its `tag` ignored) and `payload` under this binding's seal.
    fn tag<'a>(&self, header: &PageHeader, payload: impl Iterator<Item = &'a [u8]>) -> [u8; 32] {
        let mut zeroed = *header;
        zeroed.tag = [0; 32];
        let mut tag = [0u8; 32];
        match &self.mac {
            Some(keyed) => {
                let mut mac = keyed.clone();
                mac.update(bytemuck::bytes_of(&zeroed));
                payload.for_each(|piece| mac.update(piece));
                tag.copy_from_slice(&mac.finalize().into_bytes());
            }
            None => tag[..4].copy_from_slice(&crc32(&zeroed, payload).to_le_bytes()),
        }
        tag
    }
}

impl fmt::Debug for PageBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageBinding")
            .field("format", &self.format)
            .field("identity", &format_args!("{:02x?}", &self.identity[..8]))
            .field("seal", &self.seal())
            .finish()
    }
}

/// CRC-32 of `zeroed` (a header whose `tag` is zero) and `payload`.
fn crc32<'a>(zeroed: &PageHeader, payload: impl Iterator<Item = &'a [u8]>) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(bytemuck::bytes_of(zeroed));
    payload.for_each(|piece| crc.update(piece));
    crc.finalize()
}

/// The header in front of every stored page. Integers are little-endian on the wire
/// (the constructor and [`check_page`] convert, so the cast is right on any host).
///
/// The header names the key the value was written for (`page_hash`, the store's
/// `binding`) and its format; `tag` seals the header (with `tag` zero) and the payload
/// ([`Seal`]). A changed header field, a flipped payload byte or a value copied under
/// another key all fail [`check_page`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct PageHeader {
    /// [`PAGE_MAGIC`].
    pub magic: [u8; 4],
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// Tokens per page ([`PageFormat::page_size`]).
    pub page_size: u32,
    /// [`HEADER_BYTES`] (lets a later version grow the header).
    pub header_bytes: u32,
    /// [`PageFormat::bytes_per_token`].
    pub bytes_per_token: u64,
    /// Bytes of payload after the header.
    pub payload_bytes: u64,
    /// The [`Seal`] of `tag`.
    pub seal: u32,
    /// Zero ([`check_page`] refuses anything else: [`Invalid::Reserved`]).
    pub reserved: u32,
    /// The page hash the value was written for.
    pub page_hash: [u8; 32],
    /// The writer's [`PageBinding::identity`].
    pub binding: [u8; 32],
    /// The seal: CRC-32 and 28 zero bytes, or HMAC-SHA-256.
    pub tag: [u8; 32],
}

impl PageHeader {
    /// The header of page `hash` under `binding`, whose payload is the concatenation of
    /// `payload` (the pieces are sealed in order; nothing is copied or allocated).
    pub fn new<'a>(binding: &PageBinding, hash: &BlockHash, payload: impl Iterator<Item = &'a [u8]>) -> PageHeader {
        let format = binding.format;
        let mut h = PageHeader {
            magic: PAGE_MAGIC,
            version: FORMAT_VERSION.to_le(),
            page_size: format.page_size.to_le(),
            header_bytes: (HEADER_BYTES as u32).to_le(),
            bytes_per_token: format.bytes_per_token.to_le(),
            payload_bytes: (format.page_bytes() as u64).to_le(),
            seal: (binding.seal() as u32).to_le(),
            reserved: 0,
            page_hash: *hash,
            binding: binding.identity,
            tag: [0; 32],
        };
        h.tag = binding.tag(&h, payload);
        h
    }

    /// The header's bytes as they go on the wire.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }
}

/// Why a stored value was refused (a miss: nothing is loaded from it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Invalid {
    /// Shorter than a header.
    Truncated {
        /// Its length.
        len: usize,
    },
    /// Not a kvpool page (wrong magic or header length).
    Magic,
    /// Written by another format version.
    Version {
        /// The version it carries.
        found: u32,
    },
    /// A page of another shape (page size or bytes per token): another model or
    /// another page size under the same key prefix.
    Format {
        /// The format it carries.
        found: PageFormat,
    },
    /// The value's length disagrees with its header.
    Length {
        /// The value's payload length.
        found: usize,
    },
    /// The header's seal field names no [`Seal`] (damaged).
    Seal {
        /// The field's value.
        found: u32,
    },
    /// The value is sealed with a MAC and this store has no MAC key: a page of a
    /// deployment that uses one (it cannot be checked here, so it is not loaded).
    Keyed,
    /// This store checks a MAC and the value carries none (it is sealed with CRC-32):
    /// written by a store without the key, or by anyone at all.
    NoMac,
    /// The CRC-32 does not match: the bytes were changed.
    Checksum {
        /// The checksum in the header.
        stored: u32,
        /// The checksum of what was read.
        computed: u32,
    },
    /// The MAC does not verify: the value was written without this store's key (forged,
    /// or by a store with another key), or changed since.
    Mac,
    /// A sound value written for another key: another page hash (`page`), or another
    /// namespace, model id or salt (`store`), or both; copied, moved or restored under
    /// this key. Refused, so no page loads as another model's, tenant's or page's.
    Foreign {
        /// It names another page hash.
        page: bool,
        /// It names another store identity (namespace, model id, salt).
        store: bool,
    },
    /// The header's reserved field is not zero, under a seal that verifies: written so
    /// on purpose, by a writer of another revision of the format (a damaged field fails
    /// the seal first).
    Reserved {
        /// The field's value.
        found: u32,
    },
}

impl Invalid {
    /// Whether the value is damaged (truncated, not a page, wrong length, seal field or
    /// checksum), as opposed to a well-formed page of another version, revision, format
    /// or key ([`is_foreign`](Self::is_foreign)), or one the MAC refuses
    /// ([`is_forged`](Self::is_forged)).
    pub fn is_corrupt(&self) -> bool {
        matches!(
            self,
            Invalid::Truncated { .. }
                | Invalid::Magic
                | Invalid::Length { .. }
                | Invalid::Seal { .. }
                | Invalid::Checksum { .. }
        )
    }

    /// Whether the value is a sound page of another key ([`Invalid::Foreign`]).
    pub fn is_foreign(&self) -> bool {
        matches!(self, Invalid::Foreign { .. })
    }

    /// Whether a store with a MAC key refused the value for its MAC: none
    /// ([`Invalid::NoMac`]) or one that does not verify ([`Invalid::Mac`]). Forged, or
    /// written by a store without this key (a MAC also fails on damage: the two look
    /// alike).
    pub fn is_forged(&self) -> bool {
        matches!(self, Invalid::NoMac | Invalid::Mac)
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::Truncated { len } => write!(f, "value of {len} bytes is shorter than a page header"),
            Invalid::Magic => write!(f, "value is not a kvpool page"),
            Invalid::Version { found } => write!(f, "page format version {found}, expected {FORMAT_VERSION}"),
            Invalid::Format { found } => write!(
                f,
                "page of {} tokens x {} bytes, not this store's format",
                found.page_size, found.bytes_per_token
            ),
            Invalid::Length { found } => write!(f, "payload of {found} bytes disagrees with the header"),
            Invalid::Seal { found } => write!(f, "page header names seal {found}, which no writer uses"),
            Invalid::Keyed => write!(f, "page is sealed with a MAC and this store has no MAC key"),
            Invalid::NoMac => write!(f, "page carries no MAC and this store requires one"),
            Invalid::Checksum { stored, computed } => {
                write!(f, "checksum {computed:#010x} does not match the stored {stored:#010x}")
            }
            Invalid::Mac => write!(f, "page MAC does not verify under this store's key"),
            Invalid::Foreign { page, store } => {
                let what = match (page, store) {
                    (true, true) => "another page and another namespace, model or salt",
                    (true, false) => "another page",
                    _ => "another namespace, model or salt",
                };
                write!(f, "page was written for {what}")
            }
            Invalid::Reserved { found } => {
                write!(f, "page header's reserved field is {found:#010x}, not zero (another format revision)")
            }
        }
    }
}

/// Check a stored value for the page `hash` under `binding`; its payload (the page's
/// bytes in page-first order) when it is sound: exactly what [`PageHeader::new`] and
/// the payload make for this binding and hash. Allocates nothing; a MAC is compared in
/// constant time.
///
/// # Errors
///
/// [`Invalid`], in the order: length, magic, version, format, payload length, seal
/// kind ([`Invalid::Seal`], [`Invalid::Keyed`], [`Invalid::NoMac`]), seal
/// ([`Invalid::Checksum`] or [`Invalid::Mac`]), key ([`Invalid::Foreign`]), reserved
/// field.
pub fn check_page<'v>(binding: &PageBinding, hash: &BlockHash, value: &'v [u8]) -> Result<&'v [u8], Invalid> {
    let format = binding.format;
    let Some((head, payload)) = value.split_at_checked(HEADER_BYTES) else {
        return Err(Invalid::Truncated { len: value.len() });
    };
    let header: PageHeader = bytemuck::pod_read_unaligned(head);
    if header.magic != PAGE_MAGIC || u32::from_le(header.header_bytes) != HEADER_BYTES as u32 {
        return Err(Invalid::Magic);
    }
    let version = u32::from_le(header.version);
    if version != FORMAT_VERSION {
        return Err(Invalid::Version { found: version });
    }
    let found =
        PageFormat { page_size: u32::from_le(header.page_size), bytes_per_token: u64::from_le(header.bytes_per_token) };
    if found != format {
        return Err(Invalid::Format { found });
    }
    if u64::from_le(header.payload_bytes) != payload.len() as u64 || payload.len() != format.page_bytes() {
        return Err(Invalid::Length { found: payload.len() });
    }
    let seal = u32::from_le(header.seal);
    match (Seal::from_wire(seal), &binding.mac) {
        (None, _) => return Err(Invalid::Seal { found: seal }),
        (Some(Seal::HmacSha256), None) => return Err(Invalid::Keyed),
        (Some(Seal::Crc32), Some(_)) => return Err(Invalid::NoMac),
        (Some(Seal::Crc32), None) => {
            let mut zeroed = header;
            zeroed.tag = [0; 32];
            let computed = crc32(&zeroed, core::iter::once(payload));
            let stored = u32::from_le_bytes([header.tag[0], header.tag[1], header.tag[2], header.tag[3]]);
            if stored != computed || header.tag[4..] != [0; 28] {
                return Err(Invalid::Checksum { stored, computed });
            }
        }
        (Some(Seal::HmacSha256), Some(keyed)) => {
            let mut zeroed = header;
            zeroed.tag = [0; 32];
            let mut mac = keyed.clone();
            mac.update(bytemuck::bytes_of(&zeroed));
            mac.update(payload);
            // `verify_slice` compares in constant time.
            if mac.verify_slice(&header.tag).is_err() {
                return Err(Invalid::Mac);
            }
        }
    }
    // After the seal: a damaged key field is a seal failure; a sound value that names
    // another key was written for that key.
    let (page, store) = (header.page_hash != *hash, header.binding != binding.identity);
    if page || store {
        return Err(Invalid::Foreign { page, store });
    }
    // A sound header that sets the reserved field is another revision's page.
    let reserved = u32::from_le(header.reserved);
    if reserved != 0 {
        return Err(Invalid::Reserved { found: reserved });
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: PageFormat = PageFormat { page_size: 4, bytes_per_token: 6 };

    fn binding() -> PageBinding {
        PageBinding::new("ns", "model", "", F)
    }

    fn keyed(secret: &[u8]) -> PageBinding {
        binding().with_mac(&MacKey::new(secret).unwrap())
    }

    fn value(b: &PageBinding, hash: &BlockHash, payload: &[u8]) -> Vec<u8> {
        let h = PageHeader::new(b, hash, payload.chunks(5));
        [h.as_bytes(), payload].concat()
    }

    #[test]
    fn header_is_136_bytes_without_padding() {
        assert_eq!(HEADER_BYTES, 136);
        assert_eq!(core::mem::align_of::<PageHeader>(), 8);
        let h = PageHeader::new(&binding(), &[1; 32], core::iter::empty());
        let bytes = h.as_bytes();
        assert_eq!((&bytes[..4], &bytes[32..36]), (&PAGE_MAGIC[..], &1u32.to_le_bytes()[..]));
        assert_eq!((&bytes[40..72], &bytes[72..104]), (&[1u8; 32][..], &binding().identity()[..]));
    }

    #[test]
    fn a_sound_page_passes_and_every_damage_is_named() {
        let hash = [7u8; 32];
        let payload: Vec<u8> = (0..24).collect();
        for b in [binding(), keyed(b"sixteen byte key")] {
            let v = value(&b, &hash, &payload);
            assert_eq!(check_page(&b, &hash, &v), Ok(&payload[..]));
            // Any single flipped byte is refused.
            for i in 0..v.len() {
                let mut w = v.clone();
                w[i] ^= 0x10;
                let e = check_page(&b, &hash, &w).unwrap_err();
                assert!(
                    matches!(
                        e,
                        Invalid::Checksum { .. }
                            | Invalid::Mac
                            | Invalid::Magic
                            | Invalid::Version { .. }
                            | Invalid::Format { .. }
                            | Invalid::Length { .. }
                            | Invalid::Seal { .. }
                    ),
                    "{i}: {e:?}"
                );
            }
            let mut w = v.clone();
            w[HEADER_BYTES + 3] ^= 1;
            let e = check_page(&b, &hash, &w).unwrap_err();
            assert!(matches!(e, Invalid::Checksum { .. } | Invalid::Mac), "{e:?}");
            assert_eq!(e.is_corrupt(), b.seal() == Seal::Crc32);
            assert_eq!(e.is_forged(), b.seal() == Seal::HmacSha256);
            assert_eq!(check_page(&b, &hash, &v[..10]), Err(Invalid::Truncated { len: 10 }));
            assert_eq!(check_page(&b, &hash, &v[..v.len() - 1]), Err(Invalid::Length { found: 23 }));
            let other = PageBinding::new("ns", "model", "", PageFormat { page_size: 2, bytes_per_token: 12 });
            let e = check_page(&other, &hash, &v).unwrap_err();
            assert_eq!(e, Invalid::Format { found: F });
            assert!(!e.is_corrupt());
            let mut w = v.clone();
            w[4] = 3;
            assert_eq!(check_page(&b, &hash, &w), Err(Invalid::Version { found: 3 }));
            assert_eq!(check_page(&b, &hash, &[0u8; 200]), Err(Invalid::Magic));
            let mut w = v.clone();
            w[32] = 9;
            let e = check_page(&b, &hash, &w).unwrap_err();
            assert_eq!(e, Invalid::Seal { found: 9 });
            assert!(e.is_corrupt());
        }
    }

    /// A value is bound to its page hash and to the namespace, model id and salt of the
    /// store that wrote it: under any other key it is refused as foreign, whichever
    /// part differs, and for a MAC store too.
    #[test]
    fn a_value_under_another_key_is_foreign() {
        let hash = [3u8; 32];
        let payload: Vec<u8> = (100..124).collect();
        let key = MacKey::new(*b"a key of 32 bytes, for the tests").unwrap();
        for mac in [None, Some(&key)] {
            let bind = |ns: &str, model: &str, salt: &str| {
                let b = PageBinding::new(ns, model, salt, F);
                mac.map_or(b.clone(), |k| b.with_mac(k))
            };
            let a = bind("ns", "a", "");
            let v = value(&a, &hash, &payload);
            assert_eq!(check_page(&a, &hash, &v), Ok(&payload[..]));
            // Another page of the same store.
            let e = check_page(&a, &[4u8; 32], &v).unwrap_err();
            assert_eq!(e, Invalid::Foreign { page: true, store: false });
            assert!(e.is_foreign() && !e.is_corrupt() && !e.is_forged());
            // The same page of another model, namespace or salt; parts that join alike.
            for other in [
                bind("ns", "b", ""),
                bind("other", "a", ""),
                bind("ns", "a", "tenant-2"),
                bind("nsa", "", ""),
                bind("n", "sa", ""),
                bind("ns", "", "a"),
            ] {
                assert_ne!(other.identity(), a.identity());
                assert_eq!(check_page(&other, &hash, &v), Err(Invalid::Foreign { page: false, store: true }));
                assert_eq!(check_page(&other, &[4u8; 32], &v), Err(Invalid::Foreign { page: true, store: true }));
            }
            assert_eq!(bind("ns", "a", "").identity(), a.identity());
            assert!(e.to_string().contains("another page"), "{e}");
        }
    }

    /// A store with a MAC key refuses values without a MAC and values whose MAC is not
    /// its key's, whatever their CRC; a store without a key refuses MAC values.
    #[test]
    fn a_mac_store_refuses_values_not_sealed_with_its_key() {
        let hash = [9u8; 32];
        let payload: Vec<u8> = (0..24).map(|i| i * 3).collect();
        let crc = binding();
        let mac = keyed(b"the right key, sixteen bytes+");
        let other = keyed(b"another key of sixteen bytes");
        let by_crc = value(&crc, &hash, &payload);
        let by_mac = value(&mac, &hash, &payload);
        assert_eq!(check_page(&mac, &hash, &by_mac), Ok(&payload[..]));
        let e = check_page(&mac, &hash, &by_crc).unwrap_err();
        assert_eq!(e, Invalid::NoMac);
        assert!(e.is_forged() && !e.is_corrupt());
        assert_eq!(check_page(&other, &hash, &by_mac), Err(Invalid::Mac));
        let e = check_page(&crc, &hash, &by_mac).unwrap_err();
        assert_eq!(e, Invalid::Keyed);
        assert!(!e.is_corrupt() && !e.is_forged() && !e.is_foreign());
        // A forger without the key: a CRC value relabelled as sealed, with the CRC in
        // the tag or any tag at all; a MAC value with a changed payload.
        let mut forged = by_crc.clone();
        forged[32..36].copy_from_slice(&(Seal::HmacSha256 as u32).to_le_bytes());
        assert_eq!(check_page(&mac, &hash, &forged), Err(Invalid::Mac));
        forged[104..136].fill(0xa5);
        assert_eq!(check_page(&mac, &hash, &forged), Err(Invalid::Mac));
        let mut changed = by_mac.clone();
        changed[HEADER_BYTES] ^= 1;
        assert_eq!(check_page(&mac, &hash, &changed), Err(Invalid::Mac));
        // A MAC is the full HMAC-SHA-256 of the header (tag zero) and payload.
        let mut h: PageHeader = bytemuck::pod_read_unaligned(&by_mac[..HEADER_BYTES]);
        let tag = h.tag;
        h.tag = [0; 32];
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(b"the right key, sixteen bytes+").unwrap();
        m.update(h.as_bytes());
        m.update(&payload);
        assert_eq!(&m.finalize().into_bytes()[..], &tag[..]);
        // Short keys are refused; the Debug output does not show the key.
        assert!(matches!(MacKey::new(*b"fifteen bytes.."), Err(StoreError::Config { .. })));
        let k = MacKey::new(*b"secret-secret-secret").unwrap();
        assert!(!format!("{k:?} {mac:?}").contains("secret"));
    }

    /// `PageHeader::reserved` must be zero: a header that sets it, under a checksum
    /// that matches, is refused as `Invalid::Reserved` (counted as a mismatch, not as
    /// damage). A flipped bit in the field is still a checksum failure.
    #[test]
    fn a_nonzero_reserved_field_is_refused() {
        let hash = [5u8; 32];
        let payload: Vec<u8> = (0..24).collect();
        let b = binding();
        let mut h = PageHeader::new(&b, &hash, core::iter::once(&payload[..]));
        h.reserved = 7u32.to_le();
        let damaged = [h.as_bytes(), &payload[..]].concat();
        assert!(matches!(check_page(&b, &hash, &damaged), Err(Invalid::Checksum { .. })));
        h.tag = b.tag(&h, core::iter::once(&payload[..]));
        let v = [h.as_bytes(), &payload[..]].concat();
        let e = check_page(&b, &hash, &v).unwrap_err();
        assert_eq!(e, Invalid::Reserved { found: 7 });
        assert!(!e.is_corrupt());
        assert!(e.to_string().contains("reserved"), "{e}");
        // The checksum is computed independently of `tag()` too, and the CRC tag's
        // last 28 bytes are zero (a value that sets them is refused).
        let mut crc = crc32fast::Hasher::new();
        let mut zeroed = h;
        zeroed.tag = [0; 32];
        crc.update(zeroed.as_bytes());
        crc.update(&payload);
        assert_eq!(h.tag[..4], crc.finalize().to_le_bytes());
        assert_eq!(h.tag[4..], [0; 28]);
        let mut w = v.clone();
        w[HEADER_BYTES - 1] = 1;
        assert!(matches!(check_page(&b, &hash, &w), Err(Invalid::Checksum { .. })));
    }
}
