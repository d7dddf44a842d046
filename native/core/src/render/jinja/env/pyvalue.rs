//! Template values as Python writes them: `str()` (what `{{ x }}` prints), `repr()`
//! (items inside a printed list or dict) and `json.dumps` (transformers' `tojson`).

use std::fmt;
use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr, ValueKind};
use minijinja::{Error, ErrorKind, Value};

use crate::text::{py_float_str, py_repr as py_str_repr};

pub(crate) fn type_error(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// Python's type name of a value, for error messages.
pub(crate) fn py_type(v: &Value) -> &'static str {
    match v.kind() {
        ValueKind::Undefined => "Undefined",
        ValueKind::None => "NoneType",
        ValueKind::Bool => "bool",
        ValueKind::Number if is_float(v) => "float",
        ValueKind::Number => "int",
        ValueKind::String => "str",
        ValueKind::Seq => "list",
        ValueKind::Map => "dict",
        _ if is_py_iterator(v) => "generator",
        _ if is_dict_view(v) => "dict_items",
        _ => "object",
    }
}

pub(crate) fn is_float(v: &Value) -> bool {
    v.kind() == ValueKind::Number && !v.is_integer()
}

pub(crate) fn as_f64(v: &Value) -> f64 {
    f64::try_from(v.clone()).unwrap_or(f64::NAN)
}

/// A Python tuple (`d.items()` pairs, `dictsort`, `partition`): a sequence that prints
/// as `('a', 1)`.
#[derive(Debug)]
pub(crate) struct Tuple(pub Vec<Value>);

impl Object for Tuple {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let i = key.as_i64()?;
        let i = if i < 0 { i + self.0.len() as i64 } else { i };
        self.0.get(usize::try_from(i).ok()?).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Seq(self.0.len())
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&py_repr(&Value::from_dyn_object(self.clone())))
    }
}

pub(crate) fn tuple(items: Vec<Value>) -> Value {
    Value::from_object(Tuple(items))
}

/// A Python iterator (what `map`, `select`, `selectattr`, `reverse`, `items` return in
/// Jinja2): iterable, always true, without a length or JSON form.
#[derive(Debug)]
pub(crate) struct PyIterator(pub Vec<Value>);

impl Object for PyIterator {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.clone())
    }

    fn is_true(self: &Arc<Self>) -> bool {
        true
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<generator object>")
    }
}

pub(crate) fn py_iterator(items: Vec<Value>) -> Value {
    Value::from_object(PyIterator(items))
}

/// `d.items()`, `d.keys()`, `d.values()`: iterable with a length, not indexable.
#[derive(Debug)]
pub(crate) struct DictView {
    pub name: &'static str,
    pub items: Vec<Value>,
}

impl Object for DictView {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.items.clone())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.items.len())
    }

    fn is_true(self: &Arc<Self>) -> bool {
        !self.items.is_empty()
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name, py_repr(&Value::from(self.items.clone())))
    }
}

/// Whether `v` is a lazy Python iterator (no length, not JSON).
pub(crate) fn is_py_iterator(v: &Value) -> bool {
    v.downcast_object_ref::<PyIterator>().is_some()
}

pub(crate) fn is_dict_view(v: &Value) -> bool {
    v.downcast_object_ref::<DictView>().is_some()
}

/// `str(v)`.
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        ValueKind::Number if is_float(v) => py_float_str(as_f64(v)),
        ValueKind::None | ValueKind::Bool | ValueKind::Number => v.to_string(),
        _ => py_repr(v),
    }
}

/// `repr(v)`.
pub(crate) fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, v);
    out
}

fn write_repr(out: &mut String, v: &Value) {
    write_repr_at(out, v, 0)
}

/// Deeper than [`crate::json::MAX_DEPTH`] (a value a template built, possibly containing
/// itself) prints as `...`, as Python prints a list that contains itself, instead of
/// recursing without bound.
fn write_repr_at(out: &mut String, v: &Value, depth: usize) {
    if depth > crate::json::MAX_DEPTH {
        out.push_str("...");
        return;
    }
    let write_repr = |out: &mut String, item: &Value| write_repr_at(out, item, depth + 1);
    match v.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::String => out.push_str(&py_str_repr(v.as_str().unwrap_or_default())),
        ValueKind::Seq if v.downcast_object_ref::<Tuple>().is_some() => {
            let items: Vec<Value> = v.try_iter().into_iter().flatten().collect();
            out.push('(');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            if items.len() == 1 {
                out.push(',');
            }
            out.push(')');
        }
        ValueKind::Seq | ValueKind::Iterable if !is_py_iterator(v) && !is_dict_view(v) => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key);
                out.push_str(": ");
                write_repr(out, &v.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        ValueKind::None | ValueKind::Bool | ValueKind::Number => out.push_str(&py_str(v)),
        _ => out.push_str(&v.to_string()),
    }
}

/// Options of `json.dumps` as transformers' `tojson` passes them.
pub(crate) struct JsonOpts {
    pub ensure_ascii: bool,
    /// None: one line; Some(s): newlines, `s` repeated per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

/// `json.dumps(v, ...)`; errors as Python's (values JSON cannot hold, unsortable keys).
pub(crate) fn dumps(v: &Value, opts: &JsonOpts) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, v, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, depth: usize) -> Result<(), Error> {
    if depth > crate::json::MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: the value nests deeper than {} lists/dicts (or contains itself)", crate::json::MAX_DEPTH),
        ));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if is_float(v) => out.push_str(&crate::json::py_float_repr(as_f64(v))),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => crate::json::write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable if !is_py_iterator(v) && !is_dict_view(v) => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items: Vec<(Value, Value)> = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                items.push((key, value));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                sort_keys(&mut items)?;
            }
            out.push('{');
            for (i, (key, value)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                crate::json::write_json_str(out, &json_key(key)?, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, value, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push('}');
        }
        _ => return Err(type_error(format!("Object of type {} is not JSON serializable", py_type(v)))),
    }
    Ok(())
}

/// `sorted(d.items())` by key: keys of one type (numbers mix), else TypeError.
fn sort_keys(items: &mut [(Value, Value)]) -> Result<(), Error> {
    let numeric = |v: &Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool);
    let all_str = items.iter().all(|(k, _)| k.kind() == ValueKind::String);
    let all_num = items.iter().all(|(k, _)| numeric(k));
    if !all_str && !all_num {
        return Err(type_error("'<' not supported between instances of keys of different types"));
    }
    items.sort_by(|(a, _), (b, _)| a.cmp(b));
    Ok(())
}

fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if is_float(key) => crate::json::py_float_repr(as_f64(key)),
        ValueKind::Number => key.to_string(),
        _ => return Err(type_error(format!("keys must be str, int, float, bool or None, not {}", py_type(key)))),
    })
}
