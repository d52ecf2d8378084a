//! A small JavaScript tokenizer (not a parser) for workflow scripts.
//!
//! [`Lexer`] turns source text into [`Token`]s lazily (it is an iterator of
//! `Result<Token, LexError>`); [`tokenize`] collects them all. Whitespace and
//! comments (`//`, `/* */`, and a leading `#!` hashbang line) are skipped and
//! never produce tokens. `source.rs` uses this to read the `meta` literal and
//! to scan the code for forbidden calls, so the one thing that matters most
//! is that text inside strings, templates, regexes and comments never shows
//! up as code tokens, and that code inside `${ … }` always does.
//!
//! Invariants:
//! - Every token's `span` is a byte range of the source and `text` is exactly
//!   `&source[span]`; `line` and `column` are 1-based, the column counted in
//!   characters (Unicode scalar values). Line terminators are `\n`, `\r\n`,
//!   a lone `\r`, U+2028 and U+2029, as in JavaScript.
//! - Template literals are split into parts: a template without
//!   substitutions is one [`TemplatePart::NoSubstitution`] token; otherwise
//!   it is a `Head` token (`` `…${ ``), the tokens of the first substitution
//!   as ordinary tokens, then `Middle` tokens (`}…${`) and finally a `Tail`
//!   token (`` }…` ``). The `}` that closes a substitution belongs to the
//!   next part, never to a `Punct`. A stack of open substitutions (each with
//!   its own `{`/`}` depth) makes nested templates and object literals
//!   inside substitutions work.
//! - After an error the lexer yields nothing more.
//!
//! Regex or division: a `/` (that does not start a comment) is division when
//! the previous token ends an expression, and starts a regex literal
//! otherwise. Tokens that end an expression: an identifier (any identifier
//! right after `.` or `?.`, since it is a property name; otherwise any
//! identifier except the keywords in [`KEYWORDS_BEFORE_EXPRESSION`]), a
//! number, a string, a regex, a template `NoSubstitution`/`Tail` part, and
//! the punctuators `)`, `]`, `}`, `++`, `--`. This is a heuristic: it
//! misreads a regex right after the `)` of `if (…)` or after a block's `}`,
//! which real scripts almost never contain.
//!
//! Identifiers are approximated: ASCII letters, digits, `$`, `_`, any
//! non-ASCII character that is not whitespace, and `\uXXXX` / `\u{…}`
//! escapes (decoded into [`Token::value`]). `#name` (a private name) is one
//! `Ident` token whose text keeps the `#`.
//!
//! Start reading at [`Lexer::next_token`].

use std::ops::Range;

/// Keywords after which a `/` starts a regex rather than a division.
pub const KEYWORDS_BEFORE_EXPRESSION: &[&str] = &[
    "return",
    "typeof",
    "case",
    "do",
    "else",
    "in",
    "instanceof",
    "new",
    "delete",
    "void",
    "throw",
    "yield",
    "await",
    "of",
    "extends",
    "default",
];

/// Punctuators, longest first so the first match is the longest one.
const PUNCTUATORS: &[&str] = &[
    ">>>=", "...", "===", "!==", "**=", "<<=", ">>=", ">>>", "&&=", "||=", "??=", "=>", "==", "!=",
    "<=", ">=", "&&", "||", "??", "?.", "**", "++", "--", "+=", "-=", "*=", "/=", "%=", "&=", "|=",
    "^=", "<<", ">>", "{", "}", "(", ")", "[", "]", ";", ",", "<", ">", "+", "-", "*", "/", "%",
    "&", "|", "^", "!", "~", "?", ":", "=", ".", "@", "#",
];

/// Which piece of a template literal a `Template` token is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplatePart {
    /// `` `text` ``: a whole template without `${…}`.
    NoSubstitution,
    /// `` `text${ ``: the start of a template with substitutions.
    Head,
    /// `}text${`: between two substitutions.
    Middle,
    /// `` }text` ``: the end of a template with substitutions.
    Tail,
}

/// What kind of token this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// An identifier or keyword (also `#private` names).
    Ident,
    /// A punctuator such as `(`, `...`, `=>`, `?.`, `===`.
    Punct,
    /// A numeric literal, text kept as written (`1_000`, `0xff`, `10n`, `.5`).
    Number,
    /// A single- or double-quoted string; `value` holds the decoded string.
    String,
    /// One part of a template literal; `value` holds the cooked text of the
    /// part, or `None` when it contains an invalid escape (legal only in a
    /// tagged template).
    Template(TemplatePart),
    /// A regular expression literal including its flags.
    Regex,
}

/// One token of the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token<'a> {
    pub kind: TokenKind,
    /// Exactly `&source[span]`.
    pub text: &'a str,
    /// Byte range in the source.
    pub span: Range<usize>,
    /// 1-based line of the first character.
    pub line: usize,
    /// 1-based column of the first character, counted in characters.
    pub column: usize,
    /// Decoded value: the string of a `String`, the cooked text of a
    /// `Template` part, the name of an `Ident` written with `\u` escapes.
    /// `None` otherwise.
    pub value: Option<String>,
}

impl Token<'_> {
    /// Whether this is the punctuator `p`.
    pub fn is_punct(&self, p: &str) -> bool {
        self.kind == TokenKind::Punct && self.text == p
    }

    /// Whether this is the identifier (or keyword) `name`.
    pub fn is_ident(&self, name: &str) -> bool {
        self.kind == TokenKind::Ident && self.name() == name
    }

    /// The identifier's name with escapes decoded (the text for other kinds).
    pub fn name(&self) -> &str {
        match (&self.kind, &self.value) {
            (TokenKind::Ident, Some(v)) => v,
            _ => self.text,
        }
    }
}

/// A tokenizing error such as an unterminated literal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} at line {line}, column {column}")]
pub struct LexError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// Tokenizes the whole source.
pub fn tokenize(source: &str) -> Result<Vec<Token<'_>>, LexError> {
    Lexer::new(source).collect()
}

#[derive(Debug, Clone, Copy)]
struct Pos {
    offset: usize,
    line: usize,
    column: usize,
}

/// An open `${ … }` substitution: how many `{` inside it are still open,
/// and where its template started (for the unterminated-template error).
#[derive(Debug, Clone, Copy)]
struct OpenSubstitution {
    depth: usize,
    template_start: Pos,
}

/// Builds a decoded string from characters and UTF-16 code units, pairing
/// surrogates written as `\uD83D\uDE00`; a lone surrogate becomes U+FFFD.
#[derive(Default)]
struct Decoded {
    text: String,
    high: Option<u32>,
}

impl Decoded {
    fn push(&mut self, c: char) {
        self.flush();
        self.text.push(c);
    }

    fn push_code(&mut self, code: u32) {
        if (0xD800..0xDC00).contains(&code) {
            self.flush();
            self.high = Some(code);
        } else if (0xDC00..0xE000).contains(&code) {
            let combined = self
                .high
                .take()
                .and_then(|h| char::from_u32(0x10000 + ((h - 0xD800) << 10) + (code - 0xDC00)));
            self.text.push(combined.unwrap_or('\u{FFFD}'));
        } else {
            self.push(char::from_u32(code).unwrap_or('\u{FFFD}'));
        }
    }

    fn flush(&mut self) {
        if self.high.take().is_some() {
            self.text.push('\u{FFFD}');
        }
    }

    fn finish(mut self) -> String {
        self.flush();
        self.text
    }
}

fn is_line_terminator(c: char) -> bool {
    matches!(c, '\n' | '\r' | '\u{2028}' | '\u{2029}')
}

fn is_whitespace(c: char) -> bool {
    !is_line_terminator(c) && (c.is_whitespace() || c == '\u{FEFF}')
}

fn is_id_start(c: char) -> bool {
    c == '$'
        || c == '_'
        || c.is_ascii_alphabetic()
        || (!c.is_ascii() && !is_whitespace(c) && !is_line_terminator(c))
}

fn is_id_part(c: char) -> bool {
    is_id_start(c) || c.is_ascii_digit() || c == '\u{200C}' || c == '\u{200D}'
}

/// The tokenizer. Iterate it, or call [`Lexer::next_token`].
pub struct Lexer<'a> {
    src: &'a str,
    offset: usize,
    line: usize,
    column: usize,
    /// Open template substitutions, innermost last.
    open: Vec<OpenSubstitution>,
    /// Whether the previous token ends an expression (so `/` divides).
    expr_end: bool,
    /// Whether the previous token was `.` or `?.` (so an identifier is a
    /// property name).
    after_dot: bool,
    failed: bool,
}

impl<'a> Lexer<'a> {
    pub fn new(src: &'a str) -> Self {
        Lexer {
            src,
            offset: 0,
            line: 1,
            column: 1,
            open: Vec::new(),
            expr_end: false,
            after_dot: false,
            failed: false,
        }
    }

    fn pos(&self) -> Pos {
        Pos {
            offset: self.offset,
            line: self.line,
            column: self.column,
        }
    }

    fn rest(&self) -> &'a str {
        &self.src[self.offset..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn peek2(&self) -> Option<char> {
        self.rest().chars().nth(1)
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.offset += c.len_utf8();
        match c {
            '\r' if self.peek() == Some('\n') => self.column += 1,
            '\n' | '\r' | '\u{2028}' | '\u{2029}' => {
                self.line += 1;
                self.column = 1;
            }
            _ => self.column += 1,
        }
        Some(c)
    }

    fn bump_if(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn error(at: Pos, message: impl Into<String>) -> LexError {
        LexError {
            line: at.line,
            column: at.column,
            message: message.into(),
        }
    }

    fn token(&self, kind: TokenKind, start: Pos, value: Option<String>) -> Token<'a> {
        Token {
            kind,
            text: &self.src[start.offset..self.offset],
            span: start.offset..self.offset,
            line: start.line,
            column: start.column,
            value,
        }
    }

    /// Skips whitespace, line terminators, comments and a leading hashbang.
    fn skip_trivia(&mut self) -> Result<(), LexError> {
        if self.offset == 0 {
            self.bump_if('\u{FEFF}');
            if self.rest().starts_with("#!") {
                self.skip_line();
            }
        }
        while let Some(c) = self.peek() {
            if is_whitespace(c) || is_line_terminator(c) {
                self.bump();
            } else if self.rest().starts_with("//") {
                self.skip_line();
            } else if self.rest().starts_with("/*") {
                let start = self.pos();
                self.bump();
                self.bump();
                loop {
                    if self.rest().starts_with("*/") {
                        self.bump();
                        self.bump();
                        break;
                    }
                    if self.bump().is_none() {
                        return Err(Self::error(start, "unterminated comment"));
                    }
                }
            } else {
                break;
            }
        }
        Ok(())
    }

    fn skip_line(&mut self) {
        while let Some(c) = self.peek() {
            if is_line_terminator(c) {
                break;
            }
            self.bump();
        }
    }

    /// Lexes the next token; `Ok(None)` at the end of the source.
    pub fn next_token(&mut self) -> Result<Option<Token<'a>>, LexError> {
        self.skip_trivia()?;
        let start = self.pos();
        let Some(c) = self.peek() else {
            return match self.open.last() {
                Some(open) => Err(Self::error(
                    open.template_start,
                    "unterminated template literal",
                )),
                None => Ok(None),
            };
        };
        let token = match c {
            '`' => {
                self.bump();
                self.template(start, true)?
            }
            '}' if self.open.last().is_some_and(|o| o.depth == 0) => {
                self.bump();
                self.template(start, false)?
            }
            '\'' | '"' => self.string(start, c)?,
            '0'..='9' => self.number(start)?,
            '.' if self.peek2().is_some_and(|d| d.is_ascii_digit()) => self.number(start)?,
            '/' if !self.expr_end => self.regex(start)?,
            '#' if self.peek2().is_some_and(is_id_start) => {
                self.bump();
                self.identifier(start)?
            }
            '\\' => self.identifier(start)?,
            c if is_id_start(c) => self.identifier(start)?,
            _ => self.punct(start),
        };
        self.after_dot = token.is_punct(".") || token.is_punct("?.");
        Ok(Some(token))
    }

    fn punct(&mut self, start: Pos) -> Token<'a> {
        let rest = self.rest();
        let mut text = PUNCTUATORS
            .iter()
            .copied()
            .find(|p| rest.starts_with(p))
            .unwrap_or("");
        // `a?.5:b` is a conditional, not optional chaining.
        if text == "?." && self.peek2_after(2).is_some_and(|d| d.is_ascii_digit()) {
            text = "?";
        }
        if text.is_empty() {
            // An unknown character: a one-character punctuator.
            self.bump();
        } else {
            for _ in 0..text.len() {
                self.bump();
            }
        }
        match text {
            "{" => {
                if let Some(open) = self.open.last_mut() {
                    open.depth += 1;
                }
            }
            "}" => {
                if let Some(open) = self.open.last_mut() {
                    open.depth = open.depth.saturating_sub(1);
                }
            }
            _ => {}
        }
        self.expr_end = matches!(text, ")" | "]" | "}" | "++" | "--");
        self.token(TokenKind::Punct, start, None)
    }

    fn peek2_after(&self, n: usize) -> Option<char> {
        self.rest().chars().nth(n)
    }

    fn identifier(&mut self, start: Pos) -> Result<Token<'a>, LexError> {
        let mut name = String::new();
        let mut escaped = false;
        if self.src[start.offset..].starts_with('#') {
            name.push('#');
        }
        while let Some(c) = self.peek() {
            if c == '\\' {
                let at = self.pos();
                self.bump();
                let code = if self.bump_if('u') {
                    self.unicode_escape()
                } else {
                    None
                };
                match code.and_then(char::from_u32) {
                    Some(ch) => name.push(ch),
                    None => return Err(Self::error(at, "invalid escape in identifier")),
                }
                escaped = true;
            } else if is_id_part(c) {
                self.bump();
                name.push(c);
            } else {
                break;
            }
        }
        let is_property = self.after_dot;
        self.expr_end = is_property || !KEYWORDS_BEFORE_EXPRESSION.contains(&name.as_str());
        let value = escaped.then_some(name);
        Ok(self.token(TokenKind::Ident, start, value))
    }

    fn digits(&mut self, ok: impl Fn(char) -> bool) -> usize {
        let mut n = 0;
        while let Some(c) = self.peek() {
            if ok(c) || (c == '_' && n > 0) {
                self.bump();
                n += 1;
            } else {
                break;
            }
        }
        n
    }

    fn number(&mut self, start: Pos) -> Result<Token<'a>, LexError> {
        let radix = match (self.peek(), self.peek2()) {
            (Some('0'), Some('x' | 'X')) => Some(16),
            (Some('0'), Some('o' | 'O')) => Some(8),
            (Some('0'), Some('b' | 'B')) => Some(2),
            _ => None,
        };
        if let Some(radix) = radix {
            self.bump();
            self.bump();
            if self.digits(|c| c.is_digit(radix)) == 0 {
                return Err(Self::error(
                    start,
                    "invalid number: no digits after the prefix",
                ));
            }
            self.bump_if('n');
        } else {
            let int_digits = self.digits(|c| c.is_ascii_digit());
            let mut integer = true;
            if self.bump_if('.') {
                integer = false;
                self.digits(|c| c.is_ascii_digit());
            }
            let exponent = matches!(self.peek(), Some('e' | 'E'))
                && match self.peek2() {
                    Some('+' | '-') => self.peek2_after(2).is_some_and(|c| c.is_ascii_digit()),
                    Some(c) => c.is_ascii_digit(),
                    None => false,
                };
            if exponent {
                integer = false;
                self.bump();
                if !self.bump_if('+') {
                    self.bump_if('-');
                }
                self.digits(|c| c.is_ascii_digit());
            }
            if integer && int_digits > 0 {
                self.bump_if('n');
            }
        }
        if self.peek().is_some_and(|c| is_id_part(c) || c == '\\') {
            return Err(Self::error(
                start,
                "invalid number: an identifier starts right after it",
            ));
        }
        self.expr_end = true;
        Ok(self.token(TokenKind::Number, start, None))
    }

    /// Reads the part after `\u`: `XXXX` or `{X…}`. Consumes only what fits.
    fn unicode_escape(&mut self) -> Option<u32> {
        if self.bump_if('{') {
            let mut value: u32 = 0;
            let mut n = 0;
            while let Some(d) = self.peek().and_then(|c| c.to_digit(16)) {
                self.bump();
                value = value.saturating_mul(16).saturating_add(d);
                n += 1;
            }
            (n > 0 && value <= 0x10FFFF && self.bump_if('}')).then_some(value)
        } else {
            self.hex_digits(4)
        }
    }

    /// Reads exactly `n` hex digits, consuming only hex digits.
    fn hex_digits(&mut self, n: usize) -> Option<u32> {
        let mut value = 0;
        for _ in 0..n {
            let d = self.peek().and_then(|c| c.to_digit(16))?;
            self.bump();
            value = value * 16 + d;
        }
        Some(value)
    }

    /// Decodes one escape sequence, the backslash already consumed. Returns
    /// `Ok(false)` for an escape that is invalid in a template (`\1`, bad
    /// `\x`/`\u`); in a string those are errors (except legacy octal
    /// escapes, which are decoded).
    fn escape(
        &mut self,
        out: &mut Decoded,
        template: bool,
        literal_start: Pos,
    ) -> Result<bool, LexError> {
        let at = self.pos();
        let unterminated = if template {
            "unterminated template literal"
        } else {
            "unterminated string literal"
        };
        let Some(c) = self.bump() else {
            return Err(Self::error(literal_start, unterminated));
        };
        match c {
            '\r' => {
                self.bump_if('\n');
            }
            '\n' | '\u{2028}' | '\u{2029}' => {}
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            'b' => out.push('\u{8}'),
            'f' => out.push('\u{C}'),
            'v' => out.push('\u{B}'),
            '0' if !self.peek().is_some_and(|d| d.is_ascii_digit()) => out.push('\0'),
            '0'..='9' if template => return Ok(false),
            '8' | '9' => out.push(c),
            '0'..='7' => {
                let mut value = c as u32 - '0' as u32;
                let max_more = if value <= 3 { 2 } else { 1 };
                for _ in 0..max_more {
                    match self.peek().and_then(|d| d.to_digit(8)) {
                        Some(d) => {
                            self.bump();
                            value = value * 8 + d;
                        }
                        None => break,
                    }
                }
                out.push_code(value);
            }
            'x' | 'u' => {
                let code = if c == 'x' {
                    self.hex_digits(2)
                } else {
                    self.unicode_escape()
                };
                match code {
                    Some(code) => out.push_code(code),
                    None if template => return Ok(false),
                    None => {
                        let what = if c == 'x' { "hexadecimal" } else { "unicode" };
                        return Err(Self::error(at, format!("invalid {what} escape sequence")));
                    }
                }
            }
            other => out.push(other),
        }
        Ok(true)
    }

    fn string(&mut self, start: Pos, quote: char) -> Result<Token<'a>, LexError> {
        self.bump();
        let mut out = Decoded::default();
        loop {
            match self.peek() {
                None | Some('\n' | '\r') => {
                    return Err(Self::error(start, "unterminated string literal"));
                }
                Some('\\') => {
                    self.bump();
                    self.escape(&mut out, false, start)?;
                }
                Some(c) => {
                    self.bump();
                    if c == quote {
                        break;
                    }
                    out.push(c);
                }
            }
        }
        self.expr_end = true;
        Ok(self.token(TokenKind::String, start, Some(out.finish())))
    }

    /// Lexes a template part; the opening `` ` `` or `}` is already consumed.
    fn template(&mut self, start: Pos, head: bool) -> Result<Token<'a>, LexError> {
        let template_start = if head {
            start
        } else {
            // The `}` closes the innermost substitution.
            match self.open.pop() {
                Some(open) => open.template_start,
                None => start,
            }
        };
        let mut out = Decoded::default();
        let mut valid = true;
        let part = loop {
            match self.peek() {
                None => return Err(Self::error(template_start, "unterminated template literal")),
                Some('`') => {
                    self.bump();
                    break if head {
                        TemplatePart::NoSubstitution
                    } else {
                        TemplatePart::Tail
                    };
                }
                Some('$') if self.peek2() == Some('{') => {
                    self.bump();
                    self.bump();
                    self.open.push(OpenSubstitution {
                        depth: 0,
                        template_start,
                    });
                    break if head {
                        TemplatePart::Head
                    } else {
                        TemplatePart::Middle
                    };
                }
                Some('\\') => {
                    self.bump();
                    valid &= self.escape(&mut out, true, template_start)?;
                }
                Some('\r') => {
                    // Cooked text normalizes CR and CRLF to LF.
                    self.bump();
                    self.bump_if('\n');
                    out.push('\n');
                }
                Some(c) => {
                    self.bump();
                    out.push(c);
                }
            }
        };
        self.expr_end = matches!(part, TemplatePart::NoSubstitution | TemplatePart::Tail);
        let cooked = valid.then(|| out.finish());
        Ok(self.token(TokenKind::Template(part), start, cooked))
    }

    fn regex(&mut self, start: Pos) -> Result<Token<'a>, LexError> {
        self.bump();
        let mut in_class = false;
        loop {
            match self.peek() {
                None => return Err(Self::error(start, "unterminated regular expression")),
                Some(c) if is_line_terminator(c) => {
                    return Err(Self::error(start, "unterminated regular expression"));
                }
                Some('\\') => {
                    self.bump();
                    match self.peek() {
                        Some(c) if !is_line_terminator(c) => {
                            self.bump();
                        }
                        _ => return Err(Self::error(start, "unterminated regular expression")),
                    }
                }
                Some('[') => {
                    self.bump();
                    in_class = true;
                }
                Some(']') => {
                    self.bump();
                    in_class = false;
                }
                Some('/') if !in_class => {
                    self.bump();
                    break;
                }
                Some(_) => {
                    self.bump();
                }
            }
        }
        while self.peek().is_some_and(is_id_part) {
            self.bump();
        }
        self.expr_end = true;
        Ok(self.token(TokenKind::Regex, start, None))
    }
}

impl<'a> Iterator for Lexer<'a> {
    type Item = Result<Token<'a>, LexError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_token() {
            Ok(token) => token.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Vec<(TokenKind, String)> {
        tokenize(src)
            .unwrap()
            .into_iter()
            .map(|t| (t.kind, t.text.to_string()))
            .collect()
    }

    fn texts(src: &str) -> Vec<String> {
        tokenize(src)
            .unwrap()
            .into_iter()
            .map(|t| t.text.to_string())
            .collect()
    }

    fn one(src: &str) -> Token<'_> {
        let mut toks = tokenize(src).unwrap();
        assert_eq!(toks.len(), 1, "{toks:?}");
        toks.remove(0)
    }

    fn err(src: &str) -> LexError {
        tokenize(src).unwrap_err()
    }

    #[test]
    fn identifiers_and_punctuators() {
        assert_eq!(
            texts("a...b => c?.d ?? e === f !== g == h != i <= j >= k && l || m ** n"),
            vec![
                "a", "...", "b", "=>", "c", "?.", "d", "??", "e", "===", "f", "!==", "g", "==",
                "h", "!=", "i", "<=", "j", ">=", "k", "&&", "l", "||", "m", "**", "n"
            ]
        );
        assert_eq!(
            texts("x++; y--; z += 1; w -= 2; v >>>= 3; u ??= 4"),
            vec![
                "x", "++", ";", "y", "--", ";", "z", "+=", "1", ";", "w", "-=", "2", ";", "v",
                ">>>=", "3", ";", "u", "??=", "4"
            ]
        );
        assert_eq!(
            texts("f({a:[1,2]}).g;"),
            vec![
                "f", "(", "{", "a", ":", "[", "1", ",", "2", "]", "}", ")", ".", "g", ";"
            ]
        );
    }

    #[test]
    fn optional_chain_before_digit_is_conditional() {
        assert_eq!(texts("a?.5:b"), vec!["a", "?", ".5", ":", "b"]);
    }

    #[test]
    fn kinds_are_reported() {
        assert_eq!(
            kinds("/c/g $x _y 12 'a' `b`"),
            vec![
                (TokenKind::Regex, "/c/g".into()),
                (TokenKind::Ident, "$x".into()),
                (TokenKind::Ident, "_y".into()),
                (TokenKind::Number, "12".into()),
                (TokenKind::String, "'a'".into()),
                (
                    TokenKind::Template(TemplatePart::NoSubstitution),
                    "`b`".into()
                ),
            ]
        );
    }

    #[test]
    fn positions_are_lines_and_character_columns() {
        let toks = tokenize("a\n  bb\r\n\tc\rd é f").unwrap();
        let pos: Vec<_> = toks.iter().map(|t| (t.text, t.line, t.column)).collect();
        assert_eq!(
            pos,
            vec![
                ("a", 1, 1),
                ("bb", 2, 3),
                ("c", 3, 2),
                ("d", 4, 1),
                ("é", 4, 3),
                ("f", 4, 5)
            ]
        );
        let toks = tokenize("'é' x").unwrap();
        assert_eq!(toks[1].column, 5);
        assert_eq!(toks[1].span, 5..6);
    }

    #[test]
    fn unicode_line_separators_count_as_lines() {
        let toks = tokenize("a\u{2028}b\u{2029}c").unwrap();
        assert_eq!(
            toks.iter().map(|t| t.line).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
    }

    #[test]
    fn numbers() {
        for src in [
            "0",
            "42",
            "3.14",
            "1e10",
            "1E-5",
            "2.5e+3",
            "0x1F",
            "0XaB",
            "0o17",
            "0b1010",
            "1_000_000",
            "0xFF_FF",
            "10n",
            "0x1fn",
            ".5",
            "5.",
            "1.e3",
        ] {
            let t = one(src);
            assert_eq!((t.kind, t.text), (TokenKind::Number, src), "{src}");
        }
        assert_eq!(
            texts("1..toString()"),
            vec!["1.", ".", "toString", "(", ")"]
        );
        assert_eq!(texts("a.b.5"), vec!["a", ".", "b", ".5"]);
    }

    #[test]
    fn bad_numbers_are_errors() {
        assert!(err("0x").message.contains("no digits"));
        assert!(err("3in x").message.contains("identifier starts"));
    }

    #[test]
    fn strings_decode_escapes() {
        let t = one(r#""a\nb\tc\rd\be\ff\vg\0h\'i\"j\\k""#);
        assert_eq!(
            t.value.as_deref(),
            Some("a\nb\tc\rd\u{8}e\u{c}f\u{b}g\0h'i\"j\\k")
        );
        let t = one(r"'\x41\u0042\u{43}\u{1F600}\uD83D\uDE00\q'");
        assert_eq!(t.value.as_deref(), Some("ABC😀😀q"));
        let t = one("'a\\\nb\\\r\nc'");
        assert_eq!(t.value.as_deref(), Some("abc"));
        let t = one(r"'\101\7\08'");
        assert_eq!(t.value.as_deref(), Some("A\u{7}\u{0}8"));
        let t = one(r"'\uD800x'");
        assert_eq!(t.value.as_deref(), Some("\u{FFFD}x"));
    }

    #[test]
    fn string_line_continuation_moves_lines() {
        let toks = tokenize("'a\\\nb' x").unwrap();
        assert_eq!((toks[1].line, toks[1].column), (2, 4));
    }

    #[test]
    fn string_errors() {
        let e = err("x\n'abc\n'");
        assert_eq!((e.line, e.column), (2, 1));
        assert_eq!(e.message, "unterminated string literal");
        assert_eq!(err("\"abc").message, "unterminated string literal");
        assert_eq!(
            err("'\\x4g'").message,
            "invalid hexadecimal escape sequence"
        );
        assert_eq!(
            err("'\\u{110000}'").message,
            "invalid unicode escape sequence"
        );
        assert_eq!(err("'abc\\").message, "unterminated string literal");
    }

    #[test]
    fn template_without_substitution() {
        let t = one("`a\\n$`");
        assert_eq!(t.kind, TokenKind::Template(TemplatePart::NoSubstitution));
        assert_eq!(t.value.as_deref(), Some("a\n$"));
        let t = one("`line1\r\nline2\\`x\\${y}`");
        assert_eq!(t.value.as_deref(), Some("line1\nline2`x${y}"));
    }

    #[test]
    fn template_with_substitutions_is_split() {
        let toks = tokenize("`a${b}c${ {d: 1}.d }e` + 1").unwrap();
        let got: Vec<_> = toks
            .iter()
            .map(|t| (t.kind, t.text, t.value.as_deref()))
            .collect();
        use TemplatePart::*;
        use TokenKind::*;
        assert_eq!(
            got,
            vec![
                (Template(Head), "`a${", Some("a")),
                (Ident, "b", None),
                (Template(Middle), "}c${", Some("c")),
                (Punct, "{", None),
                (Ident, "d", None),
                (Punct, ":", None),
                (Number, "1", None),
                (Punct, "}", None),
                (Punct, ".", None),
                (Ident, "d", None),
                (Template(Tail), "}e`", Some("e")),
                (Punct, "+", None),
                (Number, "1", None),
            ]
        );
    }

    #[test]
    fn nested_templates() {
        let toks = tokenize("`x${ `y${ z }w` }v` / 2").unwrap();
        let got: Vec<_> = toks.iter().map(|t| t.text).collect();
        assert_eq!(got, vec!["`x${", "`y${", "z", "}w`", "}v`", "/", "2"]);
    }

    #[test]
    fn template_invalid_escape_has_no_cooked_value() {
        let toks = tokenize("String.raw`C:\\users\\x`").unwrap();
        assert_eq!(
            toks[3].kind,
            TokenKind::Template(TemplatePart::NoSubstitution)
        );
        assert_eq!(toks[3].value, None);
    }

    #[test]
    fn template_errors() {
        let e = err("x = `abc\n\ndef");
        assert_eq!(
            (e.line, e.column, e.message.as_str()),
            (1, 5, "unterminated template literal")
        );
        let e = err("`a${ b ");
        assert_eq!((e.line, e.column), (1, 1));
        assert_eq!(err("`a${ `b${c}").message, "unterminated template literal");
    }

    #[test]
    fn comments_and_hashbang_are_skipped() {
        assert_eq!(
            texts("#!/usr/bin/env node\n// line\n/* block\n */ a /* x */ b // c"),
            vec!["a", "b"]
        );
        let toks = tokenize("\u{FEFF}#!x\na").unwrap();
        assert_eq!((toks[0].line, toks[0].column), (2, 1));
        let e = err("a /* never\nclosed");
        assert_eq!(
            (e.line, e.column, e.message.as_str()),
            (1, 3, "unterminated comment")
        );
    }

    #[test]
    fn hashbang_only_at_start_and_private_names() {
        assert_eq!(texts("this.#x"), vec!["this", ".", "#x"]);
        assert_eq!(texts("a #!b"), vec!["a", "#", "!", "b"]);
    }

    #[test]
    fn regex_literals() {
        let t = one("/ab+c/gi");
        assert_eq!(t.kind, TokenKind::Regex);
        assert_eq!(
            kinds("x = /[/\\]]+/.test(s)")[2],
            (TokenKind::Regex, "/[/\\]]+/".into())
        );
        // `//` and `/*` inside a regex are not comments.
        assert_eq!(
            kinds(r"r = /\/\/|\/\*/g; y")[2],
            (TokenKind::Regex, r"/\/\/|\/\*/g".into())
        );
        assert_eq!(kinds("[/[//*]/]")[1], (TokenKind::Regex, "/[//*]/".into()));
    }

    #[test]
    fn regex_versus_division() {
        let k = kinds("a / b / c");
        assert!(
            k.iter()
                .filter(|(kind, _)| *kind == TokenKind::Punct)
                .count()
                == 2
        );
        let k = kinds("x = /ab+c/g.test(s)");
        assert_eq!(k[2], (TokenKind::Regex, "/ab+c/g".into()));
        assert_eq!(kinds("return /x/")[1].0, TokenKind::Regex);
        assert_eq!(kinds("typeof /x/")[1].0, TokenKind::Regex);
        assert_eq!(kinds("(a) / 2")[3].1, "/");
        assert_eq!(kinds("a[0] / 2")[4].1, "/");
        assert_eq!(kinds("1 / 2")[1].1, "/");
        assert_eq!(kinds("'s' / 2")[1].1, "/");
        assert_eq!(kinds("`s` / 2")[1].1, "/");
        assert_eq!(kinds("x.return / 2")[3].1, "/");
        assert_eq!(kinds("a /= 2")[1].1, "/=");
        assert_eq!(kinds("f(/x/)")[2].0, TokenKind::Regex);
        assert_eq!(kinds("`${/x/}`")[1].0, TokenKind::Regex);
        // `}` is treated as ending an expression.
        let k = kinds("({}) / 2; {a} / 2");
        assert_eq!((k[4].1.as_str(), k[10].1.as_str()), ("/", "/"));
    }

    #[test]
    fn regex_errors() {
        let e = err("x = /abc\n/");
        assert_eq!(
            (e.line, e.column, e.message.as_str()),
            (1, 5, "unterminated regular expression")
        );
        assert_eq!(err("/[/").message, "unterminated regular expression");
    }

    #[test]
    fn identifier_escapes_are_decoded() {
        let t = one("requir\\u0065");
        assert_eq!(t.name(), "require");
        assert!(t.is_ident("require"));
        assert_eq!(t.text, "requir\\u0065");
        assert_eq!(err("a\\x").message, "invalid escape in identifier");
    }

    #[test]
    fn unicode_identifiers() {
        assert_eq!(texts("café = ñ"), vec!["café", "=", "ñ"]);
    }

    #[test]
    fn lexer_stops_after_error() {
        let mut lexer = Lexer::new("a 'b");
        assert!(lexer.next().is_some_and(|t| t.is_ok()));
        assert!(lexer.next().is_some_and(|t| t.is_err()));
        assert!(lexer.next().is_none());
    }

    #[test]
    fn spans_match_text() {
        let src = "const s = `a${1}b` + 'c' // x\n/re/.x";
        for t in tokenize(src).unwrap() {
            assert_eq!(&src[t.span.clone()], t.text);
        }
    }
}
