//! Request traces: loading, validation and token expansion.
//!
//! A trace is a JSON-lines file in the format of the Mooncake traces: one request a
//! line, `{"timestamp": ms, "input_length": L, "output_length": O, "hash_ids": [..]}`,
//! where each hash id stands for one 512-token block of the prompt. Token ids are not
//! in the file; they are expanded deterministically, so every implementation replays
//! exactly the same tokens (issue 5):
//!
//! * request `r` is the request on line `r + 1` (0-based line number `r`);
//! * prompt token `p < L` is `h_(p/512) * 512 + p % 512`;
//! * output token `j < O` is `2^31 + r * 2048 + j`.
//!
//! Prompt tokens stay below `2^31` and output tokens at or above it. An output longer
//! than 2048 tokens runs into the next requests' ids, which is harmless: two requests
//! share a path in a prefix tree only up to the shorter prompt's end, since there one
//! of them holds its first output token, which no other request holds at that
//! position (the other holds a prompt token below `2^31`, or its own first output
//! token, which differs). So the one bound on outputs is that the ids stay in `u32`:
//! `r * 2048 + O <= 2^31`, which leaves a trace of 100,000 requests outputs of up to
//! 1.9 G tokens; a request's KV tokens (`L + O - 1`) must fit in `u32` too.
//!
//! Hash ids stand only for block identities. When every id the prompts reach is at most
//! [`MAX_HASH_ID`] (`2^22 - 1`; true of the Mooncake traces, whose ids count up from 0),
//! they are used as they are, so every implementation replays the same tokens. A trace
//! with a larger id (64-bit content hashes, say) is renumbered instead: its ids become
//! 0, 1, 2, ... in order of first appearance, equal ids staying equal, which keeps every
//! hit and eviction of the replay; [`Trace::renumbered`] tells which happened. At most
//! `2^22` distinct ids (2 G prompt tokens) then. Any other bound a line breaks, or an
//! `input_length` above `512 * len(hash_ids)`, is an input error naming the line; at
//! most `2^20` requests.
//!
//! A line holds at most [`MAX_LINE_BYTES`] bytes (256 MiB, its newline not counted): the
//! reader streams each line through the JSON parser and stops with an error naming the
//! line as soon as it has seen more than that, whatever the rest of the line or file
//! holds, so no line costs more than that much memory. The longest line a replay can use,
//! a prompt of [`MAX_INPUT_LEN`] tokens (8,388,604 blocks) with 20-digit ids separated by
//! `", "`, takes 185 MB; a longer line can still be valid JSON, but only padding makes it
//! so (whitespace, unknown fields, hash ids past the prompt's blocks), and it is refused.
//!
//! A request keeps only the hash ids its prompt reaches, `ceil(L / 512)` of them. The
//! others are read (each must still be an unsigned 64-bit integer) and counted, for the
//! `input_length <= 512 * len(hash_ids)` check, but never stored; where `hash_ids` comes
//! before `input_length` in a line, the first `ceil(MAX_INPUT_LEN / 512)` ids (64 MiB at
//! most) are held until the line says how many are used. So a trace takes memory in
//! proportion to the ids its prompts use, however long its lines.

use std::fmt;
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::path::Path;

use rustc_hash::FxHashMap;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// Tokens per hash block.
pub const BLOCK_TOKENS: u32 = 512;
/// The first output token id: `2^31`.
pub const OUTPUT_TOKEN_BASE: u32 = 1 << 31;
/// The step between two requests' first output ids (`output_length` may exceed it:
/// the module docs say why that is harmless).
pub const MAX_OUTPUT_LEN: u32 = 2048;
/// The longest prompt a trace may hold: a request's KV tokens (prompt and outputs) are
/// counted in `u32`, as KV slots are.
pub const MAX_INPUT_LEN: u32 = u32::MAX - MAX_OUTPUT_LEN;
/// The largest hash id whose tokens stay below [`OUTPUT_TOKEN_BASE`]: a trace whose ids
/// all stay at or below it keeps them; one with a larger id is renumbered (module docs).
pub const MAX_HASH_ID: u64 = (OUTPUT_TOKEN_BASE / BLOCK_TOKENS) as u64 - 1;
/// The most requests a trace may hold (their output ids must fit in a `u32`).
pub const MAX_REQUESTS: usize = ((u32::MAX - OUTPUT_TOKEN_BASE) / MAX_OUTPUT_LEN + 1) as usize;
/// The longest line a trace may hold, in bytes, its newline not counted: 256 MiB. A
/// longer line is an error naming it ([`TraceErrorKind::LineTooLong`]); the module docs
/// say why every line a replay can use fits.
pub const MAX_LINE_BYTES: usize = 256 << 20;

/// The most hash ids a prompt can reach: `ceil(MAX_INPUT_LEN / 512)`.
const MAX_USED_BLOCKS: usize = (MAX_INPUT_LEN as usize).div_ceil(BLOCK_TOKENS as usize);

/// The Mooncake conversation trace, bundled with the crate (gzip; see `data/README.md`).
static BUNDLED_TRACE_GZ: &[u8] = include_bytes!("../../data/mooncake_conversation_trace.jsonl.gz");

/// The name [`Trace::bundled`] reports as its source.
pub const BUNDLED_TRACE_NAME: &str = "mooncake_conversation_trace.jsonl (bundled)";

/// Prompt token `p` of a request whose blocks are `hash_ids` (`p < 512 * hash_ids.len()`).
///
/// # Examples
///
/// ```
/// use kvpool::replay::prompt_token;
/// assert_eq!(prompt_token(&[7, 3], 0), 7 * 512);
/// assert_eq!(prompt_token(&[7, 3], 513), 3 * 512 + 1);
/// ```
///
/// # Panics
///
/// If `p` lies past the last block (the loader guarantees it does not for a
/// [`Trace`]'s requests).
#[inline]
pub fn prompt_token(hash_ids: &[u32], p: usize) -> u32 {
    hash_ids[p / BLOCK_TOKENS as usize] * BLOCK_TOKENS + (p % BLOCK_TOKENS as usize) as u32
}

/// Output token `j` of request `r`: `2^31 + r * 2048 + j`.
///
/// # Examples
///
/// ```
/// use kvpool::replay::output_token;
/// assert_eq!(output_token(0, 0), 1 << 31);
/// assert_eq!(output_token(2, 5), (1 << 31) + 2 * 2048 + 5);
/// ```
#[inline]
pub fn output_token(r: usize, j: usize) -> u32 {
    OUTPUT_TOKEN_BASE + r as u32 * MAX_OUTPUT_LEN + j as u32
}

/// One request of a [`Trace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival time in milliseconds (not used by the replay, which runs as fast as it can).
    pub timestamp_ms: u64,
    /// Prompt tokens `L`.
    pub input_length: u32,
    /// Generated tokens `O`.
    pub output_length: u32,
    hash_start: u32,
    hash_len: u32,
}

impl TraceRequest {
    /// Tokens whose KV the request ends up holding: the prompt plus the outputs minus
    /// the last generated token (whose KV is never written), `L + max(O, 1) - 1`.
    #[inline]
    pub fn kv_len(&self) -> usize {
        self.input_length as usize + self.output_length.saturating_sub(1) as usize
    }
}

/// A loaded, validated trace.
///
/// # Examples
///
/// ```
/// use kvpool::replay::Trace;
///
/// let text = r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [5, 9]}"#;
/// let trace = Trace::from_jsonl_str(text, "inline")?;
/// assert_eq!(trace.len(), 1);
/// let mut tokens = vec![0; trace.request(0).kv_len()];
/// trace.write_kv_tokens(0, &mut tokens);
/// assert_eq!(tokens.len(), 602);
/// assert_eq!(&tokens[510..514], &[5 * 512 + 510, 5 * 512 + 511, 9 * 512, 9 * 512 + 1]);
/// assert_eq!(&tokens[600..], &[1 << 31, (1 << 31) + 1]);
/// # Ok::<(), kvpool::replay::TraceError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Trace {
    requests: Vec<TraceRequest>,
    hash_ids: Vec<u32>,
    source: String,
    /// Whether the hash ids were renumbered (module docs).
    renumbered: bool,
}

/// Why a trace could not be loaded. Its message names the source and, for a bad line,
/// the 1-based line number.
#[derive(Debug)]
pub struct TraceError {
    /// Where the trace came from (a path, or a name given by the caller).
    pub source: String,
    /// The 1-based line, when one line is at fault.
    pub line: Option<usize>,
    /// What is wrong.
    pub kind: TraceErrorKind,
}

/// What is wrong with a trace.
#[derive(Debug)]
#[non_exhaustive]
pub enum TraceErrorKind {
    /// The file could not be opened or read.
    Io(std::io::Error),
    /// A line is not a JSON object with the expected fields.
    Json(serde_json::Error),
    /// A line holds JSON that is not an object (an array, a number, ...).
    NotAnObject {
        /// What it holds instead ("a JSON array", ...).
        found: &'static str,
    },
    /// The gzip stream is corrupt or truncated.
    Gzip {
        /// Lines of decompressed text read before the error.
        lines_read: usize,
        /// The decoder's error.
        error: std::io::Error,
    },
    /// `input_length` above [`MAX_INPUT_LEN`].
    InputTooLong {
        /// The line's `input_length`.
        input_length: u64,
    },
    /// A blank line before the last request (the line number is the request's id).
    BlankLine,
    /// `input_length > 512 * len(hash_ids)`.
    PromptLongerThanBlocks {
        /// The line's `input_length`.
        input_length: u64,
        /// Its number of hash ids.
        blocks: usize,
    },
    /// More than `2^22` distinct hash ids in a trace that has to be renumbered (module
    /// docs), so that prompt tokens would not stay below `2^31`; or more than
    /// `2^32 - 1` blocks reached by the prompts in all.
    TooManyBlocks,
    /// An `output_length` whose output ids (`2^31 + r * 2048 + j`) or KV tokens
    /// (`L + O - 1`) would not fit in `u32`.
    OutputTooLong {
        /// The line's `output_length`.
        output_length: u64,
        /// The longest output this line may have.
        limit: u64,
    },
    /// More than [`MAX_REQUESTS`] requests.
    TooManyRequests,
    /// No request at all.
    Empty,
    /// A line longer than the limit (by default [`MAX_LINE_BYTES`]); reading stopped
    /// there.
    LineTooLong {
        /// The most bytes a line may hold (its newline not counted).
        limit: usize,
    },
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}: line {line}: ", self.source)?,
            None => write!(f, "{}: ", self.source)?,
        }
        match &self.kind {
            TraceErrorKind::Io(e) => write!(f, "{e}"),
            TraceErrorKind::Json(e) => write!(f, "not a trace record: {e}"),
            TraceErrorKind::NotAnObject { found } => write!(
                f,
                "not a trace record: expected a JSON object such as \
                 {{\"input_length\": 600, \"output_length\": 10, \"hash_ids\": [1, 2]}}, found {found}"
            ),
            TraceErrorKind::Gzip { lines_read, error } => {
                write!(f, "corrupt or truncated gzip data (after {lines_read} lines of decompressed text): {error}")
            }
            TraceErrorKind::InputTooLong { input_length } => {
                write!(f, "input_length {input_length} is above {MAX_INPUT_LEN} (KV token counts must fit in 32 bits)")
            }
            TraceErrorKind::BlankLine => {
                f.write_str("blank line (every line is one request; its 0-based line number is the request id)")
            }
            TraceErrorKind::PromptLongerThanBlocks { input_length, blocks } => write!(
                f,
                "input_length {input_length} exceeds 512 * len(hash_ids) = {} ({blocks} blocks)",
                512 * *blocks as u64
            ),
            TraceErrorKind::TooManyBlocks => {
                write!(f, "more than {} distinct hash ids (prompt tokens must stay below 2^31)", MAX_HASH_ID + 1)
            }
            TraceErrorKind::OutputTooLong { output_length, limit } => write!(
                f,
                "output_length {output_length} is above {limit}, the most this line may hold \
                 (its output token ids and KV token count must fit in 32 bits)"
            ),
            TraceErrorKind::TooManyRequests => write!(f, "more than {MAX_REQUESTS} requests"),
            TraceErrorKind::Empty => f.write_str("the trace holds no request"),
            TraceErrorKind::LineTooLong { limit } => {
                write!(f, "line longer than {limit} bytes, the most a trace line may hold")
            }
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            TraceErrorKind::Io(e) => Some(e),
            TraceErrorKind::Json(e) => Some(e),
            TraceErrorKind::Gzip { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// One request line of the file, as the reader keeps it.
#[derive(Debug)]
struct RawRequest {
    /// Ignored by the replay; absent and `null` read as 0.
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    /// The line's leading hash ids: at least the ones the prompt reaches, when the line
    /// has that many and `input_length` is at most [`MAX_INPUT_LEN`].
    hash_ids: Vec<u64>,
    /// How many hash ids the line holds.
    blocks: usize,
}

/// How many hash ids a prompt of `input_length` tokens reaches; 0 past
/// [`MAX_INPUT_LEN`] (an error anyway).
fn used_blocks(input_length: u64) -> usize {
    if input_length > MAX_INPUT_LEN as u64 {
        0
    } else {
        (input_length as usize).div_ceil(BLOCK_TOKENS as usize)
    }
}

/// What a line's JSON value holds.
enum Line {
    Request(RawRequest),
    /// A JSON value that is not an object (a boolean or `null`; the other kinds are
    /// told by their first byte before parsing): what it is.
    NotAnObject(&'static str),
}

impl<'de> Deserialize<'de> for Line {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Line, D::Error> {
        d.deserialize_any(LineVisitor)
    }
}

struct LineVisitor;

impl<'de> Visitor<'de> for LineVisitor {
    type Value = Line;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object with input_length, output_length and hash_ids")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Line, E> {
        Ok(Line::NotAnObject("a JSON boolean"))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Line, E> {
        Ok(Line::NotAnObject("JSON null"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Line, A::Error> {
        let (mut timestamp, mut input_length, mut output_length, mut ids) = (None, None, None, None);
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Timestamp if timestamp.is_some() => return Err(de::Error::duplicate_field("timestamp")),
                Field::Timestamp => timestamp = Some(map.next_value::<Option<f64>>()?.unwrap_or(0.0)),
                Field::InputLength if input_length.is_some() => return Err(de::Error::duplicate_field("input_length")),
                Field::InputLength => input_length = Some(map.next_value::<u64>()?),
                Field::OutputLength if output_length.is_some() => {
                    return Err(de::Error::duplicate_field("output_length"))
                }
                Field::OutputLength => output_length = Some(map.next_value::<u64>()?),
                Field::HashIds if ids.is_some() => return Err(de::Error::duplicate_field("hash_ids")),
                Field::HashIds => {
                    // Before input_length is known, keep as many as any prompt can use.
                    let keep = input_length.map_or(MAX_USED_BLOCKS, used_blocks);
                    ids = Some(map.next_value_seed(HashIds { keep })?);
                }
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let input_length = input_length.ok_or_else(|| de::Error::missing_field("input_length"))?;
        let output_length = output_length.ok_or_else(|| de::Error::missing_field("output_length"))?;
        let (mut hash_ids, blocks) = ids.ok_or_else(|| de::Error::missing_field("hash_ids"))?;
        hash_ids.truncate(used_blocks(input_length));
        Ok(Line::Request(RawRequest {
            timestamp: timestamp.unwrap_or(0.0),
            input_length,
            output_length,
            hash_ids,
            blocks,
        }))
    }
}

/// A key of a request line.
enum Field {
    Timestamp,
    InputLength,
    OutputLength,
    HashIds,
    /// Any other key (its value is skipped).
    Other,
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Field, D::Error> {
        d.deserialize_identifier(FieldVisitor)
    }
}

struct FieldVisitor;

impl Visitor<'_> for FieldVisitor {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Field, E> {
        Ok(match key {
            "timestamp" => Field::Timestamp,
            "input_length" => Field::InputLength,
            "output_length" => Field::OutputLength,
            "hash_ids" => Field::HashIds,
            _ => Field::Other,
        })
    }
}

/// The `hash_ids` array: every element is read as a `u64` and counted, and the first
/// `keep` are stored.
struct HashIds {
    keep: usize,
}

impl<'de> DeserializeSeed<'de> for HashIds {
    /// The stored ids and the count of all of them.
    type Value = (Vec<u64>, usize);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for HashIds {
    type Value = (Vec<u64>, usize);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of hash ids (unsigned integers)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut kept = Vec::with_capacity(self.keep.min(1024));
        let mut count = 0usize;
        while let Some(h) = seq.next_element::<u64>()? {
            if count < self.keep {
                kept.push(h);
            }
            count = count.saturating_add(1);
        }
        Ok((kept, count))
    }
}

impl Trace {
    /// The bundled Mooncake conversation trace (12,031 requests), decoded from the copy
    /// embedded in the binary.
    ///
    /// # Errors
    ///
    /// [`TraceError`] only if the embedded copy is damaged.
    pub fn bundled() -> Result<Trace, TraceError> {
        Trace::from_reader(BUNDLED_TRACE_GZ, BUNDLED_TRACE_NAME)
    }

    /// Load a JSON-lines trace from a file; a gzip file (by its magic bytes) is
    /// decompressed on the fly.
    ///
    /// # Errors
    ///
    /// [`TraceError`]: the file cannot be read, or a line is malformed (the error names
    /// the line), or the trace is empty.
    pub fn from_path(path: &Path) -> Result<Trace, TraceError> {
        let source = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| TraceError {
            source: source.clone(),
            line: None,
            kind: TraceErrorKind::Io(e),
        })?;
        Trace::from_reader(file, &source)
    }

    /// Parse a trace held in a string; `source` names it in error messages.
    ///
    /// # Errors
    ///
    /// As [`from_path`](Self::from_path).
    pub fn from_jsonl_str(text: &str, source: &str) -> Result<Trace, TraceError> {
        Trace::from_reader(text.as_bytes(), source)
    }

    /// Parse a trace from a reader (plain JSON lines, or gzip of them).
    ///
    /// # Errors
    ///
    /// As [`from_path`](Self::from_path).
    pub fn from_reader<R: Read>(reader: R, source: &str) -> Result<Trace, TraceError> {
        Trace::from_reader_with_line_limit(reader, source, MAX_LINE_BYTES)
    }

    /// [`from_reader`](Self::from_reader) with lines of at most `max_line_bytes` bytes
    /// (their newline not counted) instead of [`MAX_LINE_BYTES`]: a longer line is a
    /// [`TraceErrorKind::LineTooLong`] naming it, and no more than that much of it is
    /// ever held in memory.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::{Trace, TraceErrorKind};
    ///
    /// let long = r#"{"input_length": 600, "output_length": 1, "hash_ids": [5, 9, 10, 11]}"#;
    /// let text = format!("{{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [5, 9]}}\n{long}\n");
    /// let trace = Trace::from_reader_with_line_limit(text.as_bytes(), "t", long.len())?;
    /// assert_eq!(trace.hash_ids(1), &[5, 9]); // the ids past the prompt are not kept
    /// let e = Trace::from_reader_with_line_limit(text.as_bytes(), "t", 68).unwrap_err();
    /// assert!(matches!(e.kind, TraceErrorKind::LineTooLong { limit: 68 }) && e.line == Some(2));
    /// assert_eq!(e.to_string(), "t: line 2: line longer than 68 bytes, the most a trace line may hold");
    /// # Ok::<(), kvpool::replay::TraceError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`from_path`](Self::from_path).
    pub fn from_reader_with_line_limit<R: Read>(
        reader: R,
        source: &str,
        max_line_bytes: usize,
    ) -> Result<Trace, TraceError> {
        let err = |line: Option<usize>, kind| TraceError { source: source.to_string(), line, kind };
        let mut reader = BufReader::with_capacity(1 << 16, reader);
        let head = reader.fill_buf().map_err(|e| err(None, TraceErrorKind::Io(e)))?;
        if head.starts_with(&[0x1f, 0x8b]) {
            let decoder = GzipErrors(flate2::bufread::MultiGzDecoder::new(reader));
            Trace::parse_lines(BufReader::with_capacity(1 << 16, decoder), source, max_line_bytes)
        } else {
            Trace::parse_lines(reader, source, max_line_bytes)
        }
    }

    fn parse_lines<R: BufRead>(mut reader: R, source: &str, max_line_bytes: usize) -> Result<Trace, TraceError> {
        crate::iota::prepare();
        let err = |line: Option<usize>, kind| TraceError { source: source.to_string(), line, kind };
        // A read error while reading line `line_no`.
        let read_err = |e: std::io::Error, line_no: usize| {
            if e.get_ref().is_some_and(|inner| inner.is::<LineTooLong>()) {
                return err(Some(line_no), TraceErrorKind::LineTooLong { limit: max_line_bytes });
            }
            match GzipError::take(e) {
                Ok(error) => err(None, TraceErrorKind::Gzip { lines_read: line_no - 1, error }),
                Err(e) => err(Some(line_no), TraceErrorKind::Io(e)),
            }
        };
        // A UTF-8 byte order mark (as some editors write) is not part of the JSON.
        let mut head = [0u8; 3];
        let n = read_head(&mut reader, &mut head).map_err(|e| read_err(e, 1))?;
        let head = if head[..n] == [0xef, 0xbb, 0xbf] { &[][..] } else { &head[..n] };
        let mut reader = head.chain(reader);
        let mut trace =
            Trace { requests: Vec::new(), hash_ids: Vec::new(), source: source.to_string(), renumbered: false };
        // The renumbering, once a line needs it (module docs): raw id -> new id.
        let mut ids = None;
        let mut line_no = 0;
        let mut first_blank = None;
        loop {
            line_no += 1;
            // Bytes the rest of the line may still hold.
            let mut left = max_line_bytes;
            let first = match skip_blanks(&mut reader, &mut left).map_err(|e| read_err(e, line_no))? {
                LineStart::End => break,
                LineStart::Blank => {
                    first_blank.get_or_insert(line_no);
                    continue;
                }
                LineStart::Content(first) => first,
            };
            if let Some(blank) = first_blank {
                return Err(err(Some(blank), TraceErrorKind::BlankLine));
            }
            if trace.requests.len() == MAX_REQUESTS {
                return Err(err(Some(line_no), TraceErrorKind::TooManyRequests));
            }
            if let Some(found) = not_an_object(first) {
                return Err(err(Some(line_no), TraceErrorKind::NotAnObject { found }));
            }
            // The rest of the line, parsed as it streams by.
            let line = BufReader::with_capacity(1 << 13, LineReader { inner: &mut reader, left, ended: false });
            let mut de = serde_json::Deserializer::from_reader(line);
            let parsed = Line::deserialize(&mut de).and_then(|line| de.end().map(|()| line));
            match parsed {
                Ok(Line::Request(raw)) => trace.push(raw, &mut ids).map_err(|kind| err(Some(line_no), kind))?,
                Ok(Line::NotAnObject(found)) => return Err(err(Some(line_no), TraceErrorKind::NotAnObject { found })),
                Err(e) if e.is_io() => return Err(read_err(e.into(), line_no)),
                Err(e) => return Err(err(Some(line_no), TraceErrorKind::Json(e))),
            }
        }
        if trace.requests.is_empty() {
            return Err(err(None, TraceErrorKind::Empty));
        }
        Ok(trace)
    }

    fn push(&mut self, raw: RawRequest, ids: &mut Option<FxHashMap<u64, u32>>) -> Result<(), TraceErrorKind> {
        if raw.input_length > MAX_INPUT_LEN as u64 {
            return Err(TraceErrorKind::InputTooLong { input_length: raw.input_length });
        }
        let blocks = raw.blocks;
        let too_few = TraceErrorKind::PromptLongerThanBlocks { input_length: raw.input_length, blocks };
        if raw.input_length > BLOCK_TOKENS as u64 * blocks as u64 {
            return Err(too_few);
        }
        // Output ids 2^31 + r * 2048 + j stay in u32, and so do the KV tokens L + O - 1.
        let r = self.requests.len() as u64;
        let limit = ((u32::MAX - OUTPUT_TOKEN_BASE) as u64 + 1 - r * MAX_OUTPUT_LEN as u64)
            .min(u32::MAX as u64 + 1 - raw.input_length);
        if raw.output_length > limit {
            return Err(TraceErrorKind::OutputTooLong { output_length: raw.output_length, limit });
        }
        // Only the blocks the prompt reaches are kept (the reader stored no more than
        // those, and at least those since the line has that many).
        let Some(used) = raw.hash_ids.get(..used_blocks(raw.input_length)) else {
            return Err(too_few);
        };
        if ids.is_none() && used.iter().any(|&h| h > MAX_HASH_ID) {
            *ids = Some(self.renumber());
        }
        if self.hash_ids.len() + used.len() > u32::MAX as usize {
            return Err(TraceErrorKind::TooManyBlocks);
        }
        let hash_start = self.hash_ids.len() as u32;
        match ids {
            None => self.hash_ids.extend(used.iter().map(|&h| h as u32)),
            Some(map) => {
                for &h in used {
                    let id = match map.get(&h) {
                        Some(&id) => id,
                        None if map.len() as u64 > MAX_HASH_ID => {
                            self.hash_ids.truncate(hash_start as usize);
                            return Err(TraceErrorKind::TooManyBlocks);
                        }
                        None => {
                            let next = map.len() as u32;
                            map.insert(h, next);
                            next
                        }
                    };
                    self.hash_ids.push(id);
                }
            }
        }
        let timestamp_ms = if raw.timestamp.is_finite() && raw.timestamp > 0.0 { raw.timestamp as u64 } else { 0 };
        self.requests.push(TraceRequest {
            timestamp_ms,
            input_length: raw.input_length as u32,
            output_length: raw.output_length as u32,
            hash_start,
            hash_len: used.len() as u32,
        });
        Ok(())
    }

    /// Renumber the ids read so far in order of first appearance, and return the
    /// renumbering for the lines to come. They are all at most [`MAX_HASH_ID`], so
    /// there are not too many of them.
    fn renumber(&mut self) -> FxHashMap<u64, u32> {
        let mut map = FxHashMap::default();
        for h in &mut self.hash_ids {
            let next = map.len() as u32;
            *h = *map.entry(*h as u64).or_insert(next);
        }
        self.renumbered = true;
        map
    }

    /// Whether the trace's hash ids were renumbered because one of them was above
    /// [`MAX_HASH_ID`] (module docs): if so, [`hash_ids`](Self::hash_ids) gives the new
    /// ids, 0, 1, 2, ... in order of first appearance.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::Trace;
    /// let text = "{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [7, 9]}\n\
    ///             {\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [7, 18446744073709551615]}\n";
    /// let trace = Trace::from_jsonl_str(text, "t")?;
    /// assert!(trace.renumbered());
    /// assert_eq!((trace.hash_ids(0), trace.hash_ids(1)), (&[0, 1][..], &[0, 2][..]));
    /// # Ok::<(), kvpool::replay::TraceError>(())
    /// ```
    pub fn renumbered(&self) -> bool {
        self.renumbered
    }

    /// Where the trace came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether there are no requests (never true for a loaded trace).
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Keep only the first `n` requests.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
        let end = self.requests.last().map_or(0, |r| (r.hash_start + r.hash_len) as usize);
        self.hash_ids.truncate(end);
    }

    /// Request `r`.
    ///
    /// # Panics
    ///
    /// If `r >= len()`.
    #[inline]
    pub fn request(&self, r: usize) -> TraceRequest {
        self.requests[r]
    }

    /// All requests in file order.
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }

    /// The hash ids of request `r` that its prompt reaches (`ceil(L / 512)` of them).
    ///
    /// # Panics
    ///
    /// If `r >= len()`.
    #[inline]
    pub fn hash_ids(&self, r: usize) -> &[u32] {
        let q = &self.requests[r];
        &self.hash_ids[q.hash_start as usize..(q.hash_start + q.hash_len) as usize]
    }

    /// Write the prompt of request `r` into `out[..L]`.
    ///
    /// # Panics
    ///
    /// If `r >= len()` or `out` is shorter than the prompt.
    pub fn write_prompt(&self, r: usize, out: &mut [u32]) {
        let q = self.requests[r];
        let out = &mut out[..q.input_length as usize];
        for (block, &h) in out.chunks_mut(BLOCK_TOKENS as usize).zip(self.hash_ids(r)) {
            crate::iota::fill_ascending(block, h * BLOCK_TOKENS);
        }
    }

    /// Write the KV tokens of request `r` (prompt, then every output token but the
    /// last) into `out[..kv_len]`.
    ///
    /// # Panics
    ///
    /// If `r >= len()` or `out` is shorter than [`TraceRequest::kv_len`].
    pub fn write_kv_tokens(&self, r: usize, out: &mut [u32]) {
        let q = self.requests[r];
        self.write_prompt(r, out);
        let prompt = q.input_length as usize;
        for (j, t) in out[prompt..q.kv_len()].iter_mut().enumerate() {
            *t = output_token(r, j);
        }
    }

    /// The longest prompt.
    pub fn max_input_length(&self) -> usize {
        self.requests.iter().map(|q| q.input_length as usize).max().unwrap_or(0)
    }

    /// The longest [`TraceRequest::kv_len`].
    pub fn max_kv_len(&self) -> usize {
        self.requests.iter().map(TraceRequest::kv_len).max().unwrap_or(0)
    }

    /// The longest [`TraceRequest::kv_len`] among the requests whose KV fits in
    /// `capacity` tokens: the longest request a pool of that size can serve (the
    /// replay rejects the others before expanding their tokens). 0 if none fits.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvpool::replay::Trace;
    /// let text = "{\"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1]}\n\
    ///             {\"input_length\": 30, \"output_length\": 3, \"hash_ids\": [2]}\n";
    /// let trace = Trace::from_jsonl_str(text, "t")?;
    /// assert_eq!((trace.max_kv_len(), trace.max_kv_len_fitting(64), trace.max_kv_len_fitting(16)), (100, 32, 0));
    /// # Ok::<(), kvpool::replay::TraceError>(())
    /// ```
    pub fn max_kv_len_fitting(&self, capacity: usize) -> usize {
        self.requests.iter().map(TraceRequest::kv_len).filter(|&kv| kv <= capacity).max().unwrap_or(0)
    }

    /// The longest prompt among the requests whose KV fits in `capacity` tokens (see
    /// [`max_kv_len_fitting`](Self::max_kv_len_fitting)).
    pub fn max_input_length_fitting(&self, capacity: usize) -> usize {
        self.requests.iter().filter(|q| q.kv_len() <= capacity).map(|q| q.input_length as usize).max().unwrap_or(0)
    }

    /// Sum of `input_length`.
    pub fn total_input_tokens(&self) -> u64 {
        self.requests.iter().map(|q| q.input_length as u64).sum()
    }

    /// Sum of `output_length`.
    pub fn total_output_tokens(&self) -> u64 {
        self.requests.iter().map(|q| q.output_length as u64).sum()
    }
}

/// What a line holds when it is JSON but not an object, judged by its first byte;
/// `None` for an object, for a literal (`true`, `false`, `null`, which the parser tells
/// apart from text that only starts like one) and for text that is not JSON at all
/// (which the parser describes better).
fn not_an_object(first: u8) -> Option<&'static str> {
    match first {
        b'[' => Some("a JSON array"),
        b'"' => Some("a JSON string"),
        b'-' | b'0'..=b'9' => Some("a JSON number"),
        _ => None,
    }
}

/// Read up to `head.len()` bytes (fewer only at the end of the input); the count.
fn read_head<R: Read>(reader: &mut R, head: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < head.len() {
        match reader.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// How a line starts, past its leading whitespace.
enum LineStart {
    /// The end of the input (after nothing but whitespace, if anything).
    End,
    /// A line of whitespace only (its newline consumed).
    Blank,
    /// This byte (not consumed).
    Content(u8),
}

/// Consume the leading spaces, tabs and carriage returns of a line, at most `*left` of
/// them (counted off `*left`): more is a [`LineTooLong`] error.
fn skip_blanks<R: BufRead>(reader: &mut R, left: &mut usize) -> std::io::Result<LineStart> {
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(LineStart::End);
        }
        let n = buf.iter().position(|b| !matches!(b, b' ' | b'\t' | b'\r')).unwrap_or(buf.len());
        if n > *left {
            return Err(LineTooLong::error());
        }
        let next = buf.get(n).copied();
        reader.consume(n);
        *left -= n;
        match next {
            None => {}
            Some(b'\n') => {
                reader.consume(1);
                return Ok(LineStart::Blank);
            }
            Some(b) => return Ok(LineStart::Content(b)),
        }
    }
}

/// The rest of one line of `inner`: reads end at its newline (consumed, not returned)
/// or at the end of the input, and fail with [`LineTooLong`] once the line has more
/// than `left` bytes still to give. The bytes before that point are all returned first,
/// so the error comes at the same place however `inner` splits its reads.
struct LineReader<'a, R> {
    inner: &'a mut R,
    left: usize,
    ended: bool,
}

impl<R: BufRead> Read for LineReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.ended || buf.is_empty() {
            return Ok(0);
        }
        let avail = self.inner.fill_buf()?;
        if avail.is_empty() {
            self.ended = true;
            return Ok(0);
        }
        let window = &avail[..avail.len().min(buf.len())];
        let (n, newline) = match window.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (window.len(), false),
        };
        let (n, newline) = match n > self.left {
            false => (n, newline),
            true if self.left == 0 => return Err(LineTooLong::error()),
            true => (self.left, false),
        };
        buf[..n].copy_from_slice(&window[..n]);
        self.inner.consume(n + newline as usize);
        self.left -= n;
        self.ended = newline;
        Ok(n)
    }
}

/// The mark of a read that stopped at the line limit.
#[derive(Debug)]
struct LineTooLong;

impl LineTooLong {
    fn error() -> std::io::Error {
        std::io::Error::new(ErrorKind::InvalidData, LineTooLong)
    }
}

impl fmt::Display for LineTooLong {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("line too long")
    }
}

impl std::error::Error for LineTooLong {}

/// A gzip decoder whose errors are marked as the decoder's ([`GzipError`]), so that
/// the loader can tell a corrupt stream from an unreadable file or a bad line.
struct GzipErrors<R>(R);

impl<R: Read> Read for GzipErrors<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf).map_err(|e| std::io::Error::new(e.kind(), GzipError(e)))
    }
}

#[derive(Debug)]
struct GzipError(std::io::Error);

impl GzipError {
    /// The decoder's error inside `e`, or `e` itself if it is not one.
    fn take(e: std::io::Error) -> Result<std::io::Error, std::io::Error> {
        if !e.get_ref().is_some_and(|inner| inner.is::<GzipError>()) {
            return Err(e);
        }
        let kind = e.kind();
        match e.into_inner().map(|inner| inner.downcast::<GzipError>()) {
            Some(Ok(g)) => Ok(g.0),
            // Not reached (checked above); keep what there is.
            Some(Err(other)) => Err(std::io::Error::new(kind, other)),
            None => Err(kind.into()),
        }
    }
}

impl fmt::Display for GzipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for GzipError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Trace, TraceError> {
        Trace::from_jsonl_str(text, "t.jsonl")
    }

    /// The timestamp is ignored: a number, `null` or no field read the same, and a
    /// value of another type is still an error naming the line.
    #[test]
    fn timestamp_may_be_null_or_absent() {
        let rest = "\"input_length\": 20, \"output_length\": 2, \"hash_ids\": [7]}";
        let with = |ts: &str| parse(&format!("{{{ts}{rest}\n"));
        let plain = with("").unwrap();
        for ts in ["\"timestamp\": null, ", "\"timestamp\": 1700000000123, ", "\"timestamp\": 0.5, "] {
            let t = with(ts).unwrap();
            assert_eq!((t.request(0).input_length, t.hash_ids(0)), (plain.request(0).input_length, plain.hash_ids(0)));
        }
        assert!(with("\"timestamp\": \"soon\", ").is_err());
    }

    #[test]
    fn expansion_follows_the_formula() {
        let t = parse(
            "{\"input_length\": 1030, \"output_length\": 4, \"hash_ids\": [1, 2, 3, 99]}\n\
             {\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [4]}\n",
        )
        .unwrap();
        assert_eq!(t.hash_ids(0), &[1, 2, 3]); // block 3 is past the prompt
        let mut out = vec![0; t.request(0).kv_len()];
        t.write_kv_tokens(0, &mut out);
        assert_eq!(out.len(), 1033);
        for (p, &tok) in out[..1030].iter().enumerate() {
            assert_eq!(tok, [1u32, 2, 3][p / 512] * 512 + (p % 512) as u32);
        }
        assert_eq!(&out[1030..], &[1 << 31, (1 << 31) + 1, (1 << 31) + 2]);
        let mut out = vec![0; 1];
        t.write_kv_tokens(1, &mut out);
        assert_eq!(out, [4 * 512]);
        assert_eq!(output_token(1, 0), (1 << 31) + 2048);
    }

    #[test]
    fn bad_lines_are_named() {
        let e = parse("{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n{oops}\n").unwrap_err();
        assert_eq!(e.line, Some(2));
        assert!(e.to_string().starts_with("t.jsonl: line 2: not a trace record"), "{e}");
        let e = parse("{\"input_length\": 513, \"output_length\": 1, \"hash_ids\": [1]}").unwrap_err();
        assert!(matches!(e.kind, TraceErrorKind::PromptLongerThanBlocks { input_length: 513, blocks: 1 }));
        // Output ids stay in u32: r * 2048 + O <= 2^31.
        let line = |o: u64| format!("{{\"input_length\": 1, \"output_length\": {o}, \"hash_ids\": [1]}}\n");
        assert_eq!(parse(&line(1 << 31)).unwrap().request(0).output_length, 1 << 31);
        let e = parse(&line((1 << 31) + 1)).unwrap_err();
        assert_eq!(e.line, Some(1));
        assert!(
            matches!(e.kind, TraceErrorKind::OutputTooLong { output_length, limit: 2147483648 } if output_length == (1 << 31) + 1)
        );
        assert!(e.to_string().contains("above 2147483648"), "{e}");
        assert!(parse(&(line(1) + &line((1 << 31) - 2048))).is_ok());
        let e = parse(&(line(1) + &line((1 << 31) - 2047))).unwrap_err();
        assert!(matches!(e.kind, TraceErrorKind::OutputTooLong { limit: 2147481600, .. }) && e.line == Some(2));
        let e = parse("{\"input_length\": -1, \"output_length\": 1, \"hash_ids\": [1]}").unwrap_err();
        assert!(matches!(e.kind, TraceErrorKind::Json(_)));
        let e = parse("{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\n{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}").unwrap_err();
        assert_eq!((e.line, matches!(e.kind, TraceErrorKind::BlankLine)), (Some(2), true));
        assert!(matches!(parse("\n\n").unwrap_err().kind, TraceErrorKind::Empty));
        // Trailing blank lines are fine.
        assert_eq!(parse("{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\n").unwrap().len(), 1);
    }

    /// Outputs longer than 2048 tokens expand by the same formula, running into the
    /// next request's ids (harmless: module docs), and stay above the prompts.
    #[test]
    fn long_outputs_follow_the_formula() {
        let t = parse(
            "{\"input_length\": 3, \"output_length\": 5000, \"hash_ids\": [1]}\n\
             {\"input_length\": 3, \"output_length\": 2, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        let mut out = vec![0; t.request(0).kv_len()];
        t.write_kv_tokens(0, &mut out);
        assert_eq!(out.len(), 5002);
        assert_eq!((out[3], out[3 + 2048], out[5001]), (1 << 31, (1 << 31) + 2048, (1 << 31) + 4998));
        assert_eq!(output_token(1, 0), out[3 + 2048]);
    }

    /// A hash id above `MAX_HASH_ID` renumbers the whole trace, the lines before it
    /// included, in order of first appearance; a trace within the bound keeps its ids.
    #[test]
    fn large_hash_ids_renumber_the_trace() {
        let line = |ids: &str| format!("{{\"input_length\": 1100, \"output_length\": 1, \"hash_ids\": [{ids}]}}\n");
        let kept = parse(&(line("9, 4194303, 7") + &line("9, 5, 6"))).unwrap();
        assert!(!kept.renumbered());
        assert_eq!((kept.hash_ids(0), kept.hash_ids(1)), (&[9, 4194303, 7][..], &[9, 5, 6][..]));
        // Ids past the prompt's blocks are dropped before they are looked at.
        let t =
            parse(&(line("9, 4194303, 7, 18446744073709551615") + &line("9, 4194304, 9") + &line("4194304, 7, 12")))
                .unwrap();
        assert!(t.renumbered());
        assert_eq!((t.hash_ids(0), t.hash_ids(1), t.hash_ids(2)), (&[0, 1, 2][..], &[0, 3, 0][..], &[3, 2, 4][..]));
        let mut out = vec![0; t.request(1).kv_len()];
        t.write_kv_tokens(1, &mut out);
        assert_eq!((out[0], out[512], out[1024]), (0, 3 * 512, 0));
        // A large id on the first line: renumbered from the start.
        let t = parse(&(line("18446744073709551615, 5, 5") + &line("5, 5, 9"))).unwrap();
        assert_eq!((t.renumbered(), t.hash_ids(0), t.hash_ids(1)), (true, &[0, 1, 1][..], &[1, 1, 2][..]));
    }

    /// More distinct ids than prompt tokens below 2^31 allow, once renumbered, is an
    /// error naming the line; nothing of that line is kept.
    #[test]
    fn too_many_blocks_to_renumber_is_an_error() {
        let mut t = Trace { requests: Vec::new(), hash_ids: Vec::new(), source: "t".into(), renumbered: true };
        let mut ids = Some((0..=MAX_HASH_ID).map(|h| (h << 30, h as u32)).collect::<FxHashMap<u64, u32>>());
        let raw = |hash_ids: Vec<u64>| RawRequest {
            timestamp: 0.0,
            input_length: 1024,
            output_length: 1,
            blocks: hash_ids.len(),
            hash_ids,
        };
        t.push(raw(vec![0, 1 << 30]), &mut ids).unwrap();
        assert_eq!(t.hash_ids(0), &[0, 1]);
        assert!(matches!(t.push(raw(vec![0, 7]), &mut ids), Err(TraceErrorKind::TooManyBlocks)));
        assert_eq!((t.len(), t.hash_ids.len(), ids.as_ref().map(|m| m.contains_key(&7))), (1, 2, Some(false)));
        let e = TraceError { source: "t".into(), line: Some(2), kind: TraceErrorKind::TooManyBlocks };
        assert_eq!(
            e.to_string(),
            "t: line 2: more than 4194304 distinct hash ids (prompt tokens must stay below 2^31)"
        );
    }

    #[test]
    fn bounds_keep_token_spaces_apart() {
        assert_eq!(prompt_token(&[MAX_HASH_ID as u32], 511), OUTPUT_TOKEN_BASE - 1);
        assert_eq!(output_token(MAX_REQUESTS - 1, MAX_OUTPUT_LEN as usize - 1), u32::MAX);
    }

    /// A reader that yields `parts` in order, each `(bytes, times)` repeated `times`
    /// times, without holding more than one copy: a long input that takes no memory.
    struct Lazy {
        parts: Vec<(Vec<u8>, u64)>,
        /// Position in the current copy of `parts[0]`.
        at: usize,
    }

    impl Lazy {
        fn new(parts: Vec<(Vec<u8>, u64)>) -> Lazy {
            Lazy { parts: parts.into_iter().rev().filter(|(b, t)| !b.is_empty() && *t > 0).collect(), at: 0 }
        }
    }

    impl Read for Lazy {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let Some((bytes, times)) = self.parts.last_mut() else { return Ok(0) };
            let n = (bytes.len() - self.at).min(buf.len());
            buf[..n].copy_from_slice(&bytes[self.at..self.at + n]);
            self.at += n;
            if self.at == bytes.len() {
                self.at = 0;
                *times -= 1;
                if *times == 0 {
                    self.parts.pop();
                }
            }
            Ok(n)
        }
    }

    /// A reader that gives at most one byte a call, as a gzip decoder may at a member's
    /// end: where the reader splits the input must not change the outcome.
    struct OneByte<R>(R);

    impl<R: Read> Read for OneByte<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(1);
            self.0.read(&mut buf[..n])
        }
    }

    /// One gzip member holding `data`.
    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut encoder, data).unwrap();
        encoder.finish().unwrap()
    }

    const SHORT: &str = "{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n";

    /// A line longer than [`MAX_LINE_BYTES`] is an error naming it, plain or gzip, and
    /// whether it is long with hash ids (read by the JSON parser) or with leading
    /// whitespace (read before it). The input is made as it is read: neither the test
    /// nor the reader holds the line. (`tests/replay_cli.rs` has the gzip file of hash
    /// ids.)
    #[test]
    fn over_long_lines_are_an_error_naming_them() {
        const CHUNK: usize = 1 << 20;
        let copies = (MAX_LINE_BYTES / CHUNK) as u64 + 1;
        let head = SHORT.repeat(2) + "{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [";
        let ids = Lazy::new(vec![
            (head.into_bytes(), 1),
            (b"0,".repeat(CHUNK / 2), copies),
            (b"0]}\n".to_vec(), 1),
            (SHORT.as_bytes().to_vec(), 1),
        ]);
        let spaces = || {
            let head = SHORT.repeat(2);
            let tail = SHORT.repeat(2);
            [(head.into_bytes(), 1), (vec![b' '; CHUNK], copies), (tail.into_bytes(), 1)]
        };
        let zipped_spaces = Lazy::new(spaces().into_iter().map(|(bytes, times)| (gzip(&bytes), times)).collect());
        let errors = [
            ("hash ids", Trace::from_reader(ids, "t.jsonl").unwrap_err()),
            ("spaces", Trace::from_reader(Lazy::new(spaces().to_vec()), "t.jsonl").unwrap_err()),
            ("gzip spaces", Trace::from_reader(zipped_spaces, "t.jsonl").unwrap_err()),
        ];
        for (how, e) in errors {
            assert!(matches!(e.kind, TraceErrorKind::LineTooLong { limit: MAX_LINE_BYTES }), "{how}: {e}");
            assert_eq!(e.line, Some(3), "{how}: {e}");
            assert_eq!(
                e.to_string(),
                "t.jsonl: line 3: line longer than 268435456 bytes, the most a trace line may hold"
            );
        }
        // The longest prompt's line, with 20-digit ids, fits.
        let max_id = ", 18446744073709551615".len();
        assert!(MAX_USED_BLOCKS * max_id + 100 < MAX_LINE_BYTES);
    }

    /// The limit counts every byte of a line but its newline (leading and trailing
    /// whitespace, a carriage return, a blank line's spaces), and the outcome is the same
    /// however the input arrives: whole, a byte at a time, or gzip.
    #[test]
    fn line_limit_counts_every_byte_but_the_newline() {
        let line = "{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [5, 9, 1, 2]}";
        let cases = [
            format!("{line}\n"),
            line.to_string(),
            format!("{line}\r\n"),
            format!("  {line}\t \n"),
            format!("{}\n", line.replace("\"output_length\"", "\"x\": \"a\\\"c\", \"output_length\"")),
        ];
        let parse_all = |text: &str, limit: usize| {
            let whole = Trace::from_reader_with_line_limit(text.as_bytes(), "t", limit);
            let bytes = Trace::from_reader_with_line_limit(OneByte(text.as_bytes()), "t", limit);
            let zipped = Trace::from_reader_with_line_limit(&gzip(text.as_bytes())[..], "t", limit);
            [whole, bytes, zipped]
        };
        for second in &cases {
            let len = second.strip_suffix('\n').unwrap_or(second).len();
            let text = SHORT.to_string() + second;
            for t in parse_all(&text, len) {
                let t = t.unwrap_or_else(|e| panic!("{second:?} in {len} bytes: {e}"));
                assert_eq!((t.len(), t.hash_ids(1)), (2, &[5, 9][..]));
            }
            for e in parse_all(&text, len - 1) {
                let e = e.err().unwrap_or_else(|| panic!("{second:?} in {} bytes", len - 1));
                assert!(matches!(e.kind, TraceErrorKind::LineTooLong { limit } if limit == len - 1), "{e}");
                assert_eq!(e.line, Some(2), "{e}");
            }
        }
        // A blank line is held to the limit too (before it is found to be blank).
        let text = SHORT.to_string() + &" ".repeat(100) + "\n" + SHORT;
        for r in parse_all(&text, 100) {
            let e = r.unwrap_err();
            assert!(matches!(e.kind, TraceErrorKind::BlankLine) && e.line == Some(2), "{e}");
        }
        for r in parse_all(&text, 99) {
            let e = r.unwrap_err();
            assert!(matches!(e.kind, TraceErrorKind::LineTooLong { limit: 99 }) && e.line == Some(2), "{e}");
        }
        // A fault within the limit is reported as it is, though the line is too long.
        let limit = SHORT.len() + 10;
        let text = SHORT.to_string() + "{oops" + &"x".repeat(100) + "\n";
        for r in parse_all(&text, limit) {
            let e = r.unwrap_err();
            assert!(matches!(e.kind, TraceErrorKind::Json(_)) && e.line == Some(2), "{e}");
        }
        let text = SHORT.to_string() + "[" + &"1,".repeat(100) + "1]\n";
        for r in parse_all(&text, limit) {
            assert!(matches!(r.unwrap_err().kind, TraceErrorKind::NotAnObject { found: "a JSON array" }));
        }
        let text = SHORT.to_string() + "null  \n";
        for r in parse_all(&text, limit) {
            assert!(matches!(r.unwrap_err().kind, TraceErrorKind::NotAnObject { found: "JSON null" }));
        }
    }

    /// A request keeps only the ids its prompt reaches, whichever field comes first; the
    /// others count for the `input_length <= 512 * len(hash_ids)` check and must still
    /// be ids.
    #[test]
    fn only_the_used_hash_ids_are_kept() {
        let ids = (0..100_000).map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
        let text = format!(
            "{{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [{ids}]}}\n\
             {{\"hash_ids\": [{ids}], \"output_length\": 1, \"input_length\": 1025}}\n\
             {{\"input_length\": 0, \"output_length\": 1, \"hash_ids\": [{ids}]}}\n"
        );
        let t = parse(&text).unwrap();
        assert_eq!((t.hash_ids(0), t.hash_ids(1), t.hash_ids(2)), (&[0, 1][..], &[0, 1, 2][..], &[][..]));
        assert_eq!(t.hash_ids.len(), 5);
        for (line, blocks) in [
            ("{\"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [1, 2]}", 2),
            ("{\"hash_ids\": [1, 2], \"input_length\": 1025, \"output_length\": 1}", 2),
        ] {
            let e = parse(line).unwrap_err();
            assert!(
                matches!(e.kind, TraceErrorKind::PromptLongerThanBlocks { input_length: 1025, blocks: b } if b == blocks),
                "{e}"
            );
        }
        for bad in ["-3", "1.5", "\"x\"", "18446744073709551616", "[1]"] {
            for order in [
                format!("{{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1, 2, {bad}]}}"),
                format!("{{\"hash_ids\": [1, 2, {bad}], \"input_length\": 1, \"output_length\": 1}}"),
            ] {
                let e = parse(&order).unwrap_err();
                assert!(matches!(e.kind, TraceErrorKind::Json(_)) && e.line == Some(1), "{order}: {e}");
            }
        }
        let e = parse("{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1], \"hash_ids\": [2]}").unwrap_err();
        assert!(e.to_string().contains("duplicate field `hash_ids`"), "{e}");
        let e = parse(&format!("{{\"input_length\": 4294967296, \"output_length\": 1, \"hash_ids\": [{ids}]}}"))
            .unwrap_err();
        assert!(matches!(e.kind, TraceErrorKind::InputTooLong { input_length: 4294967296 }), "{e}");
        let (kept, count) =
            HashIds { keep: 3 }.deserialize(&mut serde_json::Deserializer::from_str("[1, 2, 3, 4, 5]")).unwrap();
        assert_eq!((kept, count), (vec![1, 2, 3], 5));
    }

    /// With `hash_ids` before `input_length`, the reader holds no more ids than the
    /// longest prompt can use while it does not know how many are used.
    #[test]
    fn ids_before_input_length_are_bounded() {
        let line = Lazy::new(vec![
            (b"{\"hash_ids\": [".to_vec(), 1),
            (b"7,".repeat(1 << 12), (2 * MAX_USED_BLOCKS as u64).div_ceil(1 << 12)),
            (b"7], \"output_length\": 1, \"input_length\": 513}".to_vec(), 1),
        ]);
        let total = (2 * MAX_USED_BLOCKS).next_multiple_of(1 << 12) + 1;
        let Line::Request(raw) = Line::deserialize(&mut serde_json::Deserializer::from_reader(line)).unwrap() else {
            panic!("not a request")
        };
        // The vector kept its largest size: never more than the longest prompt's ids.
        assert!(raw.hash_ids.capacity() <= MAX_USED_BLOCKS.next_power_of_two(), "{}", raw.hash_ids.capacity());
        assert_eq!((raw.hash_ids, raw.blocks), (vec![7, 7], total));
    }

    #[test]
    fn gzip_input_is_detected() {
        let t = Trace::bundled().unwrap();
        assert_eq!(t.len(), 12_031);
        assert_eq!(t.total_input_tokens(), 144_793_823);
        assert_eq!(t.total_output_tokens(), 4_122_048);
    }
}
