//! Errors of the core, one enum; the bindings map each variant to a Python exception
//! class under `TreadleNativeError`.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    // --- packing -------------------------------------------------------------------------
    /// A bin length of zero or less was asked for.
    #[error("seq_len must be positive, got {seq_len}")]
    InvalidSeqLen { seq_len: i64 },

    /// A sample length below zero.
    #[error("sample {index} has a negative length ({length})")]
    NegativeLength { index: usize, length: i64 },

    /// A sample that cannot fit any bin (and the policy says not to truncate it).
    #[error("sample {index} has {length} tokens, more than seq_len {seq_len}; truncate it first")]
    SequenceTooLong { index: usize, length: i64, seq_len: i64 },

    /// Arrays that must have the same length do not.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch { what: String, expected: usize, got: usize },

    /// Any other argument outside its domain (the message says which and why).
    #[error("{0}")]
    InvalidArgument(String),

    // --- rendering -----------------------------------------------------------------------
    /// A renderer family name that does not exist.
    #[error("unknown renderer family {name:?}; known families: {known}")]
    UnknownFamily { name: String, known: String },

    /// The tokenizer file could not be read or parsed.
    #[error("cannot load tokenizer: {0}")]
    Tokenizer(String),

    /// The tokenizer lacks tokens the family's template needs.
    #[error("tokenizer does not match family {family:?}: missing special tokens {missing}")]
    TokenizerMismatch { family: String, missing: String },

    /// A message is malformed (unknown role, missing field, wrong type).
    #[error("message {index}: {reason}")]
    InvalidMessage { index: usize, reason: String },

    /// A tool call of a message is malformed (e.g. arguments that are not JSON).
    #[error("message {message}, tool call {call}: {reason}")]
    InvalidToolCall { message: usize, call: usize, reason: String },

    /// A token id outside the tokenizer's vocabulary.
    #[error("token id {id} at position {position} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfVocab { position: usize, id: i64, vocab_size: usize },

    /// A chat template failed to compile or render.
    #[error("chat template error: {0}")]
    Template(String),
}

pub type Result<T> = std::result::Result<T, CoreError>;
