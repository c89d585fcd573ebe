//! The stored page format: a [`PageHeader`] followed by the page's bytes in page-first
//! order, checked on every read.

use core::fmt;

use bytemuck::{Pod, Zeroable};

use crate::kv::host::HostKvConfig;
use crate::radix::BlockHash;

/// The first four bytes of every stored page.
pub const PAGE_MAGIC: [u8; 4] = *b"KVPG";

/// The page format version this build writes and accepts.
pub const FORMAT_VERSION: u32 = 1;

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

/// The header in front of every stored page. Integers are little-endian on the wire
/// (the constructor and [`check_page`] convert, so the cast is right on any host).
///
/// The checksum is CRC-32 (`crc32fast`) over the page hash's 32 bytes, then this header
/// with `checksum` zero, then the payload: a value stored under the wrong key, a changed
/// header field or a flipped payload byte all fail it.
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
    /// The CRC-32 described above.
    pub checksum: u32,
    /// Zero ([`check_page`] refuses anything else: [`Invalid::Reserved`]).
    pub reserved: u32,
}

impl PageHeader {
    /// The header of a page of `format` under `hash` whose payload is the concatenation of
    /// `payload` (the pieces are hashed in order; nothing is copied).
    pub fn new<'a>(hash: &BlockHash, format: PageFormat, payload: impl Iterator<Item = &'a [u8]>) -> PageHeader {
        let mut h = PageHeader {
            magic: PAGE_MAGIC,
            version: FORMAT_VERSION.to_le(),
            page_size: format.page_size.to_le(),
            header_bytes: (HEADER_BYTES as u32).to_le(),
            bytes_per_token: format.bytes_per_token.to_le(),
            payload_bytes: (format.page_bytes() as u64).to_le(),
            checksum: 0,
            reserved: 0,
        };
        h.checksum = checksum(hash, &h, payload).to_le();
        h
    }

    /// The header's bytes as they go on the wire.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }
}

fn checksum<'a>(hash: &BlockHash, header: &PageHeader, payload: impl Iterator<Item = &'a [u8]>) -> u32 {
    let mut zeroed = *header;
    zeroed.checksum = 0;
    let mut crc = crc32fast::Hasher::new();
    crc.update(hash);
    crc.update(bytemuck::bytes_of(&zeroed));
    payload.for_each(|piece| crc.update(piece));
    crc.finalize()
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
    /// The checksum does not match: the bytes were changed (or the value sits under
    /// another page's key).
    Checksum {
        /// The checksum in the header.
        stored: u32,
        /// The checksum of what was read.
        computed: u32,
    },
    /// The header's reserved field is not zero, under a matching checksum: written so
    /// on purpose, by a writer of another revision of the format (a damaged field fails
    /// the checksum first).
    Reserved {
        /// The field's value.
        found: u32,
    },
}

impl Invalid {
    /// Whether the value is damaged (truncated, not a page, wrong length or checksum),
    /// as opposed to a well-formed page of another version, revision or format.
    pub fn is_corrupt(&self) -> bool {
        !matches!(self, Invalid::Version { .. } | Invalid::Format { .. } | Invalid::Reserved { .. })
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
            Invalid::Checksum { stored, computed } => {
                write!(f, "checksum {computed:#010x} does not match the stored {stored:#010x}")
            }
            Invalid::Reserved { found } => {
                write!(f, "page header's reserved field is {found:#010x}, not zero (another format revision)")
            }
        }
    }
}

/// Check a stored value for the page `hash` of `format`; its payload (the page's bytes in
/// page-first order) when it is sound. Allocates nothing.
///
/// # Errors
///
/// [`Invalid`], in the order: length, magic, version, format, payload length, checksum,
/// reserved field.
pub fn check_page<'v>(hash: &BlockHash, format: PageFormat, value: &'v [u8]) -> Result<&'v [u8], Invalid> {
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
    let stored = u32::from_le(header.checksum);
    let computed = checksum(hash, &header, core::iter::once(payload));
    if stored != computed {
        return Err(Invalid::Checksum { stored, computed });
    }
    // After the checksum: a flipped bit here is damage (`Checksum`), a sound header
    // that sets the field is another revision's page.
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

    fn value(hash: &BlockHash, format: PageFormat, payload: &[u8]) -> Vec<u8> {
        let h = PageHeader::new(hash, format, payload.chunks(5));
        [h.as_bytes(), payload].concat()
    }

    #[test]
    fn header_is_forty_bytes_without_padding() {
        assert_eq!(HEADER_BYTES, 40);
        assert_eq!(core::mem::align_of::<PageHeader>(), 8);
    }

    #[test]
    fn a_sound_page_passes_and_every_damage_is_named() {
        let hash = [7u8; 32];
        let payload: Vec<u8> = (0..24).collect();
        let v = value(&hash, F, &payload);
        assert_eq!(check_page(&hash, F, &v), Ok(&payload[..]));
        // Any single flipped byte is refused.
        for i in 0..v.len() {
            let mut w = v.clone();
            w[i] ^= 0x10;
            let e = check_page(&hash, F, &w).unwrap_err();
            assert!(
                matches!(
                    e,
                    Invalid::Checksum { .. }
                        | Invalid::Magic
                        | Invalid::Version { .. }
                        | Invalid::Format { .. }
                        | Invalid::Length { .. }
                ),
                "{i}: {e:?}"
            );
        }
        let mut w = v.clone();
        w[HEADER_BYTES + 3] ^= 1;
        assert!(matches!(check_page(&hash, F, &w), Err(Invalid::Checksum { .. })));
        assert!(check_page(&hash, F, &w).unwrap_err().is_corrupt());
        // Under another page's key.
        assert!(matches!(check_page(&[8u8; 32], F, &v), Err(Invalid::Checksum { .. })));
        assert_eq!(check_page(&hash, F, &v[..10]), Err(Invalid::Truncated { len: 10 }));
        assert_eq!(check_page(&hash, F, &v[..v.len() - 1]), Err(Invalid::Length { found: 23 }));
        let other = PageFormat { page_size: 2, bytes_per_token: 12 };
        let e = check_page(&hash, other, &v).unwrap_err();
        assert_eq!(e, Invalid::Format { found: F });
        assert!(!e.is_corrupt());
        let mut w = v.clone();
        w[4] = 2;
        assert_eq!(check_page(&hash, F, &w), Err(Invalid::Version { found: 2 }));
        assert_eq!(check_page(&hash, F, &[0u8; 64]), Err(Invalid::Magic));
    }

    /// `PageHeader::reserved` must be zero: a header that sets it, under a checksum
    /// that matches, is refused as `Invalid::Reserved` (counted as a mismatch, not as
    /// damage); it used to be accepted as a sound page. A flipped bit in the field is
    /// still a checksum failure.
    #[test]
    fn a_nonzero_reserved_field_is_refused() {
        let hash = [5u8; 32];
        let payload: Vec<u8> = (0..24).collect();
        let mut h = PageHeader::new(&hash, F, core::iter::once(&payload[..]));
        h.reserved = 7u32.to_le();
        let damaged = [h.as_bytes(), &payload[..]].concat();
        assert!(matches!(check_page(&hash, F, &damaged), Err(Invalid::Checksum { .. })));
        h.checksum = checksum(&hash, &h, core::iter::once(&payload[..])).to_le();
        let v = [h.as_bytes(), &payload[..]].concat();
        let e = check_page(&hash, F, &v).unwrap_err();
        assert_eq!(e, Invalid::Reserved { found: 7 });
        assert!(!e.is_corrupt());
        assert!(e.to_string().contains("reserved"), "{e}");
        // The checksum is computed independently of `checksum()` too.
        let mut crc = crc32fast::Hasher::new();
        crc.update(&hash);
        let mut zeroed = h;
        zeroed.checksum = 0;
        crc.update(zeroed.as_bytes());
        crc.update(&payload);
        assert_eq!(u32::from_le(h.checksum), crc.finalize());
    }
}
