//! The Jinja environment as transformers sets it up, and the values a chat template sees.
//!
//! transformers renders chat templates with Jinja2's `ImmutableSandboxedEnvironment`
//! (`trim_blocks`, `lstrip_blocks`, loop controls) plus its own `tojson`, `raise_exception`
//! and `strftime_now`. This module builds the minijinja equivalent and converts values
//! between [`Json`] and minijinja. It does not compile the chat template or attribute
//! the rendered text (`mod.rs` does).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::json::{dumps, Json};
use crate::text::{utc_today, MONTH_ABBR, MONTH_NAMES};
use crate::{CoreError, Result};

pub(crate) fn to_json(v: &Value) -> std::result::Result<Json, Error> {
    Ok(match v.kind() {
        ValueKind::Undefined | ValueKind::None => Json::Null,
        ValueKind::Bool => Json::Bool(v.is_true()),
        ValueKind::Number => {
            if v.is_integer() {
                Json::Int(
                    i128::try_from(v.clone())
                        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "integer out of range"))?,
                )
            } else {
                Json::Float(f64::try_from(v.clone()).unwrap_or(f64::NAN))
            }
        }
        ValueKind::String => Json::Str(v.as_str().unwrap_or_default().to_string()),
        ValueKind::Seq | ValueKind::Iterable => {
            Json::Array(v.try_iter()?.map(|x| to_json(&x)).collect::<std::result::Result<_, _>>()?)
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                let k = key.as_str().map(str::to_string).unwrap_or_else(|| key.to_string());
                items.push((k, to_json(&value)?));
            }
            Json::Object(items)
        }
        _ => Json::Str(v.to_string()),
    })
}

pub(crate) fn json_to_value(j: &Json) -> Value {
    match j {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Int(i) => Value::from(*i),
        Json::Float(f) => Value::from(*f),
        Json::Str(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.clone(), json_to_value(v)))),
    }
}

fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    Ok(dumps(&to_json(value)?, indent))
}

fn strftime_now(fmt: &str) -> String {
    let (year, month, day) = utc_today();
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                out.push_str(&day.to_string());
            }
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(MONTH_ABBR[(month - 1) as usize]),
            Some('B') => out.push_str(MONTH_NAMES[(month - 1) as usize]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// A minijinja environment configured as transformers configures Jinja2 (no template yet).
pub(crate) fn base_environment() -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| CoreError::Template(e.to_string()))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    // Jinja's trim is Python's str.strip (its whitespace set differs from Rust's)
    env.add_filter("trim", |s: String, chars: Option<String>| match chars {
        Some(c) => crate::text::strip_chars(&s, &c.chars().collect::<Vec<_>>()).to_string(),
        None => crate::text::strip(&s).to_string(),
    });
    env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    Ok(env)
}

/// What the template sees, as transformers builds it in `apply_chat_template`: the
/// messages (keys whose value is null dropped, reasoning aliased), the tool schemas,
/// `add_generation_prompt`, the special tokens map, then the caller's extra kwargs
/// (which win over special tokens of the same name).
pub(crate) fn template_context(
    messages: &[Json],
    tools: Option<&[Json]>,
    add_generation_prompt: bool,
    special_tokens: &[(String, String)],
    kwargs: &[(String, Json)],
) -> Value {
    let mut ctx: Vec<(String, Value)> = vec![
        ("messages".into(), Value::from(messages.iter().map(json_to_value).collect::<Vec<_>>())),
        (
            "tools".into(),
            tools.map_or(Value::from(()), |t| Value::from(t.iter().map(json_to_value).collect::<Vec<_>>())),
        ),
        ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
    ];
    for (k, v) in special_tokens {
        ctx.push((k.clone(), Value::from(v.as_str())));
    }
    for (k, v) in kwargs {
        ctx.push((k.clone(), json_to_value(v)));
    }
    Value::from(ctx.into_iter().collect::<std::collections::BTreeMap<String, Value>>())
}
