//! Which renderer a model's chat template gets, decided so that it cannot be silently wrong.
//!
//! A family port (`qwen3`, `llama3`, ...) is used only for a template it is proven equal
//! to: the registry below lists the fingerprint of every template the conformance suite
//! checks a port against token for token (`tests/native/conformance/targets.py`; a test
//! keeps the two lists equal). Any other template goes to the generic renderer. Naming a
//! family whose port does not match the model's template is an error unless forced.
//!
//! This module also finds a model folder's chat templates the way transformers does:
//! `chat_template.jinja` and `additional_chat_templates/*.jinja` when present, otherwise
//! `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates).
//! It does not render anything.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::json::Json;
use crate::render::Family;
use crate::{CoreError, Result};

/// A template some family port is proven equal to.
#[derive(Debug, Clone, Copy)]
pub struct KnownTemplate {
    /// [`fingerprint`] of the template.
    pub sha256: &'static str,
    pub family: Family,
    /// The port's variant for it.
    pub variant: Variant,
    /// The conformance target that checks it.
    pub target: &'static str,
    pub describes: &'static str,
}

/// Variants of a family port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    Default,
    /// DeepSeek-R1: the generation prompt ends with `<think>\n`.
    ThinkPrefill,
    /// Llama 3.1: the default date is "26 Jul 2024" rather than today.
    FixedDate,
}

/// Every template a family port renders (keep in step with the conformance targets).
pub const REGISTRY: &[KnownTemplate] = &[
    KnownTemplate {
        sha256: "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
        family: Family::Qwen3,
        variant: Variant::Default,
        target: "qwen3",
        describes: "Qwen3 chat template",
    },
    KnownTemplate {
        sha256: "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
        family: Family::Qwen3,
        variant: Variant::Default,
        target: "qwen3-pkg",
        describes: "older Qwen3 chat template",
    },
    KnownTemplate {
        sha256: "55b2f4a26ac9ee719330a61a0c39d9e538b0e9322212f048326318cff4f8674a",
        family: Family::Qwen25,
        variant: Variant::Default,
        target: "qwen2.5",
        describes: "Qwen2.5 Instruct chat template",
    },
    KnownTemplate {
        sha256: "d82792f95932f1c9cef5c4bd992f171225e3bf8c7b609b4557c9e1ec96be819f",
        family: Family::Llama3,
        variant: Variant::Default,
        target: "llama3",
        describes: "Llama 3.2 Instruct chat template",
    },
    KnownTemplate {
        sha256: "93c0e9aa3629bbd77e68dbc0f5621f6e6b23aa8d74b932595cdb8d64684526d7",
        family: Family::Llama3,
        variant: Variant::FixedDate,
        target: "llama3.1",
        describes: "Llama 3.1 Instruct chat template",
    },
    KnownTemplate {
        sha256: "b6835114b7303ddd78919a82e4d9f7d8c26ed0d7dfc36beeb12d524f6144eab1",
        family: Family::DeepSeekR1,
        variant: Variant::Default,
        target: "deepseek-r1",
        describes: "DeepSeek-R1 (distill) chat template",
    },
    KnownTemplate {
        sha256: "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f",
        family: Family::DeepSeekR1,
        variant: Variant::ThinkPrefill,
        target: "deepseek-r1-think",
        describes: "DeepSeek-R1 chat template with the <think> prefill",
    },
];

/// sha256 (hex) of a template, normalized only where Jinja itself does not tell the
/// difference: line endings (Jinja turns `\r\n` and `\r` into `\n`) and one trailing
/// newline (dropped by Jinja's `keep_trailing_newline=False`).
pub fn fingerprint(template: &str) -> String {
    let text = template.replace("\r\n", "\n").replace('\r', "\n");
    let text = text.strip_suffix('\n').unwrap_or(&text);
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The registry entry of a template, if a port is proven equal to it.
pub fn known(template: &str) -> Option<&'static KnownTemplate> {
    let fp = fingerprint(template);
    REGISTRY.iter().find(|k| k.sha256 == fp)
}

/// The chat templates of a model folder.
#[derive(Debug, Clone, Default)]
pub struct Templates {
    /// `(name, text)`; a single template is named "default".
    pub named: Vec<(String, String)>,
    /// Where they came from, for messages.
    pub origin: String,
}

impl Templates {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.named.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_str())
    }

    pub fn names(&self) -> Vec<&str> {
        self.named.iter().map(|(n, _)| n.as_str()).collect()
    }
}

/// The folder a tokenizer path belongs to (the path itself when it is a folder).
pub fn model_dir(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        Some(path.to_path_buf())
    } else {
        path.parent().map(Path::to_path_buf)
    }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| CoreError::Template(format!("cannot read {}: {e}", path.display())))
}

/// A folder's chat templates, found as transformers finds them.
pub fn load_templates(dir: &Path, tok_cfg: Option<&Json>) -> Result<Templates> {
    let mut named = Vec::new();
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        named.push(("default".to_string(), read(&file)?));
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&extra)
            .map_err(|e| CoreError::Template(format!("cannot list {}: {e}", extra.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .collect();
        files.sort();
        for f in files {
            let name = f.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            named.push((name, read(&f)?));
        }
    }
    if !named.is_empty() {
        let origin = if file.is_file() { "chat_template.jinja" } else { "additional_chat_templates/" };
        return Ok(Templates { named, origin: origin.into() });
    }
    match tok_cfg.and_then(|c| c.get("chat_template")) {
        None | Some(Json::Null) => Ok(Templates::default()),
        Some(Json::Str(s)) => {
            Ok(Templates { named: vec![("default".into(), s.clone())], origin: "tokenizer_config.json".into() })
        }
        Some(Json::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                match (item.get("name").and_then(Json::as_str), item.get("template").and_then(Json::as_str)) {
                    (Some(n), Some(t)) => named.push((n.to_string(), t.to_string())),
                    _ => {
                        return Err(CoreError::Template(format!(
                            "tokenizer_config.json: chat_template[{i}] must be {{\"name\": str, \"template\": str}}"
                        )))
                    }
                }
            }
            Ok(Templates { named, origin: "tokenizer_config.json (named templates)".into() })
        }
        Some(_) => Err(CoreError::Template(
            "tokenizer_config.json: chat_template must be a string or a list of named templates".into(),
        )),
    }
}

/// The template to render with: `requested` is a template's text, the name of one of
/// the folder's templates, or None for the folder's default. Returns `(text, origin)`;
/// None when there is no template at all.
pub fn choose(templates: &Templates, requested: Option<&str>) -> Result<Option<(String, String)>> {
    if let Some(r) = requested {
        if let Some(t) = templates.get(r) {
            return Ok(Some((t.to_string(), format!("{} [{r}]", templates.origin))));
        }
        return Ok(Some((r.to_string(), "chat_template argument".into())));
    }
    if templates.named.is_empty() {
        return Ok(None);
    }
    if let Some(t) = templates.get("default") {
        let origin = if templates.named.len() == 1 {
            templates.origin.clone()
        } else {
            format!("{} [default]", templates.origin)
        };
        return Ok(Some((t.to_string(), origin)));
    }
    Err(CoreError::Template(format!(
        "the model has several chat templates and none named \"default\" ({}): pass chat_template=<name>",
        templates.names().join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_ignores_what_jinja_ignores() {
        let a = fingerprint("{{ x }}\r\n{{ y }}\n");
        assert_eq!(a, fingerprint("{{ x }}\n{{ y }}"));
        assert_ne!(a, fingerprint("{{ x }}\n{{ y }}\n\n"));
        assert_ne!(a, fingerprint("{{ x }} \n{{ y }}"));
    }

    #[test]
    fn registry_fingerprints_are_unique() {
        for (i, a) in REGISTRY.iter().enumerate() {
            for b in &REGISTRY[i + 1..] {
                assert_ne!(a.sha256, b.sha256);
            }
        }
    }
}
