//! Static reading of a workflow script, before it runs.
//!
//! A workflow script is plain JavaScript whose first statement is
//! `export const meta = { … }`. [`read_meta`] reads and checks only that
//! statement (used to list saved workflows: a syntax error further down does
//! not hide the entry). [`prepare`] also checks the length limit, lexes the
//! whole script, scans the code for module loading and non-deterministic
//! calls, and returns the body to run.
//!
//! Invariants:
//! - `meta` must be a pure literal: strings (quotes, or a template without
//!   substitutions), numbers (with unary `-`/`+`), `true`, `false`, `null`,
//!   arrays and objects of those, keys being identifiers (keywords too),
//!   strings or numbers, trailing commas allowed, duplicate keys last-wins.
//!   Nothing is evaluated; everything else is rejected with its line.
//! - Numbers become JSON integers when the value is integral and exact
//!   (an integer literal that fits `u64`/`i64`, or an integral value below
//!   2^53 such as `1.0` or `1e3`), floats otherwise; `-0` becomes `0`, as
//!   `JSON.stringify` does. BigInts and non-finite values are rejected.
//! - [`Prepared::body`] is the source with the `export` keyword of the meta
//!   statement replaced by six spaces, so every line and column is where it
//!   was and `meta` stays a local constant.
//! - The scan looks only at code tokens (the lexer keeps strings, template
//!   text, regexes and comments apart, and emits the code inside `${…}` as
//!   ordinary tokens). A name right after `.` or `?.` is a property, never
//!   the global: `x.import(…)`, `a.require(…)` and `x.Date.now()` pass.
//! - Every error message starts lowercase, has no trailing period, and when
//!   `line` is set the message itself says "at line N".
//!
//! Start reading at [`prepare`]; the literal reader is `Parser::value`.

use super::lex::{LexError, Lexer, TemplatePart, Token, TokenKind};
use serde_json::{Map, Number, Value};

/// The longest script accepted by [`prepare`], in characters.
pub const MAX_SCRIPT_CHARS: usize = 524_288;

/// How deeply arrays and objects may nest inside `meta`.
const MAX_DEPTH: usize = 64;

const MUST_START: &str = "the script must start with `export const meta = { ... }`";
const NOT_LITERAL: &str = "meta must be a literal object";
const PHASES_SHAPE: &str = "meta.phases must be an array of { title, detail?, model? }";
const BREAKS_RESUME: &str =
    "it would break resume, because a relaunched run must repeat the same agent() calls";
const NO_MODULES: &str = "workflows cannot load modules, inline what you need";

/// The checked `meta` of a workflow script.
#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    pub name: String,
    pub description: String,
    pub when_to_use: Option<String>,
    pub phases: Vec<PhaseMeta>,
    /// The whole literal as JSON, unknown keys included.
    pub raw: Value,
}

/// One entry of `meta.phases`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseMeta {
    pub title: String,
    pub detail: Option<String>,
    pub model: Option<String>,
}

/// A script that passed the static checks.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub meta: Meta,
    /// The source with `export` of the meta statement blanked to spaces.
    pub body: String,
    /// 1-based line of the meta statement's `export`.
    pub meta_line: usize,
}

/// Why a script was rejected. When `line` is set, `message` already says
/// "at line N"; `Display` prints `message` alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ScriptError {
    pub line: Option<usize>,
    pub column: Option<usize>,
    pub message: String,
}

impl ScriptError {
    fn at(line: usize, column: usize, message: String) -> Self {
        ScriptError {
            line: Some(line),
            column: Some(column),
            message,
        }
    }

    fn at_token(token: &Token<'_>, message: String) -> Self {
        Self::at(token.line, token.column, message)
    }

    fn not_literal(token: &Token<'_>, found: &str) -> Self {
        Self::at_token(
            token,
            format!("{NOT_LITERAL}: found {found} at line {}", token.line),
        )
    }
}

impl From<LexError> for ScriptError {
    fn from(e: LexError) -> Self {
        ScriptError::at(
            e.line,
            e.column,
            format!("syntax error at line {}: {}", e.line, e.message),
        )
    }
}

/// Reads and checks `meta` only; the rest of the script is not lexed.
pub fn read_meta(source: &str) -> Result<Meta, ScriptError> {
    Ok(Parser::new(source).meta_statement()?.meta)
}

/// Checks a whole script and returns its meta and the body to run.
pub fn prepare(source: &str) -> Result<Prepared, ScriptError> {
    let chars = source.chars().count();
    if chars > MAX_SCRIPT_CHARS {
        return Err(ScriptError {
            line: None,
            column: None,
            message: format!(
                "the script is {chars} characters long; the limit is {MAX_SCRIPT_CHARS}"
            ),
        });
    }
    let mut parser = Parser::new(source);
    let statement = parser.meta_statement()?;
    parser.fill_all()?;
    scan(&parser.toks[statement.end..])?;
    let export = statement.export;
    let mut body = String::with_capacity(source.len());
    body.push_str(&source[..export.start]);
    body.push_str(&" ".repeat(export.len()));
    body.push_str(&source[export.end..]);
    Ok(Prepared {
        meta: statement.meta,
        body,
        meta_line: statement.meta_line,
    })
}

/// The meta statement, read.
struct MetaStatement {
    meta: Meta,
    /// Byte range of its `export` keyword.
    export: std::ops::Range<usize>,
    meta_line: usize,
    /// Index of the first token after the statement.
    end: usize,
}

/// A literal value with the position of its first token.
#[derive(Debug, Clone, PartialEq)]
struct Lit {
    value: LitValue,
    line: usize,
    column: usize,
}

#[derive(Debug, Clone, PartialEq)]
enum LitValue {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Array(Vec<Lit>),
    /// Entries in source order; duplicates kept, the last one wins.
    Object(Vec<(String, Lit)>),
}

impl Lit {
    fn to_json(&self) -> Value {
        match &self.value {
            LitValue::Null => Value::Null,
            LitValue::Bool(b) => Value::Bool(*b),
            LitValue::Number(n) => Value::Number(n.clone()),
            LitValue::String(s) => Value::String(s.clone()),
            LitValue::Array(items) => Value::Array(items.iter().map(Lit::to_json).collect()),
            LitValue::Object(entries) => {
                let mut map = Map::new();
                for (key, value) in entries {
                    map.insert(key.clone(), value.to_json());
                }
                Value::Object(map)
            }
        }
    }

    /// The value of `key` in an object (the last one written wins).
    fn get(&self, key: &str) -> Option<&Lit> {
        match &self.value {
            LitValue::Object(entries) => entries.iter().rev().find(|(k, _)| k == key).map(|e| &e.1),
            _ => None,
        }
    }

    /// "a number", "an empty string", … for messages.
    fn describe(&self) -> &'static str {
        match &self.value {
            LitValue::Null => "null",
            LitValue::Bool(_) => "a boolean",
            LitValue::Number(_) => "a number",
            LitValue::String(s) if s.trim().is_empty() => "an empty string",
            LitValue::String(_) => "a string",
            LitValue::Array(_) => "an array",
            LitValue::Object(_) => "an object",
        }
    }

    fn non_empty_string(&self) -> Option<&str> {
        match &self.value {
            LitValue::String(s) if !s.trim().is_empty() => Some(s),
            _ => None,
        }
    }
}

/// A numeric literal's value before a sign is applied.
#[derive(Debug, Clone, Copy, PartialEq)]
enum NumLit {
    Int(u64),
    Float(f64),
}

/// What a number token is that a workflow's metadata may not hold (`a BigInt \`1n\``).
struct Disallowed(String);

/// Reads a number token's text; `Err` describes why it is not allowed.
fn parse_number(text: &str) -> Result<NumLit, Disallowed> {
    if text.ends_with('n') {
        return Err(Disallowed(format!("a BigInt `{text}`")));
    }
    let digits: String = text.chars().filter(|&c| c != '_').collect();
    let radix = match digits.get(..2) {
        Some("0x" | "0X") => 16,
        Some("0o" | "0O") => 8,
        Some("0b" | "0B") => 2,
        _ => 10,
    };
    if radix != 10 {
        let body = &digits[2..];
        if let Ok(n) = u64::from_str_radix(body, radix) {
            return Ok(NumLit::Int(n));
        }
        let value = body
            .chars()
            .filter_map(|c| c.to_digit(radix))
            .fold(0.0_f64, |acc, d| acc * f64::from(radix) + f64::from(d));
        return Ok(NumLit::Float(value));
    }
    let bytes = digits.as_bytes();
    if bytes.len() > 1 && bytes[0] == b'0' && bytes[1].is_ascii_digit() {
        return Err(Disallowed(format!("a legacy octal number `{text}`")));
    }
    if digits.bytes().all(|b| b.is_ascii_digit())
        && let Ok(n) = digits.parse::<u64>()
    {
        return Ok(NumLit::Int(n));
    }
    match digits.parse::<f64>() {
        Ok(f) if f.is_finite() => Ok(NumLit::Float(f)),
        _ => Err(Disallowed(format!("a number too large for JSON `{text}`"))),
    }
}

/// 2^53: below it every integer is exact in a double.
const EXACT_LIMIT: f64 = 9_007_199_254_740_992.0;

fn float_number(f: f64) -> Option<Number> {
    if f.is_finite() && f.fract() == 0.0 && f.abs() < EXACT_LIMIT {
        // Exact: |f| < 2^53 fits i64 without loss.
        Some(Number::from(f as i64))
    } else {
        Number::from_f64(f)
    }
}

fn json_number(n: NumLit, negative: bool) -> Option<Number> {
    match (n, negative) {
        (NumLit::Int(u), false) => Some(Number::from(u)),
        (NumLit::Int(u), true) => match i64::try_from(-i128::from(u)) {
            Ok(i) => Some(Number::from(i)),
            Err(_) => float_number(-(u as f64)),
        },
        (NumLit::Float(f), negative) => float_number(if negative { -f } else { f }),
    }
}

/// The property name a numeric key stands for (JavaScript's ToString).
fn number_key(n: NumLit) -> String {
    match n {
        NumLit::Int(u) => u.to_string(),
        NumLit::Float(f) if f.fract() == 0.0 && f.abs() < 1e21 => format!("{f}"),
        NumLit::Float(f) if f != 0.0 && (f.abs() >= 1e21 || f.abs() < 1e-6) => {
            let s = format!("{f:e}");
            match s.split_once('e') {
                Some((mantissa, exp)) if !exp.starts_with('-') => format!("{mantissa}e+{exp}"),
                _ => s,
            }
        }
        NumLit::Float(f) => format!("{f}"),
    }
}

/// Shortens source text for a message: whitespace runs become one space,
/// and long text is cut with an ellipsis.
fn snippet(text: &str) -> String {
    let squashed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if squashed.chars().count() > 40 {
        let cut: String = squashed.chars().take(40).collect();
        format!("{cut}…")
    } else {
        squashed
    }
}

struct Parser<'a> {
    src: &'a str,
    lexer: Lexer<'a>,
    toks: Vec<Token<'a>>,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        Parser {
            src,
            lexer: Lexer::new(src),
            toks: Vec::new(),
            pos: 0,
        }
    }

    /// Lexes until token `index` exists or the source ends.
    fn fill(&mut self, index: usize) -> Result<(), ScriptError> {
        while self.toks.len() <= index {
            match self.lexer.next() {
                Some(token) => self.toks.push(token?),
                None => break,
            }
        }
        Ok(())
    }

    fn fill_all(&mut self) -> Result<(), ScriptError> {
        self.fill(usize::MAX)
    }

    /// The token `k` places ahead, cloned.
    fn peek(&mut self, k: usize) -> Result<Option<Token<'a>>, ScriptError> {
        let index = self.pos + k;
        self.fill(index)?;
        Ok(self.toks.get(index).cloned())
    }

    fn peek_punct(&mut self, k: usize, p: &str) -> Result<bool, ScriptError> {
        Ok(self.peek(k)?.is_some_and(|t| t.is_punct(p)))
    }

    /// The source from the start of token `from` to the end of token `to`.
    fn source_between(&self, from: usize, to: usize) -> String {
        match (self.toks.get(from), self.toks.get(to)) {
            (Some(a), Some(b)) => snippet(&self.src[a.span.start..b.span.end]),
            _ => String::new(),
        }
    }

    /// The error for the end of the script in the middle of meta.
    fn unexpected_end(&self) -> ScriptError {
        let (line, column) = self.toks.last().map_or((1, 1), |t| (t.line, t.column));
        ScriptError::at(
            line,
            column,
            format!("{NOT_LITERAL}: the script ends at line {line} before meta is closed"),
        )
    }

    fn next_or_end(&mut self) -> Result<Token<'a>, ScriptError> {
        match self.peek(0)? {
            Some(t) => Ok(t),
            None => Err(self.unexpected_end()),
        }
    }

    /// Reads `export const meta = { … }` and an optional `;`, then checks
    /// the fields.
    fn meta_statement(&mut self) -> Result<MetaStatement, ScriptError> {
        let Some(first) = self.peek(0)? else {
            return Err(ScriptError {
                line: None,
                column: None,
                message: format!("{MUST_START}: the script is empty"),
            });
        };
        let expected: [fn(&Token<'_>) -> bool; 4] = [
            |t| t.kind == TokenKind::Ident && t.text == "export",
            |t| t.is_ident("const"),
            |t| t.is_ident("meta"),
            |t| t.is_punct("="),
        ];
        for (k, ok) in expected.iter().enumerate() {
            let token = self.peek(k)?;
            if token.as_ref().is_some_and(|t| ok(t)) {
                continue;
            }
            // Show what is there: up to the mismatch, at least two tokens.
            let last = match token {
                Some(_) => k.max(1),
                None => k.saturating_sub(1),
            };
            self.fill(last)?;
            let last = last.min(self.toks.len().saturating_sub(1));
            return Err(ScriptError::at_token(
                &first,
                format!(
                    "{MUST_START}: found `{}` at line {}",
                    self.source_between(0, last),
                    first.line
                ),
            ));
        }
        self.pos = 4;
        let open = self.next_or_end()?;
        if !open.is_punct("{") {
            let found = self.describe_value_start(&open)?;
            return Err(ScriptError::not_literal(&open, &found));
        }
        let literal = self.value(0)?;
        let close_line = self.toks[self.pos - 1].line;
        match self.peek(0)? {
            None => {}
            Some(t) if t.is_punct(";") => self.pos += 1,
            Some(t) if t.line > close_line && starts_statement(&t) => {}
            Some(t) => {
                return Err(ScriptError::not_literal(
                    &t,
                    &format!(
                        "`{}` right after its closing `}}`; end the statement with `;`",
                        snippet(t.text)
                    ),
                ));
            }
        }
        let meta = check_meta(&literal, &first)?;
        Ok(MetaStatement {
            meta,
            export: first.span.clone(),
            meta_line: first.line,
            end: self.pos,
        })
    }

    /// Reads one literal value starting at the current token.
    fn value(&mut self, depth: usize) -> Result<Lit, ScriptError> {
        let token = self.next_or_end()?;
        if depth > MAX_DEPTH {
            return Err(ScriptError::not_literal(
                &token,
                &format!("nesting deeper than {MAX_DEPTH} levels"),
            ));
        }
        let value = match token.kind {
            TokenKind::Punct if token.text == "{" => {
                self.pos += 1;
                return self.object(&token, depth);
            }
            TokenKind::Punct if token.text == "[" => {
                self.pos += 1;
                return self.array(&token, depth);
            }
            TokenKind::Punct if token.text == "-" || token.text == "+" => {
                return self.signed_number(&token);
            }
            TokenKind::String => LitValue::String(token.value.clone().unwrap_or_default()),
            TokenKind::Template(TemplatePart::NoSubstitution) => match &token.value {
                Some(cooked) => LitValue::String(cooked.clone()),
                None => {
                    return Err(ScriptError::not_literal(
                        &token,
                        "a template literal with an invalid escape",
                    ));
                }
            },
            TokenKind::Number => LitValue::Number(self.number(&token, false)?),
            TokenKind::Ident if token.text == "true" => LitValue::Bool(true),
            TokenKind::Ident if token.text == "false" => LitValue::Bool(false),
            TokenKind::Ident if token.text == "null" => LitValue::Null,
            _ => {
                let found = self.describe_value_start(&token)?;
                return Err(ScriptError::not_literal(&token, &found));
            }
        };
        self.pos += 1;
        Ok(Lit {
            value,
            line: token.line,
            column: token.column,
        })
    }

    fn number(&self, token: &Token<'_>, negative: bool) -> Result<Number, ScriptError> {
        let parsed =
            parse_number(token.text).map_err(|found| ScriptError::not_literal(token, &found.0))?;
        json_number(parsed, negative).ok_or_else(|| {
            ScriptError::not_literal(
                token,
                &format!("a number too large for JSON `{}`", token.text),
            )
        })
    }

    /// `-1`, `+2`, `- -3`: unary signs in front of a number.
    fn signed_number(&mut self, first: &Token<'a>) -> Result<Lit, ScriptError> {
        let mut negative = false;
        let mut operand = self.next_or_end()?;
        while operand.is_punct("-") || operand.is_punct("+") {
            negative ^= operand.text == "-";
            self.pos += 1;
            operand = self.next_or_end()?;
        }
        if operand.kind == TokenKind::Number {
            let number = self.number(&operand, negative)?;
            self.pos += 1;
            return Ok(Lit {
                value: LitValue::Number(number),
                line: first.line,
                column: first.column,
            });
        }
        let is_name =
            operand.kind == TokenKind::Ident && !matches!(operand.text, "true" | "false" | "null");
        let found = if is_name {
            self.describe_value_start(&operand)?
        } else {
            format!(
                "a unary `{}` before something other than a number",
                first.text
            )
        };
        Err(ScriptError::not_literal(
            if is_name { &operand } else { first },
            &found,
        ))
    }

    /// Describes a token that cannot start a literal value.
    fn describe_value_start(&mut self, token: &Token<'a>) -> Result<String, ScriptError> {
        let next = self.peek(1)?;
        let next_is = |p: &str| next.as_ref().is_some_and(|t| t.is_punct(p));
        let text = snippet(token.text);
        Ok(match token.kind {
            TokenKind::Ident => match token.name() {
                "function" => "a function (`function`)".to_string(),
                "class" => "a class (`class`)".to_string(),
                "async" => "an async function (`async`)".to_string(),
                "new" => "a `new` expression".to_string(),
                _ if next_is("=>") => format!("an arrow function `{text} =>`"),
                _ if next_is("(") || next_is("?.") && self.peek_punct(2, "(")? => {
                    format!("a function call `{text}(`")
                }
                _ if next
                    .as_ref()
                    .is_some_and(|t| matches!(t.kind, TokenKind::Template(_))) =>
                {
                    format!("a tagged template `{text}`")
                }
                _ => format!("a variable reference `{text}`"),
            },
            TokenKind::Template(_) => "a template substitution (`${`)".to_string(),
            TokenKind::Regex => format!("a regular expression `{text}`"),
            TokenKind::Punct if token.text == "..." => "a spread (`...`)".to_string(),
            TokenKind::Punct if token.text == "(" => {
                if self.arrow_after_paren()? {
                    "an arrow function `(…) =>`".to_string()
                } else {
                    "a parenthesized expression `(`".to_string()
                }
            }
            _ => format!("an unexpected `{text}`"),
        })
    }

    /// Whether the `(` at the current position opens an arrow's parameters.
    fn arrow_after_paren(&mut self) -> Result<bool, ScriptError> {
        let mut depth = 0usize;
        let mut k = 0;
        while let Some(t) = self.peek(k)? {
            if t.is_punct("(") {
                depth += 1;
            } else if t.is_punct(")") {
                depth -= 1;
                if depth == 0 {
                    return self.peek_punct(k + 1, "=>");
                }
            }
            k += 1;
        }
        Ok(false)
    }

    /// Describes what follows a complete value when it is not `,` or the
    /// closer, e.g. a call or an operator.
    fn after_value_error(
        &mut self,
        value_start: usize,
        expected: &str,
    ) -> Result<ScriptError, ScriptError> {
        let token = self.next_or_end()?;
        let found = match token.kind {
            TokenKind::Punct if token.text == "(" => {
                format!(
                    "a function call `{}`",
                    self.source_between(value_start, self.pos)
                )
            }
            TokenKind::Punct if matches!(token.text, "." | "?." | "[") => {
                format!("a property access (`{}`)", token.text)
            }
            TokenKind::Template(_) => "a tagged template".to_string(),
            TokenKind::Punct => format!("an operator `{}`", token.text),
            _ => format!("`{}` where {expected} was expected", snippet(token.text)),
        };
        Ok(ScriptError::not_literal(&token, &found))
    }

    /// Reads an object; the `{` is consumed.
    fn object(&mut self, open: &Token<'a>, depth: usize) -> Result<Lit, ScriptError> {
        let mut entries = Vec::new();
        loop {
            let key_token = self.next_or_end()?;
            if key_token.is_punct("}") {
                self.pos += 1;
                break;
            }
            let key = match key_token.kind {
                TokenKind::Ident => key_token.name().to_string(),
                TokenKind::String => key_token.value.clone().unwrap_or_default(),
                TokenKind::Number => number_key(
                    parse_number(key_token.text)
                        .map_err(|found| ScriptError::not_literal(&key_token, &found.0))?,
                ),
                TokenKind::Punct if key_token.text == "..." => {
                    return Err(ScriptError::not_literal(&key_token, "a spread (`...`)"));
                }
                TokenKind::Punct if key_token.text == "[" => {
                    return Err(ScriptError::not_literal(&key_token, "a computed key (`[`)"));
                }
                TokenKind::Punct if key_token.text == "*" => {
                    return Err(ScriptError::not_literal(
                        &key_token,
                        "a generator method (`*`)",
                    ));
                }
                _ => {
                    return Err(ScriptError::not_literal(
                        &key_token,
                        &format!("`{}` where a key was expected", snippet(key_token.text)),
                    ));
                }
            };
            self.pos += 1;
            let after = self.next_or_end()?;
            let is_name = key_token.kind == TokenKind::Ident;
            let text = snippet(key_token.text);
            if after.is_punct(":") {
                self.pos += 1;
            } else if after.is_punct("(") {
                return Err(ScriptError::not_literal(
                    &key_token,
                    &format!("a method `{text}(`"),
                ));
            } else if is_name && (after.is_punct(",") || after.is_punct("}")) {
                return Err(ScriptError::not_literal(
                    &key_token,
                    &format!("a shorthand property `{text}`"),
                ));
            } else if is_name && after.is_punct("=") {
                return Err(ScriptError::not_literal(
                    &key_token,
                    &format!("a shorthand property with a default `{text} =`"),
                ));
            } else if is_name
                && matches!(key.as_str(), "get" | "set" | "async")
                && (matches!(
                    after.kind,
                    TokenKind::Ident | TokenKind::String | TokenKind::Number
                ) || after.is_punct("[")
                    || after.is_punct("*"))
            {
                return Err(ScriptError::not_literal(
                    &key_token,
                    &format!("a method `{text} {}`", snippet(after.text)),
                ));
            } else {
                return Err(ScriptError::not_literal(
                    &after,
                    &format!("`{}` where `:` was expected", snippet(after.text)),
                ));
            }
            let value_start = self.pos;
            let value = self.value(depth + 1)?;
            entries.push((key, value));
            let separator = self.next_or_end()?;
            if separator.is_punct(",") {
                self.pos += 1;
            } else if separator.is_punct("}") {
                self.pos += 1;
                break;
            } else {
                return Err(self.after_value_error(value_start, "`,` or `}`")?);
            }
        }
        Ok(Lit {
            value: LitValue::Object(entries),
            line: open.line,
            column: open.column,
        })
    }

    /// Reads an array; the `[` is consumed.
    fn array(&mut self, open: &Token<'a>, depth: usize) -> Result<Lit, ScriptError> {
        let mut items = Vec::new();
        loop {
            let token = self.next_or_end()?;
            if token.is_punct("]") {
                self.pos += 1;
                break;
            }
            if token.is_punct(",") {
                return Err(ScriptError::not_literal(
                    &token,
                    "an empty array slot (`,,`)",
                ));
            }
            let value_start = self.pos;
            items.push(self.value(depth + 1)?);
            let separator = self.next_or_end()?;
            if separator.is_punct(",") {
                self.pos += 1;
            } else if separator.is_punct("]") {
                self.pos += 1;
                break;
            } else {
                return Err(self.after_value_error(value_start, "`,` or `]`")?);
            }
        }
        Ok(Lit {
            value: LitValue::Array(items),
            line: open.line,
            column: open.column,
        })
    }
}

/// Whether a token on a new line after `meta`'s `}` begins a new statement
/// (automatic semicolon insertion) rather than continuing the expression.
fn starts_statement(token: &Token<'_>) -> bool {
    match token.kind {
        TokenKind::Ident => !matches!(token.name(), "in" | "instanceof"),
        TokenKind::String | TokenKind::Number => true,
        TokenKind::Punct => matches!(token.text, "{" | "!" | "~" | "++" | "--" | ";"),
        TokenKind::Template(_) | TokenKind::Regex => false,
    }
}

/// Checks the fields of the meta literal. `export` locates missing fields.
fn check_meta(literal: &Lit, export: &Token<'_>) -> Result<Meta, ScriptError> {
    let required = |key: &str| -> Result<String, ScriptError> {
        match literal.get(key) {
            Some(value) => value.non_empty_string().map(str::to_string).ok_or_else(|| {
                ScriptError::at(
                    value.line,
                    value.column,
                    format!(
                        "meta.{key} is required and must be a non-empty string: found {} at line {}",
                        value.describe(),
                        value.line
                    ),
                )
            }),
            None => Err(ScriptError::at_token(
                export,
                format!(
                    "meta.{key} is required and must be a non-empty string: meta at line {} has none",
                    export.line
                ),
            )),
        }
    };
    let name = required("name")?;
    let description = required("description")?;
    let when_to_use = match literal.get("whenToUse") {
        None => None,
        Some(Lit {
            value: LitValue::String(s),
            ..
        }) => Some(s.clone()),
        Some(other) => {
            return Err(ScriptError::at(
                other.line,
                other.column,
                format!(
                    "meta.whenToUse must be a string: found {} at line {}",
                    other.describe(),
                    other.line
                ),
            ));
        }
    };
    let phases = match literal.get("phases") {
        None => Vec::new(),
        Some(Lit {
            value: LitValue::Array(items),
            ..
        }) => items
            .iter()
            .enumerate()
            .map(|(i, item)| check_phase(i, item))
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ScriptError::at(
                other.line,
                other.column,
                format!(
                    "{PHASES_SHAPE}: found {} at line {}",
                    other.describe(),
                    other.line
                ),
            ));
        }
    };
    Ok(Meta {
        name,
        description,
        when_to_use,
        phases,
        raw: literal.to_json(),
    })
}

fn check_phase(index: usize, item: &Lit) -> Result<PhaseMeta, ScriptError> {
    let fail = |at: &Lit, what: String| {
        ScriptError::at(
            at.line,
            at.column,
            format!("{PHASES_SHAPE}: phases[{index}]{what} at line {}", at.line),
        )
    };
    if !matches!(item.value, LitValue::Object(_)) {
        return Err(fail(item, format!(" is {}", item.describe())));
    }
    let title = match item.get("title") {
        None => return Err(fail(item, " has no title".to_string())),
        Some(t) => t
            .non_empty_string()
            .ok_or_else(|| fail(t, format!(".title is {}", t.describe())))?
            .to_string(),
    };
    let optional = |key: &str| match item.get(key) {
        None => Ok(None),
        Some(Lit {
            value: LitValue::String(s),
            ..
        }) => Ok(Some(s.clone())),
        Some(other) => Err(fail(other, format!(".{key} is {}", other.describe()))),
    };
    Ok(PhaseMeta {
        title,
        detail: optional("detail")?,
        model: optional("model")?,
    })
}

/// Scans the code after the meta statement for module loading and
/// non-deterministic calls.
fn scan(toks: &[Token<'_>]) -> Result<(), ScriptError> {
    let punct = |i: usize, p: &str| toks.get(i).is_some_and(|t| t.is_punct(p));
    let ident = |i: usize, name: &str| toks.get(i).is_some_and(|t| t.is_ident(name));
    // A call at `i`: `(` or `?.(`.
    let call_at = |i: usize| punct(i, "(") || (punct(i, "?.") && punct(i + 1, "("));
    let dot_at = |i: usize| punct(i, ".") || punct(i, "?.");
    // `name(…) {`: a method definition named like the global.
    let method_definition = |i: usize| {
        let mut depth = 0usize;
        for (k, t) in toks.iter().enumerate().skip(i + 1) {
            if t.is_punct("(") {
                depth += 1;
            } else if t.is_punct(")") {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return punct(k + 1, "{");
                }
            }
        }
        false
    };
    for (i, token) in toks.iter().enumerate() {
        if token.kind != TokenKind::Ident || (i > 0 && dot_at(i - 1)) {
            continue;
        }
        let line = token.line;
        let message = match token.name() {
            "import" if !(punct(i + 1, ":") || (punct(i + 1, "(") && method_definition(i))) => {
                format!(
                    "import is not available in workflow scripts: found at line {line}; {NO_MODULES}"
                )
            }
            "require" if call_at(i + 1) && !method_definition(i) => format!(
                "require() is not available in workflow scripts: found at line {line}; {NO_MODULES}"
            ),
            "Date" if dot_at(i + 1) && ident(i + 2, "now") && call_at(i + 3) => format!(
                "Date.now() is not allowed in workflow scripts: found at line {line}; {BREAKS_RESUME} — pass timestamps in through args"
            ),
            "performance" if dot_at(i + 1) && ident(i + 2, "now") && call_at(i + 3) => format!(
                "performance.now() is not allowed in workflow scripts: found at line {line}; {BREAKS_RESUME} — pass timestamps in through args"
            ),
            "Math" if dot_at(i + 1) && ident(i + 2, "random") && call_at(i + 3) => format!(
                "Math.random() is not allowed in workflow scripts: found at line {line}; {BREAKS_RESUME} — derive variety from the item index instead"
            ),
            "new"
                if ident(i + 1, "Date")
                    && !dot_at(i + 2)
                    && (!punct(i + 2, "(") || punct(i + 3, ")")) =>
            {
                format!(
                    "new Date() without an argument is not allowed in workflow scripts: found at line {line}; {BREAKS_RESUME} — pass timestamps in through args; new Date(x) with an argument works"
                )
            }
            _ => continue,
        };
        return Err(ScriptError::at_token(token, message));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HEAD: &str = "export const meta = { name: 'n', description: 'd' };\n";

    fn meta_of(src: &str) -> Meta {
        match prepare(src) {
            Ok(p) => p.meta,
            Err(e) => panic!("{e}"),
        }
    }

    fn raw(literal: &str) -> Value {
        let src = format!("export const meta = {{ name: 'n', description: 'd', x: {literal} }}");
        meta_of(&src).raw["x"].clone()
    }

    fn error(src: &str) -> ScriptError {
        prepare(src).unwrap_err()
    }

    fn body_error(code: &str) -> ScriptError {
        prepare(&format!("{HEAD}{code}")).unwrap_err()
    }

    fn body_ok(code: &str) {
        if let Err(e) = prepare(&format!("{HEAD}{code}")) {
            panic!("{code:?}: {e}");
        }
    }

    fn literal_error(literal: &str) -> String {
        let src = format!("export const meta = {{ name: 'n', description: 'd',\n x: {literal} }}");
        error(&src).message
    }

    #[test]
    fn minimal_script() {
        let p = prepare("export const meta = { name: 'a', description: 'b' }\nlog(1)").unwrap();
        assert_eq!(p.meta.name, "a");
        assert_eq!(p.meta.description, "b");
        assert_eq!(p.meta.when_to_use, None);
        assert!(p.meta.phases.is_empty());
        assert_eq!(p.meta.raw, json!({"name": "a", "description": "b"}));
        assert_eq!(p.meta_line, 1);
    }

    #[test]
    fn comments_and_hashbang_before_meta() {
        let src = "#!/usr/bin/env flotilla\n// a workflow\n/* more\n words */\n\nexport const meta = {\n  name: \"x\", // trailing\n  description: 'y', /* c */\n};\nrun();\n";
        let p = prepare(src).unwrap();
        assert_eq!(p.meta_line, 6);
        assert_eq!(p.meta.name, "x");
        assert_eq!(read_meta(src).unwrap(), p.meta);
    }

    #[test]
    fn full_meta_with_phases() {
        let src = r#"export const meta = {
  name: 'review',
  description: "Review a PR",
  whenToUse: `when a PR is open`,
  phases: [
    { title: 'Read', detail: 'read the diff' },
    { title: 'Judge', model: 'opus', },
    { title: 'Write' },
  ],
  extra: { nested: [1, [2, { deep: true }]], none: null },
};
"#;
        let m = meta_of(src);
        assert_eq!(m.when_to_use.as_deref(), Some("when a PR is open"));
        assert_eq!(
            m.phases,
            vec![
                PhaseMeta {
                    title: "Read".into(),
                    detail: Some("read the diff".into()),
                    model: None
                },
                PhaseMeta {
                    title: "Judge".into(),
                    detail: None,
                    model: Some("opus".into())
                },
                PhaseMeta {
                    title: "Write".into(),
                    detail: None,
                    model: None
                },
            ]
        );
        assert_eq!(
            m.raw["extra"],
            json!({"nested": [1, [2, {"deep": true}]], "none": null})
        );
    }

    #[test]
    fn strings_in_all_quotes_with_escapes() {
        assert_eq!(raw(r#""a\"b\n""#), json!("a\"b\n"));
        assert_eq!(raw(r"'it\'s \x41\u0042\u{1F600}'"), json!("it's AB😀"));
        assert_eq!(raw("`multi\nline \\` tick`"), json!("multi\nline ` tick"));
        assert_eq!(raw("'a\\\nb'"), json!("ab"));
    }

    #[test]
    fn numbers_convert_to_json() {
        assert_eq!(raw("42"), json!(42));
        assert_eq!(raw("-7"), json!(-7));
        assert_eq!(raw("+7"), json!(7));
        assert_eq!(raw("- -7"), json!(7));
        assert_eq!(raw("1.5"), json!(1.5));
        assert_eq!(raw("-0.25"), json!(-0.25));
        assert_eq!(raw("0xff"), json!(255));
        assert_eq!(raw("0o17"), json!(15));
        assert_eq!(raw("0b101"), json!(5));
        assert_eq!(raw("1_000_000"), json!(1_000_000));
        assert_eq!(raw("1e3"), json!(1000));
        assert_eq!(raw("1.0"), json!(1));
        assert_eq!(raw(".5"), json!(0.5));
        assert_eq!(raw("-0"), json!(0));
        assert_eq!(raw("18446744073709551615"), json!(u64::MAX));
        assert_eq!(raw("-9223372036854775808"), json!(i64::MIN));
        assert_eq!(raw("1e300"), json!(1e300));
    }

    #[test]
    fn bad_numbers_are_rejected() {
        assert!(literal_error("10n").contains("a BigInt `10n` at line 2"));
        assert!(literal_error("017").contains("legacy octal"));
        assert!(literal_error("1e999").contains("too large"));
        assert!(literal_error("NaN").contains("a variable reference `NaN`"));
        assert!(literal_error("-Infinity").contains("a variable reference `Infinity`"));
        assert!(literal_error("-'a'").contains("a unary `-` before something other than a number"));
    }

    #[test]
    fn trailing_commas_keyword_and_odd_keys() {
        let v = raw(
            "{ default: 1, new: 2, 'quoted key': 3, \"dq\": 4, 5: 6, 0x10: 7, 1.50: 8, if: [1, 2,], }",
        );
        assert_eq!(
            v,
            json!({"default": 1, "new": 2, "quoted key": 3, "dq": 4, "5": 6, "16": 7, "1.5": 8, "if": [1, 2]})
        );
    }

    #[test]
    fn duplicate_keys_last_wins() {
        let m = meta_of("export const meta = { name: 'first', description: 'd', name: 'second' }");
        assert_eq!(m.name, "second");
        assert_eq!(m.raw["name"], json!("second"));
    }

    #[test]
    fn rejects_spread() {
        let src = "export const meta = {\n  name: 'n',\n  ...base,\n  description: 'd' }";
        let e = error(src);
        assert_eq!(
            e.message,
            "meta must be a literal object: found a spread (`...`) at line 3"
        );
        assert_eq!((e.line, e.column), (Some(3), Some(3)));
        assert!(literal_error("[1, ...xs]").contains("a spread (`...`) at line 2"));
    }

    #[test]
    fn rejects_variable_reference() {
        let src = "export const meta = {\n  name: 'n',\n  description: 'd',\n  other: foo,\n}";
        assert_eq!(
            error(src).message,
            "meta must be a literal object: found a variable reference `foo` at line 4"
        );
        assert!(literal_error("undefined").contains("a variable reference `undefined` at line 2"));
        assert!(literal_error("a.b").contains("a variable reference `a`"));
    }

    #[test]
    fn rejects_function_call() {
        let src = "export const meta = {\n  name: 'n',\n  description: 'd',\n  other: foo(1),\n}";
        assert_eq!(
            error(src).message,
            "meta must be a literal object: found a function call `foo(` at line 4"
        );
        assert!(literal_error("'a'.repeat(2)").contains("a property access (`.`) at line 2"));
        assert!(literal_error("'a'(2)").contains("a function call `'a'(` at line 2"));
    }

    #[test]
    fn rejects_computed_key_shorthand_and_methods() {
        assert!(literal_error("{ [k]: 1 }").contains("a computed key (`[`) at line 2"));
        assert!(literal_error("{ name }").contains("a shorthand property `name` at line 2"));
        assert!(literal_error("{ a, b: 1 }").contains("a shorthand property `a`"));
        assert!(literal_error("{ run() {} }").contains("a method `run(` at line 2"));
        assert!(literal_error("{ get x() { return 1 } }").contains("a method `get x`"));
        assert!(literal_error("{ *gen() {} }").contains("a generator method"));
        assert!(literal_error("{ a = 1 }").contains("a shorthand property with a default"));
    }

    #[test]
    fn rejects_functions_and_arrows() {
        assert!(literal_error("() => 1").contains("an arrow function `(…) =>` at line 2"));
        assert!(literal_error("x => 1").contains("an arrow function `x =>`"));
        assert!(literal_error("function () {}").contains("a function (`function`)"));
        assert!(literal_error("async () => 1").contains("an async function"));
        assert!(literal_error("(1)").contains("a parenthesized expression"));
        assert!(literal_error("new Foo()").contains("a `new` expression"));
        assert!(literal_error("class {}").contains("a class"));
    }

    #[test]
    fn rejects_template_substitution_regex_and_operators() {
        assert!(literal_error("`a${b}c`").contains("a template substitution (`${`) at line 2"));
        assert!(literal_error("/x/").contains("a regular expression `/x/`"));
        assert!(literal_error("1 + 2").contains("an operator `+` at line 2"));
        assert!(literal_error("'a' 'b'").contains("`'b'` where `,` or `}` was expected"));
        assert!(literal_error("[1 2]").contains("`2` where `,` or `]` was expected"));
        assert!(literal_error("[1,,2]").contains("an empty array slot"));
        assert!(literal_error("tag`x`").contains("a tagged template `tag`"));
        assert!(literal_error("String.raw`\\u`").contains("a variable reference `String`"));
    }

    #[test]
    fn rejects_something_after_the_object() {
        let e = error("export const meta = { name: 'n', description: 'd' }.name;");
        assert!(
            e.message.contains("found `.` right after its closing `}`"),
            "{e}"
        );
        let e = error("export const meta = { name: 'n', description: 'd' }\n(x)");
        assert!(e.message.contains("found `(` right after"), "{e}");
        assert!(
            error("export const meta = { name: 'n', description: 'd' }, b = 1")
                .message
                .contains("`,`")
        );
        // A new statement on the next line is fine without `;`.
        assert!(
            prepare("export const meta = { name: 'n', description: 'd' }\nconst x = 1").is_ok()
        );
        assert!(read_meta("export const meta = { name: 'n', description: 'd' }").is_ok());
    }

    #[test]
    fn meta_must_be_an_object() {
        let e = error("export const meta = 'x'");
        assert_eq!(
            e.message,
            "meta must be a literal object: found an unexpected `'x'` at line 1"
        );
        let e = error("export const meta = make()");
        assert!(e.message.contains("a function call `make(`"));
        let e = error("export const meta = { name: 'n',\n");
        assert_eq!(
            e.message,
            "meta must be a literal object: the script ends at line 1 before meta is closed"
        );
    }

    #[test]
    fn meta_not_first() {
        let e = error("const x = 1; export const meta = { name: 'n', description: 'd' }");
        assert_eq!(
            e.message,
            "the script must start with `export const meta = { ... }`: found `const x` at line 1"
        );
        assert_eq!((e.line, e.column), (Some(1), Some(1)));
        let e = error("// c\n\n  foo();\nexport const meta = {}");
        assert_eq!(
            e.message,
            "the script must start with `export const meta = { ... }`: found `foo(` at line 3"
        );
        let e = error("export let meta = {}");
        assert!(e.message.ends_with("found `export let` at line 1"), "{e}");
        let e = error("export const other = {}");
        assert!(
            e.message.ends_with("found `export const other` at line 1"),
            "{e}"
        );
        let e = error("'use strict'; export const meta = {}");
        assert!(
            e.message.ends_with("found `'use strict';` at line 1"),
            "{e}"
        );
        let e = error("export const meta");
        assert!(
            e.message.ends_with("found `export const meta` at line 1"),
            "{e}"
        );
    }

    #[test]
    fn missing_meta_and_empty_script() {
        assert_eq!(
            error("").message,
            "the script must start with `export const meta = { ... }`: the script is empty"
        );
        assert_eq!(error("  // only a comment\n").line, None);
        assert!(
            error("agent('x')")
                .message
                .contains("found `agent(` at line 1")
        );
    }

    #[test]
    fn name_and_description_checks() {
        let e = error("export const meta = { description: 'd' }");
        assert_eq!(
            e.message,
            "meta.name is required and must be a non-empty string: meta at line 1 has none"
        );
        let e = error("export const meta = {\n name: 42, description: 'd' }");
        assert_eq!(
            e.message,
            "meta.name is required and must be a non-empty string: found a number at line 2"
        );
        assert_eq!((e.line, e.column), (Some(2), Some(8)));
        let e = error("export const meta = { name: '  ', description: 'd' }");
        assert!(e.message.contains("found an empty string"));
        let e = error("export const meta = { name: 'n' }");
        assert!(
            e.message
                .starts_with("meta.description is required and must be a non-empty string")
        );
        let e = error("export const meta = { name: 'n', description: ['d'] }");
        assert!(e.message.contains("found an array at line 1"));
    }

    #[test]
    fn when_to_use_and_phases_checks() {
        let base = "export const meta = { name: 'n', description: 'd',\n";
        let e = error(&format!("{base} whenToUse: 3 }}"));
        assert_eq!(
            e.message,
            "meta.whenToUse must be a string: found a number at line 2"
        );
        let e = error(&format!("{base} phases: 'a' }}"));
        assert_eq!(
            e.message,
            "meta.phases must be an array of { title, detail?, model? }: found a string at line 2"
        );
        let e = error(&format!(
            "{base} phases: [{{ title: 'a' }},\n {{ detail: 'x' }}] }}"
        ));
        assert_eq!(
            e.message,
            "meta.phases must be an array of { title, detail?, model? }: phases[1] has no title at line 3"
        );
        let e = error(&format!("{base} phases: [{{ title: '' }}] }}"));
        assert!(
            e.message
                .ends_with("phases[0].title is an empty string at line 2"),
            "{e}"
        );
        let e = error(&format!("{base} phases: ['a'] }}"));
        assert!(
            e.message.ends_with("phases[0] is a string at line 2"),
            "{e}"
        );
        let e = error(&format!("{base} phases: [{{ title: 'a', model: 1 }}] }}"));
        assert!(
            e.message.ends_with("phases[0].model is a number at line 2"),
            "{e}"
        );
        let e = error(&format!(
            "{base} phases: [{{ title: 'a', detail: null }}] }}"
        ));
        assert!(
            e.message.ends_with("phases[0].detail is null at line 2"),
            "{e}"
        );
    }

    #[test]
    fn body_keeps_positions() {
        let src =
            "// hi\nexport const meta = { name: 'n', description: 'd' };\nconst x = meta.name;\n";
        let p = prepare(src).unwrap();
        assert_eq!(
            p.body,
            "// hi\n       const meta = { name: 'n', description: 'd' };\nconst x = meta.name;\n"
        );
        assert_eq!(p.body.len(), src.len());
        assert_eq!(p.body.lines().count(), src.lines().count());
        assert_eq!(p.meta_line, 2);
    }

    #[test]
    fn date_now_in_code_is_rejected() {
        let e = body_error("const a = 1;\nconst t = Date.now();");
        assert_eq!(
            e.message,
            "Date.now() is not allowed in workflow scripts: found at line 3; it would break resume, because a relaunched run must repeat the same agent() calls — pass timestamps in through args"
        );
        assert_eq!((e.line, e.column), (Some(3), Some(11)));
        assert!(
            body_error("Date . now ( )")
                .message
                .starts_with("Date.now()")
        );
        assert!(body_error("Date.now?.()").message.starts_with("Date.now()"));
        assert!(
            body_error("const t0 = performance.now();")
                .message
                .starts_with("performance.now() is not allowed")
        );
        assert!(
            body_error("Date\n  .now()")
                .message
                .starts_with("Date.now()")
        );
    }

    #[test]
    fn date_now_outside_code_is_fine() {
        body_ok("const s = 'Date.now()'; const d = \"Math.random()\";");
        body_ok("// Date.now()\n/* Math.random() new Date() require('x') import('y') */");
        body_ok("const t = `Date.now() and new Date()`;");
        body_ok("const r = /Date.now()/; const q = /require('fs')/g;");
        body_ok("x.Date.now(); a?.Math.random(); const f = Date.now;");
        body_ok("const o = { Date: 1, now: 2 }; o.now();");
    }

    #[test]
    fn date_now_inside_substitution_is_rejected() {
        let e = body_error("log(`at ${Date.now()} ms`)");
        assert!(e.message.starts_with("Date.now() is not allowed"), "{e}");
        let e = body_error("log(`a ${ `b ${ { k: Math.random() }.k }` }`)");
        assert!(e.message.starts_with("Math.random() is not allowed"), "{e}");
        body_ok("log(`a ${ `b ${ { k: 'Math.random()' }.k }` } Date.now()`)");
    }

    #[test]
    fn math_random_is_rejected() {
        let e = body_error("\n\nconst r = Math.random();");
        assert_eq!(
            e.message,
            "Math.random() is not allowed in workflow scripts: found at line 4; it would break resume, because a relaunched run must repeat the same agent() calls — derive variety from the item index instead"
        );
    }

    #[test]
    fn new_date_checks() {
        let e = body_error("const d = new Date();");
        assert_eq!(
            e.message,
            "new Date() without an argument is not allowed in workflow scripts: found at line 2; it would break resume, because a relaunched run must repeat the same agent() calls — pass timestamps in through args; new Date(x) with an argument works"
        );
        assert!(
            body_error("const d = new Date;")
                .message
                .starts_with("new Date()")
        );
        assert!(
            body_error("const d = new Date\nlog(d)")
                .message
                .starts_with("new Date()")
        );
        assert!(
            body_error("new Date( /* now */ )")
                .message
                .starts_with("new Date()")
        );
        body_ok("const d = new Date(0); const e = new Date(args.startedAt);");
        body_ok("const d = new x.Date(); const u = new Date.UTCThing();");
    }

    #[test]
    fn import_checks() {
        let e = body_error("const m = await import('x');");
        assert_eq!(
            e.message,
            "import is not available in workflow scripts: found at line 2; workflows cannot load modules, inline what you need"
        );
        assert!(
            body_error("import x from 'y';")
                .message
                .starts_with("import is not")
        );
        assert!(
            body_error("log(import.meta.url)")
                .message
                .starts_with("import is not")
        );
        body_ok("obj.import('x'); obj?.import(1); const o = { import: 1 };");
        body_ok("class A { import() { return 1 } }");
        body_ok("const s = \"import x from 'y'\";");
    }

    #[test]
    fn require_checks() {
        let e = body_error("\nconst fs = require('fs');");
        assert_eq!(
            e.message,
            "require() is not available in workflow scripts: found at line 3; workflows cannot load modules, inline what you need"
        );
        assert_eq!(e.column, Some(12));
        body_ok("const o = { require: 1 }; a.require(); a?.require('x'); const r = require;");
        assert!(
            body_error("requir\\u0065('fs')")
                .message
                .starts_with("require()")
        );
    }

    #[test]
    fn regex_and_division_in_body() {
        body_ok("const a = 6, b = 3, c = 1; const q = a / b / c;");
        body_ok("const ok = /ab+c/g.test(s); function f() { return /x/ }");
        body_ok("const u = /https?:\\/\\/[^/]+/; const c = /\\/*x/; // done");
        body_ok("const x = (a) / 2 / (b);");
    }

    #[test]
    fn nested_templates_in_body() {
        body_ok("const s = `outer ${ `inner ${ a + `deep ${b}` }` } end ${ {x: 1}.x }`;");
    }

    #[test]
    fn syntax_errors_become_source_errors() {
        let e = body_error("const a = 1;\nconst s = 'unterminated;\n");
        assert_eq!(
            e.message,
            "syntax error at line 3: unterminated string literal"
        );
        assert_eq!((e.line, e.column), (Some(3), Some(11)));
        let e = body_error("const t = `open");
        assert_eq!(
            e.message,
            "syntax error at line 2: unterminated template literal"
        );
        let e = error("export const meta = {\n  name: 'n,\n  description: 'd' }");
        assert_eq!(
            e.message,
            "syntax error at line 2: unterminated string literal"
        );
    }

    #[test]
    fn read_meta_ignores_the_body() {
        let src = format!("{HEAD}const s = 'broken\nDate.now();");
        assert!(prepare(&src).is_err());
        let m = read_meta(&src).unwrap();
        assert_eq!((m.name.as_str(), m.description.as_str()), ("n", "d"));
    }

    #[test]
    fn length_limit() {
        let mut src = HEAD.to_string();
        src.push_str(&"/".repeat(2));
        src.push_str(&"é".repeat(MAX_SCRIPT_CHARS - src.chars().count()));
        assert_eq!(src.chars().count(), MAX_SCRIPT_CHARS);
        assert!(prepare(&src).is_ok());
        src.push('x');
        let e = error(&src);
        assert_eq!(
            e.message,
            format!(
                "the script is {} characters long; the limit is 524288",
                MAX_SCRIPT_CHARS + 1
            )
        );
        assert_eq!(e.line, None);
    }

    #[test]
    fn deep_nesting_is_bounded() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(literal_error(&deep).contains("nesting deeper than 64 levels"));
        let ok = format!("{}{}", "[".repeat(30), "]".repeat(30));
        assert!(raw(&ok).is_array());
    }

    #[test]
    fn number_keys_follow_javascript() {
        assert_eq!(number_key(NumLit::Float(1e21)), "1e+21");
        assert_eq!(number_key(NumLit::Float(1.5e-7)), "1.5e-7");
        assert_eq!(number_key(NumLit::Float(0.5)), "0.5");
        assert_eq!(number_key(NumLit::Float(100.0)), "100");
    }

    #[test]
    fn arbitrary_input_never_panics() {
        const PIECES: &[&str] = &[
            "export const meta = {",
            "name: 'n', description: 'd'",
            "}",
            "{",
            "[",
            "]",
            "(",
            ")",
            "`",
            "${",
            "'",
            "\"",
            "\\",
            "/",
            "*",
            "//",
            "/*",
            "*/",
            "\n",
            "\r",
            "\u{2028}",
            "é",
            "Date.now()",
            "new Date",
            "import",
            "require(",
            ".",
            "?.",
            "...",
            "-",
            "0x",
            "1e",
            "_",
            "n",
            "#!",
            "#",
            ",",
            ":",
            ";",
            "=>",
            "\\u{",
            "\\x4",
            " ",
        ];
        let mut seed: u64 = 0x2545_F491_4F6C_DD1D;
        for _ in 0..3000 {
            let mut src = String::new();
            for _ in 0..(seed % 24) {
                seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                src.push_str(PIECES[(seed >> 33) as usize % PIECES.len()]);
            }
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let _ = prepare(&src);
            let _ = read_meta(&src);
            let _ = super::super::lex::tokenize(&src);
        }
    }

    #[test]
    fn display_is_the_message() {
        let e = error("export const meta = {\n  ...x }");
        assert_eq!(e.to_string(), e.message);
        assert!(e.to_string().contains("at line 2"));
    }
}

/// Property-based fuzzing of the meta reader and the lexer (`tools/fuzz` runs it long): any
/// text, and a valid script with random damage, is answered without a panic, and a script
/// that passes keeps its shape.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    const VALID: &str = "export const meta = { name: 'fuzz', description: 'a workflow', phases: [{ title: 'one' }] };\n\
        // a comment with `backticks` and ${braces}\n\
        const r = await agent(`item ${args?.n ?? 1}`, { label: 'a', schema: { type: 'object' } });\n\
        const re = /[a-z]+\\/x/g; const s = \"q\\\"uote\" + 'it\\'s';\n\
        return { r, n: [1, 2.5e3, 0x1f].length };\n";

    /// Pieces of JavaScript that tokenizers trip over.
    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("`".to_owned()),
            Just("${".to_owned()),
            Just("}".to_owned()),
            Just("/*".to_owned()),
            Just("*/".to_owned()),
            Just("//".to_owned()),
            Just("/".to_owned()),
            Just("'".to_owned()),
            Just("\"".to_owned()),
            Just("\\".to_owned()),
            Just("\n".to_owned()),
            Just("export const meta =".to_owned()),
            Just("\u{2028}".to_owned()),
            Just("\u{feff}".to_owned()),
            any::<char>().prop_map(String::from),
            "[ -~]{0,8}",
        ]
    }

    proptest! {
        #[test]
        fn any_text_is_answered_without_a_panic(text in "\\PC{0,400}") {
            let _ = read_meta(&text);
            let _ = prepare(&text);
        }

        #[test]
        fn a_damaged_script_is_answered_and_a_passing_one_keeps_its_length(
            cuts in prop::collection::vec((0usize..VALID.len(), piece()), 1..6),
        ) {
            let mut text = VALID.to_owned();
            for (at, piece) in cuts {
                let mut at = at.min(text.len());
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                text.insert_str(at, &piece);
            }
            let _ = read_meta(&text);
            if let Ok(p) = prepare(&text) {
                // The body is the source with only the meta's `export` blanked.
                prop_assert_eq!(p.body.chars().count(), text.chars().count());
                prop_assert!(p.meta_line >= 1);
            }
        }
    }

    #[test]
    fn the_valid_script_passes() {
        let p = prepare(VALID).unwrap();
        assert_eq!(p.meta.name, "fuzz");
    }
}
