//! [`DeviceMambaState`]: a Mamba pool's state buffers on the device, and the typed
//! launcher of the generated `mamba_state` kernels (copy or zero whole state slots for
//! a batch of slots in one launch).
//!
//! The buffers have the host [`MambaPool`](crate::mamba::MambaPool)'s layout: one
//! buffer `[layers, size + 1, row]` per component (the conv states, then the temporal
//! state), slot 0 the dummy. Slot accounting stays with a host `MambaPool` (its
//! handles say who may write a slot); this type only moves bytes, by slot number, on
//! the [`KvDevice`]'s stream. Slots are checked on the device: a slot past the buffers
//! is skipped and flagged ([`take_error`](DeviceMambaState::take_error)).
//!
//! This module loads its own PTX module (`mamba_state`) and is the only place that
//! launches its kernels; the launch parameters are checked against the PTX's
//! `.param` lists when the module is loaded.

use cust::function::Function;
use cust::launch;
use cust::memory::{CopyDestination, DeviceBuffer, DevicePointer, DeviceSlice};
use cust::module::Module;

use super::{CudaKvError, KvDevice};
use crate::error::ConfigError;
use crate::kv::ptx::module_for;
use crate::kv::KvError;
use crate::mamba::{Component, MambaConfig};

/// Threads per block (`kernels_build::mamba::MAMBA_THREADS`).
const THREADS: u32 = 256;
/// Vectors in flight per thread (`MAMBA_UNROLL`).
const UNROLL: u32 = 4;
/// Components per launch (`MAMBA_MAX_COMPONENTS`).
const MAX_COMPONENTS: usize = 4;
/// Generated vector widths, widest first (`MAMBA_WIDTHS`).
const WIDTHS: [u32; 4] = [16, 8, 4, 2];
/// Pairs per launch (the grid's y dimension).
const MAX_PAIRS: usize = 65_535;
/// The `.param` types every `mamba_state_*` kernel takes, in order.
const PARAMS: [&str; 14] =
    ["u64", "u64", "u64", "u64", "u32", "u32", "u32", "u32", "u32", "u32", "u64", "u64", "u32", "u64"];

fn kernel_name(zero: bool, vec: u32) -> String {
    format!("mamba_state_{}_v{vec}", if zero { "zero" } else { "copy" })
}

/// The `.param` types of entry `name` in `ptx`, in order (`None` if absent).
pub(crate) fn entry_params(ptx: &str, name: &str) -> Option<Vec<String>> {
    let start = ptx.find(&format!(".visible .entry {name}("))?;
    let rest = &ptx[start..];
    let list = &rest[..rest.find(')')?];
    Some(
        list.lines()
            .filter_map(|l| l.trim().strip_prefix(".param ."))
            .map(|l| l.split_whitespace().next().unwrap_or("").to_string())
            .collect(),
    )
}

/// Check, without a GPU, that every `mamba_state_*` kernel of every target has exactly
/// the parameter list the launcher passes.
///
/// # Errors
///
/// [`CudaKvError::MissingKernel`] or [`CudaKvError::KernelSignature`] (kvpool bugs).
pub fn check_mamba_signatures() -> Result<(), CudaKvError> {
    for cc in [80, 90] {
        let m = module_for("mamba_state", cc).ok_or_else(|| CudaKvError::MissingKernel("mamba_state".into()))?;
        for zero in [false, true] {
            for vec in WIDTHS {
                let name = kernel_name(zero, vec);
                let got = entry_params(m.ptx, &name).ok_or_else(|| CudaKvError::MissingKernel(name.clone()))?;
                if got != PARAMS {
                    return Err(CudaKvError::KernelSignature {
                        kernel: name,
                        ptx: got.join(","),
                        wrapper: PARAMS.join(","),
                    });
                }
            }
        }
        let entries = m.ptx.matches(".visible .entry ").count();
        if entries != 2 * WIDTHS.len() {
            return Err(CudaKvError::MissingKernel(format!("{entries} entries in {}, launchers for 8", m.path)));
        }
    }
    Ok(())
}

/// A Mamba pool's states on the device (see the module docs).
///
/// # Examples
///
/// ```no_run
/// use cust::memory::DeviceBuffer;
/// use kvpool::cuda::{mamba::DeviceMambaState, KvDevice};
/// use kvpool::mamba::{MambaConfig, StateDtype, StateShape};
///
/// let dev = KvDevice::new(0)?;
/// let cfg = MambaConfig {
///     layers: 36,
///     conv: vec![StateShape::new(&[8192, 3], StateDtype::Bf16)],
///     temporal: StateShape::new(&[32, 128, 128], StateDtype::F32),
/// };
/// let states = DeviceMambaState::new(&dev, 64, &cfg)?;
/// // Fork cached states 5 and 9 into request slots 12 and 13, and zero slot 14.
/// let src = DeviceBuffer::from_slice(&[5u32, 9])?;
/// let dst = DeviceBuffer::from_slice(&[12u32, 13])?;
/// states.copy(&dev, &src, &dst)?;
/// let fresh = DeviceBuffer::from_slice(&[14u32])?;
/// states.zero(&dev, &fresh)?;
/// states.take_error(&dev)?;                       // syncs; Err if a slot was out of range
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceMambaState {
    // Before `module`: the handles are dropped before their module is unloaded.
    /// `(zero, vec, function)` for every generated kernel.
    functions: Vec<(bool, u32, Function<'static>)>,
    _module: Module,
    buffers: Vec<DeviceBuffer<u8>>,
    row_bytes: Vec<usize>,
    /// Vectors per row of each component (0 past the last).
    vecs: [u32; MAX_COMPONENTS],
    layers: u32,
    num_rows: u32,
    vec: u32,
    err: DeviceBuffer<u32>,
}

impl core::fmt::Debug for DeviceMambaState {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceMambaState")
            .field("slots", &(self.num_rows - 1))
            .field("layers", &self.layers)
            .field("row_bytes", &self.row_bytes)
            .field("vec", &self.vec)
            .finish()
    }
}

impl DeviceMambaState {
    /// Zeroed device buffers for `size` slots (plus the dummy slot 0) of `config`,
    /// and the `mamba_state` module loaded into the device's context.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Config`] for a zero size, more than 3 conv states, or rows past
    /// 4 GiB; [`CudaKvError::Cuda`] from the driver (out of device memory, ...).
    pub fn new(dev: &KvDevice, size: u32, config: &MambaConfig) -> Result<Self, CudaKvError> {
        check_mamba_signatures()?;
        let comps: Vec<Component> = config.components().collect();
        if size == 0 || size == u32::MAX || config.layers == 0 {
            return Err(ConfigError::Zero("mamba pool size and layers").into());
        }
        if comps.len() > MAX_COMPONENTS {
            return Err(ConfigError::TooLarge { size: comps.len() as u64, page_size: 1 }.into());
        }
        let row_bytes: Vec<usize> = comps.iter().map(|&c| config.row_bytes(c)).collect();
        if row_bytes.iter().any(|&r| r == 0 || r > u32::MAX as usize) {
            return Err(ConfigError::TooLargeForMemory { what: "a Mamba state row", bytes: u64::MAX }.into());
        }
        let num_rows = size + 1;
        let vec = WIDTHS
            .into_iter()
            .find(|&w| row_bytes.iter().all(|&r| r % w as usize == 0))
            .ok_or(KvError::BadRow { what: "Mamba state row (not a multiple of 2 bytes)", bytes: row_bytes[0] })?;
        let target = dev.ptx_target();
        let m =
            module_for("mamba_state", target).ok_or(CudaKvError::UnsupportedDevice { compute_capability: target })?;
        let module = Module::from_ptx(m.ptx, &[])?;
        let mut functions = Vec::new();
        for zero in [false, true] {
            for w in WIDTHS {
                let f = module.get_function(kernel_name(zero, w))?;
                // SAFETY: `Function` is a `CUfunction` handle plus a lifetime marker; the
                // handle stays valid while its module is loaded. The module lives in this
                // struct, is never replaced, and is dropped after `functions` (field
                // order); the handles are only used borrowed from `&self`.
                let f: Function<'static> = unsafe { std::mem::transmute::<Function<'_>, Function<'static>>(f) };
                functions.push((zero, w, f));
            }
        }
        let mut buffers = Vec::with_capacity(row_bytes.len());
        for &r in &row_bytes {
            let bytes = (r as u64)
                .checked_mul(num_rows as u64 * config.layers as u64)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or(ConfigError::TooLargeForMemory { what: "a Mamba state buffer", bytes: u64::MAX })?;
            buffers.push(DeviceBuffer::<u8>::zeroed(bytes)?);
        }
        let mut vecs = [0u32; MAX_COMPONENTS];
        for (v, &r) in vecs.iter_mut().zip(&row_bytes) {
            *v = (r / vec as usize) as u32;
        }
        Ok(DeviceMambaState {
            functions,
            _module: module,
            buffers,
            row_bytes,
            vecs,
            layers: config.layers,
            num_rows,
            vec,
            err: DeviceBuffer::zeroed(1)?,
        })
    }

    /// The buffer of component `i` (conv states first, the temporal state last):
    /// `[layers, size + 1, row]` bytes, for the model's kernels.
    pub fn buffer(&self, i: usize) -> Option<&DeviceBuffer<u8>> {
        self.buffers.get(i)
    }

    /// Bytes of one row of each component.
    pub fn row_bytes(&self) -> &[usize] {
        &self.row_bytes
    }

    /// Bytes of one slot's whole state.
    pub fn slot_bytes(&self) -> usize {
        self.row_bytes.iter().sum::<usize>() * self.layers as usize
    }

    /// The vector width the kernels use for this layout (16 when every row is a
    /// multiple of 16 bytes).
    pub fn vector_bytes(&self) -> u32 {
        self.vec
    }

    /// Copy slot `src[i]` to slot `dst[i]` for every `i`, every layer and component, in
    /// one launch (per 65 535 pairs), queued on the device's stream. The slot lists
    /// live on the device (an engine builds them there); the pairs must not chain (a
    /// `dst` that is another pair's `src` makes that copy's result unspecified).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] when the lists differ in length; [`CudaKvError::Cuda`].
    pub fn copy(&self, dev: &KvDevice, src: &DeviceSlice<u32>, dst: &DeviceSlice<u32>) -> Result<(), CudaKvError> {
        if src.len() != dst.len() {
            return Err(KvError::Shape { what: "src_slots", got: src.len(), expected: dst.len() }.into());
        }
        self.launch(dev, false, src, dst)
    }

    /// Zero slots `dst` (every layer and component) in one launch.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`].
    pub fn zero(&self, dev: &KvDevice, dst: &DeviceSlice<u32>) -> Result<(), CudaKvError> {
        self.launch(dev, true, dst, dst)
    }

    fn launch(
        &self,
        dev: &KvDevice,
        zero: bool,
        src: &DeviceSlice<u32>,
        dst: &DeviceSlice<u32>,
    ) -> Result<(), CudaKvError> {
        let f = self
            .functions
            .iter()
            .find(|(z, w, _)| *z == zero && *w == self.vec)
            .map(|(_, _, f)| f)
            .ok_or_else(|| CudaKvError::MissingKernel(kernel_name(zero, self.vec)))?;
        let vecs = self.vecs;
        let max_vecs = vecs.iter().copied().max().unwrap_or(0);
        // Enough blocks per row that each thread moves about UNROLL vectors.
        let bx = max_vecs.div_ceil(THREADS * UNROLL).clamp(1, 65_535);
        let n_comps = self.buffers.len() as u32;
        let z = self.layers * n_comps;
        let base = |i: usize| self.buffers.get(i).unwrap_or(&self.buffers[0]).as_device_ptr();
        let stream = dev.stream();
        let mut at = 0;
        while at < dst.len() {
            let n = (dst.len() - at).min(MAX_PAIRS);
            let s: DevicePointer<u32> = src.index(at..at + n).as_device_ptr();
            let d: DevicePointer<u32> = dst.index(at..at + n).as_device_ptr();
            // SAFETY: the arguments are, in order and type, the kernel's `.param` list
            // (four u64 bases, four u32 vector counts, n_comps, num_rows, src_slots,
            // dst_slots (u64), n_pairs (u32), err (u64); checked against the PTX in
            // `new`). Block (x, y, z) handles pair `y < n` (`y` is bounded by the
            // grid), layer `z / n_comps < layers` and component `z % n_comps <
            // n_comps`, whose buffer holds `layers * num_rows` rows of `vecs * vec`
            // bytes; both slots are checked against `num_rows` on the device before
            // any access, so every read and write lies in that buffer; the slot lists
            // hold `n` u32 from `at` (sliced above). Unused bases (`i >= n_comps`)
            // are never dereferenced. The host touches none of these buffers before
            // it synchronizes the stream (`take_error`, `download`).
            unsafe {
                launch!(f<<<(bx, n as u32, z), THREADS, 0, stream>>>(
                    base(0), base(1), base(2), base(3), vecs[0], vecs[1], vecs[2], vecs[3],
                    n_comps, self.num_rows, s, d, n as u32, self.err.as_device_ptr()
                ))
            }?;
            at += n;
        }
        Ok(())
    }

    /// Wait for the stream, then report (and clear) a slot that a kernel skipped
    /// because it was past the buffers.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::DeviceSlotOutOfRange`], [`CudaKvError::Cuda`].
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

    /// Copy a whole component buffer to the host (synchronizes the stream first).
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Kv`] for a wrong length or component; [`CudaKvError::Cuda`].
    pub fn download(&self, dev: &KvDevice, comp: usize, out: &mut [u8]) -> Result<(), CudaKvError> {
        dev.synchronize()?;
        let buf = self.buffers.get(comp).ok_or(KvError::Shape { what: "component", got: comp, expected: 0 })?;
        if out.len() != buf.len() {
            return Err(KvError::Shape { what: "component buffer", got: out.len(), expected: buf.len() }.into());
        }
        buf.copy_to(out)?;
        Ok(())
    }

    /// Overwrite a whole component buffer from the host (synchronizes first).
    ///
    /// # Errors
    ///
    /// As [`download`](Self::download).
    pub fn upload(&mut self, dev: &KvDevice, comp: usize, data: &[u8]) -> Result<(), CudaKvError> {
        dev.synchronize()?;
        let buf = self.buffers.get_mut(comp).ok_or(KvError::Shape { what: "component", got: comp, expected: 0 })?;
        if data.len() != buf.len() {
            return Err(KvError::Shape { what: "component buffer", got: data.len(), expected: buf.len() }.into());
        }
        buf.copy_from(data)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_matches_the_generated_kernels() {
        check_mamba_signatures().unwrap();
        let m = module_for("mamba_state", 90).unwrap();
        assert_eq!(entry_params(m.ptx, "mamba_state_zero_v2").unwrap().len(), PARAMS.len());
        assert!(entry_params(m.ptx, "mamba_state_copy_v1").is_none());
    }
}
