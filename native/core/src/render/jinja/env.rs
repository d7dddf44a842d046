//! The Jinja environment as transformers sets it up, and the values a chat template sees.
//!
//! transformers renders chat templates with Jinja2's `ImmutableSandboxedEnvironment`
//! (`trim_blocks`, `lstrip_blocks`, loop controls) plus its own `tojson`, `raise_exception`,
//! `strftime_now` (local time), `dict` and `namespace`. This module builds the minijinja
//! equivalent, and makes it evaluate as Jinja2 does: values print as Python's `str()`
//! (`None`, `True`, `1e+16`, `[1, 'a']`), tests, filters and string methods follow
//! Python (`pyvalue`, `filters`, `methods`). It also builds the template context as
//! `apply_chat_template` does (null keys dropped, reasoning aliased, special tokens,
//! kwargs). It does not compile the chat template or attribute the rendered text
//! (`mod.rs` does).
//!
//! What still differs lives in minijinja's parser and operators, out of reach of an
//! environment (each is a strict xfail in `tests/native/test_jinja_parity.py`): `~` writes
//! floats as Rust does (`1e16 ~ ''` is `10000000000000000.0`, not `1e+16`); tuple
//! literals print as lists; no unary `+`, `%` formatting or `\N{...}` escapes; ordering
//! of mixed types, `1 in 'abc'`, `'a' * 2.0`, `x[:2]` of none/undefined and `undefined in
//! 'abc'` evaluate instead of raising; iterating none is empty instead of raising;
//! `loop.last`/`loop.length` over a string are unknown; chained tests (`x is a is b`)
//! compile; integers are 128-bit; `namespace(_x=...)` is allowed.

mod filters;
mod methods;
mod pyvalue;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::json::Json;
use crate::{CoreError, Result};

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

/// `datetime.now().strftime(fmt)`: local time (the `TZ` variable is read on every call),
/// formatted by the C library as Python does; `%f` is the microseconds and `%z`/`%Z` are
/// empty, as for Python's naive datetime.
fn strftime_now(fmt: &str) -> std::result::Result<String, Error> {
    extern "C" {
        fn tzset();
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut py_fmt = String::with_capacity(fmt.len());
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            py_fmt.push(c);
            continue;
        }
        match chars.next() {
            Some('f') => py_fmt.push_str(&format!("{:06}", now.subsec_micros())),
            Some('z' | 'Z') => {}
            Some(other) => {
                py_fmt.push('%');
                py_fmt.push(other);
            }
            None => py_fmt.push('%'),
        }
    }
    if py_fmt.is_empty() {
        return Ok(String::new());
    }
    let c_fmt =
        std::ffi::CString::new(py_fmt).map_err(|_| pyvalue::type_error("ValueError: embedded null character"))?;
    let secs = now.as_secs() as libc::time_t;
    // SAFETY: tm is plain data; localtime_r writes it and strftime reads it and writes at
    // most buf.len() bytes into buf.
    unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        tzset();
        if libc::localtime_r(&secs, &mut tm).is_null() {
            return Err(pyvalue::type_error("OverflowError: timestamp out of range"));
        }
        tm.tm_isdst = -1; // a naive datetime's timetuple()
        let mut size = 1024;
        loop {
            let mut buf = vec![0u8; size];
            let n = libc::strftime(buf.as_mut_ptr().cast(), size, c_fmt.as_ptr(), &tm);
            if n > 0 || size > 256 * fmt.len() {
                buf.truncate(n);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            size *= 2;
        }
    }
}

/// What `{{ value }}` writes: Python's `str(value)`.
fn format_value(
    out: &mut minijinja::Output,
    _: &mut minijinja::State,
    value: &Value,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::String => out.write_str(value.as_str().unwrap_or_default()),
        _ => out.write_str(&pyvalue::py_str(value)),
    }
    .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write output"))
}

/// transformers' `dict` global: `dict(a=1)`, `dict([("a", 1)])`, `dict(d, b=2)`.
fn dict(pos: Rest<Value>, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let mut items: Vec<(Value, Value)> = Vec::new();
    let mut put = |k: Value, v: Value| match items.iter_mut().find(|(key, _)| *key == k) {
        Some(slot) => slot.1 = v,
        None => items.push((k, v)),
    };
    match pos.as_slice() {
        [] => {}
        [src] if src.kind() == ValueKind::Map => {
            for k in src.try_iter()? {
                let v = src.get_item(&k)?;
                put(k, v);
            }
        }
        [src] => {
            for pair in filters::py_iter(src)? {
                let kv = filters::py_iter(&pair)?;
                let [k, v] = kv.as_slice() else {
                    return Err(pyvalue::type_error("ValueError: dictionary update sequence element has wrong length"));
                };
                put(k.clone(), v.clone());
            }
        }
        _ => return Err(pyvalue::type_error(format!("dict expected at most 1 argument, got {}", pos.len()))),
    }
    for k in kwargs.args() {
        put(Value::from(k), kwargs.get::<Value>(k)?);
    }
    Ok(Value::from_pairs(items))
}

/// A minijinja environment configured as transformers configures Jinja2 (no template yet).
/// transformers' whitespace rules: `trim_blocks`, `lstrip_blocks`.
pub(crate) fn syntax() -> Result<minijinja::syntax::SyntaxConfig> {
    minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| CoreError::Template(e.to_string()))
}

pub(crate) fn base_environment() -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_syntax(syntax()?);
    env.set_formatter(format_value);
    env.set_unknown_method_callback(methods::call_method);
    filters::register_filters(&mut env);
    filters::register_tests(&mut env);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    env.add_function("dict", dict);
    Ok(env)
}

/// One message as transformers hands it to the template: keys whose value is null
/// dropped (`_normalize_chat_messages`), then the reasoning copied under `thinking` and
/// `reasoning_content` (`_alias_reasoning_fields`).
fn message_value(message: &Json) -> Value {
    let Json::Object(fields) = message else { return json_to_value(message) };
    let mut fields: Vec<(String, Value)> =
        fields.iter().filter(|(_, v)| *v != Json::Null).map(|(k, v)| (k.clone(), json_to_value(v))).collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|name| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()));
    if let Some(reasoning) = reasoning {
        // {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if !fields.iter().any(|(k, _)| k == "thinking") {
            fields.insert(0, ("thinking".into(), reasoning.clone()));
        }
        match fields.iter_mut().find(|(k, _)| k == "reasoning_content") {
            Some(slot) => slot.1 = reasoning,
            None => fields.push(("reasoning_content".into(), reasoning)),
        }
    }
    Value::from_pairs(fields)
}

/// A template variable: the messages and `add_generation_prompt` vary between the renders
/// of one call (prefixes, with and without the prompt); the rest is converted once.
enum Slot {
    Messages,
    AddGenerationPrompt,
    Fixed(Value),
}

/// The template context of one call, converted once for its several renders.
pub(crate) struct Context {
    messages: Vec<Value>,
    vars: Vec<(String, Slot)>,
    pub has_tools: bool,
}

impl Context {
    /// Whether `add_generation_prompt` is the call's flag (not overridden by a kwarg).
    pub fn prompt_varies(&self) -> bool {
        self.vars.iter().any(|(k, slot)| k == "add_generation_prompt" && matches!(slot, Slot::AddGenerationPrompt))
    }

    /// What transformers passes for `messages[..upto]`.
    pub fn value(&self, upto: usize, add_generation_prompt: bool) -> Value {
        Value::from_pairs(self.vars.iter().map(|(k, slot)| {
            let v = match slot {
                Slot::Messages => Value::from(self.messages[..upto].to_vec()),
                Slot::AddGenerationPrompt => Value::from(add_generation_prompt),
                Slot::Fixed(v) => v.clone(),
            };
            (k.clone(), v)
        }))
    }
}

/// What the template sees, as transformers builds it in `apply_chat_template`: the
/// messages (keys whose value is null dropped, reasoning aliased), the tool schemas,
/// `documents` (none), `add_generation_prompt`, the special tokens map (empty ones left
/// out), then the caller's extra kwargs (which win over special tokens of the same name).
pub(crate) fn prepare_context<'a>(
    messages: impl IntoIterator<Item = &'a Json>,
    tools: Option<&[Json]>,
    special_tokens: &[(String, String)],
    kwargs: &[(String, Json)],
) -> Context {
    let messages: Vec<Value> = messages.into_iter().map(message_value).collect();
    let mut vars: Vec<(String, Slot)> = vec![
        ("messages".into(), Slot::Messages),
        (
            "tools".into(),
            Slot::Fixed(
                tools.map_or(Value::from(()), |t| Value::from(t.iter().map(json_to_value).collect::<Vec<_>>())),
            ),
        ),
        ("documents".into(), Slot::Fixed(Value::from(()))),
        ("add_generation_prompt".into(), Slot::AddGenerationPrompt),
    ];
    let mut set = |k: &str, v: Value| match vars.iter_mut().find(|(key, _)| key == k) {
        Some(slot) => slot.1 = Slot::Fixed(v),
        None => vars.push((k.to_string(), Slot::Fixed(v))),
    };
    // transformers' special_tokens_map leaves out the tokens a tokenizer does not have
    // (they are undefined in the template); an empty text stands for one here
    for (k, v) in special_tokens.iter().filter(|(_, v)| !v.is_empty()) {
        set(k, Value::from(v.as_str()));
    }
    for (k, v) in kwargs {
        set(k, json_to_value(v));
    }
    Context { messages, vars, has_tools: tools.is_some() }
}

#[cfg(test)]
pub(crate) fn template_context(
    messages: &[Json],
    tools: Option<&[Json]>,
    add_generation_prompt: bool,
    special_tokens: &[(String, String)],
    kwargs: &[(String, Json)],
) -> Value {
    prepare_context(messages.iter(), tools, special_tokens, kwargs).value(messages.len(), add_generation_prompt)
}

impl super::JinjaTemplate {
    /// Render the template with `context` as the only variables (no normalisation):
    /// what Jinja2's `template.render(**context)` does. For differential tests.
    pub fn render_context(&self, context: &[(String, Json)]) -> Result<String> {
        let tmpl = self.env.get_template("chat_template").expect("added at construction");
        let ctx = Value::from_pairs(context.iter().map(|(k, v)| (k.clone(), json_to_value(v))));
        tmpl.render(ctx).map_err(|e| CoreError::Template(format!("render failed: {e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> std::result::Result<String, Error> {
        let mut env = base_environment().expect("environment");
        env.add_template_owned("t", src.to_string())?;
        env.get_template("t")?.render(ctx)
    }

    fn json(text: &str) -> Json {
        Json::parse(text).expect("valid json")
    }

    #[test]
    fn context_drops_null_keys_and_aliases_reasoning() {
        let messages = [
            json(r#"{"role": "assistant", "content": null, "reasoning": "r", "tool_calls": null}"#),
            json(r#"{"role": "assistant", "content": "c", "thinking": "t", "reasoning_content": null}"#),
            json(r#"{"role": "user", "content": "u"}"#),
        ];
        let ctx = template_context(&messages, None, false, &[], &[]);
        let src = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ tools }}|{{ documents }}";
        assert_eq!(
            render(src, ctx).unwrap(),
            concat!(
                r#"{"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}"#,
                "\n",
                r#"{"role": "assistant", "content": "c", "thinking": "t", "reasoning_content": "t"}"#,
                "\n",
                r#"{"role": "user", "content": "u"}"#,
                "\nNone|None"
            )
        );
    }

    #[test]
    fn context_kwargs_override_special_tokens() {
        let special = [("bos_token".to_string(), "<s>".to_string()), ("eos_token".to_string(), "</s>".to_string())];
        let kwargs =
            [("eos_token".to_string(), json(r#""<end>""#)), ("reasoning_effort".to_string(), json(r#""high""#))];
        let ctx = template_context(&[], Some(&[json(r#"{"name": "f"}"#)]), true, &special, &kwargs);
        let src =
            "{{ bos_token }}{{ eos_token }}|{{ reasoning_effort }}|{{ add_generation_prompt }}|{{ tools[0].name }}";
        assert_eq!(render(src, ctx).unwrap(), "<s><end>|high|True|f");
    }

    #[test]
    fn values_print_as_python_str() {
        let ctx = json_to_value(&json(
            r#"{"f": 1e16, "g": -2.5e-07, "n": null, "l": [1, "it's", null, true], "d": {"k": 0.5}}"#,
        ));
        assert_eq!(
            render("{{ f }} {{ g }} {{ n }} {{ l }} {{ d }} {{ d.items() }}", ctx).unwrap(),
            "1e+16 -2.5e-07 None [1, \"it's\", None, True] {'k': 0.5} dict_items([('k', 0.5)])"
        );
    }

    #[test]
    fn tests_and_methods_follow_python() {
        let ctx = json_to_value(&json(r#"{"n": null, "s": "\u001c a b \u001f"}"#));
        let src = "{{ n is iterable }} {{ s is sequence }} [{{ s.strip() }}] {{ s.split() }} {{ s | trim | title }}";
        assert_eq!(render(src, ctx).unwrap(), "False True [a b] ['a', 'b'] A B");
        assert!(render("{{ 'a'.split('') }}", Value::from(())).is_err());
        assert!(render("{{ [1] | selectattr('x') | length }}", Value::from(())).is_err());
    }

    #[test]
    fn strftime_now_formats_like_python() {
        let year = strftime_now("%Y").unwrap();
        assert_eq!(year.len(), 4);
        assert_eq!(strftime_now("%z%Z%%").unwrap(), "%");
        assert_eq!(strftime_now("%f").unwrap().len(), 6);
        assert_eq!(strftime_now("").unwrap(), "");
    }
}
