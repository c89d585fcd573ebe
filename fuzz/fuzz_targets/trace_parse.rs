//! The trace reader (`kvpool::replay::Trace::from_reader`) on arbitrary bytes: plain
//! JSON lines, or gzip of them (detected by the magic bytes). It must return `Ok` or a
//! typed `TraceError`, never panic, and a trace it accepts must keep the bounds the
//! module documents (hash ids, renumbered or not; output ids and KV counts in 32 bits;
//! blocks reached by the prompt), so that expanding any request's tokens is in range.
//!
//! Differential check: a plain input is also wrapped, by hand, in two gzip members of
//! stored (uncompressed) deflate blocks; the gzip path must give exactly the same
//! trace, or an error of the same kind on the same line.
//!
//! Line limit: the input is also read with lines of at most a third of its length. Up to
//! the first line over that limit the reader must do exactly as without it: the same
//! trace, or the same error, unless it stops at such a line (`LineTooLong`), in which
//! case the unlimited reader finds no fault on an earlier line (but a blank line).
#![no_main]

use kvpool::replay::{
    output_token, prompt_token, Trace, TraceError, TraceErrorKind, BLOCK_TOKENS, MAX_HASH_ID, MAX_OUTPUT_LEN,
    MAX_REQUESTS, OUTPUT_TOKEN_BASE,
};
use libfuzzer_sys::fuzz_target;

/// Tokens expanded and checked per input at most (the rest of the requests get the
/// O(1) checks only).
const MAX_EXPANDED_TOKENS: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let plain = Trace::from_reader(data, "fuzz");
    match &plain {
        Ok(trace) => check_trace(trace),
        Err(e) => check_error(e),
    }
    let limit = data.len() / 3;
    let limited = Trace::from_reader_with_line_limit(data, "fuzz", limit);
    match (&plain, &limited) {
        (Ok(p), Ok(l)) => same_trace(p, l, "the line limit"),
        (_, Err(l)) if matches!(l.kind, TraceErrorKind::LineTooLong { .. }) => {
            assert!(l.line.is_some(), "no line in {l}");
            if let Err(p) = &plain {
                // (A blank line is a fault only once a request follows it, which the
                // reader did not see.)
                let later = p.line.map_or(true, |line| Some(line) >= l.line);
                assert!(
                    later || matches!(p.kind, TraceErrorKind::BlankLine),
                    "the limit hid an earlier error: {p} / {l}"
                );
            }
        }
        (Err(p), Err(l)) => same_error(p, l, "the line limit"),
        (p, l) => panic!(
            "the line limit changed the outcome: {:?} / {:?}",
            p.as_ref().map(Trace::len),
            l.as_ref().map(Trace::len)
        ),
    }
    if !data.starts_with(&[0x1f, 0x8b]) {
        let (a, b) = data.split_at(data.len() / 2);
        let mut gz = Vec::with_capacity(data.len() + 64);
        gzip_stored(a, &mut gz);
        gzip_stored(b, &mut gz);
        let zipped = Trace::from_reader(&gz[..], "fuzz");
        match (&plain, &zipped) {
            (Ok(p), Ok(z)) => same_trace(p, z, "gzip"),
            (Err(p), Err(z)) => same_error(p, z, "gzip"),
            (p, z) => {
                panic!("plain and gzip disagree: {:?} / {:?}", p.as_ref().map(Trace::len), z.as_ref().map(Trace::len))
            }
        }
    }
});

fn same_trace(a: &Trace, b: &Trace, what: &str) {
    assert_eq!(a.requests(), b.requests(), "{what} changed the requests");
    for r in 0..a.len() {
        assert_eq!(a.hash_ids(r), b.hash_ids(r), "{what} changed request {r}'s hash ids");
    }
}

fn same_error(a: &TraceError, b: &TraceError, what: &str) {
    assert_eq!(a.line, b.line, "{what} moved the error: {a} / {b}");
    assert_eq!(std::mem::discriminant(&a.kind), std::mem::discriminant(&b.kind), "{what} changed the error: {a} / {b}");
}

fn check_error(e: &TraceError) {
    // The message must render (it names the source and the line), and a line is 1-based.
    let _ = e.to_string();
    assert!(e.line != Some(0), "line 0 in {e}");
}

fn check_trace(trace: &Trace) {
    assert!(!trace.is_empty() && trace.len() <= MAX_REQUESTS);
    let mut budget = MAX_EXPANDED_TOKENS;
    let mut tokens = Vec::new();
    let (mut input, mut output) = (0u64, 0u64);
    for r in 0..trace.len() {
        let q = trace.request(r);
        let ids = trace.hash_ids(r);
        let (len, out_len) = (q.input_length as usize, q.output_length as usize);
        input += len as u64;
        output += out_len as u64;
        assert_eq!(ids.len(), len.div_ceil(BLOCK_TOKENS as usize), "request {r}: blocks kept");
        assert!(ids.iter().all(|&h| h as u64 <= MAX_HASH_ID), "request {r}: hash id out of range");
        assert!(r as u64 * MAX_OUTPUT_LEN as u64 + out_len as u64 <= 1 << 31, "request {r}: output ids past u32::MAX");
        assert!(q.kv_len() <= u32::MAX as usize, "request {r}: KV tokens past u32");
        assert_eq!(q.kv_len(), len + out_len.max(1) - 1);
        if len > 0 {
            assert!(prompt_token(ids, len - 1) < OUTPUT_TOKEN_BASE);
        }
        if q.kv_len() <= budget {
            budget -= q.kv_len();
            tokens.clear();
            tokens.resize(q.kv_len(), 0);
            trace.write_kv_tokens(r, &mut tokens);
            for (p, &t) in tokens.iter().enumerate() {
                let want = if p < len { prompt_token(ids, p) } else { output_token(r, p - len) };
                assert_eq!(t, want, "request {r}, token {p}");
                assert_eq!(t < OUTPUT_TOKEN_BASE, p < len, "request {r}, token {p}: prompt and output ids overlap");
            }
        }
    }
    if trace.renumbered() {
        // 0, 1, 2, ... in order of first appearance.
        let mut next = 0u32;
        for r in 0..trace.len() {
            for &h in trace.hash_ids(r) {
                assert!(h <= next, "request {r}: renumbered id {h} before {next}");
                next = next.max(h + 1);
            }
        }
    }
    assert_eq!(trace.total_input_tokens(), input);
    assert_eq!(trace.total_output_tokens(), output);
}

/// Append one gzip member holding `data` in stored deflate blocks (RFC 1951/1952).
fn gzip_stored(data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]);
    let mut chunks = data.chunks(0xffff).peekable();
    if chunks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]); // one empty final block
    }
    while let Some(chunk) = chunks.next() {
        out.push(chunks.peek().is_none() as u8); // BFINAL, BTYPE = 00 (stored)
        let len = chunk.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(chunk);
    }
    let mut crc = flate2::Crc::new();
    crc.update(data);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
}
