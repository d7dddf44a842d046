//! Python methods on template values (`s.strip()`, `d.get(k)`, `l.index(x)`), with
//! Python's semantics; what Jinja2's sandbox does not allow (mutating methods) raises.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, State, Value};

use super::filters::{bind_call as bind, opt_int, py_bool, py_iter};
use super::pyvalue::{py_type, tuple, type_error, DictView};
use crate::text;

fn value_error(msg: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("ValueError: {msg}"))
}

fn str_arg(v: &Option<Value>, method: &str) -> Result<String, Error> {
    match v {
        Some(v) if v.kind() == ValueKind::String => Ok(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Err(type_error(format!("{method}() argument must be str, not {}", py_type(v)))),
        None => Err(type_error(format!("{method}() is missing an argument"))),
    }
}

/// `None` or a str argument (`strip(None)`, `split(None)`).
fn opt_str_arg(v: &Option<Value>, method: &str) -> Result<Option<String>, Error> {
    match v {
        None => Ok(None),
        Some(x) if x.is_none() => Ok(None),
        _ => str_arg(v, method).map(Some),
    }
}

fn strings(items: Vec<String>) -> Value {
    Value::from(items.into_iter().map(Value::from).collect::<Vec<_>>())
}

/// A prefix argument of `startswith`/`endswith`: one str or a tuple of them.
fn prefixes(v: &Option<Value>, method: &str) -> Result<Vec<String>, Error> {
    match v {
        Some(x) if x.kind() == ValueKind::Seq => py_iter(x)?.into_iter().map(|p| str_arg(&Some(p), method)).collect(),
        _ => Ok(vec![str_arg(v, method)?]),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "strip" | "lstrip" | "rstrip" => {
            let a = bind(args, &["chars"], method)?;
            let chars: Option<Vec<char>> = opt_str_arg(&a[0], method)?.map(|c| c.chars().collect());
            let out = match (method, chars) {
                ("strip", None) => text::strip(s),
                ("lstrip", None) => s.trim_start_matches(text::py_isspace),
                (_, None) => s.trim_end_matches(text::py_isspace),
                ("strip", Some(c)) => text::strip_chars(s, &c),
                ("lstrip", Some(c)) => text::lstrip_chars(s, &c),
                (_, Some(c)) => text::rstrip_chars(s, &c),
            };
            Ok(Value::from(out))
        }
        "split" | "rsplit" => {
            let a = bind(args, &["sep", "maxsplit"], method)?;
            let sep = opt_str_arg(&a[0], method)?;
            if sep.as_deref() == Some("") {
                return Err(value_error("empty separator"));
            }
            let maxsplit = opt_int(&a[1], method)?.unwrap_or(-1);
            let parts = if method == "split" {
                text::split(s, sep.as_deref(), maxsplit)
            } else {
                text::rsplit(s, sep.as_deref(), maxsplit)
            };
            Ok(strings(parts))
        }
        "splitlines" => {
            let a = bind(args, &["keepends"], method)?;
            Ok(strings(text::splitlines(s, a[0].as_ref().is_some_and(py_bool))))
        }
        "startswith" | "endswith" => {
            let a = bind(args, &["prefix", "start", "end"], method)?;
            let options = prefixes(&a[0], method)?;
            let Some((lo, hi)) = text::str_range(s, opt_int(&a[1], method)?, opt_int(&a[2], method)?) else {
                return Ok(Value::from(false));
            };
            let hay = if hi >= lo { &s[lo..hi] } else { "" };
            let hit = options.iter().any(|p| {
                if method == "startswith" {
                    hay.starts_with(p.as_str())
                } else {
                    hay.ends_with(p.as_str())
                }
            });
            Ok(Value::from(hit))
        }
        "replace" => {
            let a = bind(args, &["old", "new", "count"], method)?;
            let count = opt_int(&a[2], method)?.unwrap_or(-1);
            Ok(Value::from(text::replace(s, &str_arg(&a[0], method)?, &str_arg(&a[1], method)?, count)))
        }
        "find" | "rfind" | "index" | "rindex" => {
            let a = bind(args, &["sub", "start", "end"], method)?;
            let sub = str_arg(&a[0], method)?;
            let rev = method.starts_with('r');
            let i = text::find(s, &sub, opt_int(&a[1], method)?, opt_int(&a[2], method)?, rev);
            if i < 0 && method.ends_with("index") {
                return Err(value_error("substring not found"));
            }
            Ok(Value::from(i))
        }
        "count" => {
            let a = bind(args, &["sub", "start", "end"], method)?;
            let sub = str_arg(&a[0], method)?;
            Ok(Value::from(text::count(s, &sub, opt_int(&a[1], method)?, opt_int(&a[2], method)?)))
        }
        "upper" | "lower" | "title" | "capitalize" | "swapcase" | "casefold" => {
            bind(args, &[], method)?;
            Ok(Value::from(match method {
                "upper" => s.to_uppercase(),
                "lower" | "casefold" => s.to_lowercase(),
                "title" => text::title(s),
                "capitalize" => text::capitalize(s),
                _ => text::swapcase(s),
            }))
        }
        "isspace" | "isdigit" | "isdecimal" | "isnumeric" | "isalpha" | "isalnum" | "islower" | "isupper"
        | "istitle" | "isascii" => {
            bind(args, &[], method)?;
            let nonempty = !s.is_empty();
            Ok(Value::from(match method {
                "isspace" => nonempty && s.chars().all(text::py_isspace),
                "isdigit" | "isdecimal" => nonempty && s.chars().all(text::py_isdecimal),
                "isnumeric" => nonempty && s.chars().all(char::is_numeric),
                "isalpha" => nonempty && s.chars().all(char::is_alphabetic),
                "isalnum" => nonempty && s.chars().all(|c| c.is_alphabetic() || c.is_numeric()),
                "islower" => text::islower(s),
                "isupper" => text::isupper(s),
                "istitle" => text::istitle(s),
                _ => s.is_ascii(),
            }))
        }
        "join" => {
            let a = bind(args, &["iterable"], method)?;
            let items = py_iter(a[0].as_ref().ok_or_else(|| type_error("join() takes exactly one argument"))?)?;
            let parts = items
                .iter()
                .map(|x| {
                    x.as_str().map(str::to_string).ok_or_else(|| {
                        type_error(format!("sequence item: expected str instance, {} found", py_type(x)))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Value::from(parts.join(s)))
        }
        "removeprefix" | "removesuffix" => {
            let a = bind(args, &["affix"], method)?;
            let affix = str_arg(&a[0], method)?;
            let out =
                if method == "removeprefix" { s.strip_prefix(affix.as_str()) } else { s.strip_suffix(affix.as_str()) };
            Ok(Value::from(out.unwrap_or(s)))
        }
        "partition" | "rpartition" => {
            let a = bind(args, &["sep"], method)?;
            let sep = str_arg(&a[0], method)?;
            if sep.is_empty() {
                return Err(value_error("empty separator"));
            }
            let found = if method == "partition" { s.find(&sep) } else { s.rfind(&sep) };
            let parts = match (found, method) {
                (Some(p), _) => [&s[..p], sep.as_str(), &s[p + sep.len()..]],
                (None, "partition") => [s, "", ""],
                (None, _) => ["", "", s],
            };
            Ok(tuple(parts.iter().map(|p| Value::from(*p)).collect()))
        }
        "zfill" | "ljust" | "rjust" | "center" => {
            let a = bind(args, &["width", "fillchar"], method)?;
            let width = opt_int(&a[0], method)?.unwrap_or(0).max(0) as usize;
            let fill = match opt_str_arg(&a[1], method)? {
                Some(f) if f.chars().count() == 1 => f.chars().next().unwrap_or(' '),
                Some(_) => return Err(type_error("The fill character must be exactly one character long")),
                None => {
                    if method == "zfill" {
                        '0'
                    } else {
                        ' '
                    }
                }
            };
            let len = s.chars().count();
            if len >= width {
                return Ok(Value::from(s));
            }
            let pad = width - len;
            let rep = |n: usize| std::iter::repeat_n(fill, n).collect::<String>();
            Ok(Value::from(match method {
                "ljust" => format!("{s}{}", rep(pad)),
                "rjust" => format!("{}{s}", rep(pad)),
                "center" => {
                    // CPython: left = pad / 2 + (pad & width & 1)
                    let left = pad / 2 + (pad & width & 1);
                    format!("{}{s}{}", rep(left), rep(pad - left))
                }
                _ => match s.strip_prefix(['+', '-']) {
                    Some(rest) => format!("{}{}{rest}", &s[..1], rep(pad)),
                    None => format!("{}{s}", rep(pad)),
                },
            }))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

fn map_method(v: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "get" => {
            let a = bind(args, &["key", "default"], method)?;
            let key = a[0].clone().ok_or_else(|| type_error("get expected at least 1 argument, got 0"))?;
            let hit = v.get_item(&key)?;
            Ok(if hit.is_undefined() { a[1].clone().unwrap_or_else(|| Value::from(())) } else { hit })
        }
        "items" | "keys" | "values" | "copy" => {
            bind(args, &[], method)?;
            let keys: Vec<Value> = v.try_iter()?.collect();
            if method == "copy" {
                return Ok(v.clone());
            }
            let mut items = Vec::with_capacity(keys.len());
            for k in keys {
                let value = v.get_item(&k)?;
                items.push(match method {
                    "items" => tuple(vec![k, value]),
                    "keys" => k,
                    _ => value,
                });
            }
            let name = match method {
                "items" => "dict_items",
                "keys" => "dict_keys",
                _ => "dict_values",
            };
            Ok(Value::from_object(DictView { name, items }))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

fn list_method(v: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "count" | "index" => {
            let a = bind(args, &["value"], method)?;
            let x = a[0].clone().ok_or_else(|| type_error(format!("{method}() takes exactly one argument")))?;
            let items = py_iter(v)?;
            if method == "count" {
                Ok(Value::from(items.iter().filter(|i| **i == x).count()))
            } else {
                items.iter().position(|i| *i == x).map(Value::from).ok_or_else(|| value_error("x not in list"))
            }
        }
        "copy" => {
            bind(args, &[], method)?;
            Ok(Value::from(py_iter(v)?))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// minijinja's hook for methods it does not know: Python's, then minijinja-contrib's.
pub(crate) fn call_method(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let rv = match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(value, method, args),
        ValueKind::Seq => list_method(value, method, args),
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    };
    match rv {
        Err(e) if e.kind() == ErrorKind::UnknownMethod => {
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        }
        rv => rv,
    }
}
