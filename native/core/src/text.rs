//! Python `str` operations the chat templates use, with Python's semantics.
//!
//! `str.strip()` without arguments strips what Python calls whitespace, which is
//! Unicode White_Space plus the ASCII separators U+001C..U+001F; templates that call
//! `| trim` depend on that exact set.

/// Python's `str.isspace()` for one character.
pub fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s.strip()`.
pub fn strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// `s.strip(chars)`.
pub fn strip_chars<'a>(s: &'a str, chars: &[char]) -> &'a str {
    s.trim_matches(|c| chars.contains(&c))
}

/// `s.lstrip(chars)`.
pub fn lstrip_chars<'a>(s: &'a str, chars: &[char]) -> &'a str {
    s.trim_start_matches(|c| chars.contains(&c))
}

/// `s.rstrip(chars)`.
pub fn rstrip_chars<'a>(s: &'a str, chars: &[char]) -> &'a str {
    s.trim_end_matches(|c| chars.contains(&c))
}

/// `s.split(sep)[0]`.
pub fn split_first<'a>(s: &'a str, sep: &str) -> &'a str {
    s.split_once(sep).map_or(s, |(head, _)| head)
}

/// `s.split(sep)[-1]`.
pub fn split_last<'a>(s: &'a str, sep: &str) -> &'a str {
    s.rsplit_once(sep).map_or(s, |(_, tail)| tail)
}

/// `s.split(sep, maxsplit)` (`sep` None: runs of whitespace, no empty strings).
/// `maxsplit` < 0 means no limit. `sep` must not be empty (Python raises ValueError).
pub fn split(s: &str, sep: Option<&str>, maxsplit: i64) -> Vec<String> {
    let limit = if maxsplit < 0 { usize::MAX } else { maxsplit as usize };
    match sep {
        Some(sep) => {
            let mut out = Vec::new();
            let mut rest = s;
            while out.len() < limit {
                match rest.find(sep) {
                    Some(p) => {
                        out.push(rest[..p].to_string());
                        rest = &rest[p + sep.len()..];
                    }
                    None => break,
                }
            }
            out.push(rest.to_string());
            out
        }
        None => {
            let mut out = Vec::new();
            let mut rest = s.trim_start_matches(py_isspace);
            while !rest.is_empty() {
                if out.len() == limit {
                    out.push(rest.to_string());
                    break;
                }
                let end = rest.find(py_isspace).unwrap_or(rest.len());
                out.push(rest[..end].to_string());
                rest = rest[end..].trim_start_matches(py_isspace);
            }
            out
        }
    }
}

/// `s.rsplit(sep, maxsplit)`.
pub fn rsplit(s: &str, sep: Option<&str>, maxsplit: i64) -> Vec<String> {
    let limit = if maxsplit < 0 { usize::MAX } else { maxsplit as usize };
    let mut out = Vec::new();
    match sep {
        Some(sep) => {
            let mut rest = s;
            while out.len() < limit {
                match rest.rfind(sep) {
                    Some(p) => {
                        out.push(rest[p + sep.len()..].to_string());
                        rest = &rest[..p];
                    }
                    None => break,
                }
            }
            out.push(rest.to_string());
        }
        None => {
            let mut rest = s.trim_end_matches(py_isspace);
            while !rest.is_empty() {
                if out.len() == limit {
                    out.push(rest.to_string());
                    break;
                }
                let start =
                    rest.rfind(py_isspace).map_or(0, |p| p + rest[p..].chars().next().map_or(1, char::len_utf8));
                out.push(rest[start..].to_string());
                rest = rest[..start].trim_end_matches(py_isspace);
            }
        }
    }
    out.reverse();
    out
}

/// Python's line boundaries (`str.splitlines`): `\r\n` counts as one.
fn is_line_break(c: char) -> bool {
    matches!(c, '\n' | '\r' | '\u{0b}' | '\u{0c}' | '\u{1c}' | '\u{1d}' | '\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

/// `s.splitlines(keepends)`.
pub fn splitlines(s: &str, keepends: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if !is_line_break(c) {
            continue;
        }
        let mut end = i + c.len_utf8();
        if c == '\r' && chars.peek().is_some_and(|&(_, n)| n == '\n') {
            chars.next();
            end += 1;
        }
        out.push(s[start..if keepends { end } else { i }].to_string());
        start = end;
    }
    if start < s.len() {
        out.push(s[start..].to_string());
    }
    out
}

/// Byte offset of the `n`-th character (Python index, clamped and with negatives from the end).
fn char_slice_bounds(s: &str, start: Option<i64>, end: Option<i64>) -> (usize, usize) {
    let len = s.chars().count() as i64;
    let clamp = |i: i64| if i < 0 { (i + len).max(0) } else { i.min(len) };
    let (a, b) = (clamp(start.unwrap_or(0)), clamp(end.unwrap_or(len)));
    let byte = |n: i64| s.char_indices().nth(n as usize).map_or(s.len(), |(i, _)| i);
    (byte(a), byte(b.max(a)))
}

/// The `start`/`end` arguments of `find`, `count`, `startswith`... as a byte range, or
/// None where the range is empty and starts past the end (Python finds nothing there,
/// not even the empty string).
pub fn str_range(s: &str, start: Option<i64>, end: Option<i64>) -> Option<(usize, usize)> {
    let len = s.chars().count() as i64;
    let a = start.map_or(0, |i| if i < 0 { (i + len).max(0) } else { i });
    if a > len {
        return None;
    }
    Some(char_slice_bounds(s, start, end))
}

/// `s.find(sub, start, end)` (`rev`: `rfind`) as a character index, -1 if absent.
pub fn find(s: &str, sub: &str, start: Option<i64>, end: Option<i64>, rev: bool) -> i64 {
    let Some((a, b)) = str_range(s, start, end) else { return -1 };
    if b < a {
        return -1;
    }
    let hay = &s[a..b];
    let found = if rev { hay.rfind(sub) } else { hay.find(sub) };
    found.map_or(-1, |p| s[..a + p].chars().count() as i64)
}

/// `s.count(sub, start, end)`.
pub fn count(s: &str, sub: &str, start: Option<i64>, end: Option<i64>) -> i64 {
    let Some((a, b)) = str_range(s, start, end) else { return 0 };
    let hay = &s[a..b];
    if sub.is_empty() {
        return hay.chars().count() as i64 + 1;
    }
    hay.matches(sub).count() as i64
}

/// `s.replace(old, new, count)` (`count` < 0: all).
pub fn replace(s: &str, old: &str, new: &str, count: i64) -> String {
    if count < 0 {
        s.replace(old, new)
    } else {
        s.replacen(old, new, count as usize)
    }
}

fn is_cased(c: char) -> bool {
    c.is_lowercase() || c.is_uppercase() || c.to_lowercase().ne(c.to_uppercase())
}

/// Title case of one character (Rust has no titlecase mapping: the digraphs are the only
/// characters whose title and upper case differ).
fn push_title(out: &mut String, c: char) {
    match c {
        'Ǆ' | 'ǅ' | 'ǆ' => out.push('ǅ'),
        'Ǉ' | 'ǈ' | 'ǉ' => out.push('ǈ'),
        'Ǌ' | 'ǋ' | 'ǌ' => out.push('ǋ'),
        'Ǳ' | 'ǲ' | 'ǳ' => out.push('ǲ'),
        _ => out.extend(c.to_uppercase()),
    }
}

/// `s.title()`: words start after any uncased character.
pub fn title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            push_title(&mut out, c);
        }
        prev_cased = is_cased(c);
    }
    out
}

/// `s.capitalize()`: the first character in title case, the rest lower case.
pub fn capitalize(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    if let Some(c) = chars.next() {
        push_title(&mut out, c);
    }
    for c in chars {
        out.extend(c.to_lowercase());
    }
    out
}

/// `s.swapcase()`.
pub fn swapcase(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_uppercase() {
            out.extend(c.to_lowercase());
        } else if c.is_lowercase() {
            out.extend(c.to_uppercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Python's `str.isprintable()` for one character (what `repr` writes unescaped): not
/// a control, format, private-use, unassigned or separator character, except ' '.
/// (The Unicode tables are the regex crate's, a newer Unicode version than Python 3.11's
/// 14.0: characters assigned since print unescaped here and escaped by Python.)
pub fn py_isprintable(c: char) -> bool {
    static PRINTABLE: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"^[\p{L}\p{M}\p{N}\p{P}\p{S} ]$").expect("valid regex"));
    if c.is_ascii() {
        return (' '..='~').contains(&c);
    }
    let mut buf = [0u8; 4];
    PRINTABLE.is_match(c.encode_utf8(&mut buf))
}

/// Python's `str.isdecimal()` for one character (Unicode decimal digits; `isdigit` also
/// takes superscripts, which this does not).
pub fn py_isdecimal(c: char) -> bool {
    static DECIMAL: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"^\p{Nd}$").expect("valid regex"));
    let mut buf = [0u8; 4];
    c.is_ascii_digit() || (!c.is_ascii() && DECIMAL.is_match(c.encode_utf8(&mut buf)))
}

/// Python's `repr(s)`: single quotes unless the text holds a `'` and no `"`.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_isprintable(c) => out.push(c),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push(quote);
    out
}

/// Python's `str(f)` for a float: `repr` digits, with `nan`, `inf`, `-inf`.
pub fn py_float_str(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        crate::json::py_float_repr(f)
    }
}

/// `s.islower()`: at least one cased character and no upper or title case ones.
pub fn islower(s: &str) -> bool {
    s.chars().any(is_cased) && !s.chars().any(|c| c.is_uppercase() || (is_cased(c) && !c.is_lowercase()))
}

/// `s.isupper()`: at least one cased character and no lower or title case ones.
pub fn isupper(s: &str) -> bool {
    s.chars().any(is_cased) && !s.chars().any(|c| c.is_lowercase() || (is_cased(c) && !c.is_uppercase()))
}

/// `s.istitle()`: upper case only after uncased characters, lower case only after cased ones.
pub fn istitle(s: &str) -> bool {
    let mut prev_cased = false;
    let mut any = false;
    for c in s.chars() {
        if c.is_uppercase() || (is_cased(c) && !c.is_lowercase()) {
            if prev_cased {
                return false;
            }
            prev_cased = true;
            any = true;
        } else if c.is_lowercase() {
            if !prev_cased {
                return false;
            }
            prev_cased = true;
            any = true;
        } else {
            prev_cased = false;
        }
    }
    any
}

pub const MONTH_ABBR: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
pub const MONTH_NAMES: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Today's (year, month 1-12, day 1-31) in UTC.
pub fn utc_today() -> (i64, i64, i64) {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    civil_from_days((secs / 86_400) as i64)
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil_from_days(0), (1970, 1, 1));
        assert_eq!(super::civil_from_days(20_664), (2026, 7, 30));
        assert_eq!(super::civil_from_days(11_016), (2000, 2, 29));
    }

    use super::*;

    #[test]
    fn strip_uses_python_whitespace() {
        assert_eq!(strip("\u{1c} a b \u{3000}\n"), "a b");
        assert_eq!(strip("\u{200b}x\u{200b}"), "\u{200b}x\u{200b}"); // zero-width space is not whitespace
        assert_eq!(strip_chars("\n\nab\n", &['\n']), "ab");
        assert_eq!(split_first("a</think>b</think>c", "</think>"), "a");
        assert_eq!(split_last("a</think>b</think>c", "</think>"), "c");
        assert_eq!(split_last("abc", "</think>"), "abc");
    }
}
