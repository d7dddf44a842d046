//! Python objects -> core values (JSON-like dicts, lists, scalars).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use treadle_core::json::Json;

/// Convert a JSON-like Python value (dict with str keys, list/tuple, str, int, float,
/// bool, None). `what` names the value in errors.
pub fn to_json(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Json> {
    if obj.is_none() {
        return Ok(Json::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Json::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj
            .extract::<i128>()
            .map(Json::Int)
            .map_err(|_| PyTypeError::new_err(format!("{what}: integer {obj} does not fit in 128 bits")));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Json::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Json::Str(s.to_str()?.to_string()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut items = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = k
                .cast::<PyString>()
                .map_err(|_| {
                    PyTypeError::new_err(format!(
                        "{what}: dict keys must be str, got {}",
                        k.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                    ))
                })?
                .to_str()?
                .to_string();
            let child = to_json(&v, &format!("{what}.{key}"))?;
            items.push((key, child));
        }
        return Ok(Json::Object(items));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l
            .iter()
            .enumerate()
            .map(|(i, x)| to_json(&x, &format!("{what}[{i}]")))
            .collect::<PyResult<_>>()
            .map(Json::Array);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .enumerate()
            .map(|(i, x)| to_json(&x, &format!("{what}[{i}]")))
            .collect::<PyResult<_>>()
            .map(Json::Array);
    }
    let type_name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    Err(PyTypeError::new_err(format!(
        "{what}: expected a JSON-like value (dict, list, str, int, float, bool, None), got {type_name}"
    )))
}

/// A list of JSON-like values (e.g. messages or tools).
pub fn to_json_list(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Json>> {
    match to_json(obj, what)? {
        Json::Array(items) => Ok(items),
        _ => Err(PyTypeError::new_err(format!("{what} must be a list"))),
    }
}

/// Token ids from a 1-D numpy integer array or a sequence of ints.
pub fn ids_from_py(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    use numpy::PyReadonlyArray1;
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().map(|&x| x as i64).collect());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_array().iter().map(|&x| x as i64).collect());
    }
    obj.extract::<Vec<i64>>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a 1-D integer numpy array or a list of ints")))
}
