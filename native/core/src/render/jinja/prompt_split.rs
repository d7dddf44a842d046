//! One render for both texts of a conversation: with and without the generation prompt.
//!
//! A bridge needs the conversation's text with the generation prompt and where the text
//! without it ends; rendering both costs two passes over the whole conversation. Most
//! chat templates end with `{%- if add_generation_prompt %}...{%- endif %}` at the top
//! level and read `add_generation_prompt` nowhere else. For such a template the text
//! without the prompt *is* the text with it, cut where that block starts. This is proved
//! once per template, from its syntax tree:
//!
//! 1. the last top-level statement that writes anything is an `if` with no `elif`/`else`
//!    whose condition is `add_generation_prompt` or `add_generation_prompt and ...`
//!    (`and` does not evaluate its right side when the flag is false);
//! 2. every mention of `add_generation_prompt` before that `if` is inside a top-level
//!    `{% if add_generation_prompt is not defined %}` (or `not ... is defined`) statement
//!    with no `else`: the flag is always defined here, so such a statement never runs;
//! 3. nothing before the `if` includes, imports or extends another template (the only way
//!    earlier code could read the flag without naming it).
//!
//! Before the `if`, then, nothing can see the flag: the output up to there is the same
//! with it true or false; and when it is false the rest writes nothing. The template is
//! compiled once more with an empty filter block right before the `if` tag (the tag's
//! whitespace control carried over, so no whitespace changes) whose filter writes a nonce
//! marker: one render with the prompt gives both texts. As a last check the split is
//! tried on a one-message conversation against the two plain renders; any difference
//! turns it off. With `{% generation %}` blocks (compiled to filter blocks before this
//! proof runs), their markers are cut after the prompt marker is found. Templates the
//! proof does not cover render twice, as before.

use minijinja::machinery::ast::{BinOpKind, Expr, IfCond, Stmt, UnaryOpKind};
use regex::Regex;

/// The filter that writes the marker.
pub(crate) const PROMPT_FILTER: &str = "__treadle_prompt_split";

const FLAG: &str = "add_generation_prompt";

fn is_flag(e: &Expr<'_>) -> bool {
    matches!(e, Expr::Var(v) if v.id == FLAG)
}

/// `add_generation_prompt` or `add_generation_prompt and ...`.
fn gated_by_flag(e: &Expr<'_>) -> bool {
    match e {
        Expr::BinOp(op) => matches!(op.op, BinOpKind::ScAnd) && is_flag(&op.left),
        e => is_flag(e),
    }
}

/// `{% if add_generation_prompt is not defined %}...{% endif %}` (no else): never runs,
/// since the flag is always defined.
fn defaults_flag(c: &IfCond<'_>) -> bool {
    let Expr::UnaryOp(not) = &c.expr else { return false };
    let Expr::Test(test) = &not.expr else { return false };
    matches!(not.op, UnaryOpKind::Not) && test.name == "defined" && is_flag(&test.expr) && c.false_body.is_empty()
}

/// Where the block tag whose keyword starts at `keyword` opens (`{%`), and its left
/// whitespace control.
fn tag_open(source: &str, keyword: usize) -> Option<(usize, &str)> {
    let open = source[..keyword].rfind("{%")?;
    let between = &source[open + 2..keyword];
    let lead = between.strip_prefix(['-', '+']).map_or("", |_| &between[..1]);
    between[lead.len()..].trim().is_empty().then_some((open, lead))
}

/// `source` with the marker block inserted right before its final
/// `{% if add_generation_prompt %}` tag, or None where the template is not proved to split
/// there (see the module docs).
pub(crate) fn marked_source(source: &str, syntax: minijinja::syntax::SyntaxConfig) -> Option<String> {
    let ast = minijinja::machinery::parse(source, "chat_template", syntax).ok()?;
    let Stmt::Template(t) = ast else { return None };
    // 1. the last statement that writes anything is the gated `if`
    let last = t.children.iter().rposition(|s| !matches!(s, Stmt::EmitRaw(r) if r.raw.is_empty()))?;
    let Stmt::IfCond(tail) = &t.children[last] else { return None };
    if !tail.false_body.is_empty() || !gated_by_flag(&tail.expr) {
        return None;
    }
    let (tag_start, lead) = tag_open(source, tail.span().start_offset as usize)?;
    // 2. before it, the flag is named only in statements that never run
    let mut allowed: Vec<(usize, usize)> = Vec::new();
    for s in &t.children[..last] {
        if let Stmt::IfCond(c) = s {
            if defaults_flag(c) {
                let (open, _) = tag_open(source, c.span().start_offset as usize)?;
                allowed.push((open, c.span().end_offset as usize));
            }
        }
    }
    let before = &source[..tag_start];
    let named_elsewhere =
        before.match_indices(FLAG).any(|(at, _)| !allowed.iter().any(|&(s, e)| s <= at && at + FLAG.len() <= e));
    // 3. nothing before it can reach the flag through another template
    let reach = Regex::new(r"\{%[-+]?\s*(include|import|extends|from|block)\b").expect("valid regex");
    if named_elsewhere || reach.is_match(before) {
        return None;
    }
    // the marker: an empty filter block with the tag's left whitespace control, so the
    // whitespace before it is treated as it was before the tag
    Some(format!("{before}{{%{lead} filter {PROMPT_FILTER} %}}{{% endfilter %}}{}", &source[tag_start..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::jinja::env;

    fn marked(src: &str) -> Option<String> {
        marked_source(src, env::syntax().expect("syntax"))
    }

    /// The marked template's text with the marker cut out and where it was, next to the
    /// plain template's texts with and without the prompt.
    fn renders(src: &str, ctx: minijinja::Value) -> ((String, usize), String, String) {
        let marked = marked(src).expect("splits");
        let mut e = env::base_environment().expect("environment");
        e.add_filter(PROMPT_FILTER, |_: String| "\u{F8FF}M\u{F8FF}".to_string());
        e.add_template_owned("plain", src.to_string()).unwrap();
        e.add_template_owned("marked", marked).unwrap();
        let with_ctx = |agp: bool| {
            minijinja::Value::from_pairs(
                ctx.try_iter()
                    .unwrap()
                    .map(|k| (k.to_string(), ctx.get_item(&k).unwrap()))
                    .chain([("add_generation_prompt".to_string(), minijinja::Value::from(agp))]),
            )
        };
        let m = e.get_template("marked").unwrap().render(with_ctx(true)).unwrap();
        let pos = m.find("\u{F8FF}M\u{F8FF}").expect("marker written");
        let cut = m.replacen("\u{F8FF}M\u{F8FF}", "", 1);
        let plain = e.get_template("plain");
        (
            (cut, pos),
            plain.as_ref().unwrap().render(with_ctx(true)).unwrap(),
            plain.unwrap().render(with_ctx(false)).unwrap(),
        )
    }

    #[test]
    fn the_usual_tail_splits_with_whitespace_unchanged() {
        let contexts = [
            minijinja::context! { messages => vec!["a", "b"] },
            minijinja::context! { messages => vec!["a", "b"], x => true },
            minijinja::context! { messages => vec!["a"], x => false },
        ];
        for (src, ctx) in [
            "{% for m in messages %}<{{ m }}>\n{% endfor %}{% if add_generation_prompt %}\n  <go>\n{% endif %}\n",
            "{%- for m in messages %}{{- m }}\n{%- endfor %}\n{%- if add_generation_prompt -%}\n\n   <go>{%- endif -%}",
            "{%- for m in messages %}{{ m }}   {% endfor %}\n   {%- if add_generation_prompt +%}\n <go>\n{%+ endif %}",
            "{{ messages | length }} \n{% if add_generation_prompt %}{% if x %}x{% endif %}<go>{% endif %}\n",
            // gated on something else too, and the flag defaulted first (DeepSeek's templates)
            "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}\
             {% for m in messages %}{{ m }}{% endfor %}{% if add_generation_prompt and not x %}<go>{% endif %}",
            "{% if add_generation_prompt is not defined %}{% set add_generation_prompt = true %}{% endif %}\
             {% for m in messages %}{{ m }}\n{% endfor %}\n  {%+ if add_generation_prompt and x %}<go>{% endif %}",
            "{% for m in messages %}{{ m }}\n{% endfor %}\n  {% if add_generation_prompt and x is defined %}<go>{% endif %}",
        ]
        .iter()
        .flat_map(|src| contexts.iter().map(move |ctx| (src, ctx)))
        {
            let ((cut, pos), with, without) = renders(src, ctx.clone());
            assert_eq!(cut, with, "{src:?}");
            assert_eq!(&cut[..pos], without, "{src:?}");
        }
    }

    #[test]
    fn templates_that_may_read_the_flag_elsewhere_do_not_split() {
        for src in [
            // read before the tail
            "{% set g = add_generation_prompt %}{% if add_generation_prompt %}<go>{% endif %}",
            "{{ 'add_generation_prompt' }}{% if add_generation_prompt %}<go>{% endif %}",
            // not the flag alone, or not at the top level
            "{% if x and add_generation_prompt %}<go>{% endif %}",
            "{% if add_generation_prompt or x %}<go>{% endif %}",
            "{% if add_generation_prompt is true %}<go>{% endif %}",
            "{% if add_generation_prompt is defined %}{{ 'a' }}{% endif %}{% if add_generation_prompt %}<go>{% endif %}",
            "{% if not add_generation_prompt is defined %}{% else %}{{ 'a' }}{% endif %}{% if add_generation_prompt %}<go>{% endif %}",
            "{% for m in messages %}{% if add_generation_prompt %}<go>{% endif %}{% endfor %}",
            "{% macro f() %}{% if add_generation_prompt %}<go>{% endif %}{% endmacro %}{{ f() }}",
            "{# {% if add_generation_prompt %} #}{% if add_generation_prompt %}<go>{% endif %}",
            "{% raw %}{% if add_generation_prompt %}{% endraw %}{% if add_generation_prompt %}<go>{% endif %}",
            "{{ '{% if add_generation_prompt %}' }}{% if add_generation_prompt %}<go>{% endif %}",
            // something written when the flag is false
            "{% if add_generation_prompt %}<go>{% else %}<end>{% endif %}",
            "{% if add_generation_prompt %}<go>{% elif x %}<x>{% endif %}",
            "{% if add_generation_prompt %}<go>{% endif %}<eos>",
            "{% if add_generation_prompt %}<go>{% endif %}{{ x }}",
            "{% if add_generation_prompt %}<go>{% endif %}{% if x is defined %}{{ x }}{% endif %}",
            "{% if add_generation_prompt %}<go>{% endif %}  \n  ",
            // another template could read it
            "{% include 'other' %}{% if add_generation_prompt %}<go>{% endif %}",
            // no tail at all, or a broken template
            "{{ messages }}",
            "{% if add_generation_prompt %}<go>",
        ] {
            assert_eq!(marked(src), None, "{src:?}");
        }
    }
}
