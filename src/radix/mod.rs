//! The radix prefix cache.

mod policy;

pub use policy::{EvictionPolicy, UnknownPolicy};
