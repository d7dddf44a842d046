//! `_render_template`: a private test helper that renders a template with the generic
//! renderer's Jinja environment, so tests can compare it with transformers' Jinja2.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use treadle_core::render::jinja::JinjaTemplate;
use treadle_core::render::MaskConvention;

use crate::convert::to_json;
use crate::errors::to_py_err;

/// _render_template(template, context)
/// --
///
/// Render `template` with `context` (a dict of JSON-like values) exactly as the generic
/// renderer's environment does; the context is passed as is (no message normalisation).
/// Raises `TemplateError` where the template fails to compile or render.
#[pyfunction]
fn _render_template(py: Python<'_>, template: &str, context: &Bound<'_, PyDict>) -> PyResult<String> {
    let mut ctx = Vec::with_capacity(context.len());
    for (k, v) in context.iter() {
        let key: String = k.extract()?;
        let value = to_json(&v, &key)?;
        ctx.push((key, value));
    }
    py.detach(|| JinjaTemplate::new(template, None, Vec::new(), Vec::new(), MaskConvention::Auto)?.render_context(&ctx))
        .map_err(to_py_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_render_template, m)?)
}
