//! Bindings of `treadle_core::packing`.

use std::borrow::Cow;

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::errors::to_py_err;

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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(first_fit_decreasing, m)?)?;
    Ok(())
}
