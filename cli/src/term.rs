//! Text from a script or an agent, made safe for a terminal.
//!
//! `log()` lines, labels, phase titles, `meta.name`, failure lines and results are written by
//! scripts and models; printed raw, `\u{1b}]0;…\u{7}` retitles the user's terminal, `\u{1b}[2J`
//! clears it, and a `\n` in a label forges a line of our own. [`clean`] shows every control
//! character (C0, DEL, C1) and the bidirectional overrides as visible escapes (`\n`,
//! `\u{1b}`), so what reaches the terminal is exactly the text, never instructions to it.

use std::borrow::Cow;

fn unsafe_char(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with control characters shown as escapes (one line, whatever it held).
pub fn clean(s: &str) -> Cow<'_, str> {
    escape(s, unsafe_char)
}

/// Like [`clean`], but keeps newlines and tabs (a multi-line result printed as such).
pub fn clean_text(s: &str) -> Cow<'_, str> {
    escape(s, |c| unsafe_char(c) && c != '\n' && c != '\t')
}

fn escape(s: &str, bad: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !s.chars().any(&bad) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if bad(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_become_visible_and_plain_text_is_untouched() {
        assert_eq!(
            clean("\u{1b}]0;OWNED\u{7}\u{1b}[2J"),
            "\\u{1b}]0;OWNED\\u{7}\\u{1b}[2J"
        );
        assert_eq!(
            clean("label\ncompleted in 0.1s"),
            "label\\ncompleted in 0.1s"
        );
        assert_eq!(clean("\u{202e}txt.exe"), "\\u{202e}txt.exe");
        assert!(matches!(clean("plain · ünïcode"), Cow::Borrowed(_)));
        assert_eq!(clean_text("a\nb\u{1b}[1m"), "a\nb\\u{1b}[1m");
    }
}
