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

/// The core allocates and frees many short strings and values per render (the Jinja VM,
/// converted messages) and buffers of ~100 kB per long conversation; with the C
/// library's allocator the latter went back to the system and faulted in again on every
/// call (half of a 32k-token bridge). Python's own objects are not affected.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    packing::register(m)?;
    render::register(m)?;
    jinja::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
