//! Treadle's native core, pure Rust (no Python): the batch-preparation hot paths.
//!
//! - [`packing`]: first-fit-decreasing assignment of samples to fixed-length bins.
//!
//! Python reaches this crate only through the thin `treadle-native` bindings crate, so
//! `cargo test` here needs no interpreter.

pub mod error;
pub mod packing;

pub use error::CoreError;
