//! Fuzz tests of the core (proptest, bounded case counts): arbitrary JSON text, arbitrary
//! values as messages, and render / bridge / parse of arbitrary input with real
//! tokenizers (../shared/tokenizers, beside the checkout). The property everywhere: a
//! result whose arrays are aligned, or a typed error that names a message inside the
//! input, never a panic; and values nested as deep as [`MAX_DEPTH`] go through every
//! family on a thread with a rayon worker's 2 MiB stack.

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;

use crate::json::{dumps, Json, MAX_DEPTH};
use crate::message::{parse_messages, parse_tools, Message};
use crate::render::{Family, RenderOptions, Rendered, Renderer, RendererConfig};
use crate::CoreError;

const CASES: u32 = 64;

fn shared(folder: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tokenizers").join(folder)
}

/// Every family on its own tokenizer, and the generic renderer on Qwen3's template.
fn renderers() -> &'static [Renderer] {
    static R: OnceLock<Vec<Renderer>> = OnceLock::new();
    R.get_or_init(|| {
        [
            ("qwen3", "qwen3"),
            ("qwen2.5", "qwen2.5-instruct"),
            ("llama3", "llama-3.2-instruct"),
            ("deepseek-r1", "deepseek-r1-distill-qwen"),
            ("jinja", "qwen3"),
        ]
        .iter()
        .map(|(family, folder)| {
            Renderer::new(family, &shared(folder), RendererConfig::default())
                .unwrap_or_else(|e| panic!("{family} on ../shared/tokenizers/{folder}: {e}"))
        })
        .collect()
    })
}

fn obj(items: &[(&str, Json)]) -> Json {
    Json::Object(items.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
}

fn s(text: &str) -> Json {
    Json::Str(text.to_string())
}

/// `[[[...null...]]]`, `depth` lists deep.
fn nested(depth: usize) -> Json {
    (0..depth).fold(Json::Null, |v, _| Json::Array(vec![v]))
}

// --- strategies -------------------------------------------------------------------------

/// Text with the characters chat templates and parsers care about.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "\\PC{0,16}",
        2 => prop::sample::select(vec![
            "", " ", "\n", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<|eot_id|>", "<|python_tag|>", "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "{", "}", "\"",
            "{\"name\": \"f\", \"arguments\": {}}", "{{ x }}", "{% if %}", "\u{0}", "\u{feff}", "é", "🦀",
        ])
        .prop_map(str::to_string),
        1 => prop::collection::vec(prop::sample::select(vec!["<think>", "a", "\n", "</think>", "{", "\"", "]"]), 0..8)
            .prop_map(|parts| parts.concat()),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "role", "content", "tool_calls", "function", "name", "arguments", "parameters", "reasoning_content",
            "thinking", "reasoning", "tool_call_id", "type", "id", "properties", "description", "",
        ])
        .prop_map(str::to_string),
        1 => "\\PC{0,6}",
    ]
}

fn leaf() -> impl Strategy<Value = Json> {
    prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i64>().prop_map(|i| Json::Int(i.into())),
        any::<i128>().prop_map(Json::Int),
        any::<f64>().prop_map(Json::Float),
        text().prop_map(Json::Str),
    ]
}

/// Any JSON value, a few levels deep.
fn value() -> BoxedStrategy<Json> {
    leaf()
        .prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
                prop::collection::vec((key(), inner), 0..4).prop_map(Json::Object),
            ]
        })
        .boxed()
}

fn arguments() -> impl Strategy<Value = Json> {
    prop_oneof![
        Just(obj(&[("city", s("Paris"))])),
        Just(s("{\"city\": \"Paris\"}")),
        Just(s("{oops")),
        Just(s("[1, 2]")),
        text().prop_map(Json::Str),
        value(),
    ]
}

fn tool_call() -> impl Strategy<Value = Json> {
    prop_oneof![
        4 => (prop_oneof![Just(s("get_weather")), text().prop_map(Json::Str)], arguments()).prop_map(|(name, args)| {
            obj(&[("type", s("function")), ("function", obj(&[("name", name), ("arguments", args)]))])
        }),
        1 => (text(), arguments()).prop_map(|(name, args)| obj(&[("name", s(&name)), ("arguments", args)])),
        1 => value(),
    ]
}

/// A message: mostly well-formed (so that rendering gets past validation), sometimes not.
fn message() -> impl Strategy<Value = Json> {
    let role = prop_oneof![
        8 => prop::sample::select(vec!["system", "user", "assistant", "tool", "ipython"]).prop_map(s),
        1 => prop::sample::select(vec!["bogus", "", "USER", "developer"]).prop_map(s),
        1 => value(),
    ];
    let content = prop_oneof![6 => text().prop_map(Json::Str), 1 => Just(Json::Null), 1 => value()];
    let optional = |v: BoxedStrategy<Json>| prop::option::weighted(0.2, v);
    (
        prop::option::weighted(0.97, role),
        prop::option::weighted(0.9, content),
        optional(text().prop_map(Json::Str).boxed()),
        prop::option::weighted(0.25, prop::collection::vec(tool_call(), 0..3).prop_map(Json::Array)),
        optional(text().prop_map(Json::Str).boxed()),
        optional(value()),
    )
        .prop_map(|(role, content, reasoning, calls, call_id, extra)| {
            let mut items = Vec::new();
            let mut add = |k: &str, v: Option<Json>| {
                if let Some(v) = v {
                    items.push((k.to_string(), v));
                }
            };
            add("role", role);
            add("content", content);
            add("reasoning_content", reasoning);
            add("tool_calls", calls);
            add("tool_call_id", call_id);
            add("extra", extra);
            Json::Object(items)
        })
}

fn tools() -> impl Strategy<Value = Option<Vec<Json>>> {
    let schema = prop_oneof![
        3 => (text(), value()).prop_map(|(name, params)| {
            obj(&[("type", s("function")), ("function", obj(&[("name", s(&name)), ("parameters", params)]))])
        }),
        1 => value(),
    ];
    prop::option::weighted(0.3, prop::collection::vec(schema, 0..3))
}

fn options() -> impl Strategy<Value = RenderOptions> {
    (any::<bool>(), any::<Option<bool>>(), any::<Option<bool>>()).prop_map(|(gen, thinking, in_user)| RenderOptions {
        add_generation_prompt: gen,
        enable_thinking: thinking,
        date_string: Some("26 Jul 2024".into()),
        tools_in_user_message: in_user,
        ..Default::default()
    })
}

/// Token ids: structural tokens of every family, ordinary ids, and ids outside the
/// vocabulary (the renderer's own vocabulary size is added later).
fn ids() -> impl Strategy<Value = Vec<i64>> {
    let id = prop_oneof![
        6 => 0i64..128_000,
        3 => (0i64..100).prop_map(|k| -1_000_000 - k), // a structural token, resolved per renderer
        1 => prop_oneof![Just(-1i64), Just(i64::MIN), Just(i64::MAX), Just(1 << 40), Just(151_669), Just(128_256)],
    ];
    prop::collection::vec(id, 0..40)
}

/// Map the placeholder ids of [`ids`] to the renderer's structural tokens.
fn resolve(r: &Renderer, ids: &[i64]) -> Vec<i64> {
    let specials: Vec<i64> = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<｜Assistant｜>",
        "<｜User｜>",
        "<｜end▁of▁sentence｜>",
    ]
    .iter()
    .filter_map(|t| r.tokenizer.token_id(t))
    .map(i64::from)
    .collect();
    ids.iter()
        .map(|&id| match id {
            -1_000_099..=-1_000_000 if !specials.is_empty() => specials[(-id - 1_000_000) as usize % specials.len()],
            _ => id,
        })
        .collect()
}

fn in_vocab(r: &Renderer, ids: &[i64]) -> bool {
    ids.iter().all(|&id| id >= 0 && (id as u64) < r.tokenizer.vocab_size as u64)
}

// --- properties -----------------------------------------------------------------------------

fn check_rendered(r: &Renderer, out: &Rendered, num_messages: usize) -> std::result::Result<(), TestCaseError> {
    let n = out.token_ids.len();
    prop_assert_eq!(out.message_index.len(), n);
    prop_assert_eq!(out.loss_mask.len(), n);
    prop_assert_eq!(out.is_content.len(), n);
    prop_assert!(out.message_index.iter().all(|&m| m >= -1 && (m as i64) < num_messages as i64));
    prop_assert!(out.loss_mask.iter().chain(&out.is_content).all(|&b| b <= 1));
    prop_assert!(out.token_ids.iter().all(|&t| (t as usize) < r.tokenizer.vocab_size));
    // ids are the template text tokenized as a whole (what HF does), never something else
    prop_assert_eq!(&out.token_ids, &r.tokenizer.encode_ids(&out.text).unwrap());
    Ok(())
}

/// An error about the input names a message inside it.
fn check_error(e: &CoreError, num_messages: usize) -> std::result::Result<(), TestCaseError> {
    match e {
        CoreError::InvalidMessage { index, .. } => prop_assert!(*index < num_messages, "{e}"),
        CoreError::InvalidToolCall { message, .. } => prop_assert!(*message < num_messages, "{e}"),
        CoreError::Template(_) | CoreError::InvalidArgument(_) => {}
        other => prop_assert!(false, "unexpected error kind: {other}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES * 4, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn json_parse_of_any_text_is_a_value_or_an_error(t in prop_oneof![
        "\\PC{0,64}",
        prop::collection::vec(prop::sample::select(vec!["[", "]", "{", "}", "\"", "\\", ":", ",", "1", "-1e400", "\"a\"", "null", " "]), 0..200)
            .prop_map(|p| p.concat()),
    ]) {
        if let Ok(v) = Json::parse(&t) {
            prop_assert!(v.depth() <= MAX_DEPTH);
            let text = dumps(&v, Some(2));
            if !text.contains("NaN") && !text.contains("Infinity") {
                prop_assert_eq!(Json::parse(&text).map(|w| w.depth()), Ok(v.depth()));
            }
        }
    }

    #[test]
    fn json_parse_refuses_deep_text(depth in (MAX_DEPTH + 1)..200_000usize, open in prop::sample::select(vec!["[", "{\"a\": ", "[{\"a\": "])) {
        let t = open.repeat(depth);
        let e = Json::parse(&t).unwrap_err();
        prop_assert!(e.contains("nested deeper than"), "{}", e);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES * 4, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn parse_messages_of_any_values(values in prop::collection::vec(prop_oneof![3 => message(), 1 => value()], 0..5)) {
        match parse_messages(&values) {
            Ok(m) => prop_assert_eq!(m.len(), values.len()),
            Err(e) => check_error(&e, values.len())?,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn render_any_conversation(which in 0usize..5, values in prop::collection::vec(message(), 0..5), tools in tools(), opts in options()) {
        let r = &renderers()[which];
        let Ok(messages) = parse_messages(&values) else { return Ok(()) };
        let Ok(tools) = tools.map(|t| parse_tools(&t)).transpose() else { return Ok(()) };
        match r.render_checked(&messages, tools.as_deref(), &opts) {
            Ok((out, stable)) => {
                check_rendered(r, &out, messages.len())?;
                prop_assert_eq!(stable.is_some(), r.family == Family::Jinja);
            }
            Err(e) => check_error(&e, messages.len())?,
        }
    }

    #[test]
    fn parse_any_ids(which in 0usize..5, ids in ids()) {
        let r = &renderers()[which];
        let ids = resolve(r, &ids);
        match r.parse(&ids) {
            Ok(p) => {
                prop_assert!(in_vocab(r, &ids));
                prop_assert!(p.num_tokens <= ids.len());
                prop_assert!(p.stopped || p.num_tokens == ids.len());
                for call in &p.tool_calls {
                    if call.status == crate::render::parse::CallStatus::Ok {
                        prop_assert!(Json::parse(&call.arguments).map(|a| a.is_object()).unwrap_or(false), "{:?}", call);
                    }
                }
            }
            Err(CoreError::TokenOutOfVocab { position, id, .. }) => {
                prop_assert!(!in_vocab(r, &ids));
                prop_assert_eq!(ids[position], id);
            }
            Err(e) => prop_assert!(false, "unexpected error: {}", e),
        }
    }

    #[test]
    fn bridge_any_ids_and_messages(
        which in 0usize..5,
        prompt_user in text(),
        sampled in ids(),
        new in prop::collection::vec(message(), 0..3),
        opts in options(),
    ) {
        let r = &renderers()[which];
        let user = obj(&[("role", s("user")), ("content", Json::Str(prompt_user))]);
        let gen = RenderOptions { add_generation_prompt: true, ..opts.clone() };
        let history = parse_messages(&[user]).unwrap();
        let mut prev: Vec<i64> = match r.render(&history, None, &gen) {
            Ok(p) => p.token_ids.iter().map(|&t| i64::from(t)).collect(),
            Err(_) => vec![], // the generic renderer may refuse; bridge gets only the sampled ids
        };
        prev.extend(resolve(r, &sampled));
        let Ok(new) = parse_messages(&new) else { return Ok(()) };
        match r.bridge(&prev, &new, &opts, Some(&history), None) {
            Ok(b) if b.ok => {
                prop_assert!(in_vocab(r, &prev));
                let a = &b.appended;
                prop_assert_eq!(a.message_index.len(), a.token_ids.len());
                prop_assert_eq!(a.loss_mask.len(), a.token_ids.len());
                prop_assert_eq!(a.is_content.len(), a.token_ids.len());
                prop_assert!(a.message_index.iter().all(|&m| m >= -1 && (m as i64) < new.len() as i64));
            }
            Ok(b) => {
                prop_assert!(!b.reason.is_empty());
                prop_assert!(b.appended.token_ids.is_empty());
            }
            Err(CoreError::TokenOutOfVocab { position, id, .. }) => {
                prop_assert!(!in_vocab(r, &prev));
                prop_assert_eq!(prev[position], id);
            }
            Err(e) => check_error(&e, new.len())?,
        }
    }
}

/// Values at the depth limit in every place a message or tool carries one, rendered by
/// every family on a thread with a rayon worker's stack (2 MiB), as `render_batch` does.
#[test]
fn values_at_max_depth_render_on_a_worker_thread_stack() {
    let deep = || nested(MAX_DEPTH - 1); // inside a message dict: MAX_DEPTH levels in all
    let schema =
        obj(&[("type", s("function")), ("function", obj(&[("name", s("f")), ("parameters", nested(MAX_DEPTH - 2))]))]);
    let messages = vec![
        obj(&[("role", s("system")), ("content", s("S")), ("extra", deep())]),
        obj(&[("role", s("user")), ("content", s("Hi")), ("extra", deep())]),
        obj(&[
            ("role", s("assistant")),
            ("content", s("")),
            (
                "tool_calls",
                Json::Array(vec![obj(&[
                    ("type", s("function")),
                    ("function", obj(&[("name", s("f")), ("arguments", obj(&[("a", nested(MAX_DEPTH - 5))]))])),
                ])]),
            ),
        ]),
        obj(&[("role", s("tool")), ("content", s("ok")), ("extra", deep())]),
    ];
    let messages_text_args = {
        let args = format!("{{\"a\": {}null{}}}", "[".repeat(MAX_DEPTH - 1), "]".repeat(MAX_DEPTH - 1));
        assert_eq!(Json::parse(&args).unwrap().depth(), MAX_DEPTH);
        let mut m = messages.clone();
        m[2] = obj(&[
            ("role", s("assistant")),
            ("content", s("")),
            ("tool_calls", Json::Array(vec![obj(&[("function", obj(&[("name", s("f")), ("arguments", s(&args))]))])])),
        ]);
        m
    };
    for values in [&messages, &messages_text_args] {
        assert!(values.iter().all(|m| m.depth() <= MAX_DEPTH) && values[0].depth() == MAX_DEPTH);
        let parsed = parse_messages(values).unwrap();
        std::thread::scope(|scope| {
            for r in renderers() {
                let parsed: &[Message] = &parsed;
                let tools = vec![schema.clone()];
                let worker = std::thread::Builder::new().stack_size(2 << 20);
                let outcome = worker
                    .spawn_scoped(scope, move || {
                        let opts = RenderOptions {
                            add_generation_prompt: true,
                            date_string: Some("26 Jul 2024".into()),
                            ..Default::default()
                        };
                        // llama3 takes one tool call per message; deepseek-r1 wants JSON text arguments
                        match r.render_checked(parsed, Some(&tools), &opts) {
                            Ok((out, _)) => assert_eq!(out.token_ids.len(), out.loss_mask.len()),
                            Err(e) => assert!(
                                matches!(e, CoreError::InvalidMessage { .. } | CoreError::Template(_)),
                                "{}: {e}",
                                r.family.name()
                            ),
                        }
                    })
                    .unwrap()
                    .join();
                assert!(outcome.is_ok(), "{} panicked", r.family.name());
            }
        });
    }
}

/// Templates that walk deep values themselves: a recursive loop over a value at the depth
/// limit, and `tojson` of it, on a 2 MiB stack.
#[test]
fn generic_templates_walking_values_at_max_depth() {
    let templates = [
        "{{ messages | tojson }}{{ tools | tojson(indent=2) }}",
        "{{ messages }}{{ tools }}",
        "{%- for v in messages recursive %}{% if v is mapping %}{{ loop(v.values()) }}{% elif v is sequence and v is not string %}[{{ loop(v) }}]{% else %}.{% endif %}{% endfor %}",
        "{%- macro walk(v) %}{% if v is sequence and v is not string %}[{% for x in v %}{{ walk(x) }}{% endfor %}]{% endif %}{% endmacro %}{{ walk(messages[0].extra) }}",
    ];
    let m = vec![obj(&[("role", s("user")), ("content", s("Hi")), ("extra", nested(MAX_DEPTH - 1))])];
    let parsed = parse_messages(&m).unwrap();
    for t in templates {
        let r = Renderer::new(
            "jinja",
            &shared("qwen3"),
            RendererConfig { chat_template: Some(t.to_string()), ..Default::default() },
        )
        .unwrap();
        let parsed = parsed.clone();
        let worker = std::thread::Builder::new().stack_size(2 << 20);
        let outcome = worker
            .spawn(move || match r.render(&parsed, Some(&[nested(MAX_DEPTH)]), &RenderOptions::default()) {
                Ok(out) => assert_eq!(out.token_ids.len(), out.is_content.len()),
                Err(e) => assert!(matches!(e, CoreError::Template(_)), "{e}"),
            })
            .unwrap()
            .join();
        assert!(outcome.is_ok(), "{t}");
    }
}
