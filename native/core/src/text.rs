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
