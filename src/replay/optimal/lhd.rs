//! An online policy in the page-level model (issue 13, fifth attempt): Least Hit
//! Density (Beckmann, Chen, Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit
//! Density", NSDI 2018), adapted to leaves of a prefix tree.
//!
//! A leaf's *hit density* is the hits it can still expect divided by the time it can
//! still expect to occupy the pool. Both are learned online, per class, from what the
//! cache has seen: for every leaf that ended its time as a leaf, the age (requests
//! since its last touch) at which it ended and whether a later request hit it or the
//! cache evicted it. For a leaf of class `c` and age `a`,
//!
//! ```text
//! density(c, a) = sum_{x >= a} hits(c, x) / sum_{x >= a} (hits(c, x) + evictions(c, x)) * (x - a)
//! ```
//!
//! (the expected hits over the expected remaining lifetime, given that it has lived to
//! `a`). Hit tokens per page-time is the density itself: a hit saves every page of the
//! leaf and the leaf holds every page, so the size cancels (the goal is token hits, not
//! object hits, which is why LHD's division by size is left out). The victim is the
//! least dense of [`SAMPLES`] leaves drawn at random (all of them when fewer), the
//! least recently used on a tie.
//!
//! Classes (online-observable, no per-trace constant):
//! * the leaf's *conversation depth* (0 to 3): as `EvictionPolicy::Reuse`, how many
//!   earlier requests' prefixes its path extends — LHD's classes by reference count;
//! * whether the leaf is the *remainder of a split*: the tail of a leaf that a later
//!   request matched only part of (its output and partial last block, in a Mooncake
//!   trace); whether such tails come back is for the counts to say.
//!
//! [`LhdVariant::Queue`] adds the waiting queue's knowledge: a leaf that one of the
//! next [`QUEUE`] requests uses goes after every other (the model reads the trace for
//! that, as a scheduler reads its queue), as `EvictionPolicy::Hinted` does.
//!
//! Parameters, fixed before the final measurement and not fitted to a trace: ages in
//! requests, bucketed four per octave ([`AGES`] buckets: up to 2^16 requests); the
//! densities recomputed every [`PERIOD`] requests from the whole history (no decay: no
//! time constant to pick); [`SAMPLES`] = 64 as in the LHD paper; [`QUEUE`] = 32, the
//! default lookahead. The random draws come from a fixed-seed xorshift, so a run is
//! deterministic.

/// Which classes and knowledge the modelled LHD uses (`--policy model-lhd[-...]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LhdVariant {
    /// One class: the density depends on the age alone (`model-lhd-age`).
    Age,
    /// Classes by depth and split remainder (`model-lhd-classes`).
    Classes,
    /// The classes, and the next [`QUEUE`] requests' leaves last (`model-lhd`).
    Queue,
}

/// Age buckets per class.
pub(super) const AGES: usize = 64;
/// Classes: depth 0 to 3, times remainder or not.
pub(super) const CLASSES: usize = 8;
/// Leaves drawn per eviction.
pub(super) const SAMPLES: usize = 64;
/// Requests between recomputations of the densities.
pub(super) const PERIOD: usize = 32;
/// The waiting queue of [`LhdVariant::Queue`], in requests.
pub(super) const QUEUE: u64 = 32;

/// The bucket of an age (requests since the last touch): four per octave.
pub(super) fn age_bucket(age: u64) -> usize {
    ((4.0 * ((age + 1) as f64).log2()) as usize).min(AGES - 1)
}

/// The youngest age in bucket `b` (as a real number) and the bucket's midpoint.
fn bucket_low(b: usize) -> f64 {
    2f64.powf(b as f64 / 4.0) - 1.0
}

fn bucket_mid(b: usize) -> f64 {
    2f64.powf((b as f64 + 0.5) / 4.0) - 1.0
}

/// The learned state: per (class, age bucket) the hits and evictions seen, the
/// densities last computed, and the evictable leaves to draw from.
#[derive(Clone)]
pub(super) struct Lhd {
    pub(super) variant: LhdVariant,
    hits: [[f64; AGES]; CLASSES],
    evictions: [[f64; AGES]; CLASSES],
    density: [[f64; AGES]; CLASSES],
    /// The evictable leaves (each node knows its index here).
    pub(super) leaves: Vec<u32>,
    rng: u64,
}

impl Lhd {
    pub(super) fn new(variant: LhdVariant) -> Self {
        Lhd {
            variant,
            hits: [[0.0; AGES]; CLASSES],
            evictions: [[0.0; AGES]; CLASSES],
            density: [[0.0; AGES]; CLASSES],
            leaves: Vec::new(),
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// The class of a leaf of `depth`, a split remainder or not.
    pub(super) fn class(&self, depth: u8, remainder: bool) -> usize {
        match self.variant {
            LhdVariant::Age => 0,
            LhdVariant::Classes | LhdVariant::Queue => usize::from(depth.min(3)) + 4 * usize::from(remainder),
        }
    }

    pub(super) fn hit(&mut self, class: usize, age: u64) {
        self.hits[class][age_bucket(age)] += 1.0;
    }

    pub(super) fn evicted(&mut self, class: usize, age: u64) {
        self.evictions[class][age_bucket(age)] += 1.0;
    }

    pub(super) fn density(&self, class: usize, age: u64) -> f64 {
        self.density[class][age_bucket(age)]
    }

    /// (hits, evictions) counted in `classes`, over every age.
    #[cfg(test)]
    pub(super) fn totals(&self, classes: core::ops::Range<usize>) -> (f64, f64) {
        let sum = |t: &[[f64; AGES]; CLASSES]| classes.clone().map(|c| t[c].iter().sum::<f64>()).sum::<f64>();
        (sum(&self.hits), sum(&self.evictions))
    }

    /// Recompute every density from the counts (a class with no ending at or past an
    /// age has density 0 there: nothing says it will be hit).
    pub(super) fn recompute(&mut self) {
        for c in 0..CLASSES {
            for b in 0..AGES {
                let (mut hits, mut lifetime) = (0.0, 0.0);
                for x in b..AGES {
                    let ended = self.hits[c][x] + self.evictions[c][x];
                    hits += self.hits[c][x];
                    // At least half a request: an ending in the leaf's own bucket.
                    lifetime += ended * (bucket_mid(x) - bucket_low(b)).max(0.5);
                }
                self.density[c][b] = if lifetime > 0.0 { hits / lifetime } else { 0.0 };
            }
        }
    }

    /// The index in `leaves` of the next candidate (xorshift64).
    pub(super) fn draw(&mut self) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % self.leaves.len() as u64) as usize
    }
}
