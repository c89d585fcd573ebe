//! What the shuttle tests share: schedule counts, a deterministic key generator, and a
//! shadow of which token each KV slot holds.
//!
//! The shadow is plain std state behind a std `Mutex`, never held across a kvpool call.
//! Shuttle switches threads only at its own operations (kvpool's atomics, shuttle's
//! locks, `yield_now`), so a shadow update right after a kvpool call returns happens,
//! as far as every other thread can tell, at the same instant as the call's last atomic
//! step: the shadow check after `peek_prefix` runs at the instant of its final
//! validation, when every returned slot must still hold the token it matched.
#![allow(dead_code)] // each test file uses a part

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use shuttle::rand::{thread_rng, Rng};

/// `default`, or `SHUTTLE_SCHEDULES` when set (CI's short pass, or a long local run).
pub fn schedules(default: usize) -> usize {
    std::env::var("SHUTTLE_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Run `f` under shuttle's random scheduler for `n` schedules and under PCT (depth 3)
/// for `n / 2` more, printing the counts. A failure prints the schedule to replay.
pub fn check<F>(name: &str, n: usize, f: F)
where
    F: Fn() + Send + Sync + 'static + Clone,
{
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let (r1, f1) = (runs.clone(), f.clone());
    shuttle::check_random(
        move || {
            r1.fetch_add(1, Ordering::Relaxed);
            f1()
        },
        n,
    );
    let random = runs.swap(0, Ordering::Relaxed);
    let r2 = runs.clone();
    shuttle::check_pct(
        move || {
            r2.fetch_add(1, Ordering::Relaxed);
            f()
        },
        n / 2,
        3,
    );
    let pct = runs.load(Ordering::Relaxed);
    eprintln!("shuttle {name}: {random} random schedules + {pct} PCT schedules (depth 3)");
    assert!(random + pct >= n, "shuttle ran fewer schedules than asked");
}

/// A key of `len` tokens from `1..=alphabet` (a small alphabet makes shared prefixes,
/// hence splits). Drawn from shuttle's per-schedule random source, so a failing
/// schedule replays with the same keys.
pub fn random_key(len: usize, alphabet: u32) -> Vec<u32> {
    let mut rng = thread_rng();
    (0..len).map(|_| rng.gen_range(1..=alphabet)).collect()
}

/// A number in `range` from shuttle's per-schedule random source.
pub fn random_in(range: std::ops::Range<usize>) -> usize {
    thread_rng().gen_range(range)
}

/// Which token each slot holds (what the forward pass wrote into it), and which
/// request holds it fresh (allocated, not yet handed to the cache) or through a lock.
pub struct Shadow {
    inner: Mutex<ShadowInner>,
}

struct ShadowInner {
    token: Vec<u32>,
    owner: Vec<u32>,
    locks: Vec<u32>,
}

impl Shadow {
    /// A shadow of `slots` slots, none written, none held.
    pub fn new(slots: usize) -> Self {
        Shadow {
            inner: Mutex::new(ShadowInner { token: vec![0; slots], owner: vec![0; slots], locks: vec![0; slots] }),
        }
    }

    /// Fresh slots handed to request `req` (nonzero), that wrote `tokens` into them.
    ///
    /// # Panics
    ///
    /// When one of them is held by a request or a lock: handed out twice.
    pub fn claim(&self, req: u32, slots: &[u32], tokens: &[u32]) {
        let mut s = self.inner.lock().unwrap();
        for (&slot, &t) in slots.iter().zip(tokens) {
            let i = slot as usize;
            assert!(
                s.owner[i] == 0 && s.locks[i] == 0,
                "slot {slot} handed to request {req} while held (by request {}, {} locks)",
                s.owner[i],
                s.locks[i]
            );
            s.owner[i] = req;
            s.token[i] = t;
        }
    }

    /// Freshly allocated `slots` had `tokens` written into them, by someone who hands
    /// them straight to the cache (no request holds them).
    ///
    /// # Panics
    ///
    /// When one of them is held by a request or a lock: handed out twice.
    pub fn record(&self, slots: &[u32], tokens: &[u32]) {
        let mut s = self.inner.lock().unwrap();
        for (&slot, &t) in slots.iter().zip(tokens) {
            let i = slot as usize;
            assert!(
                s.owner[i] == 0 && s.locks[i] == 0,
                "slot {slot} handed out while held (by request {}, {} locks)",
                s.owner[i],
                s.locks[i]
            );
            s.token[i] = t;
        }
    }

    /// Request `req` stops holding `slots` fresh (it hands them to the cache, or frees them).
    pub fn unclaim(&self, req: u32, slots: &[u32]) {
        let mut s = self.inner.lock().unwrap();
        for &slot in slots {
            assert_eq!(s.owner[slot as usize], req, "slot {slot} not held by request {req}");
            s.owner[slot as usize] = 0;
        }
    }

    /// A lease now protects `slots`.
    pub fn lock(&self, slots: &[u32]) {
        let mut s = self.inner.lock().unwrap();
        for &slot in slots {
            s.locks[slot as usize] += 1;
        }
    }

    /// A lease on `slots` is about to be released.
    pub fn unlock(&self, slots: &[u32]) {
        let mut s = self.inner.lock().unwrap();
        for &slot in slots {
            s.locks[slot as usize] -= 1;
        }
    }

    /// Check a prefix-cache result: `slots[i]` holds `key[i]` for every `i`, no slot
    /// twice, none held fresh by a request, whole pages of `page_size` in order.
    ///
    /// # Panics
    ///
    /// On any inconsistency, naming `what` returned it.
    pub fn check_match(&self, what: &str, key: &[u32], slots: &[u32], page_size: usize) {
        assert!(slots.len() <= key.len() && slots.len() % page_size == 0, "{what}: {} tokens matched", slots.len());
        let s = self.inner.lock().unwrap();
        for (i, (&slot, &t)) in slots.iter().zip(key).enumerate() {
            let at = slot as usize;
            assert!(at < s.token.len() && slot as usize >= page_size, "{what}: slot {slot} out of range");
            assert_eq!(s.token[at], t, "{what}: slot {slot} at {i} holds token {} not {t} ({slots:?})", s.token[at]);
            assert_eq!(s.owner[at], 0, "{what}: slot {slot} is held fresh by request {}", s.owner[at]);
            let page_start = slots[i - i % page_size];
            assert!(
                page_start as usize % page_size == 0 && slot == page_start + (i % page_size) as u32,
                "{what}: slots not whole pages in order: {slots:?}"
            );
            assert!(!slots[..i].contains(&slot), "{what}: slot {slot} twice in {slots:?}");
        }
    }

    /// Every slot is free of requests and locks (at the end of a run).
    pub fn assert_nothing_held(&self) {
        let s = self.inner.lock().unwrap();
        assert!(s.owner.iter().all(|&o| o == 0), "a slot is still held by a request");
        assert!(s.locks.iter().all(|&l| l == 0), "a slot is still locked");
    }
}

/// Named counters summed over every schedule of a test: `hit("label")` where something
/// interesting happened, `expect_seen` after the run to assert it happened at all.
#[derive(Clone, Debug)]
pub struct Outcomes {
    labels: &'static [&'static str],
    counts: std::sync::Arc<Vec<AtomicUsize>>,
}

impl Outcomes {
    /// Counters for `labels`, all zero.
    pub fn new(labels: &'static [&'static str]) -> Self {
        Outcomes { labels, counts: std::sync::Arc::new(labels.iter().map(|_| AtomicUsize::new(0)).collect()) }
    }

    fn index(&self, label: &str) -> usize {
        self.labels.iter().position(|l| *l == label).unwrap_or_else(|| panic!("undeclared outcome {label}"))
    }

    /// Count one `label`.
    pub fn hit(&self, label: &str) {
        self.counts[self.index(label)].fetch_add(1, Ordering::Relaxed);
    }

    /// How many times `label` was counted.
    pub fn count(&self, label: &str) -> usize {
        self.counts[self.index(label)].load(Ordering::Relaxed)
    }

    /// Print every count, then fail unless each of `labels` was counted at least once.
    pub fn expect_seen(&self, name: &str, labels: &[&str]) {
        let all: Vec<String> = self.labels.iter().map(|l| format!("{l}={}", self.count(l))).collect();
        eprintln!("shuttle {name}: {}", all.join(" "));
        for l in labels {
            assert!(self.count(l) > 0, "shuttle never reached `{l}` in {name} ({})", all.join(" "));
        }
    }
}
