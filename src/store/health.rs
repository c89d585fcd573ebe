//! Backoff after failures and the counters a store reports.

use std::time::{Duration, Instant};

use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// How long a store client waits before it tries the server again after a failure:
/// `initial`, doubled after each further failure in a row, at most `max`. While it
/// waits, operations return [`StoreError::Unavailable`](super::StoreError::Unavailable)
/// at once, without touching the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffConfig {
    /// The wait after the first failure.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for BackoffConfig {
    /// 50 ms, doubling up to 5 s.
    fn default() -> Self {
        BackoffConfig { initial: Duration::from_millis(50), max: Duration::from_secs(5) }
    }
}

impl BackoffConfig {
    /// The wait after `failures` failures in a row (`failures >= 1`).
    pub fn wait(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(30);
        self.initial.saturating_mul(1 << doublings).min(self.max)
    }
}

/// The backoff state: failures in a row and when the next try may go out. Atomics, so
/// that a thread can see "backing off" without waiting for the connection's lock.
#[derive(Debug)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Backoff {
    cfg: BackoffConfig,
    epoch: Instant,
    failures: AtomicU32,
    /// Nanoseconds after `epoch` before which no try goes out (0: none pending).
    retry_at: AtomicU64,
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
impl Backoff {
    pub(crate) fn new(cfg: BackoffConfig) -> Backoff {
        Backoff { cfg, epoch: Instant::now(), failures: AtomicU32::new(0), retry_at: AtomicU64::new(0) }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }

    /// `Err((wait left, failures in a row))` while backing off.
    pub(crate) fn check(&self) -> Result<(), (Duration, u32)> {
        // Relaxed: the two words are advisory (a thread that reads a stale value either
        // tries once too early or refuses once too many); the connection's lock orders
        // the real work.
        let at = self.retry_at.load(Ordering::Relaxed);
        if at == 0 {
            return Ok(());
        }
        let now = self.now();
        if now < at {
            return Err((Duration::from_nanos(at - now), self.failures.load(Ordering::Relaxed)));
        }
        Ok(())
    }

    /// Record a failure; the wait it starts.
    pub(crate) fn failed(&self) -> Duration {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        let wait = self.cfg.wait(failures);
        let at = self.now().saturating_add(wait.as_nanos().min(u64::MAX as u128) as u64).max(1);
        self.retry_at.store(at, Ordering::Relaxed);
        wait
    }

    /// Record a success: no wait.
    pub(crate) fn succeeded(&self) {
        if self.retry_at.load(Ordering::Relaxed) != 0 || self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
            self.retry_at.store(0, Ordering::Relaxed);
        }
    }

    pub(crate) fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }
}

/// Latency samples kept for percentiles: the last this many operations.
pub const LATENCY_SAMPLES: usize = 1024;

/// The live counters of a store client (atomics; [`StoreStats`] is a snapshot).
#[derive(Debug)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Counters {
    pub(crate) ops: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) full: AtomicU64,
    pub(crate) connects: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) pages_put: AtomicU64,
    pub(crate) pages_loaded: AtomicU64,
    pub(crate) absent: AtomicU64,
    pub(crate) corrupt: AtomicU64,
    pub(crate) mismatched: AtomicU64,
    pub(crate) foreign: AtomicU64,
    pub(crate) forged: AtomicU64,
    pub(crate) key_errors: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    latency_us: [AtomicU32; LATENCY_SAMPLES],
    latency_next: AtomicU64,
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
impl Counters {
    pub(crate) fn new() -> Counters {
        Counters {
            ops: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            full: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            pages_put: AtomicU64::new(0),
            pages_loaded: AtomicU64::new(0),
            absent: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            mismatched: AtomicU64::new(0),
            foreign: AtomicU64::new(0),
            forged: AtomicU64::new(0),
            key_errors: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            latency_us: core::array::from_fn(|_| AtomicU32::new(0)),
            latency_next: AtomicU64::new(0),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        // Relaxed: statistics, read as a snapshot.
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Record one operation's latency in the ring of the last [`LATENCY_SAMPLES`].
    pub(crate) fn sample(&self, took: Duration) {
        let i = self.latency_next.fetch_add(1, Ordering::Relaxed) as usize % LATENCY_SAMPLES;
        let us = took.as_micros().clamp(1, u32::MAX as u128) as u32;
        self.latency_us[i].store(us, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self, backoff_failures: u32) -> StoreStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut samples = [0u32; LATENCY_SAMPLES];
        let mut n = 0;
        for s in &self.latency_us {
            let v = s.load(Ordering::Relaxed);
            if v != 0 {
                samples[n] = v;
                n += 1;
            }
        }
        let samples = &mut samples[..n];
        samples.sort_unstable();
        let pct = |p: usize| {
            if samples.is_empty() {
                Duration::ZERO
            } else {
                Duration::from_micros(samples[((samples.len() - 1) * p).div_ceil(100)] as u64)
            }
        };
        StoreStats {
            ops: load(&self.ops),
            failures: load(&self.failures),
            timeouts: load(&self.timeouts),
            unavailable: load(&self.unavailable),
            full: load(&self.full),
            connects: load(&self.connects),
            reconnects: load(&self.reconnects),
            pages_put: load(&self.pages_put),
            pages_loaded: load(&self.pages_loaded),
            absent: load(&self.absent),
            corrupt: load(&self.corrupt),
            mismatched: load(&self.mismatched),
            foreign: load(&self.foreign),
            forged: load(&self.forged),
            key_errors: load(&self.key_errors),
            bytes_written: load(&self.bytes_written),
            bytes_read: load(&self.bytes_read),
            failures_in_row: backoff_failures,
            p50: pct(50),
            p99: pct(99),
        }
    }
}

/// A snapshot of a store client's counters (exact when no operation is in flight).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Operations that went to the server (`exists_prefix`, `get`, `put` calls).
    pub ops: u64,
    /// Operations that failed (connection errors, timeouts, server errors, full). An
    /// error reply for one page's key is not one ([`key_errors`](Self::key_errors)).
    pub failures: u64,
    /// ... of which timed out.
    pub timeouts: u64,
    /// Operations refused at once while backing off (not in `ops`).
    pub unavailable: u64,
    /// Writes the server refused for lack of memory.
    pub full: u64,
    /// Connections made (the first one included).
    pub connects: u64,
    /// Connections made after a failure dropped the previous one.
    pub reconnects: u64,
    /// Pages written.
    pub pages_put: u64,
    /// Pages loaded (checked and copied into the caller's pages).
    pub pages_loaded: u64,
    /// Pages asked for by `get` that the store did not have.
    pub absent: u64,
    /// Pages refused as damaged ([`Invalid::is_corrupt`](super::Invalid::is_corrupt)).
    pub corrupt: u64,
    /// Pages refused as another version, format or revision, or sealed with a MAC when
    /// this client has no MAC key ([`Invalid::Keyed`](super::Invalid::Keyed)).
    pub mismatched: u64,
    /// Pages refused as sound values written for another key: another page hash, or
    /// another namespace, model id or salt ([`Invalid::is_foreign`](super::Invalid::is_foreign)).
    pub foreign: u64,
    /// Pages refused by the MAC check of a client with a MAC key: no MAC, or one that
    /// does not verify ([`Invalid::is_forged`](super::Invalid::is_forged)).
    pub forged: u64,
    /// Keys the server answered with an error reply (e.g. `WRONGTYPE` for a key that
    /// holds a list), each a miss ([`Miss::Error`](super::Miss::Error)) or, for `put`, a
    /// page not written; the operation went on and the client did not back off.
    pub key_errors: u64,
    /// Value bytes written (headers included).
    pub bytes_written: u64,
    /// Value bytes read (headers included).
    pub bytes_read: u64,
    /// Failures in a row now (0 when the last try succeeded).
    pub failures_in_row: u32,
    /// Median latency of the last [`LATENCY_SAMPLES`] operations that went out.
    pub p50: Duration,
    /// 99th percentile of the same.
    pub p99: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_clears() {
        let cfg = BackoffConfig { initial: Duration::from_millis(10), max: Duration::from_millis(70) };
        let waits: Vec<_> = (1..=6).map(|f| cfg.wait(f).as_millis()).collect();
        assert_eq!(waits, [10, 20, 40, 70, 70, 70]);
        assert_eq!(cfg.wait(u32::MAX), cfg.max);
        let b = Backoff::new(BackoffConfig { initial: Duration::from_secs(60), max: Duration::from_secs(60) });
        assert!(b.check().is_ok());
        b.failed();
        let (left, failures) = b.check().unwrap_err();
        assert!(left > Duration::from_secs(59) && failures == 1);
        b.succeeded();
        assert!(b.check().is_ok());
        assert_eq!(b.failures(), 0);
    }

    #[test]
    fn percentiles_come_from_the_last_samples() {
        let c = Counters::new();
        assert_eq!(c.snapshot(0).p99, Duration::ZERO);
        for us in 1..=100u64 {
            c.sample(Duration::from_micros(us));
        }
        let s = c.snapshot(0);
        assert_eq!(s.p50, Duration::from_micros(51));
        assert_eq!(s.p99, Duration::from_micros(100));
        for _ in 0..LATENCY_SAMPLES {
            c.sample(Duration::from_micros(7));
        }
        assert_eq!(c.snapshot(0).p99, Duration::from_micros(7));
    }
}
