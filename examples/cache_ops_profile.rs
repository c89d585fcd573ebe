//! The `cache_ops` loop of `benches/radix_replay.rs` for one cache, on its own, with a
//! sampling profiler built in for machines that have no `perf` (the GPU machines these
//! benchmarks run on have none, and no hardware counters either).
//!
//! ```text
//! cargo run --release --example cache_ops_profile -- [CACHE] [PAGE_SIZE] [CAPACITY] [PASSES]
//! ```
//!
//! `CACHE` is `kvpool` (default), `reference` or `vectrie`; the page size defaults to 16,
//! the capacity to 1,048,576 tokens, the passes to 5. Every pass builds a fresh cache
//! (not timed) and runs the bundled trace's requests through it as the bench does:
//! match and lock the prompt, evict the shortfall, allocate the rest into the row,
//! finish the request. It prints the best pass's thread CPU time and the hit tokens.
//!
//! **Sampling.** With `KVPOOL_SAMPLE_US=N` a timer (`CLOCK_MONOTONIC`, so it ticks every
//! `N` µs however coarse the scheduler tick is) interrupts the loop with `SIGPROF`, and
//! the handler records the interrupted instruction and the return addresses found by
//! walking the frame pointers, during the timed passes only. `KVPOOL_SAMPLE_OUT=FILE`
//! (default `samples.txt`) receives one line per sample: hexadecimal offsets from the
//! executable's load address, innermost first. Build with frame pointers for call stacks
//! (without them the lines hold the interrupted instruction and little else):
//!
//! ```text
//! RUSTFLAGS="-C force-frame-pointers=yes" cargo build --release --example cache_ops_profile
//! KVPOOL_SAMPLE_US=100 KVPOOL_SAMPLE_OUT=s.txt target/release/examples/cache_ops_profile kvpool 16 1048576 25
//! python3 scripts/profile_report.py target/release/examples/cache_ops_profile s.txt
//! ```
//!
//! `scripts/profile_report.py` resolves the offsets with binutils' `addr2line` (inlined
//! frames included: the release profile keeps line tables) and prints the self and
//! inclusive shares. The handler costs a few microseconds a sample: at 100 µs the passes
//! run a few percent slower, so compare sampled runs with sampled runs.

use std::sync::Arc;
use std::time::Duration;

use kvpool::radix::{EvictionPolicy, RadixCache, RadixConfig};
use kvpool::replay::{ReferenceCache, ReplayCache, Trace, VecTrieReplayCache};
use kvpool::{PagedAllocator, ReqToTokenPool};

// The bench's loop itself (its `expansion_only` is the bench's alone).
#[path = "../benches/shared/cache_ops.rs"]
#[allow(dead_code)]
mod shared;
use shared::cache_ops;

/// Best thread-CPU time of `passes` passes, each on a fresh cache; the hit tokens.
fn best_of<C: ReplayCache>(make: impl Fn() -> C, trace: &Trace, passes: usize) -> (Duration, usize) {
    let mut tokens = vec![0u32; trace.max_kv_len()];
    let (mut best, mut hits) = (Duration::MAX, 0);
    for _ in 0..passes {
        let cache = make();
        sampler::resume();
        let t = thread_cpu_time();
        hits = cache_ops(&cache, trace, &mut tokens);
        best = best.min(thread_cpu_time().saturating_sub(t));
        sampler::pause();
    }
    (best, hits)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.to_string());
    let which = arg(0, "kvpool");
    let page_size: u32 = arg(1, "16").parse()?;
    let capacity: usize = arg(2, "1048576").parse()?;
    let passes: usize = arg(3, "5").parse()?;
    if passes == 0 {
        return Err("PASSES must be at least 1".into());
    }
    let trace = Trace::bundled()?;
    let max_kv = trace.max_kv_len();
    let sampling = match std::env::var("KVPOOL_SAMPLE_US") {
        Ok(us) => Some(sampler::start(us.parse()?)?),
        Err(_) => None,
    };
    let (best, hits) = match which.as_str() {
        "kvpool" => {
            // Check the configuration once, so that a bad one is an error, not a panic.
            let make = || {
                let config =
                    RadixConfig { policy: EvictionPolicy::Lru, event_capacity: None, ..RadixConfig::default() };
                let rows = ReqToTokenPool::new(1, max_kv)?;
                RadixCache::new(PagedAllocator::new(capacity, page_size)?, rows, config).map(Arc::new)
            };
            make()?;
            best_of(|| make().expect("checked above"), &trace, passes)
        }
        "reference" => {
            let make = || ReferenceCache::new(capacity, page_size, EvictionPolicy::Lru, 1, max_kv);
            make()?;
            best_of(|| make().expect("checked above"), &trace, passes)
        }
        "vectrie" => {
            let make = || VecTrieReplayCache::new(capacity, page_size, 1, max_kv);
            make()?;
            best_of(|| make().expect("checked above"), &trace, passes)
        }
        other => return Err(format!("unknown cache {other:?} (kvpool, reference or vectrie)").into()),
    };
    println!(
        "{which} page {page_size} capacity {capacity}: best of {passes} passes {:.2} ms (thread CPU), hit tokens {hits}",
        best.as_secs_f64() * 1e3
    );
    if let Some(session) = sampling {
        let path = std::env::var("KVPOOL_SAMPLE_OUT").unwrap_or_else(|_| "samples.txt".to_string());
        let n = session.finish(&path)?;
        println!("{n} samples written to {path}");
    }
    Ok(())
}

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable `timespec`, the only memory the call writes.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A `SIGPROF` sampler of the main thread (x86-64 Linux; elsewhere `start` fails).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod sampler {
    use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

    /// Addresses kept per sample: the interrupted instruction and up to 31 callers.
    const DEPTH: usize = 32;
    /// Samples kept at most (about 2 MiB of addresses per 8,192).
    const MAX_SAMPLES: usize = 1 << 18;

    /// The sample buffer (`MAX_SAMPLES * DEPTH` words, leaked by `start`), the samples
    /// taken, whether the handler records, and the main thread's stack bounds.
    static BUF: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());
    static TAKEN: AtomicUsize = AtomicUsize::new(0);
    static ON: AtomicBool = AtomicBool::new(false);
    static STACK_END: AtomicU64 = AtomicU64::new(0);

    /// Record samples from now on (no-op without a session).
    pub fn resume() {
        ON.store(true, Ordering::Relaxed);
    }

    /// Stop recording.
    pub fn pause() {
        ON.store(false, Ordering::Relaxed);
    }

    /// An armed timer; [`finish`](Session::finish) writes the samples out.
    pub struct Session {
        timer: libc::timer_t,
    }

    /// The end (highest address) of the mapping that holds the main thread's stack.
    fn stack_end() -> Result<u64, Box<dyn std::error::Error>> {
        let maps = std::fs::read_to_string("/proc/self/maps")?;
        let line = maps.lines().find(|l| l.ends_with("[stack]")).ok_or("no [stack] mapping")?;
        let range = line.split_whitespace().next().ok_or("bad maps line")?;
        let end = range.split('-').nth(1).ok_or("bad maps range")?;
        Ok(u64::from_str_radix(end, 16)?)
    }

    /// The executable's load address: start minus file offset of its first mapping.
    fn load_base() -> Result<u64, Box<dyn std::error::Error>> {
        let exe = std::fs::read_link("/proc/self/exe")?;
        let exe = exe.to_str().ok_or("executable path is not UTF-8")?;
        let maps = std::fs::read_to_string("/proc/self/maps")?;
        let mut base = u64::MAX;
        for l in maps.lines().filter(|l| l.ends_with(exe)) {
            let mut f = l.split_whitespace();
            let start = f.next().and_then(|r| r.split('-').next()).ok_or("bad maps line")?;
            let offset = f.nth(1).ok_or("bad maps line")?;
            base = base.min(u64::from_str_radix(start, 16)? - u64::from_str_radix(offset, 16)?);
        }
        if base == u64::MAX {
            return Err("the executable is not in /proc/self/maps".into());
        }
        Ok(base)
    }

    extern "C" fn on_sigprof(_sig: libc::c_int, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        if !ON.load(Ordering::Relaxed) {
            return;
        }
        let n = TAKEN.load(Ordering::Relaxed);
        let buf = BUF.load(Ordering::Relaxed);
        if n >= MAX_SAMPLES || buf.is_null() {
            return;
        }
        // SAFETY: the kernel passes a valid `ucontext_t` as the third argument of an
        // `SA_SIGINFO` handler; it is only read.
        let regs = unsafe { &(*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs };
        let (rip, rsp, mut rbp) = (
            regs[libc::REG_RIP as usize] as u64,
            regs[libc::REG_RSP as usize] as u64,
            regs[libc::REG_RBP as usize] as u64,
        );
        let end = STACK_END.load(Ordering::Relaxed);
        // SAFETY: `buf` holds `MAX_SAMPLES * DEPTH` initialised atomics (`start`) and
        // `n < MAX_SAMPLES`, so the row lies inside it.
        let row = unsafe { std::slice::from_raw_parts(buf.add(n * DEPTH), DEPTH) };
        row[0].store(rip, Ordering::Relaxed);
        let mut d = 1;
        // A frame is `[rbp] = caller's rbp, [rbp + 8] = return address`. Only words
        // between the interrupted stack pointer and the end of the stack mapping are
        // read (mapped, whatever `rbp` holds in code built without frame pointers), and
        // the chain must climb, so the walk ends.
        while d < DEPTH && rbp >= rsp && rbp % 8 == 0 && rbp.saturating_add(16) <= end {
            // SAFETY: `rbp .. rbp + 16` lies inside the main thread's stack mapping,
            // above the interrupted stack pointer (checked above): mapped, readable
            // memory. The words may be anything; they are only recorded or compared.
            let (next, ret) = unsafe { (*(rbp as *const u64), *((rbp + 8) as *const u64)) };
            row[d].store(ret, Ordering::Relaxed);
            d += 1;
            if next <= rbp {
                break;
            }
            rbp = next;
        }
        if d < DEPTH {
            row[d].store(0, Ordering::Relaxed);
        }
        TAKEN.store(n + 1, Ordering::Relaxed);
    }

    /// Arm a `CLOCK_MONOTONIC` timer that sends `SIGPROF` every `us` microseconds.
    pub fn start(us: u64) -> Result<Session, Box<dyn std::error::Error>> {
        if us == 0 {
            return Err("KVPOOL_SAMPLE_US must be at least 1".into());
        }
        if !BUF.load(Ordering::Relaxed).is_null() {
            return Err("the sampler is already started".into());
        }
        STACK_END.store(stack_end()?, Ordering::Relaxed);
        let buf: Box<[AtomicU64]> = (0..MAX_SAMPLES * DEPTH).map(|_| AtomicU64::new(0)).collect();
        BUF.store(Box::leak(buf).as_mut_ptr(), Ordering::Relaxed);
        // SAFETY: `sigaction` and `sigevent` are plain C structs for which all-zero is a
        // valid value; every pointer passed is to a live local; the handler has the
        // `SA_SIGINFO` signature and touches only atomics and the stack words it checks.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigprof as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            let mut ev: libc::sigevent = std::mem::zeroed();
            ev.sigev_notify = libc::SIGEV_SIGNAL;
            ev.sigev_signo = libc::SIGPROF;
            let mut timer: libc::timer_t = std::mem::zeroed();
            if libc::timer_create(libc::CLOCK_MONOTONIC, &mut ev, &mut timer) != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            let period = libc::timespec { tv_sec: (us / 1_000_000) as _, tv_nsec: ((us % 1_000_000) * 1000) as _ };
            let spec = libc::itimerspec { it_interval: period, it_value: period };
            if libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            Ok(Session { timer })
        }
    }

    impl Session {
        /// Disarm the timer and write the samples to `path`; returns how many.
        pub fn finish(self, path: &str) -> Result<usize, Box<dyn std::error::Error>> {
            use std::io::Write;
            pause();
            // SAFETY: `self.timer` was created by `timer_create` and is deleted once
            // (`self` is consumed).
            unsafe { libc::timer_delete(self.timer) };
            let base = load_base()?;
            let n = TAKEN.load(Ordering::Relaxed);
            let buf = BUF.load(Ordering::Relaxed);
            // SAFETY: `buf` holds `MAX_SAMPLES * DEPTH` atomics, leaked (never freed) by
            // `start`, and `n <= MAX_SAMPLES`.
            let words = unsafe { std::slice::from_raw_parts(buf, n * DEPTH) };
            let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
            for row in words.chunks_exact(DEPTH) {
                let addrs: Vec<String> = row
                    .iter()
                    .map(|a| a.load(Ordering::Relaxed))
                    .take_while(|&a| a != 0)
                    // Addresses outside the executable (libc, the vDSO) are written as 0.
                    .map(|a| format!("{:x}", a.checked_sub(base).filter(|&o| o < 1 << 32).unwrap_or(0)))
                    .collect();
                writeln!(out, "{}", addrs.join(" "))?;
            }
            out.flush()?;
            Ok(n)
        }
    }
}

/// Elsewhere the loop runs and the sampler refuses to start.
#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
mod sampler {
    pub struct Session;

    pub fn resume() {}

    pub fn pause() {}

    pub fn start(_us: u64) -> Result<Session, Box<dyn std::error::Error>> {
        Err("the sampler reads x86-64 registers through Linux's ucontext: x86-64 Linux only".into())
    }

    impl Session {
        pub fn finish(self, _path: &str) -> Result<usize, Box<dyn std::error::Error>> {
            Ok(0)
        }
    }
}
