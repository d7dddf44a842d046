//! Python objects -> core values (JSON-like dicts, lists, scalars) and token ids.
//!
//! Whatever the caller passes, conversion ends in a value or a Python exception that
//! names where in the argument the problem is (`messages[3].content`), never in a
//! crash: nesting is bounded by [`MAX_DEPTH`] (a value that contains itself is reported
//! as a cycle), strings must be valid Unicode without lone surrogates.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use treadle_core::json::{Json, MAX_DEPTH};

use crate::errors::{InvalidMessageError, TokenIdError, TreadleNativeError};

/// One step of a path into an argument: a list index or a dict key.
enum Step {
    Index(usize),
    Key(String),
}

/// Why a value cannot be converted.
enum Problem {
    /// Not a JSON-like type (TypeError).
    Type(String),
    /// A JSON-like value the core cannot take: too deep, a cycle, a lone surrogate.
    Value(String),
}

/// A conversion failure and the path to it, innermost step first (steps are pushed as
/// the recursion unwinds).
struct Failure {
    problem: Problem,
    steps: Vec<Step>,
}

impl Failure {
    fn ty(msg: String) -> Failure {
        Failure { problem: Problem::Type(msg), steps: Vec::new() }
    }

    fn value(msg: String) -> Failure {
        Failure { problem: Problem::Value(msg), steps: Vec::new() }
    }

    fn at(mut self, step: Step) -> Failure {
        self.steps.push(step);
        self
    }

    /// The Python exception: TypeError for wrong types; for bad values of a message
    /// InvalidMessageError, of anything else (tools, kwargs) TreadleNativeError.
    fn into_err(self, what: &str) -> PyErr {
        let path = format_path(what, self.steps.iter().rev());
        match self.problem {
            Problem::Type(m) => PyTypeError::new_err(format!("{path}: {m}")),
            Problem::Value(m) if what.starts_with("messages") || what.starts_with("conversations") => {
                InvalidMessageError::new_err(format!("{path}: {m}"))
            }
            Problem::Value(m) => TreadleNativeError::new_err(format!("{path}: {m}")),
        }
    }
}

fn is_identifier(key: &str) -> bool {
    let mut chars = key.chars();
    chars.next().is_some_and(|c| c.is_alphabetic() || c == '_') && chars.all(|c| c.is_alphanumeric() || c == '_')
}

/// `what[0].key["odd key"]`; very deep paths keep their first and last steps.
fn format_path<'a>(what: &str, steps: impl ExactSizeIterator<Item = &'a Step>) -> String {
    const HEAD: usize = 8;
    const TAIL: usize = 2;
    const KEY_CHARS: usize = 40;
    let n = steps.len();
    let mut out = what.to_string();
    for (i, step) in steps.enumerate() {
        if n > HEAD + TAIL + 1 && i == HEAD {
            out.push_str(&format!("...({} more)...", n - HEAD - TAIL));
        }
        if n > HEAD + TAIL + 1 && (HEAD..n - TAIL).contains(&i) {
            continue;
        }
        match step {
            Step::Index(j) => out.push_str(&format!("[{j}]")),
            Step::Key(k) if is_identifier(k) && k.chars().count() <= KEY_CHARS => {
                out.push('.');
                out.push_str(k);
            }
            Step::Key(k) if k.chars().count() <= KEY_CHARS => out.push_str(&format!("[{k:?}]")),
            Step::Key(k) => {
                let head: String = k.chars().take(KEY_CHARS).collect();
                out.push_str(&format!("[{head:?}...]"));
            }
        }
    }
    out
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// A Python str as UTF-8; lone surrogates (which UTF-8 cannot encode) are an error
/// saying where in the string.
fn string(s: &Bound<'_, PyString>) -> Result<String, String> {
    match s.to_str() {
        Ok(t) => Ok(t.to_string()),
        Err(e) => {
            let start = e.value(s.py()).getattr("start").ok().and_then(|v| v.extract::<usize>().ok());
            let bad = start
                .and_then(|i| s.get_item(i).ok())
                .and_then(|c| c.repr().ok())
                .map(|r| r.to_string())
                .unwrap_or_default();
            Err(match start {
                Some(i) => format!("is not valid Unicode: lone surrogate {bad} at index {i}"),
                None => format!("is not valid Unicode: {e}"),
            })
        }
    }
}

/// The walk: `ancestors` holds the containers enclosing `obj` (to detect cycles), whose
/// number is also the depth; `max_depth` bounds it.
struct Walk {
    ancestors: Vec<usize>,
    max_depth: usize,
}

impl Walk {
    fn enter(&mut self, obj: &Bound<'_, PyAny>) -> Result<(), Failure> {
        let id = obj.as_ptr() as usize;
        if self.ancestors.contains(&id) {
            return Err(Failure::value(format!(
                "the {} contains itself (a reference cycle cannot be rendered)",
                type_name(obj)
            )));
        }
        if self.ancestors.len() >= self.max_depth {
            return Err(Failure::value(format!("nested deeper than {MAX_DEPTH} lists/dicts")));
        }
        self.ancestors.push(id);
        Ok(())
    }

    fn value(&mut self, obj: &Bound<'_, PyAny>) -> Result<Json, Failure> {
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
                .map_err(|_| Failure::ty(format!("integer {obj} does not fit in 128 bits")));
        }
        if let Ok(f) = obj.cast::<PyFloat>() {
            return Ok(Json::Float(f.value()));
        }
        if let Ok(s) = obj.cast::<PyString>() {
            return string(s).map(Json::Str).map_err(|m| Failure::value(format!("string {m}")));
        }
        if let Ok(d) = obj.cast::<PyDict>() {
            self.enter(obj)?;
            let mut items = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                let Ok(key) = k.cast::<PyString>() else {
                    return Err(Failure::ty(format!("dict keys must be str, got {}", type_name(&k))));
                };
                let key = string(key).map_err(|m| Failure::value(format!("a dict key {m}")))?;
                let child = self.value(&v).map_err(|f| f.at(Step::Key(key.clone())))?;
                items.push((key, child));
            }
            self.ancestors.pop();
            return Ok(Json::Object(items));
        }
        // lists and tuples are read item by item (their own __iter__ is not called)
        if let Ok(l) = obj.cast::<PyList>() {
            self.enter(obj)?;
            let items = l.iter().enumerate().map(|(i, x)| self.value(&x).map_err(|f| f.at(Step::Index(i))));
            let items = items.collect::<Result<Vec<_>, _>>()?;
            self.ancestors.pop();
            return Ok(Json::Array(items));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            self.enter(obj)?;
            let items = t.iter().enumerate().map(|(i, x)| self.value(&x).map_err(|f| f.at(Step::Index(i))));
            let items = items.collect::<Result<Vec<_>, _>>()?;
            self.ancestors.pop();
            return Ok(Json::Array(items));
        }
        Err(Failure::ty(format!(
            "expected a JSON-like value (dict, list, str, int, float, bool, None), got {}",
            type_name(obj)
        )))
    }
}

/// Convert a JSON-like Python value (dict with str keys, list/tuple, str, int, float,
/// bool, None) that nests at most [`MAX_DEPTH`] lists/dicts (itself counting as one).
/// `what` names the value in errors.
pub fn to_json(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Json> {
    Walk { ancestors: Vec::new(), max_depth: MAX_DEPTH }.value(obj).map_err(|f| f.into_err(what))
}

/// A list of JSON-like values (e.g. messages or tools); each item may nest
/// [`MAX_DEPTH`] lists/dicts (the item itself counting as one).
pub fn to_json_list(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Json>> {
    let items = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect::<Vec<_>>()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!("{what} must be a list, got {}", type_name(obj))));
    };
    items.iter().enumerate().map(|(i, x)| to_json(x, &format!("{what}[{i}]"))).collect()
}

/// Token ids from a 1-D numpy integer array or a sequence of ints. Ids are checked
/// against the vocabulary by the core; here, an int beyond 64 bits is a `TokenIdError`
/// and anything that is not an int a `TypeError`, both naming the position.
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
    let expected = || {
        PyTypeError::new_err(format!(
            "{what} must be a 1-D integer numpy array or a list of ints, got {}",
            type_name(obj)
        ))
    };
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyDict>()
    {
        return Err(expected());
    }
    if let Ok(ids) = obj.extract::<Vec<i64>>() {
        return Ok(ids);
    }
    // other array dtypes and sequences: element by element, to say which one is wrong
    let iter = obj.try_iter().map_err(|_| expected())?;
    let mut ids = Vec::new();
    for (i, x) in iter.enumerate() {
        let x = x?;
        if x.is_instance_of::<PyFloat>() || x.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!("{what}[{i}]: expected an int, got {}", type_name(&x))));
        }
        match x.extract::<i64>() {
            Ok(id) => ids.push(id),
            Err(_) => match x.extract::<i128>().ok().map(|v| v.to_string()).or_else(|| {
                // beyond 128 bits: any Python int (or object with __index__) still prints
                x.call_method0("__index__").ok().map(|v| v.to_string())
            }) {
                Some(big) => {
                    return Err(TokenIdError::new_err(format!(
                        "{what}[{i}]: token id {big} at position {i} is outside the vocabulary"
                    )))
                }
                None => {
                    return Err(PyTypeError::new_err(format!("{what}[{i}]: expected an int, got {}", type_name(&x))))
                }
            },
        }
    }
    Ok(ids)
}
