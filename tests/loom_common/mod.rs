//! What every loom model shares: it counts the executions loom explored and fails when
//! there was only one, and it counts the outcomes the model names, so a model can
//! assert that the interleaving it is about was really reached.
//!
//! Why: loom does not explore every order of a load in one thread and a later store in
//! another (tokio-rs/loom#392). A model whose reader runs before its writer in loom's
//! first schedule can explore exactly one execution and pass without checking the race
//! at all. Counting executions turns that silent gap into a failure.
//!
//! The counters are std atomics outside the model: loom runs its executions one after
//! the other on one OS thread, so they count across executions and cost the search
//! nothing.
#![allow(dead_code)] // each model file uses a part

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Run `f` under [`loom::model`] (with `LOOM_MAX_PREEMPTIONS` from the environment, as
/// `scripts/loom.sh` sets it), print how many executions loom explored, and fail unless
/// there were at least two. Returns the count.
///
/// # Panics
///
/// When loom explored a single execution: the model's threads never interleaved.
pub fn model<F>(name: &str, f: F) -> usize
where
    F: Fn() + Sync + Send + 'static,
{
    model_with(name, loom::model::Builder::new(), f)
}

/// [`model`] with a configured builder (for a model that bounds its own search).
pub fn model_with<F>(name: &str, builder: loom::model::Builder, f: F) -> usize
where
    F: Fn() + Sync + Send + 'static,
{
    let executions = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&executions);
    builder.check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        f();
    });
    let n = executions.load(Ordering::Relaxed);
    eprintln!("loom model {name}: {n} executions");
    assert!(n > 1, "loom explored only {n} execution of {name}: its threads never interleaved (see tokio-rs/loom#392)");
    n
}

/// Named outcome counters shared by a model's executions: `hit("label")` in the model,
/// then `expect_seen` after it to assert each interesting outcome happened at least once.
#[derive(Clone, Debug)]
pub struct Outcomes {
    labels: &'static [&'static str],
    counts: Arc<Vec<AtomicUsize>>,
}

impl Outcomes {
    /// Counters for `labels`, all zero.
    pub fn new(labels: &'static [&'static str]) -> Self {
        Outcomes { labels, counts: Arc::new(labels.iter().map(|_| AtomicUsize::new(0)).collect()) }
    }

    /// Count one execution with outcome `label`.
    ///
    /// # Panics
    ///
    /// If `label` was not declared.
    pub fn hit(&self, label: &str) {
        let i = self.labels.iter().position(|l| *l == label).unwrap_or_else(|| panic!("undeclared outcome {label}"));
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    /// How many executions had outcome `label`.
    pub fn count(&self, label: &str) -> usize {
        let i = self.labels.iter().position(|l| *l == label).unwrap_or_else(|| panic!("undeclared outcome {label}"));
        self.counts[i].load(Ordering::Relaxed)
    }

    /// Print every count, then fail unless each of `labels` was seen at least once.
    ///
    /// # Panics
    ///
    /// When one of `labels` was never seen: the model did not reach that interleaving.
    pub fn expect_seen(&self, name: &str, labels: &[&str]) {
        let all: Vec<String> = self.labels.iter().map(|l| format!("{l}={}", self.count(l))).collect();
        eprintln!("loom model {name}: outcomes {}", all.join(" "));
        for l in labels {
            assert!(self.count(l) > 0, "loom never reached outcome `{l}` in {name} (counts: {})", all.join(" "));
        }
    }
}
