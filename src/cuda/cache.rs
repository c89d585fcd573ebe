//! [`DeviceKvCache`]: the physical KV buffers on the GPU and the row kernels on them.

use cust::memory::{CopyDestination, DeviceBuffer, DevicePointer, DeviceSlice};

use super::launch::{GatherArgs, MlaArgs, MoveArgs, ScatterArgs, StoreKind};
use super::{CudaKvError, KvDevice};
use crate::kv::{KvConfig, KvDtype, KvError, KvLayout, SrcFloat};

/// Which layers an operation covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layers {
    /// One layer (the usual per-layer call from the forward pass).
    One(u32),
    /// Every layer in one launch; the dense side steps `layer_stride` bytes per layer.
    All,
}

/// Dense rows on the device that an operation reads: token `i` of layer `l` starts at
/// byte `l * layer_stride + i * row_stride` of `data`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    /// The device bytes.
    pub data: &'a DeviceSlice<u8>,
    /// Bytes from one token to the next (at least the row's size; more for a view into
    /// a wider tensor, such as the K part of a fused QKV output).
    pub row_stride: usize,
    /// Bytes from one layer to the next ([`Layers::All`] only).
    pub layer_stride: usize,
}

/// Dense rows on the device that an operation writes; laid out as [`Rows`].
#[derive(Debug)]
pub struct RowsMut<'a> {
    /// The device bytes.
    pub data: &'a mut DeviceSlice<u8>,
    /// Bytes from one token to the next.
    pub row_stride: usize,
    /// Bytes from one layer to the next ([`Layers::All`] only).
    pub layer_stride: usize,
}

/// The KV cache on the GPU: SGLang's `MHATokenToKVPool` (K and V buffers per layer)
/// or `MLATokenToKVPool` (one buffer per layer), each layer `size + page_size` rows
/// (slot 0 is the dummy row padded tokens write to), in f16, bf16, f32 or fp8 e4m3.
///
/// A buffer holds all layers back to back (layer `l` at `l * config().layer_bytes()`),
/// so an all-layers kernel needs only a base pointer and a stride.
pub struct DeviceKvCache {
    cfg: KvConfig,
    k: DeviceBuffer<u8>,
    v: Option<DeviceBuffer<u8>>,
    err: DeviceBuffer<u32>,
}

impl core::fmt::Debug for DeviceKvCache {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceKvCache").field("config", &self.cfg).finish()
    }
}

fn extent(what: &'static str, rows: &Rows<'_>, n: usize, layers: usize, row_bytes: usize) -> Result<(), KvError> {
    if n > 1 && rows.row_stride < row_bytes {
        return Err(KvError::BadRow { what, bytes: rows.row_stride });
    }
    if n == 0 || layers == 0 {
        return Ok(());
    }
    let need = (layers - 1)
        .checked_mul(rows.layer_stride)
        .and_then(|a| (n - 1).checked_mul(rows.row_stride).and_then(|b| a.checked_add(b)))
        .and_then(|a| a.checked_add(row_bytes))
        .ok_or(KvError::Shape { what, got: rows.data.len(), expected: usize::MAX })?;
    if rows.data.len() < need {
        return Err(KvError::Shape { what, got: rows.data.len(), expected: need });
    }
    Ok(())
}

/// The widest vector width of `store` that divides every row size and alignment.
fn pick_vec(store: StoreKind, row_bytes: &[usize], aligns: &[u64]) -> Result<u32, KvError> {
    store
        .widths()
        .iter()
        .copied()
        .find(|&w| row_bytes.iter().all(|&b| b % w as usize == 0) && aligns.iter().all(|&a| a % w as u64 == 0))
        .ok_or(KvError::Format { what: "source rows or pointers are not aligned to the source element size" })
}

impl DeviceKvCache {
    /// Allocate (zeroed) buffers for `cfg`.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for an invalid configuration, [`CudaKvError::Cuda`] when
    /// the device is out of memory.
    pub fn new(cfg: KvConfig) -> Result<DeviceKvCache, CudaKvError> {
        cfg.validate()?;
        let bytes = cfg.layer_bytes() * cfg.layer_num as usize;
        let k = DeviceBuffer::zeroed(bytes)?;
        let v = if cfg.layout.buffers() == 2 { Some(DeviceBuffer::zeroed(bytes)?) } else { None };
        let err = DeviceBuffer::zeroed(1)?;
        Ok(DeviceKvCache { cfg, k, v, err })
    }

    /// The configuration.
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// Rows per layer buffer (`size + page_size`).
    pub fn rows(&self) -> usize {
        self.cfg.rows()
    }

    fn layer_slice(buf: &DeviceBuffer<u8>, cfg: &KvConfig, layer: u32) -> Result<DeviceSlice<u8>, KvError> {
        if layer >= cfg.layer_num {
            return Err(KvError::Shape { what: "layer", got: layer as usize, expected: cfg.layer_num as usize });
        }
        let lb = cfg.layer_bytes();
        Ok(buf.index(layer as usize * lb..(layer as usize + 1) * lb))
    }

    /// Layer `layer` of the K buffer (the only buffer of an MLA cache).
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] for a layer past `layer_num`.
    pub fn k_layer(&self, layer: u32) -> Result<DeviceSlice<u8>, KvError> {
        Self::layer_slice(&self.k, &self.cfg, layer)
    }

    /// Layer `layer` of the V buffer (`None` for MLA).
    ///
    /// # Errors
    ///
    /// As [`k_layer`](Self::k_layer).
    pub fn v_layer(&self, layer: u32) -> Result<Option<DeviceSlice<u8>>, KvError> {
        self.v.as_ref().map(|v| Self::layer_slice(v, &self.cfg, layer)).transpose()
    }

    /// `(first layer's byte offset, layer count)`.
    fn span(&self, layers: Layers) -> Result<(usize, u32), KvError> {
        match layers {
            Layers::All => Ok((0, self.cfg.layer_num)),
            Layers::One(l) if l < self.cfg.layer_num => Ok((l as usize * self.cfg.layer_bytes(), 1)),
            Layers::One(l) => {
                Err(KvError::Shape { what: "layer", got: l as usize, expected: self.cfg.layer_num as usize })
            }
        }
    }

    fn store_for(&self, src: Option<SrcFloat>) -> Result<StoreKind, KvError> {
        match (src, self.cfg.dtype) {
            (None, _) => Ok(StoreKind::Copy),
            (Some(f), KvDtype::Fp8E4m3) => Ok(StoreKind::Fp8(f)),
            (Some(_), _) => {
                Err(KvError::Format { what: "a conversion source type needs an fp8 cache (pass None to copy)" })
            }
        }
    }

    fn count(what: &'static str, n: usize) -> Result<u32, KvError> {
        u32::try_from(n).map_err(|_| KvError::Shape { what, got: n, expected: u32::MAX as usize })
    }

    /// SGLang's `set_kv_buffer` for an MHA cache: token `i`'s K and V rows go to row
    /// `slots[i]` of the layer(s), in one launch. With `src: None` the rows are
    /// already in the cache's element type and are copied; with `Some(ty)` (fp8 caches)
    /// each element of type `ty` is stored as `e4m3(x * (1 / scale))`, with
    /// `scales = (k_scale, v_scale)` (see [`kv::fp8`](crate::kv::fp8)).
    ///
    /// Rows are moved with 16-byte accesses when row sizes, strides and pointers allow,
    /// else the widest that fits.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the sources are too short or misaligned, the layer is
    /// out of range, the cache is MLA, or `src` does not fit the dtype; nothing is
    /// launched then. A slot past the buffer is reported later by
    /// [`take_error`](Self::take_error).
    #[allow(clippy::too_many_arguments)]
    pub fn set_kv(
        &self,
        dev: &KvDevice,
        layers: Layers,
        slots: &DeviceSlice<u32>,
        k: Rows<'_>,
        v: Rows<'_>,
        src: Option<SrcFloat>,
        scales: (f32, f32),
    ) -> Result<(), CudaKvError> {
        let KvLayout::Mha { .. } = self.cfg.layout else {
            return Err(KvError::Format { what: "set_kv needs an MHA cache (use set_mla_kv)" }.into());
        };
        let v_buf = self.v.as_ref().expect("MHA caches have a V buffer");
        let store = self.store_for(src)?;
        let (offset, n_layers) = self.span(layers)?;
        let n = Self::count("slots", slots.len())?;
        let src_row = self.cfg.layout.row_elems() * src.map_or(self.cfg.dtype.bytes(), |f| f.bytes());
        extent("k", &k, slots.len(), n_layers as usize, src_row)?;
        extent("v", &v, slots.len(), n_layers as usize, src_row)?;
        let aligns = [
            k.data.as_device_ptr().as_raw(),
            v.data.as_device_ptr().as_raw(),
            k.row_stride as u64,
            v.row_stride as u64,
            k.layer_stride as u64,
            v.layer_stride as u64,
        ];
        let vec = pick_vec(store, &[src_row], &aligns)?;
        if k.row_stride != v.row_stride || k.layer_stride != v.layer_stride {
            return Err(KvError::Format { what: "K and V sources must share their strides" }.into());
        }
        let a = ScatterArgs {
            k_src: k.data.as_device_ptr(),
            v_src: v.data.as_device_ptr(),
            src_row_stride: k.row_stride as u64,
            src_layer_stride: k.layer_stride as u64,
            k_dst: self.k.as_device_ptr().wrapping_add(offset),
            v_dst: v_buf.as_device_ptr().wrapping_add(offset),
            dst_layer_stride: self.cfg.layer_bytes() as u64,
            slots: slots.as_device_ptr(),
            n_tokens: n,
            vecs: (src_row / vec as usize) as u32,
            num_rows: self.cfg.rows() as u32,
            k_inv_scale: 1.0 / scales.0,
            v_inv_scale: 1.0 / scales.1,
            err: self.err.as_device_ptr(),
        };
        // SAFETY: both sources were checked above to hold `n_layers` layers of `n` rows
        // of `vecs * vec` bytes at their strides, and every pointer and stride is a
        // multiple of `vec`; the destinations are this cache's K and V buffers from
        // layer `offset` on, `n_layers` layers of `rows` rows of `row_bytes =
        // vecs * stored(vec)` bytes; `slots` has `n` entries and `err` one. All of them
        // are borrowed for this call and freed only through `Drop`, whose
        // `cuMemFree` waits for the device.
        unsafe { dev.kernels().scatter(dev.stream(), store, vec, n_layers, 2, &a) }
    }

    /// SGLang's `set_mla_kv_buffer`: row `slots[i]` becomes token `i`'s nope row
    /// followed by its rope row (`kv_lora_rank` then `qk_rope_head_dim` elements),
    /// copied or quantized as in [`set_kv`](Self::set_kv) with one scale.
    ///
    /// # Errors
    ///
    /// As [`set_kv`](Self::set_kv) (an MHA cache is refused).
    #[allow(clippy::too_many_arguments)]
    pub fn set_mla_kv(
        &self,
        dev: &KvDevice,
        layers: Layers,
        slots: &DeviceSlice<u32>,
        nope: Rows<'_>,
        rope: Rows<'_>,
        src: Option<SrcFloat>,
        scale: f32,
    ) -> Result<(), CudaKvError> {
        let KvLayout::Mla { kv_lora_rank, qk_rope_head_dim } = self.cfg.layout else {
            return Err(KvError::Format { what: "set_mla_kv needs an MLA cache" }.into());
        };
        let store = self.store_for(src)?;
        let (offset, n_layers) = self.span(layers)?;
        let n = Self::count("slots", slots.len())?;
        let esz = src.map_or(self.cfg.dtype.bytes(), |f| f.bytes());
        let (nope_row, rope_row) = (kv_lora_rank as usize * esz, qk_rope_head_dim as usize * esz);
        extent("nope", &nope, slots.len(), n_layers as usize, nope_row)?;
        extent("rope", &rope, slots.len(), n_layers as usize, rope_row)?;
        let aligns = [
            nope.data.as_device_ptr().as_raw(),
            rope.data.as_device_ptr().as_raw(),
            nope.row_stride as u64,
            rope.row_stride as u64,
            nope.layer_stride as u64,
            rope.layer_stride as u64,
        ];
        let vec = pick_vec(store, &[nope_row, rope_row], &aligns)?;
        let a = MlaArgs {
            nope_src: nope.data.as_device_ptr(),
            nope_row_stride: nope.row_stride as u64,
            nope_layer_stride: nope.layer_stride as u64,
            rope_src: rope.data.as_device_ptr(),
            rope_row_stride: rope.row_stride as u64,
            rope_layer_stride: rope.layer_stride as u64,
            dst: self.k.as_device_ptr().wrapping_add(offset),
            dst_layer_stride: self.cfg.layer_bytes() as u64,
            slots: slots.as_device_ptr(),
            n_tokens: n,
            nope_vecs: (nope_row / vec as usize) as u32,
            rope_vecs: (rope_row / vec as usize) as u32,
            num_rows: self.cfg.rows() as u32,
            inv_scale: 1.0 / scale,
            err: self.err.as_device_ptr(),
        };
        // SAFETY: as in `set_kv`: both sources hold the checked extents at aligned
        // strides; pool rows are `(nope_vecs + rope_vecs) * stored(vec)` =
        // `row_bytes` bytes, `rows` of them per layer from `offset`.
        unsafe { dev.kernels().scatter_mla(dev.stream(), store, vec, n_layers, &a) }
    }

    /// Gather rows `slots[i]` of the layer(s) into dense rows (raw stored bytes: fp8
    /// caches give e4m3 codes), K into `k_out` and V into `v_out` (`None` for MLA).
    ///
    /// # Errors
    ///
    /// As [`set_kv`](Self::set_kv); `v_out` must be given exactly for MHA caches.
    pub fn get_kv(
        &self,
        dev: &KvDevice,
        layers: Layers,
        slots: &DeviceSlice<u32>,
        k_out: RowsMut<'_>,
        v_out: Option<RowsMut<'_>>,
    ) -> Result<(), CudaKvError> {
        if v_out.is_some() != self.v.is_some() {
            return Err(KvError::Format { what: "v_out must be given for MHA caches and only for them" }.into());
        }
        let (offset, n_layers) = self.span(layers)?;
        let n = Self::count("slots", slots.len())?;
        let row = self.cfg.row_bytes();
        let kr = Rows { data: &*k_out.data, row_stride: k_out.row_stride, layer_stride: k_out.layer_stride };
        extent("k_out", &kr, slots.len(), n_layers as usize, row)?;
        let mut aligns = [kr.data.as_device_ptr().as_raw(), kr.row_stride as u64, kr.layer_stride as u64];
        let v_dst = match &v_out {
            Some(v) => {
                let vr = Rows { data: &*v.data, row_stride: v.row_stride, layer_stride: v.layer_stride };
                extent("v_out", &vr, slots.len(), n_layers as usize, row)?;
                if v.row_stride != k_out.row_stride || v.layer_stride != k_out.layer_stride {
                    return Err(KvError::Format { what: "K and V outputs must share their strides" }.into());
                }
                aligns[0] |= v.data.as_device_ptr().as_raw();
                v.data.as_device_ptr()
            }
            None => DevicePointer::null(),
        };
        let vec = pick_vec(StoreKind::Copy, &[row], &aligns)?;
        let v_src = self.v.as_ref().map_or(DevicePointer::null(), |v| v.as_device_ptr().wrapping_add(offset));
        let a = GatherArgs {
            k_src: self.k.as_device_ptr().wrapping_add(offset),
            v_src,
            src_layer_stride: self.cfg.layer_bytes() as u64,
            k_dst: k_out.data.as_device_ptr(),
            v_dst,
            dst_row_stride: k_out.row_stride as u64,
            dst_layer_stride: k_out.layer_stride as u64,
            slots: slots.as_device_ptr(),
            n_tokens: n,
            vecs: (row / vec as usize) as u32,
            num_rows: self.cfg.rows() as u32,
            err: self.err.as_device_ptr(),
        };
        let buffers = self.cfg.layout.buffers() as u32;
        // SAFETY: the outputs were checked to hold `n_layers` layers of `n` rows of
        // `row_bytes` at their (aligned) strides and are mutably borrowed for this
        // call; the sources are this cache's buffers from `offset`; with one buffer
        // the null V pointers are never used (grid z = 1).
        unsafe { dev.kernels().gather(dev.stream(), vec, n_layers, buffers, &a) }
    }

    /// Copy row `src_slots[i]` to row `dst_slots[i]` in every layer and buffer (cache
    /// migration, SGLang's `move_kv_cache`). The destinations should be distinct and
    /// not among the sources; otherwise the copied contents are unspecified (the
    /// host reference [`move_rows`](crate::kv::reference::move_rows) refuses that).
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] if the lists differ in length.
    pub fn move_kv(
        &self,
        dev: &KvDevice,
        src_slots: &DeviceSlice<u32>,
        dst_slots: &DeviceSlice<u32>,
    ) -> Result<(), CudaKvError> {
        if src_slots.len() != dst_slots.len() {
            return Err(KvError::Shape { what: "dst_slots", got: dst_slots.len(), expected: src_slots.len() }.into());
        }
        let n = Self::count("src_slots", src_slots.len())?;
        let row = self.cfg.row_bytes();
        let vec = pick_vec(StoreKind::Copy, &[row], &[])?;
        let a = MoveArgs {
            k: self.k.as_device_ptr(),
            v: self.v.as_ref().map_or(DevicePointer::null(), |v| v.as_device_ptr()),
            layer_stride: self.cfg.layer_bytes() as u64,
            src_slots: src_slots.as_device_ptr(),
            dst_slots: dst_slots.as_device_ptr(),
            n_pairs: n,
            vecs: (row / vec as usize) as u32,
            num_rows: self.cfg.rows() as u32,
            err: self.err.as_device_ptr(),
        };
        let buffers = self.cfg.layout.buffers() as u32;
        // SAFETY: `k`/`v` are this cache's buffers, `layer_num` layers of `rows` rows of
        // `row_bytes` (a multiple of `vec`); both slot lists have `n` entries.
        unsafe { dev.kernels().move_rows(dev.stream(), vec, self.cfg.layer_num, buffers, &a) }
    }

    /// Wait for the stream and report whether any kernel since the last call met a slot
    /// past the buffer (those rows were skipped); clears the flag.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::DeviceSlotOutOfRange`], or [`CudaKvError::Cuda`] for an
    /// asynchronous fault.
    pub fn take_error(&self, dev: &KvDevice) -> Result<(), CudaKvError> {
        dev.synchronize()?;
        let mut word = [0u32];
        self.err.copy_to(&mut word[..])?;
        if word[0] == 0 {
            return Ok(());
        }
        let mut err = self.err.index(..);
        err.copy_from(&[0u32][..])?;
        Err(CudaKvError::DeviceSlotOutOfRange)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_width_is_the_widest_that_divides_everything() {
        assert_eq!(pick_vec(StoreKind::Copy, &[2048], &[256, 2048, 0]), Ok(16));
        assert_eq!(pick_vec(StoreKind::Copy, &[2048], &[256, 2056, 0]), Ok(8));
        assert_eq!(pick_vec(StoreKind::Copy, &[6], &[256]), Ok(2));
        assert_eq!(pick_vec(StoreKind::Copy, &[7], &[256]), Ok(1));
        assert_eq!(pick_vec(StoreKind::Copy, &[1024, 128], &[258]), Ok(2));
        // fp8 from bf16: 16 bytes, else one element; a misaligned source is refused.
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[1024], &[256]), Ok(16));
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[6], &[256]), Ok(2));
        assert!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[6], &[257]).is_err());
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::F32), &[12], &[256]), Ok(4));
    }

    #[test]
    fn extents_cover_every_row_of_every_layer() {
        // `Rows` needs a device slice; a dangling one is fine, it is never dereferenced.
        // SAFETY: the slice is only measured (`len`), never read or written.
        let data = unsafe { DeviceSlice::<u8>::from_raw_parts(DevicePointer::null(), 1000) };
        let rows = |row_stride, layer_stride| Rows { data: &data, row_stride, layer_stride };
        assert_eq!(extent("k", &rows(100, 0), 10, 1, 100), Ok(()));
        assert_eq!(
            extent("k", &rows(100, 0), 11, 1, 100),
            Err(KvError::Shape { what: "k", got: 1000, expected: 1100 })
        );
        assert_eq!(extent("k", &rows(100, 500), 5, 2, 100), Ok(()));
        assert!(extent("k", &rows(100, 501), 5, 2, 100).is_err());
        assert!(matches!(extent("k", &rows(50, 0), 2, 1, 100), Err(KvError::BadRow { .. })));
        assert_eq!(extent("k", &rows(0, 0), 0, 4, 100), Ok(()));
        assert!(extent("k", &rows(usize::MAX, 0), 3, 1, 100).is_err());
    }
}
