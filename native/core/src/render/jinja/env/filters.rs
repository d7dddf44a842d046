//! Jinja2's filters and tests where minijinja's differ from them, with Python semantics:
//! what Jinja2 3.1 computes (and where it raises) for the values a chat template sees.

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, Value};

use std::borrow::Cow;

use minijinja::value::ValueOrKwargs;
use minijinja::State;

use super::pyvalue::{
    as_f64, dumps, is_dict_view, is_float, is_py_iterator, py_iterator, py_str, py_type, tuple, type_error, JsonOpts,
};
use crate::text;

/// Python-style binding of positional and keyword arguments to the parameter `names`.
pub(crate) fn bind(pos: &[Value], kwargs: &Kwargs, names: &[&str], what: &str) -> Result<Vec<Option<Value>>, Error> {
    let mut out: Vec<Option<Value>> = vec![None; names.len()];
    if pos.len() > names.len() {
        return Err(type_error(format!("{what}() takes at most {} arguments ({} given)", names.len(), pos.len())));
    }
    for (slot, v) in out.iter_mut().zip(pos) {
        *slot = Some(v.clone());
    }
    for name in kwargs.args() {
        let Some(i) = names.iter().position(|n| *n == name) else {
            return Err(type_error(format!("{what}() got an unexpected keyword argument '{name}'")));
        };
        if out[i].is_some() {
            return Err(type_error(format!("{what}() got multiple values for argument '{name}'")));
        }
        out[i] = Some(kwargs.peek::<Value>(name)?);
    }
    Ok(out)
}

/// [`bind`] for a method call's arguments (keyword arguments come last, as one value).
pub(crate) fn bind_call(args: &[Value], names: &[&str], what: &str) -> Result<Vec<Option<Value>>, Error> {
    let (pos, kwargs): (Rest<Value>, Kwargs) = minijinja::value::from_args(args)?;
    bind(&pos, &kwargs, names, what)
}

fn opt_str(v: &Option<Value>, what: &str) -> Result<Option<String>, Error> {
    match v {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.as_str().map(|s| Some(s.to_string())).ok_or_else(|| type_error(format!("{what} must be str"))),
    }
}

pub(crate) fn opt_int(v: &Option<Value>, what: &str) -> Result<Option<i64>, Error> {
    match v {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) if matches!(v.kind(), ValueKind::Number | ValueKind::Bool) && !is_float(v) => {
            Ok(Some(i64::try_from(v.clone())?))
        }
        Some(v) => Err(type_error(format!("{what}: '{}' object cannot be interpreted as an integer", py_type(v)))),
    }
}

/// Python truthiness.
pub(crate) fn py_bool(v: &Value) -> bool {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => false,
        ValueKind::Number if is_float(v) => as_f64(v) != 0.0,
        _ => v.is_true(),
    }
}

/// What `iter(v)` yields (strings: characters, dicts: keys), or TypeError.
pub(crate) fn py_iter(v: &Value) -> Result<Vec<Value>, Error> {
    match v.kind() {
        ValueKind::Undefined => Ok(Vec::new()),
        ValueKind::String => Ok(v.as_str().unwrap_or_default().chars().map(Value::from).collect()),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => Ok(v.try_iter()?.collect()),
        _ => Err(type_error(format!("'{}' object is not iterable", py_type(v)))),
    }
}

/// `len(v)`.
pub(crate) fn py_len(v: &Value) -> Result<usize, Error> {
    match v.kind() {
        ValueKind::Undefined => Ok(0),
        ValueKind::String => Ok(v.as_str().unwrap_or_default().chars().count()),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable if !is_py_iterator(v) => match v.len() {
            Some(n) => Ok(n),
            None => Ok(v.try_iter()?.count()),
        },
        _ => Err(type_error(format!("object of type '{}' has no len()", py_type(v)))),
    }
}

/// Jinja2's `soft_str`: strings as they are, anything else `str()`.
fn soft_str(v: &Value) -> String {
    py_str(v)
}

fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["ensure_ascii", "indent", "separators", "sort_keys"], "tojson")?;
    let ensure_ascii = a[0].as_ref().is_some_and(py_bool);
    let indent = match &a[1] {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Some(" ".repeat(opt_int(&Some(v.clone()), "indent")?.unwrap_or(0).max(0) as usize)),
    };
    let (item_sep, key_sep) = match &a[2] {
        Some(v) if !v.is_none() => {
            let parts = py_iter(v)?;
            let [item, key] = parts.as_slice() else {
                return Err(type_error("separators must be a pair of strings"));
            };
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => (i.to_string(), k.to_string()),
                _ => return Err(type_error("separators must be a pair of strings")),
            }
        }
        _ => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
    };
    let sort_keys = a[3].as_ref().is_some_and(py_bool);
    let opts = JsonOpts { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    dumps(value, &opts).map(Value::from)
}

fn trim(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let a = bind(&args, &kwargs, &["chars"], "trim")?;
    let s = soft_str(value);
    Ok(match opt_str(&a[0], "trim chars")? {
        Some(chars) => text::strip_chars(&s, &chars.chars().collect::<Vec<_>>()).to_string(),
        None => text::strip(&s).to_string(),
    })
}

fn string(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        value.clone()
    } else {
        Value::from(py_str(value))
    }
}

fn length(value: &Value) -> Result<usize, Error> {
    py_len(value)
}

fn join(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let a = bind(&args, &kwargs, &["d", "attribute"], "join")?;
    let sep = a[0].as_ref().map(soft_str).unwrap_or_default();
    let mut items = py_iter(value)?;
    if let Some(attr) = &a[1] {
        items = items.iter().map(|x| get_attribute(x, attr)).collect::<Result<_, _>>()?;
    }
    Ok(items.iter().map(py_str).collect::<Vec<_>>().join(&sep))
}

/// Jinja2's `make_attrgetter`: `a.b.0` walks items (numbers index lists).
fn get_attribute(v: &Value, attr: &Value) -> Result<Value, Error> {
    let Some(path) = attr.as_str() else { return v.get_item(attr) };
    let mut cur = v.clone();
    for part in path.split('.') {
        let key = part.parse::<i64>().map_or_else(|_| Value::from(part), Value::from);
        cur = cur.get_item(&key).unwrap_or_default();
    }
    Ok(cur)
}

fn list(value: &Value) -> Result<Value, Error> {
    Ok(Value::from(py_iter(value)?))
}

fn first(value: &Value) -> Result<Value, Error> {
    Ok(py_iter(value)?.into_iter().next().unwrap_or_default())
}

fn last(value: &Value) -> Result<Value, Error> {
    if is_py_iterator(value) {
        return Err(type_error("'generator' object is not reversible"));
    }
    Ok(py_iter(value)?.pop().unwrap_or_default())
}

fn items(value: &Value) -> Result<Value, Error> {
    Ok(py_iterator(item_pairs(value)?.try_iter()?.collect()))
}

fn item_pairs(value: &Value) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(Value::from(Vec::<Value>::new())),
        ValueKind::Map => {
            let mut out = Vec::new();
            for key in value.try_iter()? {
                let v = value.get_item(&key)?;
                out.push(tuple(vec![key, v]));
            }
            Ok(Value::from(out))
        }
        _ => Err(type_error("Can only get item pairs from a mapping.")),
    }
}

fn upper(value: &Value) -> String {
    soft_str(value).to_uppercase()
}

fn lower(value: &Value) -> String {
    soft_str(value).to_lowercase()
}

fn capitalize(value: &Value) -> String {
    text::capitalize(&soft_str(value))
}

/// Jinja2's `title` filter: words start after `-`, whitespace or an opening bracket
/// (not Python's `str.title`).
fn title(value: &Value) -> String {
    let s = soft_str(value);
    let is_sep = |c: char| c == '-' || text::py_isspace(c) || matches!(c, '(' | '{' | '[' | '<');
    let mut out = String::with_capacity(s.len());
    let mut rest = s.as_str();
    while !rest.is_empty() {
        let sep_len = rest.find(|c: char| !is_sep(c)).unwrap_or(rest.len());
        let (seps, tail) = rest.split_at(sep_len);
        out.push_str(&seps.to_uppercase());
        let word_len = tail.find(is_sep).unwrap_or(tail.len());
        let (word, tail) = tail.split_at(word_len);
        let mut chars = word.chars();
        if let Some(c) = chars.next() {
            out.extend(c.to_uppercase());
            out.push_str(&chars.as_str().to_lowercase());
        }
        rest = tail;
    }
    out
}

fn replace(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let a = bind(&args, &kwargs, &["old", "new", "count"], "replace")?;
    let old = a[0].as_ref().map(soft_str).ok_or_else(|| type_error("replace() missing 'old'"))?;
    let new = a[1].as_ref().map(soft_str).ok_or_else(|| type_error("replace() missing 'new'"))?;
    let count = opt_int(&a[2], "replace count")?.unwrap_or(-1);
    Ok(text::replace(&soft_str(value), &old, &new, count))
}

fn default(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["default_value", "boolean"], "default")?;
    let boolean = a[1].as_ref().is_some_and(py_bool);
    if value.is_undefined() || (boolean && !py_bool(value)) {
        Ok(a[0].clone().unwrap_or_else(|| Value::from("")))
    } else {
        Ok(value.clone())
    }
}

/// Python's `int(s, base)` for a string: whitespace, a sign, `_` between digits, and a
/// `0x`/`0o`/`0b` prefix matching the base (base 0: the prefix decides).
fn parse_py_int(s: &str, base: u32) -> Option<i128> {
    let t = text::strip(s);
    let (neg, digits) = match t.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let lower = digits.to_ascii_lowercase();
    let prefixed =
        [(16, "0x"), (8, "0o"), (2, "0b")].iter().find(|(b, p)| (base == 0 || base == *b) && lower.starts_with(p));
    let (base, digits) = match prefixed {
        Some((b, _)) => (*b, digits[2..].strip_prefix('_').unwrap_or(&digits[2..])),
        None if base == 0 => {
            if digits.trim_start_matches(['0', '_']).is_empty() || !digits.starts_with('0') {
                (10, digits)
            } else {
                return None;
            }
        }
        None => (base, digits),
    };
    if !(2..=36).contains(&base)
        || digits.is_empty()
        || digits.starts_with(['_', '+', '-'])
        || digits.ends_with('_')
        || digits.contains("__")
    {
        return None;
    }
    let v = i128::from_str_radix(&digits.replace('_', ""), base).ok()?;
    Some(if neg { -v } else { v })
}

/// Python's `float(s)` for a string.
fn parse_py_float(s: &str) -> Option<f64> {
    let t = text::strip(s);
    let lower = t.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if matches!(unsigned, "inf" | "infinity" | "nan") {
        let v = if unsigned == "nan" { f64::NAN } else { f64::INFINITY };
        return Some(if lower.starts_with('-') { -v } else { v });
    }
    if t.is_empty() || t.starts_with('_') || t.ends_with('_') || t.contains("__") {
        return None;
    }
    let cleaned = t.replace('_', "");
    if !cleaned.chars().all(|c| c.is_ascii_digit() || matches!(c, '+' | '-' | '.' | 'e' | 'E')) {
        return None;
    }
    cleaned.parse::<f64>().ok()
}

fn py_float(v: &Value) -> Option<f64> {
    match v.kind() {
        ValueKind::Number | ValueKind::Bool => Some(as_f64(v)),
        ValueKind::String => parse_py_float(v.as_str().unwrap_or_default()),
        _ => None,
    }
}

fn int(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["default", "base"], "int")?;
    let default = a[0].clone().unwrap_or_else(|| Value::from(0));
    let base = opt_int(&a[1], "int base")?.unwrap_or(10) as u32;
    let direct = match value.kind() {
        ValueKind::String => parse_py_int(value.as_str().unwrap_or_default(), base).map(Value::from),
        ValueKind::Bool => Some(Value::from(i64::from(value.is_true()))),
        ValueKind::Number if !is_float(value) => Some(value.clone()),
        _ => None,
    };
    if let Some(v) = direct {
        return Ok(v);
    }
    match py_float(value) {
        Some(f) if f.is_finite() => Ok(Value::from(f.trunc() as i128)),
        _ => Ok(default),
    }
}

fn float(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["default"], "float")?;
    Ok(py_float(value).map_or_else(|| a[0].clone().unwrap_or_else(|| Value::from(0.0)), Value::from))
}

/// Python's `round(x, n)` for a float: correctly rounded, ties to even.
fn py_round(x: f64, n: i64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    if n >= 0 {
        format!("{x:.prec$}", prec = n.min(340) as usize).parse().unwrap_or(x)
    } else {
        let p = 10f64.powi((-n) as i32);
        (x / p).round_ties_even() * p
    }
}

fn round(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["precision", "method"], "round")?;
    let precision = opt_int(&a[0], "round precision")?.unwrap_or(0);
    let method = opt_str(&a[1], "round method")?.unwrap_or_else(|| "common".into());
    if !matches!(value.kind(), ValueKind::Number | ValueKind::Bool) {
        return Err(type_error(format!("type {} doesn't define __round__ method", py_type(value))));
    }
    let x = as_f64(value);
    let scale = 10f64.powi(precision as i32);
    match method.as_str() {
        "common" if value.kind() == ValueKind::Bool => Ok(Value::from(i64::from(value.is_true()))),
        "common" if !is_float(value) => Ok(value.clone()),
        "common" => Ok(Value::from(py_round(x, precision))),
        "floor" => Ok(Value::from((x * scale).floor() / scale)),
        "ceil" => Ok(Value::from((x * scale).ceil() / scale)),
        _ => Err(type_error("method must be 'common', 'ceil' or 'floor'")),
    }
}

/// Jinja2's `sort_key`-style comparison key: strings lowered unless case sensitive.
fn fold(v: &Value, case_sensitive: bool) -> Value {
    match v.as_str() {
        Some(s) if !case_sensitive => Value::from(s.to_lowercase()),
        _ => v.clone(),
    }
}

fn check_comparable(keys: &[Value]) -> Result<(), Error> {
    let class = |v: &Value| match v.kind() {
        ValueKind::Number | ValueKind::Bool => 0,
        ValueKind::String => 1,
        ValueKind::Seq => 2,
        _ => 3,
    };
    if let Some(k) = keys.first() {
        let c = class(k);
        if c == 3 || keys.iter().any(|x| class(x) != c) {
            return Err(type_error("'<' not supported between these types"));
        }
    }
    Ok(())
}

fn dictsort(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["case_sensitive", "by", "reverse"], "dictsort")?;
    let case_sensitive = a[0].as_ref().is_some_and(py_bool);
    let by = opt_str(&a[1], "dictsort by")?.unwrap_or_else(|| "key".into());
    let reverse = a[2].as_ref().is_some_and(py_bool);
    let pos = match by.as_str() {
        "key" => 0,
        "value" => 1,
        _ => return Err(type_error("You can only sort by either \"key\" or \"value\"")),
    };
    if value.is_undefined() {
        return Err(type_error("dictsort of an undefined value"));
    }
    let pairs: Vec<Value> = item_pairs(value)?.try_iter()?.collect();
    let mut keyed: Vec<(Value, Value)> = pairs
        .into_iter()
        .map(|p| (fold(&p.get_item(&Value::from(pos)).unwrap_or_default(), case_sensitive), p))
        .collect();
    check_comparable(&keyed.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>())?;
    keyed.sort_by(|(a, _), (b, _)| a.cmp(b));
    if reverse {
        keyed.reverse();
    }
    Ok(Value::from(keyed.into_iter().map(|(_, p)| p).collect::<Vec<_>>()))
}

fn unique(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["case_sensitive", "attribute"], "unique")?;
    let case_sensitive = a[0].as_ref().is_some_and(py_bool);
    let mut seen: Vec<Value> = Vec::new();
    let mut out = Vec::new();
    for item in py_iter(value)? {
        let key = match &a[1] {
            Some(attr) => get_attribute(&item, attr)?,
            None => item.clone(),
        };
        let key = fold(&key, case_sensitive);
        if !seen.contains(&key) {
            seen.push(key);
            out.push(item);
        }
    }
    Ok(Value::from(out))
}

fn sum(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let a = bind(&args, &kwargs, &["attribute", "start"], "sum")?;
    let mut total = a[1].clone().unwrap_or_else(|| Value::from(0));
    for item in py_iter(value)? {
        let item = match &a[0] {
            Some(attr) => get_attribute(&item, attr)?,
            None => item,
        };
        let numeric = |v: &Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool);
        if !numeric(&total) || !numeric(&item) {
            return Err(type_error(format!(
                "unsupported operand type(s) for +: '{}' and '{}'",
                py_type(&total),
                py_type(&item)
            )));
        }
        total = if is_float(&total) || is_float(&item) {
            Value::from(as_f64(&total) + as_f64(&item))
        } else {
            let int = |v: &Value| i128::try_from(v.clone()).unwrap_or(i128::from(v.is_true()));
            Value::from(int(&total).checked_add(int(&item)).ok_or_else(|| type_error("integer overflow"))?)
        };
    }
    Ok(total)
}

fn abs(value: &Value) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::Bool => Ok(Value::from(i64::from(value.is_true()))),
        ValueKind::Number if is_float(value) => Ok(Value::from(as_f64(value).abs())),
        ValueKind::Number => Ok(Value::from(i128::try_from(value.clone())?.abs())),
        _ => Err(type_error(format!("bad operand type for abs(): '{}'", py_type(value)))),
    }
}

// Jinja2's map, select, reject, selectattr, rejectattr and reverse return iterators;
// the first five yield nothing for a false value (`0 | select` is empty, not an error).

fn map(state: &mut State, value: Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    if !py_bool(&value) {
        return Ok(py_iterator(Vec::new()));
    }
    minijinja::filters::map(state, value, args).map(py_iterator)
}

fn select(
    state: &mut State,
    value: Value,
    test: Option<Cow<'_, str>>,
    args: Rest<ValueOrKwargs>,
) -> Result<Value, Error> {
    if !py_bool(&value) {
        return Ok(py_iterator(Vec::new()));
    }
    minijinja::filters::select(state, value, test, args).map(py_iterator)
}

fn reject(
    state: &mut State,
    value: Value,
    test: Option<Cow<'_, str>>,
    args: Rest<ValueOrKwargs>,
) -> Result<Value, Error> {
    if !py_bool(&value) {
        return Ok(py_iterator(Vec::new()));
    }
    minijinja::filters::reject(state, value, test, args).map(py_iterator)
}

fn selectattr(
    state: &mut State,
    value: Value,
    attr: Cow<'_, str>,
    test: Option<Cow<'_, str>>,
    args: Rest<ValueOrKwargs>,
) -> Result<Value, Error> {
    if !py_bool(&value) {
        return Ok(py_iterator(Vec::new()));
    }
    minijinja::filters::selectattr(state, value, attr, test, args).map(py_iterator)
}

fn rejectattr(
    state: &mut State,
    value: Value,
    attr: Cow<'_, str>,
    test: Option<Cow<'_, str>>,
    args: Rest<ValueOrKwargs>,
) -> Result<Value, Error> {
    if !py_bool(&value) {
        return Ok(py_iterator(Vec::new()));
    }
    minijinja::filters::rejectattr(state, value, attr, test, args).map(py_iterator)
}

fn reverse(value: &Value) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => Ok(Value::from(value.as_str().unwrap_or_default().chars().rev().collect::<String>())),
        _ if is_py_iterator(value) => Err(type_error("'generator' object is not reversible")),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable | ValueKind::Undefined => {
            let mut items = py_iter(value)?;
            items.reverse();
            Ok(py_iterator(items))
        }
        _ => Err(type_error(format!("'{}' object is not reversible", py_type(value)))),
    }
}

pub(crate) fn register_filters(env: &mut Environment<'static>) {
    env.add_filter("map", map);
    env.add_filter("select", select);
    env.add_filter("reject", reject);
    env.add_filter("selectattr", selectattr);
    env.add_filter("rejectattr", rejectattr);
    env.add_filter("reverse", reverse);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", trim);
    env.add_filter("string", string);
    env.add_filter("length", length);
    env.add_filter("count", length);
    env.add_filter("join", join);
    env.add_filter("list", list);
    env.add_filter("first", first);
    env.add_filter("last", last);
    env.add_filter("items", items);
    env.add_filter("upper", upper);
    env.add_filter("lower", lower);
    env.add_filter("capitalize", capitalize);
    env.add_filter("title", title);
    env.add_filter("replace", replace);
    env.add_filter("default", default);
    env.add_filter("d", default);
    env.add_filter("int", int);
    env.add_filter("float", float);
    env.add_filter("round", round);
    env.add_filter("dictsort", dictsort);
    env.add_filter("unique", unique);
    env.add_filter("sum", sum);
    env.add_filter("abs", abs);
}

// --- tests ----------------------------------------------------------------------------------

fn is_iterable(v: &Value) -> bool {
    matches!(v.kind(), ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable)
}

/// Jinja2: anything with `len()` and `__getitem__` (strings and dicts too).
fn is_sequence(v: &Value) -> bool {
    match v.kind() {
        ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map => true,
        // slices and ranges are sequences; iterators and dict views are not
        ValueKind::Iterable => !is_py_iterator(v) && !is_dict_view(v),
        _ => false,
    }
}

fn is_mapping(v: &Value) -> bool {
    v.kind() == ValueKind::Map
}

fn is_string(v: &Value) -> bool {
    v.kind() == ValueKind::String
}

fn is_number(v: &Value) -> bool {
    matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
}

fn is_integer(v: &Value) -> bool {
    v.kind() == ValueKind::Number && !is_float(v)
}

fn is_float_test(v: &Value) -> bool {
    is_float(v)
}

fn is_boolean(v: &Value) -> bool {
    v.kind() == ValueKind::Bool
}

fn is_true(v: &Value) -> bool {
    v.kind() == ValueKind::Bool && v.is_true()
}

fn is_false(v: &Value) -> bool {
    v.kind() == ValueKind::Bool && !v.is_true()
}

fn is_lower(v: &Value) -> bool {
    text::islower(&py_str(v))
}

fn is_upper(v: &Value) -> bool {
    text::isupper(&py_str(v))
}

pub(crate) fn register_tests(env: &mut Environment<'static>) {
    env.add_test("iterable", is_iterable);
    env.add_test("sequence", is_sequence);
    env.add_test("mapping", is_mapping);
    env.add_test("string", is_string);
    env.add_test("number", is_number);
    env.add_test("integer", is_integer);
    env.add_test("float", is_float_test);
    env.add_test("boolean", is_boolean);
    env.add_test("true", is_true);
    env.add_test("false", is_false);
    env.add_test("lower", is_lower);
    env.add_test("upper", is_upper);
}
