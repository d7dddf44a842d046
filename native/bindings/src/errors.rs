//! Python exception classes, one per kind of core error, all under TreadleNativeError.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use treadle_core::CoreError;

create_exception!(_core, TreadleNativeError, PyValueError, "Base class of every error raised by treadle_native.");
create_exception!(_core, SequenceTooLongError, TreadleNativeError, "A sample does not fit in seq_len tokens.");
create_exception!(_core, ShapeError, TreadleNativeError, "Arrays that must have matching lengths do not.");
create_exception!(_core, UnknownFamilyError, TreadleNativeError, "No renderer family of that name exists.");
create_exception!(
    _core,
    TokenizerError,
    TreadleNativeError,
    "The tokenizer file cannot be loaded, or does not fit the family."
);
create_exception!(
    _core,
    InvalidMessageError,
    TreadleNativeError,
    "A chat message is malformed (role, fields, tool calls)."
);
create_exception!(_core, TokenIdError, TreadleNativeError, "A token id is outside the tokenizer's vocabulary.");
create_exception!(_core, TemplateError, TreadleNativeError, "A chat template failed to compile or render.");

pub fn to_py_err(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::SequenceTooLong { .. } => SequenceTooLongError::new_err(msg),
        CoreError::LengthMismatch { .. } => ShapeError::new_err(msg),
        CoreError::UnknownFamily { .. } => UnknownFamilyError::new_err(msg),
        CoreError::Tokenizer(_) | CoreError::TokenizerMismatch { .. } => TokenizerError::new_err(msg),
        CoreError::InvalidMessage { .. } | CoreError::InvalidToolCall { .. } => InvalidMessageError::new_err(msg),
        CoreError::TokenOutOfVocab { .. } => TokenIdError::new_err(msg),
        CoreError::Template(_) => TemplateError::new_err(msg),
        CoreError::InvalidSeqLen { .. } | CoreError::NegativeLength { .. } | CoreError::InvalidArgument(_) => {
            TreadleNativeError::new_err(msg)
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TreadleNativeError", py.get_type::<TreadleNativeError>())?;
    m.add("SequenceTooLongError", py.get_type::<SequenceTooLongError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("UnknownFamilyError", py.get_type::<UnknownFamilyError>())?;
    m.add("TokenizerError", py.get_type::<TokenizerError>())?;
    m.add("InvalidMessageError", py.get_type::<InvalidMessageError>())?;
    m.add("TokenIdError", py.get_type::<TokenIdError>())?;
    m.add("TemplateError", py.get_type::<TemplateError>())?;
    Ok(())
}
