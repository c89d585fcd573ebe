//! KV buffer layouts and the host reference implementations of every GPU kernel.
//!
//! The physical KV cache (SGLang's `MHATokenToKVPool` / `MLATokenToKVPool`) is, per
//! layer, a buffer of `size + page_size` rows (slot 0 and the rest of page 0 are the
//! dummy rows padded tokens write to). A row holds one token:
//!
//! * **MHA** — two buffers per layer, K and V; a row is `head_num * head_dim` elements;
//! * **MLA** — one buffer per layer; a row is `kv_lora_rank + qk_rope_head_dim`
//!   elements, the compressed "nope" part followed by the rope part.
//!
//! Elements are f16, bf16, f32, or fp8 e4m3 (stored as bytes, quantized on store with
//! a scale: see [`fp8`]).
//!
//! [`reference`](mod@reference) holds the host versions of the kernels — paged allocation with the
//! fused row write, scatter (plain and fp8, MHA and MLA), gather and move — written as
//! plainly as possible; the GPU tests compare each kernel with them bit for bit.
//! [`ptx`] holds the generated PTX, embedded at build time; [`staging`] the records
//! the allocation kernels read and the host half of a decode step; [`delta`] the host
//! half of a delta-staged decode step (changes only, request state kept on the device).
//! [`swa`] holds the sliding-window (Gemma 2/3, gpt-oss) layout: which layers use
//! the full pool and which the window pool, and the host reference of the mapped
//! scatter. [`host`] holds the host KV tier (HiCache): a pinned host pool of pages in
//! layer-first or page-first order and the host reference of the page transfers.

pub mod delta;
pub mod fp8;
pub mod host;
pub mod ptx;
pub mod reference;
pub mod staging;
pub mod swa;

use core::fmt;

use crate::error::{AllocError, ConfigError};

/// The element type a KV buffer stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single.
    F32,
    /// fp8 e4m3, quantized on store (`float8_e4m3fn`, stored as `u8`).
    Fp8E4m3,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Fp8E4m3 => 1,
        }
    }
}

/// The floating-point type of K/V values handed to a scatter into an fp8 buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SrcFloat {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single.
    F32,
}

impl SrcFloat {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            SrcFloat::F16 | SrcFloat::Bf16 => 2,
            SrcFloat::F32 => 4,
        }
    }

    /// The value of the element at the start of `b` (little-endian).
    pub(crate) fn read(self, b: &[u8]) -> f32 {
        match self {
            SrcFloat::F16 => fp8::f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            SrcFloat::Bf16 => fp8::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            SrcFloat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

/// How a scatter turns source rows into stored rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowStore {
    /// Store the bytes unchanged (the source has the buffer's element type).
    Copy,
    /// Quantize each `src` element to e4m3: `quantize_e4m3(x, inv_scale)`.
    Fp8E4m3 {
        /// The source element type.
        src: SrcFloat,
        /// `1 / scale`.
        inv_scale: f32,
    },
}

impl RowStore {
    /// Bytes stored for `src_bytes` bytes of source.
    pub(crate) fn stored_bytes(self, src_bytes: usize) -> usize {
        match self {
            RowStore::Copy => src_bytes,
            RowStore::Fp8E4m3 { src, .. } => src_bytes / src.bytes(),
        }
    }

    /// Bytes of source per stored element (1 for a copy).
    pub(crate) fn src_elem_bytes(self) -> usize {
        match self {
            RowStore::Copy => 1,
            RowStore::Fp8E4m3 { src, .. } => src.bytes(),
        }
    }
}

/// The shape of one token's KV in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvLayout {
    /// Multi-head attention: K and V buffers per layer, rows of `head_num * head_dim`.
    Mha {
        /// KV heads.
        head_num: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// Multi-latent attention (DeepSeek): one buffer per layer, rows of
    /// `kv_lora_rank` (nope) then `qk_rope_head_dim` (rope) elements.
    Mla {
        /// Elements of the compressed part.
        kv_lora_rank: u32,
        /// Elements of the rope part.
        qk_rope_head_dim: u32,
    },
}

impl KvLayout {
    /// Elements per row. Always exact on 64-bit targets (two `u32` dimensions multiply
    /// or add within a `u64`); where `usize` is narrower and the count overflows it
    /// ([`checked_row_elems`](Self::checked_row_elems) says `None`), `usize::MAX`.
    pub fn row_elems(self) -> usize {
        self.checked_row_elems().unwrap_or(usize::MAX)
    }

    /// Elements per row, or `None` when that overflows `usize` (only possible where
    /// `usize` is narrower than 64 bits).
    pub fn checked_row_elems(self) -> Option<usize> {
        match self {
            KvLayout::Mha { head_num, head_dim } => (head_num as usize).checked_mul(head_dim as usize),
            KvLayout::Mla { kv_lora_rank, qk_rope_head_dim } => {
                (kv_lora_rank as usize).checked_add(qk_rope_head_dim as usize)
            }
        }
    }

    /// Buffers per layer: 2 (K, V) for MHA, 1 for MLA.
    pub fn buffers(self) -> usize {
        match self {
            KvLayout::Mha { .. } => 2,
            KvLayout::Mla { .. } => 1,
        }
    }
}

/// The shape of a KV cache: layout, element type, layers and capacity.
///
/// # Examples
///
/// Llama-3-8B in bf16 with 16-token pages:
///
/// ```
/// use kvpool::kv::{KvConfig, KvDtype, KvLayout};
/// let cfg = KvConfig {
///     layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
///     dtype: KvDtype::Bf16,
///     layer_num: 32,
///     size: 1 << 16,
///     page_size: 16,
/// };
/// cfg.validate()?;
/// assert_eq!(cfg.rows(), (1 << 16) + 16);      // page 0 is the dummy page
/// assert_eq!(cfg.row_bytes(), 2048);
/// assert_eq!(cfg.total_bytes(), 32 * 2 * cfg.rows() * 2048);
/// # Ok::<(), kvpool::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvConfig {
    /// MHA or MLA, with its dimensions.
    pub layout: KvLayout,
    /// The stored element type.
    pub dtype: KvDtype,
    /// Transformer layers.
    pub layer_num: u32,
    /// Token capacity (as given to the allocator).
    pub size: usize,
    /// Tokens per page (1 for a token allocator).
    pub page_size: u32,
}

impl KvConfig {
    /// Rows per buffer: `size + page_size` (page 0 holds the dummy slot 0).
    /// `usize::MAX` when that overflows (a configuration [`validate`](Self::validate)
    /// refuses).
    pub fn rows(&self) -> usize {
        self.size.saturating_add(self.page_size as usize)
    }

    /// Bytes per row. `usize::MAX` (never a real size) when that overflows `usize`, a
    /// configuration [`validate`](Self::validate) refuses; see
    /// [`checked_row_bytes`](Self::checked_row_bytes).
    pub fn row_bytes(&self) -> usize {
        self.checked_row_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes of one layer's buffer (`rows * row_bytes`). `usize::MAX` when that
    /// overflows `usize`, a configuration [`validate`](Self::validate) refuses; see
    /// [`checked_layer_bytes`](Self::checked_layer_bytes).
    pub fn layer_bytes(&self) -> usize {
        self.checked_layer_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes of the whole cache (all layers, all buffers: `layer_bytes * layer_num *
    /// buffers`). `usize::MAX` when that overflows `usize`, a configuration
    /// [`validate`](Self::validate) refuses; see
    /// [`checked_total_bytes`](Self::checked_total_bytes).
    pub fn total_bytes(&self) -> usize {
        self.checked_total_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes per row, or `None` when that overflows `usize`.
    pub fn checked_row_bytes(&self) -> Option<usize> {
        self.layout.checked_row_elems()?.checked_mul(self.dtype.bytes())
    }

    /// Bytes of one layer's buffer, or `None` when that (or the rows) overflows `usize`.
    pub fn checked_layer_bytes(&self) -> Option<usize> {
        self.size.checked_add(self.page_size as usize)?.checked_mul(self.checked_row_bytes()?)
    }

    /// Bytes of the whole cache, or `None` when that (or any part of it) overflows
    /// `usize`. A configuration that [`validate`](Self::validate) accepts always has
    /// `Some`, at most `isize::MAX`.
    pub fn checked_total_bytes(&self) -> Option<usize> {
        self.checked_layer_bytes()?.checked_mul(self.layer_num as usize)?.checked_mul(self.layout.buffers())
    }

    /// Check that the configuration is usable.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero dimension, [`ConfigError::ZeroPageSize`],
    /// [`ConfigError::TooLarge`] when slots overflow `u32`, the cache's bytes overflow
    /// `isize` (or `usize`), or a row's bytes overflow `u32`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.page_size == 0 {
            return Err(ConfigError::ZeroPageSize);
        }
        if self.layer_num == 0 {
            return Err(ConfigError::Zero("layer_num"));
        }
        match self.layout {
            KvLayout::Mha { head_num: 0, .. } => return Err(ConfigError::Zero("head_num")),
            KvLayout::Mha { head_dim: 0, .. } => return Err(ConfigError::Zero("head_dim")),
            KvLayout::Mla { kv_lora_rank: 0, .. } => return Err(ConfigError::Zero("kv_lora_rank")),
            KvLayout::Mla { qk_rope_head_dim: 0, .. } => return Err(ConfigError::Zero("qk_rope_head_dim")),
            _ => {}
        }
        let too_large = ConfigError::TooLarge { size: self.size as u64, page_size: self.page_size };
        let rows = (self.size as u64).checked_add(self.page_size as u64).ok_or(too_large.clone())?;
        if rows > u32::MAX as u64 {
            return Err(too_large);
        }
        self.checked_total_bytes().filter(|&b| b <= isize::MAX as usize).ok_or(too_large)?;
        // The whole cache's bytes fit, so a row's do: `row_bytes` is exact here.
        let row_bytes = self.row_bytes();
        if row_bytes > u32::MAX as usize {
            return Err(ConfigError::TooLarge { size: row_bytes as u64, page_size: self.page_size });
        }
        Ok(())
    }
}

/// Why a KV operation was refused. Nothing was written.
#[derive(Clone, Debug, PartialEq)]
pub enum KvError {
    /// A slot is past the buffer's rows.
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// The buffer's rows.
        rows: usize,
    },
    /// A buffer or list has the wrong length.
    Shape {
        /// Which argument.
        what: &'static str,
        /// Its length (elements or bytes, as the argument is counted).
        got: usize,
        /// The length needed.
        expected: usize,
    },
    /// A row size is not a whole number of elements, or a stride is smaller than a row.
    BadRow {
        /// Which argument.
        what: &'static str,
        /// The size given, in bytes.
        bytes: usize,
    },
    /// A move would read a row that another pair of the same move writes, or write one
    /// row twice: the result would depend on the order of the copies.
    MoveOverlap {
        /// A slot named twice.
        slot: u32,
    },
    /// The source element type does not fit the buffer's (a plain copy needs the
    /// buffer's type; fp8 buffers take f16, bf16 or f32).
    Format {
        /// What is wrong.
        what: &'static str,
    },
    /// The allocation half of a fused kernel was refused.
    Alloc(AllocError),
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::SlotOutOfRange { slot, rows } => {
                write!(f, "slot {slot} is out of range: the KV buffer has {rows} rows")
            }
            KvError::Shape { what, got, expected } => write!(f, "`{what}` has length {got}, expected {expected}"),
            KvError::BadRow { what, bytes } => {
                write!(f, "`{what}` of {bytes} bytes is not a whole number of elements or is smaller than a row")
            }
            KvError::MoveOverlap { slot } => {
                write!(f, "slot {slot} appears twice among the move's destinations and sources")
            }
            KvError::Format { what } => write!(f, "unsupported element format: {what}"),
            KvError::Alloc(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for KvError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KvError::Alloc(e) => Some(e),
            _ => None,
        }
    }
}

impl From<AllocError> for KvError {
    fn from(e: AllocError) -> Self {
        KvError::Alloc(e)
    }
}

impl From<crate::error::InvalidInput> for KvError {
    fn from(e: crate::error::InvalidInput) -> Self {
        KvError::Alloc(AllocError::Invalid(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        let ok = KvConfig {
            layout: KvLayout::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 },
            dtype: KvDtype::Fp8E4m3,
            layer_num: 2,
            size: 1000,
            page_size: 64,
        };
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.row_bytes(), 576);
        assert_eq!(ok.layout.buffers(), 1);
        assert_eq!(KvConfig { page_size: 0, ..ok }.validate(), Err(ConfigError::ZeroPageSize));
        assert_eq!(KvConfig { layer_num: 0, ..ok }.validate(), Err(ConfigError::Zero("layer_num")));
        let mha0 = KvConfig { layout: KvLayout::Mha { head_num: 0, head_dim: 8 }, ..ok };
        assert_eq!(mha0.validate(), Err(ConfigError::Zero("head_num")));
        assert!(KvConfig { size: u32::MAX as usize, ..ok }.validate().is_err());
        assert!(KvConfig { size: usize::MAX - 1, ..ok }.validate().is_err());
    }

    /// The byte counts of a configuration `validate` refuses (public fields: callers
    /// can ask before validating) wrapped in release builds and panicked in debug ones,
    /// and `validate` itself panicked computing them. Now they saturate at `usize::MAX`
    /// (never a real size), the `checked_*` forms say `None`, and `validate` refuses.
    #[test]
    fn sizes_of_an_unvalidated_config_saturate() {
        let ok = KvConfig {
            layout: KvLayout::Mha { head_num: 8, head_dim: 128 },
            dtype: KvDtype::Bf16,
            layer_num: 32,
            size: 1 << 16,
            page_size: 16,
        };
        let max = KvLayout::Mha { head_num: u32::MAX, head_dim: u32::MAX };
        // (2^32 - 1)^2 elements fit in a 64-bit usize; times 4 bytes they do not.
        let wide = KvConfig { layout: max, dtype: KvDtype::F32, layer_num: u32::MAX, ..ok };
        assert_eq!(wide.checked_row_bytes(), None);
        assert_eq!((wide.row_bytes(), wide.layer_bytes(), wide.total_bytes()), (usize::MAX, usize::MAX, usize::MAX));
        assert_eq!((wide.checked_layer_bytes(), wide.checked_total_bytes()), (None, None));
        assert!(matches!(wide.validate(), Err(ConfigError::TooLarge { .. })), "{:?}", wide.validate());
        // A row that fits, but a layer or the whole cache that does not.
        let tall = KvConfig { size: usize::MAX / 2, ..ok };
        assert_eq!(tall.row_bytes(), 2048);
        assert_eq!(tall.checked_row_bytes(), Some(2048));
        assert_eq!((tall.layer_bytes(), tall.total_bytes()), (usize::MAX, usize::MAX));
        assert!(matches!(tall.validate(), Err(ConfigError::TooLarge { .. })));
        let deep =
            KvConfig { layout: KvLayout::Mha { head_num: 1 << 16, head_dim: 1 << 16 }, layer_num: u32::MAX, ..ok };
        assert_eq!(deep.checked_layer_bytes(), Some(deep.rows() << 33));
        assert_eq!((deep.checked_total_bytes(), deep.total_bytes()), (None, usize::MAX));
        assert!(matches!(deep.validate(), Err(ConfigError::TooLarge { .. })));
        // `rows` saturates too.
        let rows = KvConfig { size: usize::MAX, ..ok };
        assert_eq!(rows.rows(), usize::MAX);
        assert_eq!((rows.layer_bytes(), rows.total_bytes()), (usize::MAX, usize::MAX));
        assert!(matches!(rows.validate(), Err(ConfigError::TooLarge { .. })));
        // Every row's element count fits a 64-bit usize: both parts are u32.
        #[cfg(target_pointer_width = "64")]
        {
            let mla = KvLayout::Mla { kv_lora_rank: u32::MAX, qk_rope_head_dim: u32::MAX };
            assert_eq!(mla.checked_row_elems(), Some(2 * u32::MAX as usize));
            let mha = KvLayout::Mha { head_num: u32::MAX, head_dim: u32::MAX };
            assert_eq!(mha.row_elems(), u32::MAX as usize * u32::MAX as usize);
        }
        // A valid configuration is unchanged, and the checked forms agree with it.
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.checked_row_bytes(), Some(ok.row_bytes()));
        assert_eq!(ok.checked_layer_bytes(), Some(ok.rows() * 2048));
        assert_eq!(ok.checked_total_bytes(), Some(32 * 2 * ok.rows() * 2048));
        assert_eq!(ok.total_bytes(), 32 * 2 * ok.rows() * 2048);
    }
}
