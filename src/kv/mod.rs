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
    pub fn stored_bytes(self, src_bytes: usize) -> usize {
        match self {
            RowStore::Copy => src_bytes,
            RowStore::Fp8E4m3 { src, .. } => src_bytes / src.bytes(),
        }
    }

    /// Bytes of source per stored element (1 for a copy).
    pub fn src_elem_bytes(self) -> usize {
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
    /// Elements per row.
    pub fn row_elems(self) -> usize {
        match self {
            KvLayout::Mha { head_num, head_dim } => head_num as usize * head_dim as usize,
            KvLayout::Mla { kv_lora_rank, qk_rope_head_dim } => kv_lora_rank as usize + qk_rope_head_dim as usize,
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
    pub fn rows(&self) -> usize {
        self.size + self.page_size as usize
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.layout.row_elems() * self.dtype.bytes()
    }

    /// Bytes of one layer's buffer.
    pub fn layer_bytes(&self) -> usize {
        self.rows() * self.row_bytes()
    }

    /// Bytes of the whole cache (all layers, all buffers).
    pub fn total_bytes(&self) -> usize {
        self.layer_bytes() * self.layer_num as usize * self.layout.buffers()
    }

    /// Check that the configuration is usable.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero dimension, [`ConfigError::ZeroPageSize`],
    /// [`ConfigError::TooLarge`] when slots overflow `u32` or sizes overflow `usize`.
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
        (self.rows())
            .checked_mul(self.row_bytes())
            .and_then(|b| b.checked_mul(self.layer_num as usize * self.layout.buffers()))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(too_large)?;
        if self.row_bytes() > u32::MAX as usize {
            return Err(ConfigError::TooLarge { size: self.row_bytes() as u64, page_size: self.page_size });
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
}
