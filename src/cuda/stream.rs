//! Streams kvpool's work can run on: [`StreamRef`] (any stream of the device's primary
//! context, whoever created it) and [`KvStream`] (a stream together with the loaded
//! kernels: what every launcher takes).

use core::marker::PhantomData;

use cust::stream::Stream;
use cust::sys::{
    cuEventCreate, cuEventDestroy_v2, cuEventQuery, cuEventRecord, cuEventSynchronize, cuStreamGetCtx,
    cuStreamSynchronize, cudaError_enum, CUcontext, CUevent, CUevent_flags_enum, CUstream,
};

use super::launch::{check, KvKernels};
use super::{CudaKvError, KvDevice};

/// A borrowed CUDA stream: a raw `CUstream` handle valid for `'a`.
///
/// Made from a `cust` [`Stream`] (`StreamRef::from(&stream)`), from a `cudarc` stream
/// (feature `cudarc`), or from any raw handle with [`from_raw`](Self::from_raw). The
/// null handle is the legacy default stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamRef<'a> {
    raw: CUstream,
    _life: PhantomData<&'a ()>,
}

impl<'a> StreamRef<'a> {
    /// A stream from its raw driver handle.
    ///
    /// # Safety
    ///
    /// `raw` is null (the legacy default stream) or a stream handle that stays valid
    /// (is not destroyed) for `'a`. Which context it belongs to is checked where it is
    /// paired with a device ([`KvDevice::on`]).
    pub unsafe fn from_raw(raw: CUstream) -> StreamRef<'a> {
        StreamRef { raw, _life: PhantomData }
    }

    /// The raw handle.
    pub fn as_raw(self) -> CUstream {
        self.raw
    }

    /// Wait until everything queued on the stream has run.
    ///
    /// # Errors
    ///
    /// [`CudaKvError::Cuda`], including an asynchronous kernel fault.
    pub fn synchronize(self) -> Result<(), CudaKvError> {
        // SAFETY: the handle is valid for `'a` (the constructor's contract).
        check(unsafe { cuStreamSynchronize(self.raw) }, "cuStreamSynchronize")
    }

    /// The context the stream belongs to.
    pub(crate) fn context(self) -> Result<CUcontext, CudaKvError> {
        let mut ctx: CUcontext = core::ptr::null_mut();
        // SAFETY: a valid (or null) stream handle and a place for the answer.
        check(unsafe { cuStreamGetCtx(self.raw, &mut ctx) }, "cuStreamGetCtx")?;
        Ok(ctx)
    }
}

impl<'a> From<&'a Stream> for StreamRef<'a> {
    fn from(s: &'a Stream) -> StreamRef<'a> {
        // SAFETY: the handle of a live `cust` stream, borrowed for `'a`.
        unsafe { StreamRef::from_raw(s.as_inner()) }
    }
}

#[cfg(feature = "cudarc")]
impl<'a> From<&'a cudarc::driver::CudaStream> for StreamRef<'a> {
    fn from(s: &'a cudarc::driver::CudaStream) -> StreamRef<'a> {
        // SAFETY: the handle of a live cudarc stream, borrowed for `'a`; cudarc's
        // `CUstream` is the same driver type (a pointer to `CUstream_st`) under
        // another crate's name.
        unsafe { StreamRef::from_raw(s.cu_stream() as CUstream) }
    }
}

/// A stream paired with a device's kernels: what every launcher takes. Work is queued
/// on the stream in call order and nothing synchronizes unless a method says so.
///
/// `&KvDevice` converts into one on the device's own stream; [`KvDevice::on`] pairs
/// the device with any other stream of its context (checking the context).
#[derive(Clone, Copy, Debug)]
pub struct KvStream<'a> {
    pub(crate) kernels: &'a KvKernels,
    pub(crate) stream: StreamRef<'a>,
}

impl<'a> KvStream<'a> {
    /// The stream.
    pub fn stream(self) -> StreamRef<'a> {
        self.stream
    }

    pub(crate) fn raw(self) -> CUstream {
        self.stream.raw
    }

    /// Wait for the stream.
    ///
    /// # Errors
    ///
    /// As [`StreamRef::synchronize`].
    pub fn synchronize(self) -> Result<(), CudaKvError> {
        self.stream.synchronize()
    }
}

impl<'a> From<&'a KvDevice> for KvStream<'a> {
    fn from(dev: &'a KvDevice) -> KvStream<'a> {
        KvStream { kernels: dev.kernels(), stream: StreamRef::from(dev.stream()) }
    }
}

/// A CUDA event of the current context, recorded on raw streams (kvpool's staging
/// guards). Timing is disabled: recording and querying it is cheap.
#[derive(Debug)]
pub(crate) struct RawEvent(CUevent);

impl RawEvent {
    pub(crate) fn new() -> Result<RawEvent, CudaKvError> {
        let mut e: CUevent = core::ptr::null_mut();
        let flags = CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: an out-parameter and valid flags; the event belongs to the current context.
        check(unsafe { cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(RawEvent(e))
    }

    /// The raw handle (valid while `self` lives).
    pub(crate) fn as_raw(&self) -> CUevent {
        self.0
    }

    /// Record the event at the current end of `stream`'s queue.
    pub(crate) fn record(&self, stream: StreamRef<'_>) -> Result<(), CudaKvError> {
        // SAFETY: a live event and a stream valid for the call.
        check(unsafe { cuEventRecord(self.0, stream.as_raw()) }, "cuEventRecord")
    }

    /// Whether the work before the last record has run (true if never recorded).
    pub(crate) fn is_done(&self) -> Result<bool, CudaKvError> {
        // SAFETY: a live event.
        match unsafe { cuEventQuery(self.0) } {
            cudaError_enum::CUDA_SUCCESS => Ok(true),
            cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|()| false),
        }
    }

    /// Block until the work before the last record has run.
    pub(crate) fn synchronize(&self) -> Result<(), CudaKvError> {
        // SAFETY: a live event.
        check(unsafe { cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: the event was created by `new` and is destroyed once; the driver
        // defers the release until pending records complete.
        unsafe { cuEventDestroy_v2(self.0) };
    }
}
