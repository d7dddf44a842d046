//! One render for both texts of a conversation: with and without the generation prompt.
//!
//! A bridge needs the conversation's text with the generation prompt and where the text
//! without it ends; rendering both costs two passes over the whole conversation. Most
//! chat templates end with `{%- if add_generation_prompt %}...{%- endif %}` at the top
//! level and read `add_generation_prompt` nowhere else. For such a template the text
//! without the prompt *is* the text with it, cut where that block starts. This is proved
//! once per template, from its syntax tree:
//!
//! 1. the first mention of `add_generation_prompt` in the source is the tag
//!    `{% if add_generation_prompt %}` (any whitespace control), and that tag opens a
//!    top-level `if` of the parsed template (not one inside a loop, macro, comment, raw
//!    block or string) whose condition is the variable alone;
//! 2. the `if` has no `elif`/`else`, and nothing after it writes anything (text after the
//!    block must be empty once whitespace control applies);
//! 3. nothing before the tag includes, imports or extends another template (the only way
//!    earlier code could read the flag without naming it).
//!
//! Before the tag, then, nothing can see the flag: the output up to there is the same
//! with it true or false; and when it is false the rest writes nothing. The template is
//! compiled once more with an empty filter block right after the tag (the tag's
//! whitespace control carried over, so no whitespace changes) whose filter writes a nonce
//! marker: one render with the prompt gives both texts. As a last check the split is
//! tried on a one-message conversation against the two plain renders; any difference
//! turns it off. With `{% generation %}` blocks (compiled to filter blocks before this
//! proof runs), their markers are cut after the prompt marker is found. Templates the
//! proof does not cover render twice, as before (12 of TRL's 72 reference templates).

use minijinja::machinery::ast::{Expr, Stmt};
use regex::Regex;

/// The filter that writes the marker.
pub(crate) const PROMPT_FILTER: &str = "__treadle_prompt_split";

const FLAG: &str = "add_generation_prompt";

/// `source` with the marker block inserted right after its `{% if add_generation_prompt %}`
/// tag, or None where the template is not proved to split there (see the module docs).
pub(crate) fn marked_source(source: &str, syntax: minijinja::syntax::SyntaxConfig) -> Option<String> {
    // 1. the first mention of the flag is inside the tag, which is the whole tag
    let first = source.find(FLAG)?;
    let tag_start = source[..first].rfind("{%")?;
    let tag_end = first + source[first..].find("%}")? + 2;
    let tag = Regex::new(r"^\{%([-+]?)\s*if\s+add_generation_prompt\s*([-+]?)%\}$").expect("valid regex");
    let caps = tag.captures(&source[tag_start..tag_end])?;
    let trail = caps.get(2).map_or("", |m| m.as_str());
    // 3. nothing before it can reach the flag through another template
    let reach = Regex::new(r"\{%[-+]?\s*(include|import|extends|from|block)\b").expect("valid regex");
    if reach.is_match(&source[..tag_start]) {
        return None;
    }
    // the tag opens a top-level `if` on the flag alone, with no else; only empty text follows
    let ast = minijinja::machinery::parse(source, "chat_template", syntax).ok()?;
    let Stmt::Template(t) = ast else { return None };
    let at = t.children.iter().position(|s| match s {
        Stmt::IfCond(c) => {
            let span = c.span();
            (span.start_offset as usize) <= first && first < span.end_offset as usize
        }
        _ => false,
    })?;
    let Stmt::IfCond(cond) = &t.children[at] else { return None };
    let Expr::Var(var) = &cond.expr else { return None };
    if var.id != FLAG || !cond.false_body.is_empty() {
        return None;
    }
    let rest_writes = t.children[at + 1..].iter().any(|s| !matches!(s, Stmt::EmitRaw(r) if r.raw.is_empty()));
    if rest_writes {
        return None;
    }
    // 2. the marker: an empty filter block, carrying the tag's right whitespace control
    Some(format!("{}{{% filter {PROMPT_FILTER} %}}{{% endfilter {trail}%}}{}", &source[..tag_end], &source[tag_end..]))
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
        let ctx = minijinja::context! { messages => vec!["a", "b"] };
        for src in [
            "{% for m in messages %}<{{ m }}>\n{% endfor %}{% if add_generation_prompt %}\n  <go>\n{% endif %}\n",
            "{%- for m in messages %}{{- m }}\n{%- endfor %}\n{%- if add_generation_prompt -%}\n\n   <go>{%- endif -%}",
            "{%- for m in messages %}{{ m }}   {% endfor %}\n   {%- if add_generation_prompt +%}\n <go>\n{%+ endif %}",
            "{{ messages | length }} \n{% if add_generation_prompt %}{% if x %}x{% endif %}<go>{% endif %}\n",
        ] {
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
            "{% if add_generation_prompt and x %}<go>{% endif %}",
            "{% if add_generation_prompt is true %}<go>{% endif %}",
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
