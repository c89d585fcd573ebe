//! Sliding-window (SWA) KV layouts: models that interleave full-attention layers and
//! sliding-window layers (Gemma 2 and 3, gpt-oss), after SGLang's `SWAKVPool`.
//!
//! Such a model keeps two KV pools. The full layers' buffers have `full_size +
//! page_size` rows, addressed by the *full* slots the allocator hands out; the window
//! layers' buffers have `window_size + page_size` rows (`window_size` is usually much
//! smaller: a window layer only attends to the last few thousand tokens), addressed
//! through the **full-to-window mapping** (SGLang's `full_to_swa_index_mapping`):
//!
//! * one `u32` entry per full slot, `(full_pages + 1) * page_size` entries
//!   ([`SwaKvConfig::map_len`]), kept by the dual allocator on the host;
//! * entry = the token's window slot, **0 = no window slot** (freed, or never mapped:
//!   slot 0 / page 0 of each pool is never handed out, so row 0 of a window buffer is
//!   a dummy row);
//! * a full page `P` maps to a window page `W` as a whole: slot `P*ps + k` -> `W*ps + k`.
//!
//! [`SwaLayout`] says which layers are which ([`SwaLayout::gemma3`],
//! [`SwaLayout::alternating`] for the published patterns); [`SwaKvConfig`] gives the
//! buffer sizes; [`SwaHostKv::scatter`] is the host reference of the mapped scatter
//! (the `swa_scatter_*` kernel, `kvpool::cuda::swa` under feature `cuda`): token `i`'s
//! K and V rows of every layer go to full slot `loc[i]` in full layers and to window
//! slot `map[loc[i]]` in window layers, skipped when that entry is 0 (SGLang writes such
//! a token to the dummy row 0 instead, which nothing reads: skipping is the same for
//! every reader and saves the bandwidth).

use core::mem::size_of;

use bytemuck::Pod;

use super::{KvConfig, KvDtype, KvError, KvLayout};
use crate::alloc::SwaWindow;
use crate::error::{ConfigError, LayerFault};
use crate::sync::atomic::{AtomicU32, Ordering};

/// Which attention a layer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Full attention: its KV lives in the full pool, at the full slot.
    Full,
    /// Sliding-window attention: its KV lives in the window pool, at the mapped slot.
    Window,
}

/// Which layers of a model are full-attention and which sliding-window layers.
///
/// SGLang's `full_attention_layer_ids` / `swa_attention_layer_ids`: the two lists
/// partition `0..num_layers`, and a layer's index *within its list* is its layer in
/// that pool (the full pool has `full_layers().len()` layers, the window pool
/// `window_layers().len()`).
///
/// # Examples
///
/// Gemma 3 27B (62 layers, one global layer after every five local ones):
///
/// ```
/// use kvpool::kv::swa::{LayerKind, SwaLayout};
/// let layout = SwaLayout::gemma3(62)?;
/// assert_eq!(&layout.full_layers()[..3], &[5, 11, 17]);
/// assert_eq!(layout.window_layers().len(), 52);
/// assert_eq!(layout.layer(11), Some((LayerKind::Full, 1)));   // second layer of the full pool
/// assert_eq!(layout.layer(12), Some((LayerKind::Window, 10)));
/// # Ok::<(), kvpool::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SwaLayout {
    full: Box<[u32]>,
    window: Box<[u32]>,
    /// Per model layer: its kind and its index in that pool.
    index: Box<[(LayerKind, u32)]>,
}

impl SwaLayout {
    /// The layout with these lists (kept in the given order: a layer's position in its
    /// list is its layer in that pool).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] when `num_layers` is 0 or a list is empty (a model with
    /// no window layers needs no SWA pool; one with no full layers has no full pool);
    /// [`ConfigError::LayerPartition`] when the lists are not a partition of
    /// `0..num_layers` (an id out of range, listed twice, or missing).
    pub fn new(num_layers: u32, full: &[u32], window: &[u32]) -> Result<SwaLayout, ConfigError> {
        if num_layers == 0 {
            return Err(ConfigError::Zero("num_layers"));
        }
        if full.is_empty() {
            return Err(ConfigError::Zero("full attention layers"));
        }
        if window.is_empty() {
            return Err(ConfigError::Zero("sliding window layers"));
        }
        let fault = |layer, fault| ConfigError::LayerPartition { layer, num_layers, fault };
        let mut index: Vec<Option<(LayerKind, u32)>> = vec![None; num_layers as usize];
        for (kind, list) in [(LayerKind::Full, full), (LayerKind::Window, window)] {
            for (i, &layer) in list.iter().enumerate() {
                let cell = index.get_mut(layer as usize).ok_or(fault(layer, LayerFault::OutOfRange))?;
                if cell.is_some() {
                    return Err(fault(layer, LayerFault::Repeated));
                }
                *cell = Some((kind, i as u32));
            }
        }
        let index = index
            .iter()
            .enumerate()
            .map(|(l, c)| c.ok_or(fault(l as u32, LayerFault::Missing)))
            .collect::<Result<Box<[_]>, _>>()?;
        Ok(SwaLayout { full: full.into(), window: window.into(), index })
    }

    /// Layer `l` is a window layer exactly when `window[l]`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn from_window_flags(window: &[bool]) -> Result<SwaLayout, ConfigError> {
        let n = u32::try_from(window.len())
            .map_err(|_| ConfigError::TooLarge { size: window.len() as u64, page_size: 1 })?;
        let (w, f): (Vec<u32>, Vec<u32>) = (0..n).partition(|&l| window[l as usize]);
        SwaLayout::new(n, &f, &w)
    }

    /// One full layer after every `n - 1` window layers: layer `l` is full when `(l + 1)
    /// % n == 0`. This is the rule of Hugging Face `transformers` for the default
    /// `layer_types` of Gemma 3 (`sliding_window_pattern`, 6) and, with `n = 2`, of
    /// Gemma 2 and gpt-oss (`"sliding_attention" if bool((i + 1) % n) else
    /// "full_attention"`).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for `n == 0`, for `n == 1` (no window layers) and for
    /// `num_layers < n` (no full layer).
    pub fn every_nth_full(num_layers: u32, n: u32) -> Result<SwaLayout, ConfigError> {
        if n == 0 {
            return Err(ConfigError::Zero("full layer period"));
        }
        let (full, window): (Vec<u32>, Vec<u32>) = (0..num_layers).partition(|&l| (l + 1) % n == 0);
        SwaLayout::new(num_layers, &full, &window)
    }

    /// Gemma 3: five sliding-window layers, then one full layer (`every_nth_full(num_layers,
    /// 6)`; 26 layers for Gemma 3 1B, 34 for 4B, 48 for 12B, 62 for 27B).
    ///
    /// # Errors
    ///
    /// As [`every_nth_full`](Self::every_nth_full).
    pub fn gemma3(num_layers: u32) -> Result<SwaLayout, ConfigError> {
        SwaLayout::every_nth_full(num_layers, 6)
    }

    /// Gemma 2 and gpt-oss: window and full layers alternate, layer 0 a window layer
    /// (`every_nth_full(num_layers, 2)`; gpt-oss-20b has 24 layers, gpt-oss-120b 36).
    ///
    /// # Errors
    ///
    /// As [`every_nth_full`](Self::every_nth_full).
    pub fn alternating(num_layers: u32) -> Result<SwaLayout, ConfigError> {
        SwaLayout::every_nth_full(num_layers, 2)
    }

    /// The model's layer count.
    pub fn num_layers(&self) -> u32 {
        self.index.len() as u32
    }

    /// The full-attention layers, in pool order.
    pub fn full_layers(&self) -> &[u32] {
        &self.full
    }

    /// The sliding-window layers, in pool order.
    pub fn window_layers(&self) -> &[u32] {
        &self.window
    }

    /// Layer `layer`'s kind and its layer index in that pool (`None` past the last).
    pub fn layer(&self, layer: u32) -> Option<(LayerKind, u32)> {
        self.index.get(layer as usize).copied()
    }
}

/// The shape of an SWA model's KV: its [`SwaLayout`], the MHA row shape shared by both
/// pools, and the two capacities.
///
/// # Examples
///
/// gpt-oss-20b (24 layers alternating, 8 KV heads of 64, bf16) with 1 M full tokens and a
/// window pool of 128 K tokens:
///
/// ```
/// use kvpool::kv::swa::{SwaKvConfig, SwaLayout};
/// use kvpool::kv::KvDtype;
/// let cfg = SwaKvConfig {
///     layers: SwaLayout::alternating(24)?,
///     head_num: 8,
///     head_dim: 64,
///     dtype: KvDtype::Bf16,
///     full_size: 1 << 20,
///     window_size: 1 << 17,
///     page_size: 16,
/// };
/// cfg.validate()?;
/// assert_eq!(cfg.row_bytes(), 1024);
/// assert_eq!(cfg.layer_rows(1), Some((1 << 20) + 16));     // layer 1 is full
/// assert_eq!(cfg.layer_rows(0), Some((1 << 17) + 16));     // layer 0 is a window layer
/// assert_eq!(cfg.map_len(), (1 << 20) + 16);               // one entry per full slot
/// assert_eq!(cfg.full_config().layer_num, 12);
/// # Ok::<(), kvpool::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SwaKvConfig {
    /// Which layers are full and which window layers.
    pub layers: SwaLayout,
    /// KV heads (both kinds of layer).
    pub head_num: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// The stored element type.
    pub dtype: KvDtype,
    /// Token capacity of the full pool (a multiple of `page_size`).
    pub full_size: usize,
    /// Token capacity of the window pool (a multiple of `page_size`).
    pub window_size: usize,
    /// Tokens per page, both pools.
    pub page_size: u32,
}

impl SwaKvConfig {
    fn pool(&self, layers: usize, size: usize) -> KvConfig {
        KvConfig {
            layout: KvLayout::Mha { head_num: self.head_num, head_dim: self.head_dim },
            dtype: self.dtype,
            layer_num: layers as u32,
            size,
            page_size: self.page_size,
        }
    }

    /// The full pool: `full_layers().len()` layers of `full_size + page_size` rows.
    pub fn full_config(&self) -> KvConfig {
        self.pool(self.layers.full.len(), self.full_size)
    }

    /// The window pool: `window_layers().len()` layers of `window_size + page_size` rows.
    pub fn window_config(&self) -> KvConfig {
        self.pool(self.layers.window.len(), self.window_size)
    }

    /// Check that both pools are usable and the mapping table fits.
    ///
    /// # Errors
    ///
    /// As [`KvConfig::validate`] for either pool; [`ConfigError::NotAMultiple`] when a
    /// capacity is not a whole number of pages (the table has one entry per slot of
    /// whole pages).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.full_config().validate()?;
        self.window_config().validate()?;
        for (what, size) in [("full_size", self.full_size), ("window_size", self.window_size)] {
            if size % self.page_size as usize != 0 {
                return Err(ConfigError::NotAMultiple {
                    what,
                    value: size,
                    of: "page_size",
                    unit: self.page_size as usize,
                });
            }
        }
        Ok(())
    }

    /// Bytes per row (K or V of one token in one layer), both pools. `usize::MAX` when
    /// that overflows (a configuration [`validate`](Self::validate) refuses; see
    /// [`KvConfig::row_bytes`]).
    pub fn row_bytes(&self) -> usize {
        self.full_config().row_bytes()
    }

    /// Rows of layer `layer`'s buffers: `full_size + page_size` for a full layer,
    /// `window_size + page_size` for a window layer, `None` past the last layer.
    /// `Some(usize::MAX)` when the rows overflow (see [`KvConfig::rows`]).
    pub fn layer_rows(&self, layer: u32) -> Option<usize> {
        self.layers.layer(layer).map(|(kind, _)| match kind {
            LayerKind::Full => self.full_config().rows(),
            LayerKind::Window => self.window_config().rows(),
        })
    }

    /// Entries of the full-to-window mapping table: one per full slot, `(full_pages +
    /// 1) * page_size`. `usize::MAX` when that overflows (a configuration
    /// [`validate`](Self::validate) refuses).
    pub fn map_len(&self) -> usize {
        self.full_size.saturating_add(self.page_size as usize)
    }

    /// Bytes of all K and V buffers of both pools. `usize::MAX` (never a real size) when
    /// that overflows `usize`, a configuration [`validate`](Self::validate) refuses.
    pub fn total_bytes(&self) -> usize {
        self.full_config().total_bytes().saturating_add(self.window_config().total_bytes())
    }
}

/// A host view of the full-to-window mapping table: `[u32]`, `[AtomicU32]`, or the
/// lock-free [`SwaAllocator`](crate::alloc::SwaAllocator)'s own table
/// ([`SwaWindow`]); atomic entries are read with `Acquire` (an entry the allocator
/// published is seen with everything written before it).
pub trait MappingTable {
    /// Entries in the table.
    fn entries(&self) -> usize;
    /// Entry `i` (the window slot of full slot `i`, 0 for none). `i < entries()`.
    fn entry(&self, i: usize) -> u32;
}

impl MappingTable for [u32] {
    fn entries(&self) -> usize {
        self.len()
    }
    fn entry(&self, i: usize) -> u32 {
        self[i]
    }
}

impl MappingTable for [AtomicU32] {
    fn entries(&self) -> usize {
        self.len()
    }
    fn entry(&self, i: usize) -> u32 {
        self[i].load(Ordering::Acquire)
    }
}

/// The mapping of an [`SwaAllocator`](crate::alloc::SwaAllocator) (its
/// [`window()`](crate::alloc::SwaAllocator::window)), read entry by entry with
/// `Acquire` as [`SwaAllocator::window_slot`](crate::alloc::SwaAllocator::window_slot) does.
impl MappingTable for SwaWindow {
    fn entries(&self) -> usize {
        self.mapping_len()
    }
    fn entry(&self, i: usize) -> u32 {
        u32::try_from(i).ok().and_then(|s| self.slot_of(s)).unwrap_or(0)
    }
}

/// Dense K or V source rows of every layer for a scatter, of element type `T` (the
/// cache dtype's size, or `u8` for raw bytes): token `i` of layer `l` starts at element
/// `l * layer_stride + i * row_stride`.
#[derive(Clone, Copy, Debug)]
pub struct SwaSource<'a, T: Pod> {
    /// The elements.
    pub data: &'a [T],
    /// Elements from one token's row to the next (at least a row when there are two
    /// or more tokens).
    pub row_stride: usize,
    /// Elements from one layer to the next.
    pub layer_stride: usize,
}

impl<T: Pod> SwaSource<'_, T> {
    /// The source as bytes: `(bytes, row stride, layer stride)` in bytes. A stride
    /// whose bytes overflow `usize` saturates: unused (one token, one layer) it changes
    /// nothing, used it makes the checked extent in [`SwaHostKv::scatter`] overflow
    /// (rows are at least one byte), a [`KvError::Shape`].
    fn bytes(&self) -> (&[u8], usize, usize) {
        let t = size_of::<T>();
        (bytemuck::cast_slice(self.data), self.row_stride.saturating_mul(t), self.layer_stride.saturating_mul(t))
    }
}

/// What a mapped scatter wrote, counted per (token, layer); each counts a K and a V row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SwaWrites {
    /// Rows written in full layers.
    pub full: usize,
    /// Rows written in window layers.
    pub window: usize,
    /// Window-layer rows skipped because the token has no window slot (entry 0).
    pub unmapped: usize,
}

/// An SWA model's K and V buffers on the host, in the layout the device uses: each
/// pool's K (and V) buffer holds its layers back to back (pool layer `j` at `j *
/// layer_bytes`), every layer `rows * row_bytes` bytes. The reference the GPU tests
/// hold the `swa_scatter_*` kernel to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwaHostKv {
    cfg: SwaKvConfig,
    /// The full pool's K layers.
    pub full_k: Vec<u8>,
    /// The full pool's V layers.
    pub full_v: Vec<u8>,
    /// The window pool's K layers.
    pub window_k: Vec<u8>,
    /// The window pool's V layers.
    pub window_v: Vec<u8>,
}

impl SwaHostKv {
    /// Zeroed buffers for `cfg`.
    ///
    /// # Errors
    ///
    /// As [`SwaKvConfig::validate`]; [`ConfigError::TooLargeForMemory`] when the host
    /// cannot allocate them.
    pub fn new(cfg: SwaKvConfig) -> Result<SwaHostKv, ConfigError> {
        cfg.validate()?;
        let zeroed = |bytes: usize| -> Result<Vec<u8>, ConfigError> {
            let mut v = Vec::new();
            v.try_reserve_exact(bytes)
                .map_err(|_| ConfigError::TooLargeForMemory { what: "an SWA host KV buffer", bytes: bytes as u64 })?;
            v.resize(bytes, 0);
            Ok(v)
        };
        let (f, w) = (cfg.full_config(), cfg.window_config());
        let full = f.layer_bytes() * f.layer_num as usize;
        let window = w.layer_bytes() * w.layer_num as usize;
        Ok(SwaHostKv {
            full_k: zeroed(full)?,
            full_v: zeroed(full)?,
            window_k: zeroed(window)?,
            window_v: zeroed(window)?,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SwaKvConfig {
        &self.cfg
    }

    /// Model layer `layer`'s K (`v == false`) or V buffer: `layer_rows(layer) *
    /// row_bytes` bytes (`None` past the last layer).
    pub fn layer(&self, layer: u32, v: bool) -> Option<&[u8]> {
        let (kind, j) = self.cfg.layers.layer(layer)?;
        let (buf, c) = match (kind, v) {
            (LayerKind::Full, false) => (&self.full_k, self.cfg.full_config()),
            (LayerKind::Full, true) => (&self.full_v, self.cfg.full_config()),
            (LayerKind::Window, false) => (&self.window_k, self.cfg.window_config()),
            (LayerKind::Window, true) => (&self.window_v, self.cfg.window_config()),
        };
        buf.get(j as usize * c.layer_bytes()..(j as usize + 1) * c.layer_bytes())
    }

    /// The mapped scatter (the `swa_scatter_*` kernel): for every token `i` and layer
    /// `l`, source rows `i` of layer `l` (K and V) are written to row `loc[i]` of a full
    /// layer, or to row `map[loc[i]]` of a window layer (skipped when that is 0).
    ///
    /// Everything is checked before anything is written: the element type against the
    /// dtype (`u8` is raw bytes and always fits), the sources' extents (`num_layers`
    /// layers of `loc.len()` rows), the table's length ([`SwaKvConfig::map_len`]), every
    /// `loc[i]` against the full rows and every mapped slot a window layer would write
    /// against the window rows. Two tokens writing one row is allowed here (the last
    /// wins) but unspecified on the GPU: give each token its own slot.
    ///
    /// # Errors
    ///
    /// [`KvError::Format`] for the element type, [`KvError::Shape`] / [`KvError::BadRow`]
    /// for the sources and the table, [`KvError::SlotOutOfRange`] for a slot; nothing
    /// is written then.
    ///
    /// # Examples
    ///
    /// Two layers (0: window, 1: full), one-byte rows, pages of 2; full page 1 (slots 2,
    /// 3) maps to window page 1, full page 2 has no window page:
    ///
    /// ```
    /// use kvpool::kv::swa::{SwaHostKv, SwaKvConfig, SwaLayout, SwaSource};
    /// use kvpool::kv::KvDtype;
    /// let cfg = SwaKvConfig { layers: SwaLayout::alternating(2)?, head_num: 1, head_dim: 1,
    ///     dtype: KvDtype::Fp8E4m3, full_size: 4, window_size: 2, page_size: 2 };
    /// let mut kv = SwaHostKv::new(cfg)?;
    /// let map = [0u32, 0, 2, 3, 0, 0];                     // full slot -> window slot
    /// let k = [10u8, 11, 20, 21];                           // layer 0: tokens 0, 1; layer 1
    /// let v = [12u8, 13, 22, 23];
    /// let src = |d| SwaSource { data: d, row_stride: 1, layer_stride: 2 };
    /// let w = kv.scatter(src(&k), src(&v), &[3, 4], &map[..])?;
    /// assert_eq!((w.full, w.window, w.unmapped), (2, 1, 1));
    /// assert_eq!(kv.layer(0, false).unwrap(), &[0, 0, 0, 10]); // token 0 at window slot 3
    /// assert_eq!(kv.layer(1, false).unwrap(), &[0, 0, 0, 20, 21, 0]);
    /// assert_eq!(kv.layer(1, true).unwrap(), &[0, 0, 0, 22, 23, 0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn scatter<T: Pod, M: MappingTable + ?Sized>(
        &mut self,
        k: SwaSource<'_, T>,
        v: SwaSource<'_, T>,
        loc: &[u32],
        map: &M,
    ) -> Result<SwaWrites, KvError> {
        let cfg = &self.cfg;
        let t = size_of::<T>();
        if t != 1 && t != cfg.dtype.bytes() {
            return Err(KvError::Format { what: "the source element type does not match the cache dtype" });
        }
        let row = cfg.row_bytes();
        let layers = cfg.layers.num_layers() as usize;
        let n = loc.len();
        let (k, v) = (k.bytes(), v.bytes());
        for (what, (data, row_stride, layer_stride)) in [("k", k), ("v", v)] {
            if n > 1 && row_stride < row {
                return Err(KvError::BadRow { what, bytes: row_stride });
            }
            if n > 0 {
                let need = (layers - 1)
                    .checked_mul(layer_stride)
                    .and_then(|a| (n - 1).checked_mul(row_stride).and_then(|b| a.checked_add(b)))
                    .and_then(|a| a.checked_add(row))
                    .ok_or(KvError::Shape { what, got: data.len(), expected: usize::MAX })?;
                if data.len() < need {
                    return Err(KvError::Shape { what, got: data.len(), expected: need });
                }
            }
        }
        if map.entries() != cfg.map_len() {
            return Err(KvError::Shape { what: "mapping table", got: map.entries(), expected: cfg.map_len() });
        }
        let (full_rows, window_rows) = (cfg.full_config().rows(), cfg.window_config().rows());
        let mut window_slots = Vec::with_capacity(n);
        for &slot in loc {
            if slot as usize >= full_rows {
                return Err(KvError::SlotOutOfRange { slot, rows: full_rows });
            }
            let w = map.entry(slot as usize);
            if w as usize >= window_rows {
                return Err(KvError::SlotOutOfRange { slot: w, rows: window_rows });
            }
            window_slots.push(w);
        }
        let mut writes = SwaWrites::default();
        for l in 0..layers {
            let (kind, j) = cfg.layers.layer(l as u32).expect("l < num_layers");
            let (pool_k, pool_v, pool) = match kind {
                LayerKind::Full => (&mut self.full_k, &mut self.full_v, cfg.full_config()),
                LayerKind::Window => (&mut self.window_k, &mut self.window_v, cfg.window_config()),
            };
            let base = j as usize * pool.layer_bytes();
            for (i, (&slot, &w)) in loc.iter().zip(&window_slots).enumerate() {
                let dst_row = match kind {
                    LayerKind::Full => {
                        writes.full += 1;
                        slot
                    }
                    LayerKind::Window if w == 0 => {
                        writes.unmapped += 1;
                        continue;
                    }
                    LayerKind::Window => {
                        writes.window += 1;
                        w
                    }
                };
                let at = base + dst_row as usize * row;
                for (pool_buf, (data, row_stride, layer_stride)) in [(&mut *pool_k, k), (&mut *pool_v, v)] {
                    let src = &data[l * layer_stride + i * row_stride..][..row];
                    pool_buf[at..at + row].copy_from_slice(src);
                }
            }
        }
        Ok(writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(layer: u32, num_layers: u32, fault: LayerFault) -> ConfigError {
        ConfigError::LayerPartition { layer, num_layers, fault }
    }

    #[test]
    fn layouts_must_partition_the_layers() {
        let ok = SwaLayout::new(4, &[3, 1], &[0, 2]).unwrap();
        assert_eq!(ok.layer(3), Some((LayerKind::Full, 0)));
        assert_eq!(ok.layer(1), Some((LayerKind::Full, 1)));
        assert_eq!(ok.layer(2), Some((LayerKind::Window, 1)));
        assert_eq!(ok.layer(4), None);
        assert_eq!(SwaLayout::new(4, &[1, 3], &[0, 4]), Err(partition(4, 4, LayerFault::OutOfRange)));
        assert_eq!(SwaLayout::new(4, &[1, 3], &[0, 1, 2]), Err(partition(1, 4, LayerFault::Repeated)));
        assert_eq!(SwaLayout::new(4, &[1, 1], &[0, 2]), Err(partition(1, 4, LayerFault::Repeated)));
        assert_eq!(SwaLayout::new(4, &[1], &[0, 2]), Err(partition(3, 4, LayerFault::Missing)));
        assert_eq!(SwaLayout::new(4, &[u32::MAX], &[0]), Err(partition(u32::MAX, 4, LayerFault::OutOfRange)));
        assert_eq!(SwaLayout::new(0, &[], &[]), Err(ConfigError::Zero("num_layers")));
        assert_eq!(SwaLayout::new(2, &[], &[0, 1]), Err(ConfigError::Zero("full attention layers")));
        assert_eq!(SwaLayout::new(2, &[0, 1], &[]), Err(ConfigError::Zero("sliding window layers")));
        let e = SwaLayout::new(4, &[1], &[0, 2]).unwrap_err().to_string();
        assert!(e.contains("layer 3 is in neither list"), "{e}");
    }

    #[test]
    fn published_patterns() {
        // Gemma 3 1B: 26 layers, full at 5, 11, 17, 23 (transformers' default layer_types).
        let g = SwaLayout::gemma3(26).unwrap();
        assert_eq!(g.full_layers(), &[5, 11, 17, 23]);
        assert_eq!(g.window_layers().len(), 22);
        assert_eq!(g.window_layers()[..6], [0, 1, 2, 3, 4, 6]);
        // gpt-oss-20b / Gemma 2: even layers slide, odd layers are full.
        let a = SwaLayout::alternating(24).unwrap();
        assert_eq!(a.full_layers(), (0..12).map(|i| 2 * i + 1).collect::<Vec<_>>());
        assert_eq!(a.layer(0), Some((LayerKind::Window, 0)));
        assert_eq!(a, SwaLayout::from_window_flags(&(0..24).map(|l| l % 2 == 0).collect::<Vec<_>>()).unwrap());
        assert_eq!(SwaLayout::every_nth_full(4, 0), Err(ConfigError::Zero("full layer period")));
        assert_eq!(SwaLayout::every_nth_full(4, 1), Err(ConfigError::Zero("sliding window layers")));
        assert_eq!(SwaLayout::gemma3(5), Err(ConfigError::Zero("full attention layers")));
    }

    fn small() -> SwaKvConfig {
        SwaKvConfig {
            layers: SwaLayout::new(3, &[1], &[0, 2]).unwrap(),
            head_num: 1,
            head_dim: 2,
            dtype: KvDtype::F16,
            full_size: 8,
            window_size: 4,
            page_size: 2,
        }
    }

    #[test]
    fn config_sizes_and_validation() {
        let c = small();
        c.validate().unwrap();
        assert_eq!(c.row_bytes(), 4);
        assert_eq!((c.layer_rows(0), c.layer_rows(1), c.layer_rows(3)), (Some(6), Some(10), None));
        assert_eq!(c.map_len(), 10);
        assert_eq!(c.total_bytes(), 2 * (10 * 4) + 2 * 2 * (6 * 4));
        let bad = SwaKvConfig { window_size: 5, ..small() };
        assert!(matches!(bad.validate(), Err(ConfigError::NotAMultiple { what: "window_size", .. })));
        assert_eq!(SwaKvConfig { head_dim: 0, ..small() }.validate(), Err(ConfigError::Zero("head_dim")));
        assert_eq!(SwaKvConfig { page_size: 0, ..small() }.validate(), Err(ConfigError::ZeroPageSize));
        assert!(SwaKvConfig { full_size: u32::MAX as usize - 1, ..small() }.validate().is_err());
    }

    /// The sizes of a configuration `validate` refuses saturate at `usize::MAX` (as
    /// [`KvConfig`]'s do) instead of overflowing: the sum of the two pools and the
    /// mapping table's length panicked in debug builds and wrapped in release ones.
    #[test]
    fn sizes_of_an_unvalidated_config_saturate() {
        let huge_rows = SwaKvConfig { window_size: usize::MAX - 1, ..small() };
        assert_eq!(huge_rows.window_config().rows(), usize::MAX);
        assert_eq!(huge_rows.total_bytes(), usize::MAX);
        assert_eq!(huge_rows.layer_rows(0), Some(usize::MAX));
        assert!(matches!(huge_rows.validate(), Err(ConfigError::TooLarge { .. })));
        let huge_map = SwaKvConfig { full_size: usize::MAX - 1, ..small() };
        assert_eq!((huge_map.map_len(), huge_map.total_bytes()), (usize::MAX, usize::MAX));
        assert!(matches!(huge_map.validate(), Err(ConfigError::TooLarge { .. })));
        let wide = SwaKvConfig { head_num: u32::MAX, head_dim: u32::MAX, dtype: KvDtype::F32, ..small() };
        assert_eq!((wide.row_bytes(), wide.total_bytes()), (usize::MAX, usize::MAX));
        assert!(matches!(wide.validate(), Err(ConfigError::TooLarge { .. })));
        // Each pool fits on its own; together they do not.
        let big =
            SwaKvConfig { head_num: 1 << 16, head_dim: 1 << 16, full_size: 1 << 29, window_size: 1 << 28, ..small() };
        let (f, w) = (big.full_config().total_bytes(), big.window_config().total_bytes());
        assert!(f < usize::MAX && w < usize::MAX && f.checked_add(w).is_none(), "{f} {w}");
        assert_eq!(big.total_bytes(), usize::MAX);
        assert!(matches!(big.validate(), Err(ConfigError::TooLarge { .. })));
    }

    #[test]
    fn scatter_maps_window_layers_and_skips_unmapped_tokens() {
        let mut kv = SwaHostKv::new(small()).unwrap();
        // Full page 2 (slots 4, 5) -> window page 1 (2, 3); full page 3 unmapped.
        let mut map = [0u32; 10];
        map[4] = 2;
        map[5] = 3;
        // 3 layers x 2 tokens x 2 f16, tokens 2 elements apart, layers 4 apart.
        let k: Vec<u16> = (0..12).map(|x| 100 + x).collect();
        let v: Vec<u16> = (0..12).map(|x| 200 + x).collect();
        let src = |d| SwaSource { data: d, row_stride: 2, layer_stride: 4 };
        let w = kv.scatter(src(&k), src(&v), &[5, 6], &map[..]).unwrap();
        assert_eq!(w, SwaWrites { full: 2, window: 2, unmapped: 2 });
        let le = |xs: &[u16]| -> Vec<u8> { xs.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let row_at = |buf: &[u8], r: usize| buf[r * 4..r * 4 + 4].to_vec();
        // Layer 0 (window): token 0 (full slot 5) at window slot 3; token 1 skipped.
        let mut l0 = [0u8; 6 * 4];
        l0[12..16].copy_from_slice(&le(&[100, 101]));
        assert_eq!(kv.layer(0, false).unwrap(), &l0[..]);
        // Layer 1 (full): both tokens at 5 and 6.
        let l1 = kv.layer(1, true).unwrap();
        assert_eq!((row_at(l1, 5), row_at(l1, 6)), (le(&[204, 205]), le(&[206, 207])));
        // Layer 2 (window, V).
        assert_eq!(row_at(kv.layer(2, true).unwrap(), 3), le(&[208, 209]));
        // The same through an atomic table.
        let atomic: Vec<AtomicU32> = map.iter().map(|&e| AtomicU32::new(e)).collect();
        let mut kv2 = SwaHostKv::new(small()).unwrap();
        kv2.scatter(src(&k), src(&v), &[5, 6], &atomic[..]).unwrap();
        assert_eq!(kv2, kv);
    }

    #[test]
    fn the_allocators_table_is_a_mapping_table() {
        use crate::alloc::SwaAllocator;
        use crate::KvAllocator;
        let cfg = small(); // full 8 tokens, window 4, pages of 2
        let alloc = SwaAllocator::new(cfg.full_size, cfg.window_size, cfg.page_size).unwrap();
        let mut slots = [0u32; 4];
        alloc.alloc(&mut slots).unwrap(); // two full pages, each with a window page
        let window = alloc.window();
        assert_eq!(window.entries(), cfg.map_len());
        let mut copy = vec![0u32; cfg.map_len()];
        window.copy_mapping(0, &mut copy).unwrap();
        assert!((0..cfg.map_len()).all(|i| window.entry(i) == copy[i]));
        assert!(slots.iter().all(|&s| window.entry(s as usize) != 0), "{slots:?} {copy:?}");
        let k: Vec<u16> = (0..3 * 4 * 2).map(|x| x as u16 + 1).collect();
        let src = SwaSource { data: &k[..], row_stride: 2, layer_stride: 8 };
        let (mut a, mut b) = (SwaHostKv::new(cfg.clone()).unwrap(), SwaHostKv::new(cfg).unwrap());
        let wa = a.scatter(src, src, &slots, window).unwrap();
        let wb = b.scatter(src, src, &slots, &copy[..]).unwrap();
        assert_eq!((wa, &a), (wb, &b));
        assert_eq!(wa.window, 2 * 4);
    }

    #[test]
    fn scatter_checks_everything_first() {
        let mut kv = SwaHostKv::new(small()).unwrap();
        let before = kv.clone();
        let mut map = vec![0u32; 10];
        let k = vec![1u16; 12];
        fn src(d: &[u16]) -> SwaSource<'_, u16> {
            SwaSource { data: d, row_stride: 2, layer_stride: 4 }
        }
        let go = |kv: &mut SwaHostKv, loc: &[u32], map: &[u32], k: &[u16]| kv.scatter(src(k), src(k), loc, map);
        assert_eq!(
            go(&mut kv, &[5, 6], &map[..9], &k),
            Err(KvError::Shape { what: "mapping table", got: 9, expected: 10 })
        );
        assert_eq!(go(&mut kv, &[5, 10], &map, &k), Err(KvError::SlotOutOfRange { slot: 10, rows: 10 }));
        map[6] = 6;
        assert_eq!(go(&mut kv, &[5, 6], &map, &k), Err(KvError::SlotOutOfRange { slot: 6, rows: 6 }));
        map[6] = 0;
        assert_eq!(go(&mut kv, &[5, 6], &map, &k[..11]), Err(KvError::Shape { what: "k", got: 22, expected: 24 }));
        let tight = SwaSource { data: &k[..], row_stride: 1, layer_stride: 4 };
        assert_eq!(kv.scatter(tight, src(&k), &[5, 6], &map[..]), Err(KvError::BadRow { what: "k", bytes: 2 }));
        let wide = [1u32; 6];
        let wsrc = SwaSource { data: &wide[..], row_stride: 1, layer_stride: 2 };
        assert!(matches!(kv.scatter(wsrc, wsrc, &[5, 6], &map[..]), Err(KvError::Format { .. })));
        assert_eq!(kv, before);
        // No tokens: nothing to check in the sources, nothing written.
        assert_eq!(go(&mut kv, &[], &map, &[]), Ok(SwaWrites::default()));
    }

    /// Element strides whose byte size overflows `usize` are refused by the checked
    /// extent (`KvError::Shape`) with nothing written; `SwaSource::bytes` used to
    /// multiply them by the element size unchecked and panic first. A stride that is
    /// never stepped over (one token, or one layer) stays harmless.
    #[test]
    fn scatter_refuses_strides_whose_bytes_overflow() {
        let cfg = SwaKvConfig {
            layers: SwaLayout::alternating(2).unwrap(),
            head_num: 1,
            head_dim: 1,
            dtype: KvDtype::F16,
            full_size: 4,
            window_size: 2,
            page_size: 2,
        };
        let mut kv = SwaHostKv::new(cfg).unwrap();
        let before = kv.clone();
        let map = [0u32, 0, 2, 3, 0, 0];
        let k = [1u16; 4];
        let src = |row_stride, layer_stride| SwaSource { data: &k[..], row_stride, layer_stride };
        let huge = |what| Err(KvError::Shape { what, got: 8, expected: usize::MAX });
        assert_eq!(kv.scatter(src(usize::MAX, 2), src(1, 2), &[3, 2], &map[..]), huge("k"));
        assert_eq!(kv.scatter(src(1, 2), src(usize::MAX / 2 + 1, 2), &[3, 2], &map[..]), huge("v"));
        assert_eq!(kv.scatter(src(1, usize::MAX), src(1, 2), &[3, 2], &map[..]), huge("k"));
        assert_eq!(kv, before);
        // One token: its row stride is never used.
        let w = kv.scatter(src(usize::MAX, 2), src(usize::MAX, 2), &[3], &map[..]).unwrap();
        assert_eq!((w.full, w.window), (1, 1));
    }
}
