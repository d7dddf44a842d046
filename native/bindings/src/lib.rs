//! `treadle_native._core`: thin PyO3 bindings over `treadle-core`.
//!
//! Each function converts its arguments (numpy arrays are borrowed, not copied),
//! releases the GIL for the work (`py.detach`), and returns numpy arrays. Core errors
//! become exceptions under `TreadleNativeError` (itself a `ValueError`); no panic
//! crosses into Python.

use pyo3::prelude::*;

mod convert;
mod errors;
mod jinja;
mod packing;
mod render;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    packing::register(m)?;
    render::register(m)?;
    jinja::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
