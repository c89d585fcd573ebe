//! Operation models shared by the model tests (proptest) and the fuzz targets
//! (cargo-fuzz): each drives a kvpool structure and a plain reference side by side and
//! reports the first disagreement. Behind the `testing` feature.

pub mod radix;
