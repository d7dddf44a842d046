//! Treadle's native core, pure Rust (no Python): the batch-preparation hot paths.
//!
//! - [`packing`], [`balance`], [`batch`]: samples into fixed-length micro-batches
//!   (first fit decreasing), balanced over data-parallel ranks, with the per-token
//!   tensors the loss reads; and back (unpack).
//! - [`render`]: chats to token ids exactly as each model family's chat template does,
//!   with per-token message index, loss mask and content flag; append-only extension of
//!   sampled conversations (`bridge`); parsing of sampled completions.
//!
//! Python reaches this crate only through the thin `treadle-native` bindings crate, so
//! `cargo test` here needs no interpreter.

pub mod balance;
pub mod batch;
pub mod error;
mod fastbpe;
pub mod json;
pub mod message;
pub mod packing;
pub mod render;
pub mod text;
pub mod tokenizer;

pub use error::{CoreError, Result};
