//! The generic renderer: any Hugging Face `chat_template`, rendered with minijinja.
//!
//! The environment matches transformers' (`env.rs`). Attribution comes from rendering
//! every prefix of the conversation: when each prefix renders as a prefix of the next
//! (the template is *prefix-stable* for this conversation), message boundaries and the
//! generation-prompt split of assistant turns are exact. When it is not (e.g. a template
//! that rewrites earlier turns), the renderer says so and locates each message's fields
//! with markers (`located.rs`), or, where the markers change the text, by searching for
//! each message's content. Text and token ids are exact either way.
//!
//! Loss masks ([`MaskConvention`]): with `{% generation %}` blocks (transformers'
//! `return_assistant_tokens_mask`) the mask is exactly transformers' `assistant_masks`:
//! every token overlapping a block. Without, the *sampled* convention: each assistant
//! turn from the end of its generation prompt (the longest common prefix of the prompt's
//! tail and the turn, so a prefilled `<think>\n` the history drops does not hide the
//! turn) through its end-of-turn token, which is always in the mask; scaffold never is.
//!
//! `{% generation %}` blocks are compiled as `{% filter %}` blocks (same whitespace
//! rules: both are block tags) whose filter wraps the body in markers holding a random
//! nonce; the markers are cut out of the text and give the block spans.
//!
//! Bridging (append-only extension of a sampled conversation) is in `bridge.rs`.

mod bridge;
pub(crate) mod env;
mod located;
mod prompt_split;

use std::borrow::{Borrow, Cow};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use minijinja::Environment;

use crate::json::Json;
use crate::message::{Message, Role};
use crate::render::builder::{Attr, Builder, Rendered};
use crate::render::{MaskConvention, RenderOptions};
use crate::tokenizer::Tokenizer;
use crate::{CoreError, Result};

pub struct JinjaTemplate {
    env: Environment<'static>,
    /// A `tool_use` template is used when tools are given (as transformers does).
    has_tool_use: bool,
    /// The special tokens map as transformers passes it to the template (`bos_token`,
    /// `eos_token`, ...), in order.
    special_tokens: Vec<(String, String)>,
    /// End-of-turn token texts (eos and generation_config's eos ids).
    stops: Vec<String>,
    /// The template has `{% generation %}` blocks.
    has_generation: bool,
    mask: MaskConvention,
    open: String,
    close: String,
    /// `prev_ids` of recent bridges, proved (`bridge.rs`).
    verified: bridge::VerifiedPrefixes,
    /// What the marked templates (`prompt_split.rs`) write where the generation prompt
    /// starts; `chat_template#split` / `tool_use#split` exist where the split is proved.
    prompt_marker: String,
}

const GENERATION_FILTER: &str = "__treadle_generation";

/// Rewrite `{% generation %}` / `{% endgeneration %}` (any whitespace control) as a
/// filter block; returns the new source and whether there was any.
fn compile_generation_tags(src: &str) -> (String, bool) {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    let mut found = false;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            rest = "";
            break;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (c.to_string(), &inner[1..]),
            _ => (String::new(), inner),
        };
        let (body, trail) = match body.chars().last() {
            Some(c @ ('-' | '+')) => (&body[..body.len() - 1], c.to_string()),
            _ => (body, String::new()),
        };
        let replacement = match body.trim() {
            "generation" => Some(format!("{{%{lead} filter {GENERATION_FILTER} {trail}%}}")),
            "endgeneration" => Some(format!("{{%{lead} endfilter {trail}%}}")),
            _ => None,
        };
        match replacement {
            Some(r) => {
                found = true;
                out.push_str(&r);
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    (out, found)
}

fn nonce() -> String {
    let a = RandomState::new().build_hasher().finish();
    let mut h = RandomState::new().build_hasher();
    h.write_u64(a);
    format!("{a:016x}{:016x}", h.finish())
}

/// Byte length of the longest common prefix of `a` and `b`, on a char boundary.
pub(crate) fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).take_while(|((_, x), y)| x == y).last().map_or(0, |((i, c), _)| i + c.len_utf8())
}

impl JinjaTemplate {
    pub fn new(
        template: &str,
        tool_use: Option<&str>,
        special_tokens: Vec<(String, String)>,
        stops: Vec<String>,
        mask: MaskConvention,
    ) -> Result<JinjaTemplate> {
        let mut env = env::base_environment()?;
        let n = nonce();
        let (open, close) = (format!("\u{F8FF}gen<{n}\u{F8FF}"), format!("\u{F8FF}gen>{n}\u{F8FF}"));
        let (o, c) = (open.clone(), close.clone());
        env.add_filter(GENERATION_FILTER, move |body: String| format!("{o}{body}{c}"));
        let prompt_marker = format!("\u{F8FF}prompt{n}\u{F8FF}");
        let m = prompt_marker.clone();
        env.add_filter(prompt_split::PROMPT_FILTER, move |_: String| m.clone());
        let (source, has_generation) = compile_generation_tags(template);
        let split_source = |src: &str| prompt_split::marked_source(src, env::syntax().ok()?);
        let chat_split = split_source(&source);
        env.add_template_owned("chat_template", source)
            .map_err(|e| CoreError::Template(format!("cannot compile: {e}")))?;
        if let Some(marked) = chat_split {
            env.add_template_owned("chat_template#split", marked)
                .map_err(|e| CoreError::Template(format!("cannot compile: {e}")))?;
        }
        if let Some(t) = tool_use {
            let (source, _) = compile_generation_tags(t);
            let tool_split = split_source(&source);
            env.add_template_owned("tool_use", source)
                .map_err(|e| CoreError::Template(format!("cannot compile the tool_use template: {e}")))?;
            if let Some(marked) = tool_split {
                env.add_template_owned("tool_use#split", marked)
                    .map_err(|e| CoreError::Template(format!("cannot compile the tool_use template: {e}")))?;
            }
        }
        let mask = match mask {
            MaskConvention::Auto if has_generation => MaskConvention::Generation,
            MaskConvention::Auto => MaskConvention::Sampled,
            m => m,
        };
        Ok(JinjaTemplate {
            env,
            has_tool_use: tool_use.is_some(),
            special_tokens,
            stops,
            has_generation,
            mask,
            open,
            close,
            verified: bridge::VerifiedPrefixes::default(),
            prompt_marker,
        }
        .check_prompt_split())
    }

    /// The template's end-of-sequence token text, if known.
    pub fn eos_token(&self) -> Option<&str> {
        self.special_tokens.iter().find(|(k, _)| k == "eos_token").map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
    }

    /// End-of-turn token texts.
    pub fn stop_tokens(&self) -> &[String] {
        &self.stops
    }

    /// Whether the template has `{% generation %}` blocks.
    pub fn has_generation_blocks(&self) -> bool {
        self.has_generation
    }

    /// The loss-mask convention in force (never `Auto`).
    pub fn mask_convention(&self) -> MaskConvention {
        self.mask
    }

    /// The template context of one call, converted once for its several renders.
    pub(crate) fn context<'a>(
        &self,
        messages: impl IntoIterator<Item = &'a Message>,
        tools: Option<&[Json]>,
        opts: &RenderOptions,
    ) -> env::Context {
        env::prepare_context(messages.into_iter().map(|m| &m.raw), tools, &self.special_tokens, &opts.kwargs())
    }

    /// The template's text for the context's first `upto` messages and the byte spans of
    /// its generation blocks.
    pub(crate) fn render_spans(
        &self,
        ctx: &env::Context,
        upto: usize,
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<(usize, usize)>)> {
        let text = self
            .template(ctx)
            .render(ctx.value(upto, add_generation_prompt))
            .map_err(|e| CoreError::Template(format!("render failed: {e:#}")))?;
        if !self.has_generation {
            return Ok((text, Vec::new()));
        }
        Ok(self.cut_markers(&text))
    }

    /// The text with the generation prompt for the context's first `upto` messages, its
    /// generation-block spans and where the text without the prompt ends, from one render
    /// (`prompt_split.rs`); None where the template is not proved to split, or the render
    /// fails (the caller renders again, and reports the failure as it always does).
    pub(crate) fn render_prompt_split(&self, ctx: &env::Context, upto: usize) -> Option<SplitRender> {
        if !ctx.prompt_varies() {
            return None;
        }
        let name = if ctx.has_tools && self.has_tool_use { "tool_use#split" } else { "chat_template#split" };
        let mut text = self.env.get_template(name).ok()?.render(ctx.value(upto, true)).ok()?;
        let at = text.find(&self.prompt_marker)?;
        let end = at + self.prompt_marker.len();
        if text[end..].contains(&self.prompt_marker) {
            return None; // written twice: not the template proved
        }
        text.replace_range(at..end, "");
        if !self.has_generation {
            return Some((text, Vec::new(), at));
        }
        // generation blocks before the prompt are closed (it is a top-level tail)
        let plain_len = self.cut_markers(&text[..at]).0.len();
        let (text, spans) = self.cut_markers(&text);
        Some((text, spans, plain_len))
    }

    /// Try the proved split once on a one-message conversation against the two plain
    /// renders; a template where they differ renders twice.
    fn check_prompt_split(mut self) -> JinjaTemplate {
        let probe = [Json::Object(vec![
            ("role".to_string(), Json::Str("user".to_string())),
            ("content".to_string(), Json::Str("Hello".to_string())),
        ])];
        let ctx = env::prepare_context(probe.iter(), None, &self.special_tokens, &[]);
        let plain = |prompt: bool| self.render_spans(&ctx, 1, prompt).ok();
        let agrees = match (self.render_prompt_split(&ctx, 1), plain(true), plain(false)) {
            (Some((text, spans, at)), Some(with), Some(without)) => {
                (text.as_str(), &spans) == (with.0.as_str(), &with.1) && text[..at] == without.0
            }
            (None, Some(_), Some(_)) => !self.env.templates().any(|(name, _)| name == "chat_template#split"),
            _ => true, // the template refuses the probe: the proof stands alone
        };
        if !agrees {
            self.env.remove_template("chat_template#split");
            self.env.remove_template("tool_use#split");
        }
        self
    }

    fn template(&self, ctx: &env::Context) -> minijinja::Template<'_, '_> {
        let name = if ctx.has_tools && self.has_tool_use { "tool_use" } else { "chat_template" };
        self.env.get_template(name).expect("added at construction")
    }

    /// Where the template's text for the context's first `upto` messages is a prefix of
    /// `expected`, its length (None: it is not). The text is compared as it is written,
    /// never built (templates with generation blocks, whose markers are cut out of the
    /// text afterwards, are rendered and compared).
    pub(crate) fn rendered_prefix_len(
        &self,
        ctx: &env::Context,
        upto: usize,
        add_generation_prompt: bool,
        expected: &str,
    ) -> Result<Option<usize>> {
        if self.has_generation {
            let (text, _) = self.render_spans(ctx, upto, add_generation_prompt)?;
            return Ok(expected.starts_with(&text).then_some(text.len()));
        }
        let mut sink = PrefixSink { expected: expected.as_bytes(), at: 0, matches: true };
        let rendered = self.template(ctx).render_captured_to(ctx.value(upto, add_generation_prompt), &mut sink);
        match (rendered, sink.matches) {
            (_, false) => Ok(None),
            (Ok(_), true) => Ok(Some(sink.at)),
            (Err(e), true) => Err(CoreError::Template(format!("render failed: {e:#}"))),
        }
    }

    fn cut_markers(&self, text: &str) -> (String, Vec<(usize, usize)>) {
        let mut out = String::with_capacity(text.len());
        let mut spans = Vec::new();
        let mut open_at: Vec<usize> = Vec::new();
        let mut rest = text;
        loop {
            let o = rest.find(&self.open);
            let c = rest.find(&self.close);
            let (pos, is_open) = match (o, c) {
                (Some(o), Some(c)) if o < c => (o, true),
                (Some(o), None) => (o, true),
                (_, Some(c)) => (c, false),
                (None, None) => break,
            };
            out.push_str(&rest[..pos]);
            if is_open {
                open_at.push(out.len());
                rest = &rest[pos + self.open.len()..];
            } else {
                if let Some(s) = open_at.pop() {
                    if open_at.is_empty() {
                        spans.push((s, out.len()));
                    }
                }
                rest = &rest[pos + self.close.len()..];
            }
        }
        out.push_str(rest);
        spans.sort_unstable();
        (out, spans)
    }

    /// The template's text for `messages`.
    pub fn render_text(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let ctx = self.context(messages, tools, opts);
        self.render_spans(&ctx, messages.len(), add_generation_prompt).map(|(t, _)| t)
    }

    /// Render with attribution; the flag says whether the conversation was prefix-stable.
    pub fn render(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
    ) -> Result<(Rendered, bool)> {
        let ctx = self.context(messages, tools, opts);
        let split = if opts.add_generation_prompt { self.render_prompt_split(&ctx, messages.len()) } else { None };
        let (full, spans, plain_len) = match split {
            Some((text, spans, at)) => (text, spans, Some(at)),
            None => {
                let (text, spans) = self.render_spans(&ctx, messages.len(), opts.add_generation_prompt)?;
                let len = (!opts.add_generation_prompt).then_some(text.len());
                (text, spans, len)
            }
        };
        let mut b = Builder::new();
        let plain = plain_len.map(|len| &full[..len]);
        let stable = match self.prefix_regions(&ctx, messages, &full, plain, 0, 0) {
            Some(regions) => {
                let mut end = 0;
                for r in &regions {
                    push_region(&mut b, &full, r, &messages[r.message], r.message as i32, &self.stops);
                    end = r.end;
                }
                b.push(&full[end..], Attr::GLOBAL);
                true
            }
            None => {
                match self.located_pieces(messages, tools, opts, &full) {
                    Some(pieces) => {
                        let mut cursor = 0;
                        for (s, e, attr) in pieces {
                            b.push(&full[cursor..s], Attr::GLOBAL);
                            b.push(&full[s..e], attr);
                            cursor = e;
                        }
                        b.push(&full[cursor..], Attr::GLOBAL);
                    }
                    None => search_attribution(&mut b, &full, messages, &self.stops),
                }
                false
            }
        };
        let (mut rendered, offsets) = b.encode_with_offsets(tok)?;
        if self.mask == MaskConvention::Generation {
            rendered.loss_mask = generation_mask(&offsets, &spans);
        }
        Ok((rendered, stable))
    }

    /// Byte regions of messages `from..` when every prefix renders as a prefix of the
    /// next (and of `full`); regions of the messages before `from` are not computed, the
    /// caller says where message `from`'s starts (`from_start`: 0 for the first message,
    /// where `prev_ids` end for a bridge). `plain`: the whole conversation's text without
    /// the generation prompt, when known (it is the last prefix: not rendered again).
    pub(crate) fn prefix_regions<M: Borrow<Message>>(
        &self,
        ctx: &env::Context,
        messages: &[M],
        full: &str,
        plain: Option<&str>,
        from: usize,
        from_start: usize,
    ) -> Option<Vec<Region>> {
        let text_of = |upto: usize, prompt: bool| -> Option<Cow<'_, str>> {
            match plain {
                Some(p) if upto == messages.len() && !prompt => Some(Cow::Borrowed(p)),
                _ => self.render_spans(ctx, upto, prompt).ok().map(|(t, _)| Cow::Owned(t)),
            }
        };
        let mut regions = Vec::with_capacity(messages.len());
        let mut prev = Cow::Borrowed(full.get(..from_start)?);
        for k in from + 1..=messages.len() {
            let text = text_of(k, false)?;
            if !text.starts_with(prev.as_ref()) || !full.starts_with(text.as_ref()) {
                return None;
            }
            let mut gen_prompt = None;
            if messages[k - 1].borrow().role == Role::Assistant {
                if let Some(prompt) = text_of(k - 1, true) {
                    if let Some(tail) = prompt.strip_prefix(prev.as_ref()) {
                        gen_prompt = Some(tail.to_string());
                    }
                }
            }
            regions.push(Region { start: prev.len(), end: text.len(), message: k - 1, gen_prompt });
            prev = text;
        }
        Some(regions)
    }
}

/// A render's output compared with the text it should start: stops the render at the
/// first byte that differs.
struct PrefixSink<'a> {
    expected: &'a [u8],
    at: usize,
    matches: bool,
}

impl std::io::Write for PrefixSink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.expected[self.at..].starts_with(buf) {
            self.matches = false;
            return Err(std::io::Error::other("the render differs"));
        }
        self.at += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A render with the generation prompt: its text, generation-block spans, and where the
/// text without the prompt ends.
pub(crate) type SplitRender = (String, Vec<(usize, usize)>, usize);

pub(crate) struct Region {
    pub start: usize,
    pub end: usize,
    pub message: usize,
    /// Assistant turns: the generation prompt's text after the previous messages.
    pub gen_prompt: Option<String>,
}

/// transformers' `assistant_masks`: 1 for every token overlapping a generation span.
pub(crate) fn generation_mask(offsets: &[(usize, usize)], spans: &[(usize, usize)]) -> Vec<u8> {
    let mut mask = vec![0u8; offsets.len()];
    let mut s = 0;
    for (t, &(start, end)) in offsets.iter().enumerate() {
        while s < spans.len() && start >= spans[s].1 {
            s += 1;
        }
        if s == spans.len() {
            break;
        }
        if end > spans[s].0 {
            mask[t] = 1;
        }
    }
    mask
}

/// Byte position just after the first end-of-turn token in `text[from..to]`, if any.
fn stop_after(text: &str, from: usize, to: usize, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..to].find(s.as_str()).map(|p| (p, from + p + s.len())))
        .min()
        .map(|(_, end)| end)
}

/// Push the text of one message's region with its attribution (index `m`).
pub(crate) fn push_region(b: &mut Builder, full: &str, r: &Region, msg: &Message, m: i32, stops: &[String]) {
    let content = msg.content_str();
    let (cs, ce) = match (content.is_empty(), full[r.start..r.end].find(content)) {
        (false, Some(pos)) => (r.start + pos, r.start + pos + content.len()),
        _ => (r.end, r.end),
    };
    let (trained_from, trained_to) = if msg.role == Role::Assistant {
        let from = match &r.gen_prompt {
            Some(g) => r.start + common_prefix(g, &full[r.start..r.end]),
            None if cs < ce => cs,
            None => r.start,
        };
        // the model stops at its end-of-turn token: what the template writes after it is scaffold
        let search_from = if cs < ce && ce > from { ce } else { from };
        let to = stop_after(full, search_from, r.end, stops).unwrap_or(r.end);
        (from, to)
    } else {
        (r.end, r.end)
    };
    // cut the region at every boundary and push each piece with its attribution
    let mut cuts = vec![r.start, r.end, trained_from, trained_to, cs, ce];
    cuts.sort_unstable();
    cuts.dedup();
    for w in cuts.windows(2) {
        let (s, e) = (w[0], w[1]);
        let attr =
            Attr { message: m, content: s >= cs && e <= ce && cs < ce, train: s >= trained_from && e <= trained_to };
        b.push(&full[s..e], attr);
    }
}

/// Unstable templates: find each message's content in order; an assistant message's
/// content is trained together with what follows it up to its end-of-turn token.
fn search_attribution(b: &mut Builder, full: &str, messages: &[Message], stops: &[String]) {
    let mut found: Vec<(usize, usize, usize)> = Vec::new(); // (message, start, end)
    let mut cursor = 0;
    for (i, msg) in messages.iter().enumerate() {
        let content = msg.content_str();
        if content.is_empty() {
            continue;
        }
        if let Some(pos) = full[cursor..].find(content) {
            found.push((i, cursor + pos, cursor + pos + content.len()));
            cursor = cursor + pos + content.len();
        }
    }
    let mut cursor = 0;
    for (k, &(i, start, end)) in found.iter().enumerate() {
        b.push(&full[cursor..start], Attr::GLOBAL);
        let attr = Attr::content(i as i32);
        if messages[i].role == Role::Assistant {
            b.push(&full[start..end], attr.trained());
            let limit = found.get(k + 1).map_or(full.len(), |&(_, s, _)| s);
            match stop_after(full, end, limit, stops) {
                Some(stop_end) => {
                    b.push(&full[end..stop_end], Attr::scaffold(i as i32).trained());
                    cursor = stop_end;
                }
                None => cursor = end,
            }
        } else {
            b.push(&full[start..end], attr);
            cursor = end;
        }
    }
    b.push(&full[cursor..], Attr::GLOBAL);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_filter_blocks() {
        let (src, found) = compile_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}{% endif %}");
        assert!(found);
        assert_eq!(src, format!("a{{%- filter {GENERATION_FILTER} -%}}b{{% endfilter %}}c{{% if x %}}{{% endif %}}"));
        let (src, found) = compile_generation_tags("{{ 'generation' }}{% set generation = 1 %}");
        assert!(!found);
        assert_eq!(src, "{{ 'generation' }}{% set generation = 1 %}");
    }

    #[test]
    fn generation_mask_marks_overlapping_tokens() {
        let offsets = [(0, 2), (2, 4), (4, 6), (6, 8)];
        assert_eq!(generation_mask(&offsets, &[(3, 5)]), vec![0, 1, 1, 0]);
        assert_eq!(generation_mask(&offsets, &[(0, 2), (6, 8)]), vec![1, 0, 0, 1]);
        assert_eq!(generation_mask(&offsets, &[]), vec![0, 0, 0, 0]);
    }

    #[test]
    fn common_prefix_is_on_char_boundaries() {
        assert_eq!(common_prefix("<a>\n<think>\n", "<a>\nHello"), 4);
        assert_eq!(common_prefix("éa", "éb"), 2);
        assert_eq!(common_prefix("", "x"), 0);
    }
}
