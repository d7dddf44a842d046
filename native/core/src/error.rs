//! Errors of the core, one enum; the bindings map each variant to a Python exception.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A bin length of zero or less was asked for.
    #[error("seq_len must be positive, got {seq_len}")]
    InvalidSeqLen { seq_len: i64 },

    /// A sample length below zero.
    #[error("sample {index} has a negative length ({length})")]
    NegativeLength { index: usize, length: i64 },

    /// A sample that cannot fit any bin.
    #[error("sample {index} has {length} tokens, more than seq_len {seq_len}; truncate it first")]
    SequenceTooLong { index: usize, length: i64, seq_len: i64 },
}
