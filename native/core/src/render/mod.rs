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
pub mod select;
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
            _ => {
                return Err(CoreError::UnknownFamily {
                    name: s.to_string(),
                    known: format!("auto, {}", Family::NAMES.join(", ")),
                })
            }
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

/// Which tokens of assistant turns the loss mask marks (generic renderer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaskConvention {
    /// `Generation` when the template has `{% generation %}` blocks, else `Sampled`.
    #[default]
    Auto,
    /// What the model generates: every assistant turn from the end of its generation
    /// prompt through its end-of-turn token; scaffold never.
    Sampled,
    /// transformers' `return_assistant_tokens_mask`: tokens overlapping a
    /// `{% generation %}` block (none when the template has no such block).
    Generation,
}

impl FromStr for MaskConvention {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<MaskConvention> {
        Ok(match s {
            "auto" => MaskConvention::Auto,
            "sampled" => MaskConvention::Sampled,
            "generation" => MaskConvention::Generation,
            _ => {
                return Err(CoreError::InvalidArgument(format!(
                    "loss_mask must be \"auto\", \"sampled\" or \"generation\", got {s:?}"
                )))
            }
        })
    }
}

/// Constructor options.
#[derive(Debug, Clone, Default)]
pub struct RendererConfig {
    /// A chat template's text, or the name of one of the model folder's templates
    /// (default: the folder's default template, found as transformers finds it).
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Use the named family port even for a template it is not proven equal to.
    pub force: bool,
    /// Generic renderer: the loss-mask convention.
    pub loss_mask: MaskConvention,
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
    /// Family ports: the model's own template, run by the generic renderer to prove a
    /// bridge the port's rules refuse (see [`Renderer::bridge`]).
    pub proof: Option<jinja::JinjaTemplate>,
    /// Why this renderer was chosen (one line, for startup logs).
    pub selection: String,
    /// [`select::fingerprint`] of the chat template, when there is one.
    pub template_sha256: Option<String>,
}

fn read_json(dir: Option<&Path>, name: &str) -> Option<Json> {
    let text = std::fs::read_to_string(dir?.join(name)).ok()?;
    Json::parse(&text).ok()
}

fn token_text(cfg: Option<&Json>, key: &str) -> Option<String> {
    match cfg?.get(key)? {
        Json::Str(s) => Some(s.clone()),
        obj @ Json::Object(_) => obj.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// The special tokens transformers passes to a template (`special_tokens_map`), in its order.
const SPECIAL_TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

impl Renderer {
    /// Build a renderer from a tokenizer.json (or the model folder holding one).
    /// `family` is a family name, "jinja" (the generic renderer) or "auto" (a family
    /// port when the model's template is one it is proven equal to, else generic).
    pub fn new(family: &str, tokenizer_path: &Path, config: RendererConfig) -> Result<Renderer> {
        let auto = family == "auto";
        let named: Option<Family> = if auto { None } else { Some(family.parse()?) };
        let tokenizer = Tokenizer::from_path(tokenizer_path)?;
        let dir = select::model_dir(tokenizer_path);
        let tok_cfg = read_json(dir.as_deref(), "tokenizer_config.json");
        let templates = match &dir {
            Some(d) => select::load_templates(d, tok_cfg.as_ref())?,
            None => select::Templates::default(),
        };
        let chosen = select::choose(&templates, config.chat_template.as_deref())?;
        let fp = chosen.as_ref().map(|(t, _)| select::fingerprint(t));
        let short = |fp: &str| fp[..16].to_string();
        let known = chosen.as_ref().and_then(|(t, _)| select::known(t));
        let where_ = dir.as_ref().map_or_else(|| tokenizer_path.display().to_string(), |d| d.display().to_string());
        let (family, variant, selection) = match (named, &chosen, known) {
            (None, None, _) => {
                return Err(CoreError::Template(format!(
                    "no chat template for {where_}: none given and none in chat_template.jinja, \
                     additional_chat_templates/ or tokenizer_config.json"
                )))
            }
            (None, Some((_, origin)), Some(k)) => {
                let why = format!(
                    "{} ({origin}, sha256 {}) is the {} the {:?} port is proven equal to (conformance target {})",
                    "the chat template",
                    short(k.sha256),
                    k.describes,
                    k.family.name(),
                    k.target
                );
                (k.family, k.variant, why)
            }
            (None, Some((_, origin)), None) | (Some(Family::Jinja), Some((_, origin)), _) => {
                let fp = fp.as_deref().expect("a template has a fingerprint");
                let why = if named.is_some() {
                    format!("generic renderer as named, on the chat template ({origin}, sha256 {})", short(fp))
                } else {
                    format!(
                        "the chat template ({origin}, sha256 {}) is not one a family port is proven equal to: \
                         generic renderer",
                        short(fp)
                    )
                };
                (Family::Jinja, select::Variant::Default, why)
            }
            (Some(Family::Jinja), None, _) => {
                return Err(CoreError::Template(format!(
                    "the generic renderer needs a chat template: none given and none in {where_} \
                     (chat_template.jinja, additional_chat_templates/ or tokenizer_config.json)"
                )))
            }
            (Some(f), None, _) => (
                f,
                select::Variant::Default,
                format!("the {:?} port as named ({where_} has no chat template to check it against)", f.name()),
            ),
            (Some(f), Some(_), Some(k)) if k.family == f => (
                f,
                k.variant,
                format!("the {:?} port as named; the template is the {} it is proven equal to", f.name(), k.describes),
            ),
            (Some(f), Some((_, origin)), _) => {
                let fp = fp.as_deref().expect("a template has a fingerprint");
                let actual = match known {
                    Some(k) => format!("it is the {} (port {:?})", k.describes, k.family.name()),
                    None => "no family port is proven equal to it".to_string(),
                };
                if !config.force {
                    return Err(CoreError::Template(format!(
                        "renderer {:?} does not match the model's chat template ({origin}, sha256 {}): {actual}; \
                         use renderer \"auto\" (or \"jinja\"), or force the port knowingly",
                        f.name(),
                        short(fp)
                    )));
                }
                (f, select::Variant::Default, format!(
                    "FORCED: the {:?} port on a chat template it is not proven equal to ({origin}, sha256 {}; {actual}) \
                     -- renders may differ from transformers",
                    f.name(),
                    short(fp)
                ))
            }
        };
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
            think_prefill: variant == select::Variant::ThinkPrefill,
            fixed_default_date: variant == select::Variant::FixedDate,
            jinja: None,
            proof: None,
            selection,
            template_sha256: fp,
        };
        if let Some((text, _)) = chosen {
            let special_map = read_json(dir.as_deref(), "special_tokens_map.json");
            let mut specials = Vec::new();
            for key in SPECIAL_TOKEN_KEYS {
                let given = match key {
                    "bos_token" => config.bos_token.clone(),
                    "eos_token" => config.eos_token.clone(),
                    _ => None,
                };
                if let Some(v) = given
                    .or_else(|| token_text(tok_cfg.as_ref(), key))
                    .or_else(|| token_text(special_map.as_ref(), key))
                {
                    specials.push((key.to_string(), v));
                }
            }
            let mut stops: Vec<String> =
                specials.iter().filter(|(k, _)| k == "eos_token").map(|(_, v)| v.clone()).collect();
            if let Some(gen) = read_json(dir.as_deref(), "generation_config.json") {
                let ids: Vec<i128> = match gen.get("eos_token_id") {
                    Some(Json::Int(i)) => vec![*i],
                    Some(Json::Array(a)) => {
                        a.iter().filter_map(|v| if let Json::Int(i) = v { Some(*i) } else { None }).collect()
                    }
                    _ => vec![],
                };
                for id in ids {
                    if let Some(t) = u32::try_from(id).ok().and_then(|i| renderer.tokenizer.id_to_token(i)) {
                        if !stops.contains(&t) {
                            stops.push(t);
                        }
                    }
                }
            }
            let tool_use = match (&config.chat_template, templates.get("tool_use")) {
                (None, Some(t)) if templates.get("default").is_some() => Some(t.to_string()),
                _ => None,
            };
            let template = jinja::JinjaTemplate::new(&text, tool_use.as_deref(), specials, stops, config.loss_mask)?;
            if family == Family::Jinja {
                renderer.jinja = Some(template);
            } else {
                renderer.proof = Some(template);
            }
        }
        Ok(renderer)
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
