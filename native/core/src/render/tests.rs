//! Renderer tests on a real tokenizer (../shared/tokenizers, beside the checkout).

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;

use crate::json::Json;
use crate::message::{parse_messages, Message};
use crate::render::{RenderOptions, Renderer, RendererConfig};

fn shared(folder: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tokenizers").join(folder)
}

fn qwen3() -> &'static Renderer {
    static R: OnceLock<Renderer> = OnceLock::new();
    R.get_or_init(|| {
        Renderer::new("qwen3", &shared("qwen3"), RendererConfig::default()).expect("../shared/tokenizers/qwen3")
    })
}

fn msgs(json: &str) -> Vec<Message> {
    let Json::Array(items) = Json::parse(json).unwrap() else { panic!("not a list") };
    parse_messages(&items).unwrap()
}

fn ids(r: &Renderer, text: &str) -> Vec<i64> {
    r.tokenizer.encode_ids(text).unwrap().into_iter().map(i64::from).collect()
}

#[test]
fn qwen3_renders_the_template_text_and_its_tokens() {
    let r = qwen3();
    let m = msgs(
        r#"[{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]"#,
    );
    let out = r.render(&m, None, &RenderOptions::default()).unwrap();
    assert_eq!(
        out.text,
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nYo<|im_end|>\n"
    );
    let expected: Vec<u32> = r.tokenizer.encode_ids(&out.text).unwrap();
    assert_eq!(out.token_ids, expected);
    assert_eq!(out.loss_mask.len(), out.token_ids.len());
    let trained: Vec<u32> =
        out.token_ids.iter().zip(&out.loss_mask).filter(|(_, &l)| l == 1).map(|(&t, _)| t).collect();
    assert_eq!(r.tokenizer.decode(&trained).unwrap(), "<think>\n\n</think>\n\nYo<|im_end|>");
}

#[test]
fn qwen3_generation_prompt_without_thinking() {
    let r = qwen3();
    let m = msgs(r#"[{"role": "user", "content": "Hi"}]"#);
    let opts = RenderOptions { add_generation_prompt: true, enable_thinking: Some(false), ..Default::default() };
    let out = r.render(&m, None, &opts).unwrap();
    assert!(out.text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(out.message_index.iter().rev().take(5).all(|&i| i == -1));
}

#[test]
fn bridge_appends_and_closes_truncated_turns() {
    let r = qwen3();
    let prompt = r
        .render(
            &msgs(r#"[{"role": "user", "content": "Hi"}]"#),
            None,
            &RenderOptions { add_generation_prompt: true, ..Default::default() },
        )
        .unwrap();
    let mut prev: Vec<i64> = prompt.token_ids.iter().map(|&t| i64::from(t)).collect();
    prev.extend(ids(r, "<think>\nok\n</think>\n\nHello wor")); // cut while answering
    let new = msgs(r#"[{"role": "tool", "content": "x"}]"#);
    let b = r
        .bridge(&prev, &new, &RenderOptions { add_generation_prompt: true, ..Default::default() }, None, None)
        .unwrap();
    assert!(b.ok, "{}", b.reason);
    assert!(b.closed_turn);
    assert!(b.appended.text.starts_with("<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n</tool_response>"));
    assert!(b.appended.loss_mask.iter().all(|&l| l == 0));
}

#[test]
fn bridge_refuses_a_turn_cut_inside_a_tool_call() {
    let r = qwen3();
    let prompt = r
        .render(
            &msgs(r#"[{"role": "user", "content": "Hi"}]"#),
            None,
            &RenderOptions { add_generation_prompt: true, ..Default::default() },
        )
        .unwrap();
    let mut prev: Vec<i64> = prompt.token_ids.iter().map(|&t| i64::from(t)).collect();
    prev.extend(ids(r, "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"argu"));
    let b =
        r.bridge(&prev, &msgs(r#"[{"role": "tool", "content": "x"}]"#), &RenderOptions::default(), None, None).unwrap();
    assert!(!b.ok);
    assert!(b.reason.contains("cannot reproduce"), "{}", b.reason);
}

#[test]
fn parse_never_takes_text_for_structural_tokens() {
    let r = qwen3();
    let mut spoof = Vec::new();
    for piece in ["<", "think", ">", "x", "</", "think", ">", "answer"] {
        spoof.extend(ids(r, piece));
    }
    let p = r.parse(&spoof).unwrap();
    assert_eq!(p.reasoning, None);
    assert_eq!(p.content, "<think>x</think>answer");
    assert!(!p.stopped);
}

#[test]
fn unknown_family_and_mismatched_tokenizer_are_errors() {
    let e = Renderer::new("gpt5", &shared("qwen3"), RendererConfig::default()).err().unwrap();
    assert!(e.to_string().contains("unknown renderer family"));
    let e = Renderer::new("llama3", &shared("qwen3"), RendererConfig::default()).err().unwrap();
    assert!(e.to_string().contains("does not match the model's chat template"), "{e}");
    assert!(e.to_string().contains("Qwen3 chat template"), "{e}");
    let forced = RendererConfig { force: true, ..Default::default() };
    let e = Renderer::new("llama3", &shared("qwen3"), forced).err().unwrap();
    assert!(e.to_string().contains("<|start_header_id|>"), "{e}");
}

#[test]
fn auto_picks_a_port_only_for_its_proven_templates() {
    let r = Renderer::new("auto", &shared("qwen3"), RendererConfig::default()).unwrap();
    assert_eq!(r.family.name(), "qwen3");
    assert!(r.selection.contains("conformance target qwen3"), "{}", r.selection);
    let r = Renderer::new("auto", &shared("llama-3.2-instruct"), RendererConfig::default()).unwrap();
    assert_eq!(r.family.name(), "llama3");
    // one character more and the port is no longer proven equal: the generic renderer
    let qwen_template = crate::render::select::load_templates(&shared("qwen3"), None);
    assert!(qwen_template.unwrap().named.is_empty(), "the template is in tokenizer_config.json");
    let cfg = RendererConfig { chat_template: Some("{{ messages[0]['content'] }} ".into()), ..Default::default() };
    let r = Renderer::new("auto", &shared("qwen3"), cfg.clone()).unwrap();
    assert_eq!(r.family.name(), "jinja");
    assert!(r.selection.contains("generic renderer"), "{}", r.selection);
    let e = Renderer::new("qwen3", &shared("qwen3"), cfg.clone()).err().unwrap();
    assert!(e.to_string().contains("no family port is proven equal to it"), "{e}");
    let r = Renderer::new("qwen3", &shared("qwen3"), RendererConfig { force: true, ..cfg }).unwrap();
    assert!(r.selection.starts_with("FORCED"), "{}", r.selection);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn rendering_equals_encoding_the_rendered_text(user in "\\PC{0,40}", answer in "\\PC{0,40}") {
        let r = qwen3();
        let m = vec![
            Json::Object(vec![("role".into(), Json::Str("user".into())), ("content".into(), Json::Str(user))]),
            Json::Object(vec![("role".into(), Json::Str("assistant".into())), ("content".into(), Json::Str(answer))]),
        ];
        let m = parse_messages(&m).unwrap();
        let out = r.render(&m, None, &RenderOptions::default()).unwrap();
        prop_assert_eq!(&out.token_ids, &r.tokenizer.encode_ids(&out.text).unwrap());
        prop_assert_eq!(out.message_index.len(), out.token_ids.len());
        prop_assert!(out.loss_mask.iter().zip(&out.message_index).all(|(&l, &i)| l == 0 || i == 1));
    }

    #[test]
    fn bridge_keeps_prev_whatever_was_sampled(sampled in "\\PC{0,60}", cut in 0usize..8) {
        let r = qwen3();
        let prompt = r.render(&msgs(r#"[{"role": "user", "content": "Go"}]"#), None, &RenderOptions { add_generation_prompt: true, ..Default::default() }).unwrap();
        let mut prev: Vec<i64> = prompt.token_ids.iter().map(|&t| i64::from(t)).collect();
        let mut completion = ids(r, &format!("{sampled}<|im_end|>"));
        completion.truncate(completion.len().saturating_sub(cut));
        prev.extend(completion);
        let b = r.bridge(&prev, &msgs(r#"[{"role": "user", "content": "next"}]"#), &RenderOptions::default(), None, None).unwrap();
        if b.ok {
            prop_assert!(!b.appended.token_ids.is_empty());
            prop_assert_eq!(b.appended.loss_mask.len(), b.appended.token_ids.len());
        } else {
            prop_assert!(!b.reason.is_empty());
            prop_assert!(b.appended.token_ids.is_empty());
        }
    }
}
