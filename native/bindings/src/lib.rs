//! `treadle_native._core`: thin PyO3 bindings over `treadle-core`.
//!
//! Each function converts its arguments (numpy arrays are borrowed, not copied),
//! releases the GIL for the work, and returns numpy arrays. Core errors become
//! exceptions under `TreadleNativeError` (itself a `ValueError`).

use std::borrow::Cow;

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use treadle_core::CoreError;

create_exception!(_core, TreadleNativeError, PyValueError, "Base class of every error raised by treadle_native.");
create_exception!(_core, SequenceTooLongError, TreadleNativeError, "A sample does not fit in seq_len tokens.");

fn to_py_err(e: CoreError) -> PyErr {
    match e {
        CoreError::SequenceTooLong { .. } => SequenceTooLongError::new_err(e.to_string()),
        CoreError::InvalidSeqLen { .. } | CoreError::NegativeLength { .. } => TreadleNativeError::new_err(e.to_string()),
    }
}

/// first_fit_decreasing(lengths, seq_len)
/// --
///
/// Bin index of every sample when packing `lengths` (int64, 1-D) into bins of `seq_len`
/// tokens, first fit in decreasing length order. Returns a uint32 array of len(lengths).
#[pyfunction]
fn first_fit_decreasing<'py>(
    py: Python<'py>,
    lengths: PyReadonlyArray1<'py, i64>,
    seq_len: i64,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    // contiguous arrays are borrowed as they are; strided views are gathered once
    let lengths: Cow<'_, [i64]> = match lengths.as_slice() {
        Ok(slice) => Cow::Borrowed(slice),
        Err(_) => Cow::Owned(lengths.as_array().iter().copied().collect()),
    };
    let bins = py
        .detach(|| treadle_core::packing::first_fit_decreasing(&lengths, seq_len))
        .map_err(to_py_err)?;
    Ok(bins.into_pyarray(py))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TreadleNativeError", m.py().get_type::<TreadleNativeError>())?;
    m.add("SequenceTooLongError", m.py().get_type::<SequenceTooLongError>())?;
    m.add_function(wrap_pyfunction!(first_fit_decreasing, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
