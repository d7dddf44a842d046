//! Treadle's native core, pure Rust (no Python): the batch-preparation hot paths.
//!
//! - [`packing`]: samples into fixed-length micro-batches, balanced over data-parallel
//!   ranks, with the per-token tensors the loss reads, and back.
//! - [`render`]: chats to token ids exactly as each model family's chat template does,
//!   with per-token message index, loss mask and content flag; append-only extension of
//!   sampled conversations (`bridge`); parsing of sampled completions.
//!
//! Python reaches this crate only through the thin `treadle-native` bindings crate, so
//! `cargo test` here needs no interpreter.

pub mod error;
pub mod balance;
pub mod batch;
pub mod packing;

pub use error::{CoreError, Result};
