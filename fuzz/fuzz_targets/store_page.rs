//! The shared store tier's page check (`kvpool::store::check_page`) on arbitrary bytes:
//! what a store returns is untrusted. It must return the payload or a typed `Invalid`,
//! never panic; a value it accepts must be exactly what the writer produces for that
//! binding (namespace, model id, salt, format, seal), hash and payload (header then
//! payload), so nothing but a sound page of the reader's own key is ever loaded.
//!
//! Differential check: a page the writer built from the input (its hash, a binding and
//! a payload taken from the input, sealed with CRC-32 or HMAC-SHA-256) is accepted with
//! its payload, and the same page with any one byte changed (position and new value
//! from the input) is refused; so is the page checked under another hash, under
//! another model, namespace or salt (foreign), under the other seal, or under another
//! MAC key; and, for a reader with a MAC key, a value with a correct CRC relabelled as
//! sealed.
#![no_main]

use kvpool::radix::BlockHash;
use kvpool::store::{check_page, Invalid, MacKey, PageBinding, PageFormat, PageHeader, Seal, HEADER_BYTES};
use libfuzzer_sys::fuzz_target;

fn value_of(binding: &PageBinding, hash: &BlockHash, payload: &[u8]) -> Vec<u8> {
    let header = PageHeader::new(binding, hash, core::iter::once(payload));
    let mut v = header.as_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

fn binding(namespace: &str, model: &str, salt: &str, format: PageFormat, key: Option<&MacKey>) -> PageBinding {
    let b = PageBinding::new(namespace, model, salt, format);
    match key {
        Some(k) => b.with_mac(k),
        None => b,
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 37 {
        return;
    }
    let mut hash: BlockHash = [0; 32];
    hash.copy_from_slice(&data[..32]);
    let format =
        PageFormat { page_size: [1, 2, 4, 16][data[32] as usize % 4], bytes_per_token: 1 + u64::from(data[33] % 8) };
    let (at, flip) = (u16::from_le_bytes([data[34], data[35]]) as usize, data.get(37).copied().unwrap_or(1));
    // Which binding reads: a MAC key or none, and one of two models and salts.
    let pick = data[36];
    let key = MacKey::new(*b"the fuzz target's MAC key, 32 B.").unwrap();
    let other_key = MacKey::new(*b"another MAC key of thirty-two B.").unwrap();
    let mac = (pick & 1 == 1).then_some(&key);
    let model = ["m", "n"][usize::from(pick >> 1 & 1)];
    let salt = ["", "s"][usize::from(pick >> 2 & 1)];
    let reader = binding("ns", model, salt, format, mac);
    let rest = &data[37..];

    // Arbitrary bytes as a stored value.
    match check_page(&reader, &hash, rest) {
        Ok(payload) => {
            assert_eq!(payload.len(), format.page_bytes(), "accepted payload of the wrong length");
            assert_eq!(value_of(&reader, &hash, payload), rest, "accepted a value the writer would not produce");
        }
        Err(e) => {
            let _ = (e.is_corrupt(), e.is_foreign(), e.is_forged(), e.to_string());
        }
    }

    // A sound page, then the same page with one byte changed or under another key.
    let payload: Vec<u8> = rest.iter().copied().cycle().take(format.page_bytes()).collect();
    if payload.len() != format.page_bytes() {
        return;
    }
    let value = value_of(&reader, &hash, &payload);
    assert_eq!(value.len(), HEADER_BYTES + payload.len());
    assert_eq!(check_page(&reader, &hash, &value), Ok(&payload[..]), "a sound page refused");
    let mut other = hash;
    other[0] ^= 1;
    assert_eq!(
        check_page(&reader, &other, &value),
        Err(Invalid::Foreign { page: true, store: false }),
        "a page accepted under another hash"
    );
    for foreign in [
        binding("ns", ["n", "m"][usize::from(pick >> 1 & 1)], salt, format, mac),
        binding("ns", model, ["s", ""][usize::from(pick >> 2 & 1)], format, mac),
        binding("other", model, salt, format, mac),
        binding("ns", "", &format!("{model}{salt}"), format, mac),
    ] {
        let e = check_page(&foreign, &hash, &value).unwrap_err();
        assert_eq!(e, Invalid::Foreign { page: false, store: true }, "a page accepted under another key");
    }
    let unkeyed = binding("ns", model, salt, format, None);
    let keyed = binding("ns", model, salt, format, Some(&key));
    let other_keyed = binding("ns", model, salt, format, Some(&other_key));
    match mac {
        Some(_) => {
            assert_eq!(check_page(&unkeyed, &hash, &value), Err(Invalid::Keyed));
            assert_eq!(check_page(&other_keyed, &hash, &value), Err(Invalid::Mac), "another key's MAC accepted");
        }
        None => {
            assert_eq!(check_page(&keyed, &hash, &value), Err(Invalid::NoMac), "a CRC value accepted by a MAC reader");
            // A forger without the key: the sound CRC value labelled as sealed.
            let mut forged = value.clone();
            forged[32..36].copy_from_slice(&(Seal::HmacSha256 as u32).to_le_bytes());
            assert_eq!(check_page(&keyed, &hash, &forged), Err(Invalid::Mac), "a forged MAC accepted");
        }
    }
    let mut bad = value.clone();
    let i = at % bad.len();
    bad[i] ^= flip.max(1);
    assert!(check_page(&reader, &hash, &bad).is_err(), "a page with byte {i} changed was accepted");
    assert!(check_page(&reader, &hash, &value[..value.len() - 1]).is_err(), "a truncated page was accepted");
});
