//! The shared store tier's page check (`kvpool::store::check_page`) on arbitrary bytes:
//! what a store returns is untrusted. It must return the payload or a typed `Invalid`,
//! never panic; a value it accepts must be exactly what the writer produces for that
//! hash, format and payload (header then payload), so nothing but a sound page is ever
//! loaded.
//!
//! Differential check: a page the writer built from the input (its hash, a format and a
//! payload taken from the input) is accepted with its payload, and the same page with
//! any one byte changed (position and new value from the input) is refused; a page
//! checked under another hash is refused.
#![no_main]

use kvpool::radix::BlockHash;
use kvpool::store::{check_page, PageFormat, PageHeader, HEADER_BYTES};
use libfuzzer_sys::fuzz_target;

fn value_of(hash: &BlockHash, format: PageFormat, payload: &[u8]) -> Vec<u8> {
    let header = PageHeader::new(hash, format, core::iter::once(payload));
    let mut v = header.as_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 36 {
        return;
    }
    let mut hash: BlockHash = [0; 32];
    hash.copy_from_slice(&data[..32]);
    let format =
        PageFormat { page_size: [1, 2, 4, 16][data[32] as usize % 4], bytes_per_token: 1 + u64::from(data[33] % 8) };
    let (at, flip) = (u16::from_le_bytes([data[34], data[35]]) as usize, data.get(36).copied().unwrap_or(1));
    let rest = &data[36.min(data.len())..];

    // Arbitrary bytes as a stored value.
    match check_page(&hash, format, rest) {
        Ok(payload) => {
            assert_eq!(payload.len(), format.page_bytes(), "accepted payload of the wrong length");
            assert_eq!(value_of(&hash, format, payload), rest, "accepted a value the writer would not produce");
        }
        Err(e) => {
            let _ = (e.is_corrupt(), e.to_string());
        }
    }

    // A sound page, then the same page with one byte changed.
    let payload: Vec<u8> = rest.iter().copied().cycle().take(format.page_bytes()).collect();
    if payload.len() != format.page_bytes() {
        return;
    }
    let value = value_of(&hash, format, &payload);
    assert_eq!(value.len(), HEADER_BYTES + payload.len());
    assert_eq!(check_page(&hash, format, &value), Ok(&payload[..]), "a sound page refused");
    let mut other = hash;
    other[0] ^= 1;
    assert!(check_page(&other, format, &value).is_err(), "a page accepted under another hash");
    let mut bad = value.clone();
    let i = at % bad.len();
    bad[i] ^= flip.max(1);
    assert!(check_page(&hash, format, &bad).is_err(), "a page with byte {i} changed was accepted");
    assert!(check_page(&hash, format, &value[..value.len() - 1]).is_err(), "a truncated page was accepted");
});
