//! [`KvCacheView`]: KV buffers anyone allocated, described for the row kernels; and
//! [`DeviceKvCache`], kvpool's own buffers, which is one owner of such a view.

use core::marker::PhantomData;
use core::ops::Deref;

use bytemuck::Pod;
use cust::memory::{CopyDestination, DeviceBuffer, DeviceCopy, DevicePointer, DeviceSlice};
use cust::sys::{cuMemGetAddressRange_v2, cuPointerGetAttribute, CUdeviceptr, CUmemorytype, CUpointer_attribute};

use super::launch::{check, GatherArgs, MlaArgs, MoveArgs, ScatterArgs, StoreKind};
use super::{CudaKvError, KvStream};
use crate::kv::{KvConfig, KvDtype, KvError, KvLayout, SrcFloat};

/// Which layers an operation covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layers {
    /// One layer (the usual per-layer call from the forward pass).
    One(u32),
    /// Every layer; the dense side steps `layer_stride` elements per layer. One launch
    /// when the cache's layers are evenly spaced, one per layer otherwise.
    All,
}

/// Dense rows on the device that a scatter reads, of element type `T` (`half::f16`,
/// `half::bf16`, `f32`, `u8` for fp8 codes, or any other [`Pod`] type; `u8` also
/// stands for raw bytes of any element type): token `i` of layer `l` starts at
/// element `l * layer_stride + i * row_stride`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a, T: Pod = u8> {
    ptr: u64,
    len: usize,
    row_stride: usize,
    layer_stride: usize,
    _data: PhantomData<&'a [T]>,
}

impl<'a, T: Pod + DeviceCopy> Rows<'a, T> {
    /// Rows in a `cust` device slice; strides in elements (`row_stride` at least a
    /// row, more for a view into a wider tensor such as a fused QKV output;
    /// `layer_stride` is read for [`Layers::All`] only).
    pub fn new(data: &'a DeviceSlice<T>, row_stride: usize, layer_stride: usize) -> Rows<'a, T> {
        Rows { ptr: data.as_device_ptr().as_raw(), len: data.len(), row_stride, layer_stride, _data: PhantomData }
    }
}

impl<'a, T: Pod> Rows<'a, T> {
    /// Rows at a raw device address (memory another crate allocated), `len` elements.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len * size_of::<T>()` is device memory of the context the rows are
    /// used in, readable until the stream has run every launch that reads them, and
    /// not written by anyone else meanwhile (the borrow `'a` stands for that).
    pub unsafe fn from_raw(ptr: u64, len: usize, row_stride: usize, layer_stride: usize) -> Rows<'a, T> {
        Rows { ptr, len, row_stride, layer_stride, _data: PhantomData }
    }

    /// The same memory seen as elements of `U` (strides converted).
    ///
    /// # Errors
    ///
    /// [`KvError::Format`] when the length, a stride or the address is not a whole
    /// number of `U` elements (or not aligned to `U`).
    pub fn cast<U: Pod>(self) -> Result<Rows<'a, U>, KvError> {
        let (t, u) = (core::mem::size_of::<T>(), core::mem::size_of::<U>());
        let whole = |n: usize| (n * t) % u == 0;
        if u == 0 || !whole(self.len) || !whole(self.row_stride) || !whole(self.layer_stride) {
            return Err(KvError::Format { what: "rows are not a whole number of the target elements" });
        }
        if self.ptr % core::mem::align_of::<U>() as u64 != 0 {
            return Err(KvError::Format { what: "rows are not aligned to the target element" });
        }
        let conv = |n: usize| n * t / u;
        Ok(Rows {
            ptr: self.ptr,
            len: conv(self.len),
            row_stride: conv(self.row_stride),
            layer_stride: conv(self.layer_stride),
            _data: PhantomData,
        })
    }

    /// `(address, bytes, row stride bytes, layer stride bytes)`.
    pub(crate) fn bytes(&self) -> Result<(u64, usize, usize, usize), KvError> {
        let t = core::mem::size_of::<T>();
        let b = |n: usize, what| n.checked_mul(t).ok_or(KvError::Shape { what, got: n, expected: usize::MAX / t });
        Ok((self.ptr, b(self.len, "rows")?, b(self.row_stride, "row_stride")?, b(self.layer_stride, "layer_stride")?))
    }
}

/// Dense rows on the device that an operation writes: token `i` of layer `l` starts
/// at byte `l * layer_stride + i * row_stride` of `data`.
#[derive(Debug)]
pub struct RowsMut<'a> {
    /// The device bytes.
    pub data: &'a mut DeviceSlice<u8>,
    /// Bytes from one token to the next.
    pub row_stride: usize,
    /// Bytes from one layer to the next ([`Layers::All`] only).
    pub layer_stride: usize,
}

/// `(address, bytes, row stride, layer stride)` of dense rows, all in bytes.
type Dense = (u64, usize, usize, usize);

pub(crate) fn extent(
    what: &'static str,
    rows: Dense,
    n: usize,
    layers: usize,
    row_bytes: usize,
) -> Result<(), KvError> {
    let (_, len, row_stride, layer_stride) = rows;
    if n > 1 && row_stride < row_bytes {
        return Err(KvError::BadRow { what, bytes: row_stride });
    }
    if n == 0 || layers == 0 {
        return Ok(());
    }
    let need = (layers - 1)
        .checked_mul(layer_stride)
        .and_then(|a| (n - 1).checked_mul(row_stride).and_then(|b| a.checked_add(b)))
        .and_then(|a| a.checked_add(row_bytes))
        .ok_or(KvError::Shape { what, got: len, expected: usize::MAX })?;
    if len < need {
        return Err(KvError::Shape { what, got: len, expected: need });
    }
    Ok(())
}

/// The widest vector width of `store` that divides every source row size and
/// alignment in `aligns`, and whose stored width divides `dst_align` (the pool's base
/// addresses or-ed together; 0 when the pool is not the destination).
fn pick_vec(store: StoreKind, row_bytes: &[usize], aligns: &[u64], dst_align: u64) -> Result<u32, KvError> {
    store
        .widths()
        .iter()
        .copied()
        .find(|&w| {
            row_bytes.iter().all(|&b| b % w as usize == 0)
                && aligns.iter().all(|&a| a % w as u64 == 0)
                && dst_align % store.stored(w) as u64 == 0
        })
        .ok_or(KvError::Format { what: "source rows or pointers are not aligned to the source element size" })
}

/// Where each layer of one buffer (K, or V) starts.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LayerBases {
    bases: Box<[u64]>,
    /// `Some(stride)` when layer `l` is at `bases[0] + l * stride` for every `l`: then
    /// an all-layers operation is one launch.
    stride: Option<u64>,
}

impl LayerBases {
    fn new(bases: &[u64]) -> LayerBases {
        let stride = match bases {
            [] => None,
            [_] => Some(0),
            [a, b, ..] => {
                let s = b.wrapping_sub(*a);
                let even = bases.windows(2).all(|w| w[1].wrapping_sub(w[0]) == s) && *b > *a;
                even.then_some(s)
            }
        };
        LayerBases { bases: bases.into(), stride }
    }
}

/// A run of layers one launch covers: `(first layer, count, K base, V base, stride)`.
type Span = (u32, u32, u64, u64, u64);

/// KV buffers on the device described for kvpool's row kernels: layout (MHA or MLA),
/// dtype, layer count and capacity ([`KvConfig`]), and where each layer's K and V
/// rows start. The memory can belong to anyone (an engine's own tensors, allocated
/// with `cudarc` or `cust` or anything else in the same context): kvpool reads and
/// writes it in place, on the stream the caller names, and never frees it.
///
/// A layer holds `cfg.rows()` rows of `cfg.row_bytes()` bytes back to back (slot 0
/// is the dummy row); layers may lie anywhere.
///
/// The view owns one 4-byte device word, the flag kernels raise when they meet a slot
/// past the rows ([`take_error`](Self::take_error)).
pub struct KvCacheView {
    cfg: KvConfig,
    k: LayerBases,
    v: Option<LayerBases>,
    /// Every base address or-ed together: its low bits bound the vector width.
    align: u64,
    err: DeviceBuffer<u32>,
}

impl core::fmt::Debug for KvCacheView {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KvCacheView").field("config", &self.cfg).field("k_layer_stride", &self.k.stride).finish()
    }
}

/// Check that `bytes` bytes from `addr` lie inside one device allocation of the
/// current context (`cuMemGetAddressRange`). Where the driver reports no range for an
/// address it nevertheless knows as device memory (`cuPointerGetAttribute`: some
/// stream-ordered pool allocations), only that much is checked and the size stays the
/// caller's contract.
pub(crate) fn check_allocation(what: &'static str, addr: u64, bytes: usize) -> Result<(), CudaKvError> {
    if addr == 0 {
        return Err(KvError::Format { what: "a null device address" }.into());
    }
    let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
    // SAFETY: plain out-parameters; the driver only looks the address up.
    let r = unsafe { cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
    if check(r, "cuMemGetAddressRange").is_err() {
        let mut kind = 0u32;
        // SAFETY: `MEMORY_TYPE` writes one `unsigned int` into `kind`.
        let r = unsafe {
            cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        let device = check(r, "cuPointerGetAttribute").is_ok() && kind == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        return if device { Ok(()) } else { Err(CudaKvError::NotDeviceMemory { what, address: addr }) };
    }
    let avail = (base + size as u64).saturating_sub(addr) as usize;
    if avail < bytes {
        return Err(KvError::Shape { what, got: avail, expected: bytes }.into());
    }
    Ok(())
}

impl KvCacheView {
    /// Describe KV buffers at caller addresses: `k_layers[l]` (and `v_layers[l]` for
    /// MHA; `None` for MLA) is where layer `l` starts, `row_stride` the bytes from one
    /// row to the next.
    ///
    /// Checked: the configuration; one address per layer and a V list exactly for MHA;
    /// `row_stride == cfg.row_bytes()` (the kernels address rows densely); every
    /// address non-null, aligned to the element size, and the start of
    /// `cfg.layer_bytes()` bytes inside one allocation of the current context
    /// (`cuMemGetAddressRange`).
    ///
    /// # Safety
    ///
    /// The memory outlives the view and every launch queued through it, belongs to the
    /// current context (the device's primary context: see `docs/GPU.md`), and nobody
    /// else writes the rows kvpool writes while its kernels may run (order your own
    /// work on the same stream).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for a bad configuration, [`CudaKvError::Kv`] for the
    /// shape, stride and alignment checks, [`CudaKvError::NotDeviceMemory`] for an
    /// address the driver does not know, [`CudaKvError::Cuda`] when the flag word
    /// cannot be allocated.
    pub unsafe fn from_raw(
        cfg: KvConfig,
        k_layers: &[u64],
        v_layers: Option<&[u64]>,
        row_stride: usize,
    ) -> Result<KvCacheView, CudaKvError> {
        cfg.validate()?;
        if row_stride != cfg.row_bytes() {
            return Err(KvError::BadRow { what: "row_stride (must equal the row size)", bytes: row_stride }.into());
        }
        let layers = cfg.layer_num as usize;
        if k_layers.len() != layers {
            return Err(KvError::Shape { what: "k_layers", got: k_layers.len(), expected: layers }.into());
        }
        match (cfg.layout, v_layers) {
            (KvLayout::Mha { .. }, Some(v)) if v.len() != layers => {
                return Err(KvError::Shape { what: "v_layers", got: v.len(), expected: layers }.into());
            }
            (KvLayout::Mha { .. }, None) => {
                return Err(KvError::Format { what: "an MHA cache needs V layer addresses" }.into())
            }
            (KvLayout::Mla { .. }, Some(_)) => {
                return Err(KvError::Format { what: "an MLA cache has no V buffer" }.into())
            }
            _ => {}
        }
        let mut align = 0u64;
        for (what, list) in [("k layer", Some(k_layers)), ("v layer", v_layers)] {
            for &addr in list.unwrap_or(&[]) {
                if addr % cfg.dtype.bytes() as u64 != 0 {
                    return Err(KvError::Format { what: "a layer address is not aligned to the element size" }.into());
                }
                check_allocation(what, addr, cfg.layer_bytes())?;
                align |= addr;
            }
        }
        let k = LayerBases::new(k_layers);
        let v = v_layers.map(LayerBases::new);
        Ok(KvCacheView { cfg, k, v, align, err: DeviceBuffer::zeroed(1)? })
    }

    /// The configuration.
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// Rows per layer buffer (`size + page_size`).
    pub fn rows(&self) -> usize {
        self.cfg.rows()
    }

    fn layer_slice(bases: &LayerBases, cfg: &KvConfig, layer: u32) -> Result<DeviceSlice<u8>, KvError> {
        if layer >= cfg.layer_num {
            return Err(KvError::Shape { what: "layer", got: layer as usize, expected: cfg.layer_num as usize });
        }
        let ptr = DevicePointer::from_raw(bases.bases[layer as usize]);
        // SAFETY: a description of `layer_bytes` bytes at the layer's base, which the
        // constructor's contract (and check) says exist for the view's lifetime.
        Ok(unsafe { DeviceSlice::from_raw_parts(ptr, cfg.layer_bytes()) })
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

    /// `(first layer, layer count)` of `layers`, checked.
    fn first_and_count(&self, layers: Layers) -> Result<(u32, u32), KvError> {
        match layers {
            Layers::All => Ok((0, self.cfg.layer_num)),
            Layers::One(l) if l < self.cfg.layer_num => Ok((l, 1)),
            Layers::One(l) => {
                Err(KvError::Shape { what: "layer", got: l as usize, expected: self.cfg.layer_num as usize })
            }
        }
    }

    /// The launches `layers` takes: one span when it is one layer or the layers are
    /// evenly spaced in both buffers, else one per layer. `i`-th span.
    fn span(&self, first: u32, count: u32, i: u32) -> Span {
        let v_stride = self.v.as_ref().map_or(self.k.stride, |v| v.stride);
        let (l0, n, stride) = match (count, self.k.stride, v_stride) {
            (1, _, _) => (first, 1, 0),
            (_, Some(ks), Some(vs)) if self.v.is_none() || ks == vs => (first, count, ks),
            _ => (first + i, 1, 0),
        };
        let vb = self.v.as_ref().map_or(0, |v| v.bases[l0 as usize]);
        (l0, n, self.k.bases[l0 as usize], vb, stride)
    }

    fn span_count(&self, count: u32) -> u32 {
        let (_, n, ..) = self.span(0, count, 0);
        count / n.max(1)
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

    /// The source element size a scatter expects, checked against `T` (`u8` is raw
    /// bytes and always fits).
    fn elem_bytes<T: Pod>(&self, src: Option<SrcFloat>) -> Result<usize, KvError> {
        let want = src.map_or(self.cfg.dtype.bytes(), |f| f.bytes());
        let t = core::mem::size_of::<T>();
        if t != 1 && t != want {
            return Err(KvError::Format { what: "the rows' element type does not match the cache dtype or `src`" });
        }
        Ok(want)
    }

    /// SGLang's `set_kv_buffer` for an MHA cache: token `i`'s K and V rows go to row
    /// `slots[i]` of the layer(s). With `src: None` the rows are already in the cache's
    /// element type and are copied; with `Some(ty)` (fp8 caches) each element of type
    /// `ty` is stored as `e4m3(x * (1 / scale))`, with `scales = (k_scale, v_scale)`
    /// (see [`kv::fp8`](crate::kv::fp8)).
    ///
    /// `on` is the stream (and kernels) to run on: `&KvDevice` for the device's own
    /// stream, [`KvDevice::on`](super::KvDevice::on) for any other. Rows are moved with
    /// 16-byte accesses when row sizes, strides and pointers allow, else the widest that
    /// fits.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the sources are too short or misaligned, their element
    /// type does not fit, the layer is out of range, the cache is MLA, or `src` does
    /// not fit the dtype; nothing is launched then. A slot past the buffer is reported
    /// later by [`take_error`](Self::take_error).
    #[allow(clippy::too_many_arguments)]
    pub fn set_kv<'s, T: Pod>(
        &self,
        on: impl Into<KvStream<'s>>,
        layers: Layers,
        slots: &DeviceSlice<u32>,
        k: Rows<'_, T>,
        v: Rows<'_, T>,
        src: Option<SrcFloat>,
        scales: (f32, f32),
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        let KvLayout::Mha { .. } = self.cfg.layout else {
            return Err(KvError::Format { what: "set_kv needs an MHA cache (use set_mla_kv)" }.into());
        };
        let store = self.store_for(src)?;
        let (first, n_layers) = self.first_and_count(layers)?;
        let n = Self::count("slots", slots.len())?;
        let src_row = self.cfg.layout.row_elems() * self.elem_bytes::<T>(src)?;
        let (k, v) = (k.bytes()?, v.bytes()?);
        extent("k", k, slots.len(), n_layers as usize, src_row)?;
        extent("v", v, slots.len(), n_layers as usize, src_row)?;
        let aligns = [k.0, v.0, k.2 as u64, v.2 as u64, k.3 as u64, v.3 as u64];
        let vec = pick_vec(store, &[src_row], &aligns, self.align)?;
        if k.2 != v.2 || k.3 != v.3 {
            return Err(KvError::Format { what: "K and V sources must share their strides" }.into());
        }
        for i in 0..self.span_count(n_layers) {
            let (l0, count, kd, vd, stride) = self.span(first, n_layers, i);
            let src_off = (l0 - first) as u64 * k.3 as u64;
            let a = ScatterArgs {
                k_src: DevicePointer::from_raw(k.0 + src_off),
                v_src: DevicePointer::from_raw(v.0 + src_off),
                src_row_stride: k.2 as u64,
                src_layer_stride: k.3 as u64,
                k_dst: DevicePointer::from_raw(kd),
                v_dst: DevicePointer::from_raw(vd),
                dst_layer_stride: stride,
                slots: slots.as_device_ptr(),
                n_tokens: n,
                vecs: (src_row / vec as usize) as u32,
                num_rows: self.cfg.rows() as u32,
                k_inv_scale: 1.0 / scales.0,
                v_inv_scale: 1.0 / scales.1,
                err: self.err.as_device_ptr(),
            };
            // SAFETY: both sources were checked above to hold `n_layers` layers of `n`
            // rows of `vecs * vec` bytes at their strides (this span's `count` layers
            // from layer `l0 - first` of them), and every pointer and stride is a
            // multiple of `vec`; the destinations are this view's K and V layers `l0..`,
            // `count` layers `stride` apart (evenly spaced, or a single one) of `rows`
            // rows of `row_bytes = vecs * stored(vec)` bytes, which the view's contract
            // says exist until the stream has run; `slots` has `n` entries, `err` one.
            unsafe { on.kernels.scatter(on.raw(), store, vec, count, 2, &a) }?;
        }
        Ok(())
    }

    /// SGLang's `set_mla_kv_buffer`: row `slots[i]` becomes token `i`'s nope row
    /// followed by its rope row (`kv_lora_rank` then `qk_rope_head_dim` elements),
    /// copied or quantized as in [`set_kv`](Self::set_kv) with one scale.
    ///
    /// # Errors
    ///
    /// As [`set_kv`](Self::set_kv) (an MHA cache is refused).
    #[allow(clippy::too_many_arguments)]
    pub fn set_mla_kv<'s, T: Pod>(
        &self,
        on: impl Into<KvStream<'s>>,
        layers: Layers,
        slots: &DeviceSlice<u32>,
        nope: Rows<'_, T>,
        rope: Rows<'_, T>,
        src: Option<SrcFloat>,
        scale: f32,
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        let KvLayout::Mla { kv_lora_rank, qk_rope_head_dim } = self.cfg.layout else {
            return Err(KvError::Format { what: "set_mla_kv needs an MLA cache" }.into());
        };
        let store = self.store_for(src)?;
        let (first, n_layers) = self.first_and_count(layers)?;
        let n = Self::count("slots", slots.len())?;
        let esz = self.elem_bytes::<T>(src)?;
        let (nope_row, rope_row) = (kv_lora_rank as usize * esz, qk_rope_head_dim as usize * esz);
        let (nope, rope) = (nope.bytes()?, rope.bytes()?);
        extent("nope", nope, slots.len(), n_layers as usize, nope_row)?;
        extent("rope", rope, slots.len(), n_layers as usize, rope_row)?;
        let aligns = [nope.0, rope.0, nope.2 as u64, rope.2 as u64, nope.3 as u64, rope.3 as u64];
        let vec = pick_vec(store, &[nope_row, rope_row], &aligns, self.align)?;
        for i in 0..self.span_count(n_layers) {
            let (l0, count, kd, _, stride) = self.span(first, n_layers, i);
            let (no, ro) = ((l0 - first) as u64 * nope.3 as u64, (l0 - first) as u64 * rope.3 as u64);
            let a = MlaArgs {
                nope_src: DevicePointer::from_raw(nope.0 + no),
                nope_row_stride: nope.2 as u64,
                nope_layer_stride: nope.3 as u64,
                rope_src: DevicePointer::from_raw(rope.0 + ro),
                rope_row_stride: rope.2 as u64,
                rope_layer_stride: rope.3 as u64,
                dst: DevicePointer::from_raw(kd),
                dst_layer_stride: stride,
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
            // `row_bytes` bytes, `rows` of them in each of the span's layers.
            unsafe { on.kernels.scatter_mla(on.raw(), store, vec, count, &a) }?;
        }
        Ok(())
    }

    /// Gather rows `slots[i]` of the layer(s) into dense rows (raw stored bytes: fp8
    /// caches give e4m3 codes), K into `k_out` and V into `v_out` (`None` for MLA).
    ///
    /// # Errors
    ///
    /// As [`set_kv`](Self::set_kv); `v_out` must be given exactly for MHA caches.
    pub fn get_kv<'s>(
        &self,
        on: impl Into<KvStream<'s>>,
        layers: Layers,
        slots: &DeviceSlice<u32>,
        k_out: RowsMut<'_>,
        v_out: Option<RowsMut<'_>>,
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        if v_out.is_some() != self.v.is_some() {
            return Err(KvError::Format { what: "v_out must be given for MHA caches and only for them" }.into());
        }
        let (first, n_layers) = self.first_and_count(layers)?;
        let n = Self::count("slots", slots.len())?;
        let row = self.cfg.row_bytes();
        let dense = |r: &RowsMut<'_>| (r.data.as_device_ptr().as_raw(), r.data.len(), r.row_stride, r.layer_stride);
        let kr = dense(&k_out);
        extent("k_out", kr, slots.len(), n_layers as usize, row)?;
        let mut aligns = [kr.0, kr.2 as u64, kr.3 as u64, self.align];
        let v_dst = match &v_out {
            Some(v) => {
                extent("v_out", dense(v), slots.len(), n_layers as usize, row)?;
                if v.row_stride != k_out.row_stride || v.layer_stride != k_out.layer_stride {
                    return Err(KvError::Format { what: "K and V outputs must share their strides" }.into());
                }
                aligns[0] |= v.data.as_device_ptr().as_raw();
                v.data.as_device_ptr().as_raw()
            }
            None => 0,
        };
        let vec = pick_vec(StoreKind::Copy, &[row], &aligns, 0)?;
        let buffers = self.cfg.layout.buffers() as u32;
        for i in 0..self.span_count(n_layers) {
            let (l0, count, ks, vs, stride) = self.span(first, n_layers, i);
            let off = (l0 - first) as u64 * kr.3 as u64;
            let a = GatherArgs {
                k_src: DevicePointer::from_raw(ks),
                v_src: DevicePointer::from_raw(vs),
                src_layer_stride: stride,
                k_dst: DevicePointer::from_raw(kr.0 + off),
                v_dst: DevicePointer::from_raw(if v_dst == 0 { 0 } else { v_dst + off }),
                dst_row_stride: kr.2 as u64,
                dst_layer_stride: kr.3 as u64,
                slots: slots.as_device_ptr(),
                n_tokens: n,
                vecs: (row / vec as usize) as u32,
                num_rows: self.cfg.rows() as u32,
                err: self.err.as_device_ptr(),
            };
            // SAFETY: the outputs were checked to hold `n_layers` layers of `n` rows of
            // `row_bytes` at their (aligned) strides and are mutably borrowed for this
            // call; the sources are this view's layers; with one buffer the null V
            // pointers are never used (grid z = 1).
            unsafe { on.kernels.gather(on.raw(), vec, count, buffers, &a) }?;
        }
        Ok(())
    }

    /// Copy row `src_slots[i]` to row `dst_slots[i]` in every layer and buffer (cache
    /// migration, SGLang's `move_kv_cache`). The destinations should be distinct and
    /// not among the sources; otherwise the copied contents are unspecified (the
    /// host reference [`move_rows`](crate::kv::reference::move_rows) refuses that).
    ///
    /// # Errors
    ///
    /// [`KvError::Shape`] if the lists differ in length.
    pub fn move_kv<'s>(
        &self,
        on: impl Into<KvStream<'s>>,
        src_slots: &DeviceSlice<u32>,
        dst_slots: &DeviceSlice<u32>,
    ) -> Result<(), CudaKvError> {
        let on = on.into();
        if src_slots.len() != dst_slots.len() {
            return Err(KvError::Shape { what: "dst_slots", got: dst_slots.len(), expected: src_slots.len() }.into());
        }
        let n = Self::count("src_slots", src_slots.len())?;
        let row = self.cfg.row_bytes();
        let vec = pick_vec(StoreKind::Copy, &[row], &[self.align], 0)?;
        let buffers = self.cfg.layout.buffers() as u32;
        let layers = self.cfg.layer_num;
        for i in 0..self.span_count(layers) {
            let (_, count, k, v, stride) = self.span(0, layers, i);
            let a = MoveArgs {
                k: DevicePointer::from_raw(k),
                v: DevicePointer::from_raw(v),
                layer_stride: stride,
                src_slots: src_slots.as_device_ptr(),
                dst_slots: dst_slots.as_device_ptr(),
                n_pairs: n,
                vecs: (row / vec as usize) as u32,
                num_rows: self.cfg.rows() as u32,
                err: self.err.as_device_ptr(),
            };
            // SAFETY: `k`/`v` are this view's layers of the span, `count` layers of
            // `rows` rows of `row_bytes` (a multiple of `vec`); both slot lists have `n`
            // entries.
            unsafe { on.kernels.move_rows(on.raw(), vec, count, buffers, &a) }?;
        }
        Ok(())
    }

    /// Wait for the stream and report whether any kernel since the last call met a slot
    /// past the buffer (those rows were skipped); clears the flag.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::DeviceSlotOutOfRange`], or [`CudaKvError::Cuda`] for an
    /// asynchronous fault.
    pub fn take_error<'s>(&self, on: impl Into<KvStream<'s>>) -> Result<(), CudaKvError> {
        on.into().synchronize()?;
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

/// The KV cache on the GPU in kvpool's own memory: SGLang's `MHATokenToKVPool` (K and
/// V buffers per layer) or `MLATokenToKVPool` (one buffer per layer), each layer
/// `size + page_size` rows (slot 0 is the dummy row padded tokens write to), in f16,
/// bf16, f32 or fp8 e4m3.
///
/// It owns the buffers and a [`KvCacheView`] of them (every operation is the view's,
/// through `Deref`). A buffer holds all layers back to back (layer `l` at
/// `l * config().layer_bytes()`), so an all-layers kernel is one launch.
pub struct DeviceKvCache {
    // First: the view (and its flag word) goes before the memory it describes.
    view: KvCacheView,
    _k: DeviceBuffer<u8>,
    _v: Option<DeviceBuffer<u8>>,
}

impl core::fmt::Debug for DeviceKvCache {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceKvCache").field("config", &self.view.cfg).finish()
    }
}

impl Deref for DeviceKvCache {
    type Target = KvCacheView;
    fn deref(&self) -> &KvCacheView {
        &self.view
    }
}

impl DeviceKvCache {
    /// Allocate (zeroed) buffers for `cfg` in the current context.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for an invalid configuration, [`CudaKvError::Cuda`] when
    /// the device is out of memory.
    pub fn new(cfg: KvConfig) -> Result<DeviceKvCache, CudaKvError> {
        cfg.validate()?;
        let lb = cfg.layer_bytes();
        let bytes = lb * cfg.layer_num as usize;
        let k = DeviceBuffer::<u8>::zeroed(bytes)?;
        let v = if cfg.layout.buffers() == 2 { Some(DeviceBuffer::<u8>::zeroed(bytes)?) } else { None };
        let bases = |b: &DeviceBuffer<u8>| -> Vec<u64> {
            (0..cfg.layer_num as u64).map(|l| b.as_device_ptr().as_raw() + l * lb as u64).collect()
        };
        let (kb, vb) = (bases(&k), v.as_ref().map(bases));
        // SAFETY: the layers are this struct's own buffers, allocated just above in the
        // current context with `layer_num * layer_bytes` bytes; they are dropped after
        // the view (field order), and `cuMemFree` waits for the device to finish with
        // them.
        let view = unsafe { KvCacheView::from_raw(cfg, &kb, vb.as_deref(), cfg.row_bytes()) }?;
        Ok(DeviceKvCache { view, _k: k, _v: v })
    }

    /// The view of the buffers (also reachable through `Deref`).
    pub fn view(&self) -> &KvCacheView {
        &self.view
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_width_is_the_widest_that_divides_everything() {
        assert_eq!(pick_vec(StoreKind::Copy, &[2048], &[256, 2048, 0], 0), Ok(16));
        assert_eq!(pick_vec(StoreKind::Copy, &[2048], &[256, 2056, 0], 0), Ok(8));
        assert_eq!(pick_vec(StoreKind::Copy, &[6], &[256], 0), Ok(2));
        assert_eq!(pick_vec(StoreKind::Copy, &[7], &[256], 0), Ok(1));
        assert_eq!(pick_vec(StoreKind::Copy, &[1024, 128], &[258], 0), Ok(2));
        // fp8 from bf16: 16 bytes, else one element; a misaligned source is refused.
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[1024], &[256], 0), Ok(16));
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[6], &[256], 0), Ok(2));
        assert!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[6], &[257], 0).is_err());
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::F32), &[12], &[256], 0), Ok(4));
        // The pool's alignment bounds the stored width, not the source width: fp8 from
        // bf16 stores 8 bytes per 16 read.
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[1024], &[256], 8), Ok(16));
        assert_eq!(pick_vec(StoreKind::Fp8(SrcFloat::Bf16), &[1024], &[256], 3), Ok(2));
        assert_eq!(pick_vec(StoreKind::Copy, &[1024], &[256], 4), Ok(4));
    }

    #[test]
    fn extents_cover_every_row_of_every_layer() {
        let rows = |row_stride, layer_stride| (0u64, 1000usize, row_stride, layer_stride);
        assert_eq!(extent("k", rows(100, 0), 10, 1, 100), Ok(()));
        assert_eq!(extent("k", rows(100, 0), 11, 1, 100), Err(KvError::Shape { what: "k", got: 1000, expected: 1100 }));
        assert_eq!(extent("k", rows(100, 500), 5, 2, 100), Ok(()));
        assert!(extent("k", rows(100, 501), 5, 2, 100).is_err());
        assert!(matches!(extent("k", rows(50, 0), 2, 1, 100), Err(KvError::BadRow { .. })));
        assert_eq!(extent("k", rows(0, 0), 0, 4, 100), Ok(()));
        assert!(extent("k", rows(usize::MAX, 0), 3, 1, 100).is_err());
    }

    #[test]
    fn typed_rows_convert_their_strides() {
        // SAFETY: the rows are only measured and converted, never launched.
        let r: Rows<'_, u16> = unsafe { Rows::from_raw(256, 1000, 64, 640) };
        let b = r.cast::<u8>().unwrap();
        assert_eq!(b.bytes().unwrap(), (256, 2000, 128, 1280));
        let f = b.cast::<f32>().unwrap();
        assert_eq!(f.bytes().unwrap(), (256, 2000, 128, 1280));
        assert_eq!((f.len, f.row_stride), (500, 32));
        // SAFETY: as above.
        let odd: Rows<'_, u8> = unsafe { Rows::from_raw(256, 1001, 64, 0) };
        assert!(odd.cast::<u16>().is_err());
        // SAFETY: as above.
        let misaligned: Rows<'_, u8> = unsafe { Rows::from_raw(257, 1000, 64, 0) };
        assert!(misaligned.cast::<u16>().is_err());
    }

    #[test]
    fn layer_spacing_is_detected() {
        assert_eq!(LayerBases::new(&[4096]).stride, Some(0));
        assert_eq!(LayerBases::new(&[4096, 8192, 12288]).stride, Some(4096));
        assert_eq!(LayerBases::new(&[4096, 8192, 16384]).stride, None);
        assert_eq!(LayerBases::new(&[8192, 4096]).stride, None);
    }
}
