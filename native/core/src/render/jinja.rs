//! The generic renderer: any Hugging Face `chat_template`, rendered with minijinja.
//!
//! The environment matches transformers' (`trim_blocks`, `lstrip_blocks`, loop controls,
//! Python string methods, a `tojson` that is `json.dumps(ensure_ascii=False)`,
//! `raise_exception`, `strftime_now`). Attribution comes from rendering every prefix of
//! the conversation: when each prefix renders as a prefix of the next (the template is
//! *prefix-stable* for this conversation), message boundaries and the generation-prompt
//! split of assistant turns are exact. When it is not (e.g. a template that rewrites
//! earlier turns), the renderer says so and falls back to locating each message's
//! content in the text.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::json::{dumps, Json};
use crate::message::{Message, Role};
use crate::render::builder::{Attr, Builder, Rendered};
use crate::render::RenderOptions;
use crate::text::{utc_today, MONTH_ABBR, MONTH_NAMES};
use crate::tokenizer::Tokenizer;
use crate::{CoreError, Result};

pub struct JinjaTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

fn to_json(v: &Value) -> std::result::Result<Json, Error> {
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

fn json_to_value(j: &Json) -> Value {
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

impl JinjaTemplate {
    /// The template's end-of-sequence token text, if known.
    pub fn eos_token(&self) -> Option<&str> {
        (!self.eos_token.is_empty()).then_some(self.eos_token.as_str())
    }

    pub fn new(template: &str, bos_token: String, eos_token: String) -> Result<JinjaTemplate> {
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
        env.add_template_owned("chat_template", template.to_string())
            .map_err(|e| CoreError::Template(format!("cannot compile: {e}")))?;
        Ok(JinjaTemplate { env, bos_token, eos_token })
    }

    /// The template's text for `messages`.
    pub fn render_text(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self.env.get_template("chat_template").expect("added at construction");
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from(messages.iter().map(|m| json_to_value(&m.raw)).collect::<Vec<_>>())),
            ("tools", tools.map_or(Value::from(()), |t| Value::from(t.iter().map(json_to_value).collect::<Vec<_>>()))),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ];
        if let Some(t) = opts.enable_thinking {
            ctx.push(("enable_thinking", Value::from(t)));
        }
        if let Some(d) = &opts.date_string {
            ctx.push(("date_string", Value::from(d.as_str())));
        }
        if let Some(t) = opts.tools_in_user_message {
            ctx.push(("tools_in_user_message", Value::from(t)));
        }
        tmpl.render(Value::from_pairs(ctx)).map_err(|e| CoreError::Template(format!("render failed: {e:#}")))
    }

    /// Render with attribution; the flag says whether the conversation was prefix-stable.
    pub fn render(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
    ) -> Result<(Rendered, bool)> {
        let full = self.render_text(messages, tools, opts, opts.add_generation_prompt)?;
        let mut b = Builder::new();
        let stable = match self.prefix_regions(messages, tools, opts, &full) {
            Some(regions) => {
                let mut end = 0;
                for r in &regions {
                    push_region(&mut b, &full, r, messages, &self.eos_token);
                    end = r.end;
                }
                b.push(&full[end..], Attr::GLOBAL);
                true
            }
            None => {
                search_attribution(&mut b, &full, messages);
                false
            }
        };
        Ok((b.encode(tok)?, stable))
    }

    /// Byte regions of each message when every prefix renders as a prefix of the next.
    fn prefix_regions(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
        full: &str,
    ) -> Option<Vec<Region>> {
        let mut regions = Vec::with_capacity(messages.len());
        let mut prev = String::new();
        for k in 1..=messages.len() {
            let text = self.render_text(&messages[..k], tools, opts, false).ok()?;
            if !text.starts_with(&prev) || !full.starts_with(&text) {
                return None;
            }
            let mut generated_from = None;
            if messages[k - 1].role == Role::Assistant && k > 1 {
                if let Ok(prompt) = self.render_text(&messages[..k - 1], tools, opts, true) {
                    if prompt.starts_with(&prev) && text.starts_with(&prompt) {
                        generated_from = Some(prompt.len());
                    }
                }
            }
            regions.push(Region { start: prev.len(), end: text.len(), message: k - 1, generated_from });
            prev = text;
        }
        Some(regions)
    }
}

struct Region {
    start: usize,
    end: usize,
    message: usize,
    /// Assistant turns: where the generated part starts (after the generation prompt).
    generated_from: Option<usize>,
}

fn push_region(b: &mut Builder, full: &str, r: &Region, messages: &[Message], eos: &str) {
    let m = r.message as i32;
    let msg = &messages[r.message];
    let trained_from = match (msg.role, r.generated_from) {
        (Role::Assistant, Some(g)) => g,
        _ => r.end,
    };
    // the model stops at its end-of-turn token: what the template writes after it is scaffold
    let trained_to = match (eos.is_empty(), full[trained_from..r.end].rfind(eos)) {
        (false, Some(p)) => trained_from + p + eos.len(),
        _ => r.end,
    };
    let content = msg.content_str();
    let (cs, ce) = match (content.is_empty(), full[r.start..r.end].find(content)) {
        (false, Some(pos)) => (r.start + pos, r.start + pos + content.len()),
        _ => (r.end, r.end),
    };
    // cut the region at every boundary and push each piece with its attribution
    let mut cuts = vec![r.start, r.end, trained_from.clamp(r.start, r.end), trained_to, cs, ce];
    cuts.sort_unstable();
    cuts.dedup();
    for w in cuts.windows(2) {
        let (s, e) = (w[0], w[1]);
        let attr = Attr { message: m, content: s >= cs && e <= ce && cs < ce, train: s >= trained_from && e <= trained_to };
        b.push(&full[s..e], attr);
    }
}

/// Unstable templates: find each message's content in order; assistant content is trained.
fn search_attribution(b: &mut Builder, full: &str, messages: &[Message]) {
    let mut cursor = 0;
    for (i, msg) in messages.iter().enumerate() {
        let content = msg.content_str();
        if content.is_empty() {
            continue;
        }
        if let Some(pos) = full[cursor..].find(content) {
            let start = cursor + pos;
            b.push(&full[cursor..start], Attr::GLOBAL);
            let attr = Attr::content(i as i32);
            b.push(content, if msg.role == Role::Assistant { attr.trained() } else { attr });
            cursor = start + content.len();
        }
    }
    b.push(&full[cursor..], Attr::GLOBAL);
}
