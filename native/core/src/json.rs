//! JSON values as Python sees them, and `json.dumps` byte-for-byte.
//!
//! Chat templates serialize tool schemas and arguments with transformers' `tojson`
//! filter, i.e. `json.dumps(x, ensure_ascii=False, indent=...)`. Token-exact rendering
//! needs the same bytes: insertion-ordered keys, `", "`/`": "` separators, Python's
//! float repr (`1e-05`, `1.0`, `1e+16`), `NaN`/`Infinity`, and only the escapes Python
//! writes with `ensure_ascii=False`.
//!
//! Depth: every walk over a [`Json`] (clone, drop, `dumps`, the template conversion) is
//! recursive, so a value must never nest deeper than [`MAX_DEPTH`] lists/dicts. The
//! places that build values from untrusted input enforce it: [`Json::parse`] here, the
//! Python conversion in the bindings (which also detects reference cycles). Code that
//! builds a `Json` by hand from other input must check [`Json::depth`] (or, better,
//! count while building: a too-deep value can overflow the stack when it is dropped).

use std::fmt::Write;

/// The deepest nesting of lists/dicts accepted in a value: a message or tool schema
/// (the message dict itself counting as one level), or JSON text such as tool-call
/// arguments. Real data nests far less (tool schemas ~20 levels); the limit keeps every
/// recursive walk of a value, including the template engine's, within a few hundred
/// KiB of stack, i.e. safe on 2 MiB worker threads. transformers' own limit is Python's
/// recursion limit (~1000 frames); serde_json's parser refuses more than 127 levels.
pub const MAX_DEPTH: usize = 100;

/// A JSON value with object keys in insertion order (as a Python dict).
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// Python ints up to 128 bits.
    Int(i128),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parse JSON text (keys keep their order; numbers with '.', 'e' or out of i64 are floats).
    /// Text nesting deeper than [`MAX_DEPTH`] lists/dicts is an error.
    pub fn parse(text: &str) -> Result<Json, String> {
        if let Some(at) = text_exceeds_depth(text, MAX_DEPTH) {
            return Err(format!("nested deeper than {MAX_DEPTH} lists/dicts (at byte {at})"));
        }
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Ok(Json::from_serde(&v))
    }

    /// Nesting depth: 0 for a scalar, 1 for a flat list/dict, ... (iterative: safe to call
    /// on any value).
    pub fn depth(&self) -> usize {
        let mut deepest = 0;
        let mut stack: Vec<(&Json, usize)> = vec![(self, 0)];
        while let Some((v, d)) = stack.pop() {
            match v {
                Json::Array(items) => {
                    deepest = deepest.max(d + 1);
                    stack.extend(items.iter().map(|x| (x, d + 1)));
                }
                Json::Object(items) => {
                    deepest = deepest.max(d + 1);
                    stack.extend(items.iter().map(|(_, x)| (x, d + 1)));
                }
                _ => {}
            }
        }
        deepest
    }

    fn from_serde(v: &serde_json::Value) -> Json {
        match v {
            serde_json::Value::Null => Json::Null,
            serde_json::Value::Bool(b) => Json::Bool(*b),
            serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Json::Int(i.into()),
                (None, Some(u)) => Json::Int(u.into()),
                _ => Json::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            serde_json::Value::String(s) => Json::Str(s.clone()),
            serde_json::Value::Array(a) => Json::Array(a.iter().map(Json::from_serde).collect()),
            serde_json::Value::Object(o) => {
                Json::Object(o.iter().map(|(k, v)| (k.clone(), Json::from_serde(v))).collect())
            }
        }
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }

    /// Value of `key` in an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(items) => items.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Byte offset of the first `[`/`{` that opens level `max + 1` of JSON text (strings
/// skipped), or None when the text nests at most `max` levels. Only a bound for the
/// parser: text that is not JSON is rejected by the parser itself.
fn text_exceeds_depth(text: &str, max: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, &b) in text.as_bytes().iter().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Some(i);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// `json.dumps(value, ensure_ascii=False)` (indent None) or with `indent` spaces.
pub fn dumps(value: &Json, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_value(&mut out, value, indent, 0);
    out
}

fn write_value(out: &mut String, value: &Json, indent: Option<usize>, depth: usize) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(true) => out.push_str("true"),
        Json::Bool(false) => out.push_str("false"),
        Json::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Json::Float(f) => out.push_str(&py_float_repr(*f)),
        Json::Str(s) => write_json_str(out, s, false),
        Json::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separate(out, i, indent, depth + 1);
                write_value(out, item, indent, depth + 1);
            }
            close(out, indent, depth);
            out.push(']');
        }
        Json::Object(items) => {
            if items.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (k, v)) in items.iter().enumerate() {
                separate(out, i, indent, depth + 1);
                write_json_str(out, k, false);
                out.push_str(": ");
                write_value(out, v, indent, depth + 1);
            }
            close(out, indent, depth);
            out.push('}');
        }
    }
}

fn separate(out: &mut String, i: usize, indent: Option<usize>, depth: usize) {
    match indent {
        None => {
            if i > 0 {
                out.push_str(", ");
            }
        }
        Some(n) => {
            if i > 0 {
                out.push(',');
            }
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }
}

fn close(out: &mut String, indent: Option<usize>, depth: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

/// A JSON string as `json.dumps` writes it (`ensure_ascii`: `\uXXXX` beyond ASCII).
pub(crate) fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits; fixed notation for exponents in
/// [-4, 16), scientific (`1e-05`, `1.5e+16`) otherwise; `NaN`, `Infinity` as json.dumps.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's {:e} gives the shortest round-trip digits: "-1.2345e-7"
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456789.0, "123456789.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (-2.5, "-2.5"),
            (std::f64::consts::PI, "3.141592653589793"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (-0.0, "-0.0"),
            (0.00012345, "0.00012345"),
            (12.0, "12.0"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
        assert_eq!(py_float_repr(f64::NAN), "NaN");
        assert_eq!(py_float_repr(f64::NEG_INFINITY), "-Infinity");
    }

    fn nested(open: &str, close: &str, n: usize) -> String {
        format!("{}{}", open.repeat(n), close.repeat(n))
    }

    #[test]
    fn parse_accepts_max_depth_and_refuses_more() {
        let ok = Json::parse(&nested("[", "]", MAX_DEPTH)).unwrap();
        assert_eq!(ok.depth(), MAX_DEPTH);
        let ok = Json::parse(&nested("{\"a\": ", "}", MAX_DEPTH - 1).replace("{\"a\": }", "{\"a\": {}}")).unwrap();
        assert_eq!(ok.depth(), MAX_DEPTH);
        for text in [nested("[", "]", MAX_DEPTH + 1), nested("[", "]", 1_000_000), "[".repeat(1_000_000)] {
            let e = Json::parse(&text).unwrap_err();
            assert!(e.contains(&format!("nested deeper than {MAX_DEPTH}")), "{e}");
        }
        // brackets inside strings do not count, escaped quotes do not end a string
        let text = format!("[\"\\\"{}\"]", "[".repeat(1000));
        assert_eq!(Json::parse(&text).unwrap().depth(), 1);
    }

    #[test]
    fn depth_is_iterative() {
        let mut v = Json::Null;
        for _ in 0..3 {
            v = Json::Array(vec![Json::Int(1), v, Json::Object(vec![("k".into(), Json::Array(vec![]))])]);
        }
        assert_eq!(v.depth(), 5);
        assert_eq!(Json::Str("[[[".into()).depth(), 0);
    }

    #[test]
    fn dumps_matches_python_separators_and_escapes() {
        let v = Json::parse(r#"{"b": [1, 2.5, {"x": null}], "a": "é\n\"\u0001", "e": {}, "f": []}"#).unwrap();
        assert_eq!(dumps(&v, None), r#"{"b": [1, 2.5, {"x": null}], "a": "é\n\"\u0001", "e": {}, "f": []}"#);
        assert_eq!(
            dumps(&v, Some(4)),
            "{\n    \"b\": [\n        1,\n        2.5,\n        {\n            \"x\": null\n        }\n    ],\n    \"a\": \"é\\n\\\"\\u0001\",\n    \"e\": {},\n    \"f\": []\n}"
        );
    }
}
