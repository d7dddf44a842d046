//! Chat rendering: conversations to token ids exactly as each family's chat template +
//! tokenizer does, with per-token attribution; append-only extension (`bridge`) and
//! parsing of sampled completions.
//!
//! One constructor keyed by a validated family name ([`Family`]); each family is a port
//! of its official Jinja template in its own module, checked token-for-token against
//! Hugging Face by the conformance suite. The `jinja` family renders any HF
//! `chat_template` with minijinja and reports whether it is prefix-stable.

pub mod bridge;
pub mod builder;
pub mod deepseek;
#[cfg(test)]
mod fuzz_tests;
pub mod jinja;
pub mod llama3;
pub mod parse;
pub mod qwen;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::str::FromStr;

use crate::json::Json;
use crate::message::Message;
use crate::tokenizer::Tokenizer;
use crate::{CoreError, Result};
pub use builder::{Builder, Rendered};

/// The renderer families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3,
    Qwen25,
    Llama3,
    DeepSeekR1,
    Jinja,
}

impl Family {
    pub const NAMES: [&'static str; 5] = ["qwen3", "qwen2.5", "llama3", "deepseek-r1", "jinja"];

    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Qwen25 => "qwen2.5",
            Family::Llama3 => "llama3",
            Family::DeepSeekR1 => "deepseek-r1",
            Family::Jinja => "jinja",
        }
    }

    /// Tokens the family's template writes; the tokenizer must know each as one token.
    pub fn required_tokens(self) -> &'static [&'static str] {
        match self {
            Family::Qwen3 => &[
                "<|im_start|>",
                "<|im_end|>",
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                "<tool_response>",
                "</tool_response>",
            ],
            Family::Qwen25 => &["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
            Family::Llama3 => {
                &["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
            }
            Family::DeepSeekR1 => &[
                "<｜begin▁of▁sentence｜>",
                "<｜end▁of▁sentence｜>",
                "<｜User｜>",
                "<｜Assistant｜>",
                "<think>",
                "</think>",
            ],
            Family::Jinja => &[],
        }
    }
}

impl FromStr for Family {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Family> {
        Ok(match s {
            "qwen3" => Family::Qwen3,
            "qwen2.5" => Family::Qwen25,
            "llama3" => Family::Llama3,
            "deepseek-r1" => Family::DeepSeekR1,
            "jinja" => Family::Jinja,
            _ => return Err(CoreError::UnknownFamily { name: s.to_string(), known: Family::NAMES.join(", ") }),
        })
    }
}

/// Per-call options (template variables).
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    /// Qwen3: `enable_thinking` (None = template default, thinking on).
    pub enable_thinking: Option<bool>,
    /// Llama 3: the "Today Date" line (None = today, as the template's strftime_now).
    pub date_string: Option<String>,
    /// Llama 3: tools in the first user message (default) or in the system prompt.
    pub tools_in_user_message: Option<bool>,
    /// Any other template variables (transformers passes `**kwargs` through to the
    /// template); generic renderer only.
    pub template_kwargs: Vec<(String, Json)>,
}

impl RenderOptions {
    /// Every template variable of these options, in the order transformers would pass them.
    pub fn kwargs(&self) -> Vec<(String, Json)> {
        let mut out = Vec::new();
        if let Some(t) = self.enable_thinking {
            out.push(("enable_thinking".to_string(), Json::Bool(t)));
        }
        if let Some(d) = &self.date_string {
            out.push(("date_string".to_string(), Json::Str(d.clone())));
        }
        if let Some(t) = self.tools_in_user_message {
            out.push(("tools_in_user_message".to_string(), Json::Bool(t)));
        }
        out.extend(self.template_kwargs.iter().cloned());
        out
    }
}

/// Constructor options.
#[derive(Debug, Clone, Default)]
pub struct RendererConfig {
    /// For `jinja`: the template (default: tokenizer_config.json's). For other families:
    /// selects a known variant of the family's template.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// Ids of the family's structural tokens.
#[derive(Debug, Clone, Default)]
pub struct Specials {
    ids: Vec<(String, u32)>,
}

impl Specials {
    pub fn id(&self, token: &str) -> u32 {
        self.ids
            .iter()
            .find(|(t, _)| t == token)
            .map(|&(_, id)| id)
            .expect("required tokens are checked at construction")
    }
}

pub struct Renderer {
    pub family: Family,
    pub tokenizer: Tokenizer,
    pub specials: Specials,
    /// DeepSeek-R1 think-prefill variant: generation prompt ends with `<think>\n`.
    pub think_prefill: bool,
    /// Llama 3.1 variant: default date "26 Jul 2024" instead of today.
    pub fixed_default_date: bool,
    pub jinja: Option<jinja::JinjaTemplate>,
}

fn read_tokenizer_config(path: &Path) -> Option<Json> {
    let dir = if path.is_dir() { path.to_path_buf() } else { path.parent()?.to_path_buf() };
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    Json::parse(&text).ok()
}

fn token_text(cfg: Option<&Json>, key: &str) -> Option<String> {
    match cfg?.get(key)? {
        Json::Str(s) => Some(s.clone()),
        obj @ Json::Object(_) => obj.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

impl Renderer {
    /// Build a renderer for `family` from a tokenizer.json (or a folder holding one).
    pub fn new(family: &str, tokenizer_path: &Path, config: RendererConfig) -> Result<Renderer> {
        let family: Family = family.parse()?;
        let tokenizer = Tokenizer::from_path(tokenizer_path)?;
        let tok_cfg = read_tokenizer_config(tokenizer_path);
        Renderer::with_tokenizer(family, tokenizer, config, tok_cfg.as_ref())
    }

    pub fn with_tokenizer(
        family: Family,
        tokenizer: Tokenizer,
        config: RendererConfig,
        tok_cfg: Option<&Json>,
    ) -> Result<Renderer> {
        let mut missing = Vec::new();
        let mut ids = Vec::new();
        for &t in family.required_tokens() {
            match tokenizer.token_id(t) {
                Some(id) => ids.push((t.to_string(), id)),
                None => missing.push(t),
            }
        }
        if !missing.is_empty() {
            return Err(CoreError::TokenizerMismatch { family: family.name().into(), missing: missing.join(", ") });
        }
        let mut renderer = Renderer {
            family,
            tokenizer,
            specials: Specials { ids },
            think_prefill: false,
            fixed_default_date: false,
            jinja: None,
        };
        let template = config.chat_template.clone();
        match family {
            Family::Jinja => {
                let text = template
                    .or_else(|| tok_cfg.and_then(|c| c.get("chat_template")).and_then(Json::as_str).map(str::to_string))
                    .ok_or_else(|| {
                        CoreError::Template(
                            "the jinja family needs chat_template (none given and no tokenizer_config.json with one)"
                                .into(),
                        )
                    })?;
                let bos = config.bos_token.or_else(|| token_text(tok_cfg, "bos_token")).unwrap_or_default();
                let eos = config.eos_token.or_else(|| token_text(tok_cfg, "eos_token")).unwrap_or_default();
                renderer.jinja = Some(jinja::JinjaTemplate::new(&text, bos, eos)?);
            }
            _ => {
                if let Some(t) = template {
                    renderer.select_variant(&t)?;
                }
            }
        }
        Ok(renderer)
    }

    /// Pick the family variant a given chat template corresponds to.
    fn select_variant(&mut self, template: &str) -> Result<()> {
        let known = match self.family {
            Family::DeepSeekR1 => {
                self.think_prefill = template.contains("{{'<｜Assistant｜><think>\\n'}}");
                template.contains("<｜tool▁calls▁begin｜>")
            }
            Family::Llama3 => {
                self.fixed_default_date = !template.contains("strftime_now");
                template.contains("<|start_header_id|>") && template.contains("Cutting Knowledge Date")
            }
            Family::Qwen3 => {
                template.contains("<tool_response>")
                    && template.contains("enable_thinking")
                    && template.contains("reasoning_content")
            }
            Family::Qwen25 => template.contains("You are Qwen, created by Alibaba Cloud."),
            Family::Jinja => true,
        };
        if known {
            Ok(())
        } else {
            Err(CoreError::Template(format!(
                "this chat_template is not a known variant of family {:?}; render it with family \"jinja\"",
                self.family.name()
            )))
        }
    }

    /// Render a conversation.
    pub fn render(&self, messages: &[Message], tools: Option<&[Json]>, opts: &RenderOptions) -> Result<Rendered> {
        let mut b = Builder::new();
        match self.family {
            Family::Qwen3 => qwen::render(&mut b, qwen::Version::Qwen3, messages, tools.unwrap_or(&[]), opts)?,
            Family::Qwen25 => qwen::render(&mut b, qwen::Version::Qwen25, messages, tools.unwrap_or(&[]), opts)?,
            Family::Llama3 => {
                let mut opts = opts.clone();
                if opts.date_string.is_none() && self.fixed_default_date {
                    opts.date_string = Some("26 Jul 2024".into());
                }
                llama3::render(&mut b, messages, tools, &opts)?
            }
            Family::DeepSeekR1 => {
                deepseek::render(&mut b, messages, opts, self.think_prefill)?;
            }
            Family::Jinja => {
                let jinja = self.jinja.as_ref().expect("jinja family has a template");
                return jinja.render(&self.tokenizer, messages, tools, opts).map(|(r, _)| r);
            }
        }
        b.encode(&self.tokenizer)
    }

    /// Whether the generic renderer found the conversation prefix-stable (None for the
    /// native families, which know their template's rules).
    pub fn render_checked(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
    ) -> Result<(Rendered, Option<bool>)> {
        match &self.jinja {
            Some(j) => j.render(&self.tokenizer, messages, tools, opts).map(|(r, s)| (r, Some(s))),
            None => self.render(messages, tools, opts).map(|r| (r, None)),
        }
    }
}
