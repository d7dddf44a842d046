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

pub(crate) mod env;

use minijinja::Environment;

use crate::json::Json;
use crate::message::{Message, Role};
use crate::render::builder::{Attr, Builder, Rendered};
use crate::render::RenderOptions;
use crate::tokenizer::Tokenizer;
use crate::{CoreError, Result};

pub struct JinjaTemplate {
    env: Environment<'static>,
    /// The special tokens map as transformers passes it to the template (`bos_token`,
    /// `eos_token`, ...), in order.
    special_tokens: Vec<(String, String)>,
    eos_token: String,
}

impl JinjaTemplate {
    /// The template's end-of-sequence token text, if known.
    pub fn eos_token(&self) -> Option<&str> {
        (!self.eos_token.is_empty()).then_some(self.eos_token.as_str())
    }

    pub fn new(template: &str, bos_token: String, eos_token: String) -> Result<JinjaTemplate> {
        let mut env = env::base_environment()?;
        env.add_template_owned("chat_template", template.to_string())
            .map_err(|e| CoreError::Template(format!("cannot compile: {e}")))?;
        let special_tokens = vec![("bos_token".to_string(), bos_token), ("eos_token".to_string(), eos_token.clone())];
        Ok(JinjaTemplate { env, special_tokens, eos_token })
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
        let raw: Vec<Json> = messages.iter().map(|m| m.raw.clone()).collect();
        let ctx = env::template_context(&raw, tools, add_generation_prompt, &self.special_tokens, &opts.kwargs());
        tmpl.render(ctx).map_err(|e| CoreError::Template(format!("render failed: {e:#}")))
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
        let attr =
            Attr { message: m, content: s >= cs && e <= ce && cs < ce, train: s >= trained_from && e <= trained_to };
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
