//! Reading what an agent's process writes, with limits: a process can write a line of ten
//! gigabytes, or no newline at all. [`BoundedLines`] hands out lines of at most `max` bytes
//! (a longer one is cut there, the rest of it skipped, and the cut is said), so a reader's
//! memory is bounded by its limit, never by the process.

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// Longest stderr line kept (diagnostics).
pub const STDERR_LINE_BYTES: usize = 64 << 10;
/// Longest stdout line of a CLI that speaks JSON lines (a whole result can be one line).
pub const JSON_LINE_BYTES: usize = 128 << 20;
/// Most an exec command may write to stdout: its result.
pub const EXEC_STDOUT_BYTES: usize = 64 << 20;

/// One line, and whether it was cut at the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub text: String,
    pub cut: bool,
}

/// Lines of at most `max` bytes.
pub struct BoundedLines<R> {
    inner: BufReader<R>,
    max: usize,
}

impl<R> std::fmt::Debug for BoundedLines<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedLines")
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl<R: AsyncRead + Unpin> BoundedLines<R> {
    pub fn new(inner: R, max: usize) -> Self {
        BoundedLines {
            inner: BufReader::new(inner),
            max,
        }
    }

    /// The next line without its newline; `None` at the end.
    pub async fn next_line(&mut self) -> std::io::Result<Option<Line>> {
        let mut line = Vec::new();
        let mut cut = false;
        let mut any = false;
        loop {
            let buf = self.inner.fill_buf().await?;
            if buf.is_empty() {
                return Ok(any.then(|| finish(line, cut)));
            }
            any = true;
            let (part, used, done) = match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (&buf[..i], i + 1, true),
                None => (buf, buf.len(), false),
            };
            let room = self.max.saturating_sub(line.len());
            if part.len() > room {
                cut = true;
            }
            line.extend_from_slice(&part[..part.len().min(room)]);
            self.inner.consume(used);
            if done {
                return Ok(Some(finish(line, cut)));
            }
        }
    }
}

fn finish(mut line: Vec<u8>, cut: bool) -> Line {
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Line {
        text: String::from_utf8_lossy(&line).into_owned(),
        cut,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn long_lines_are_cut_and_the_rest_still_reads() {
        let mut input = Vec::new();
        input.extend_from_slice(b"short\r\n");
        input.extend(std::iter::repeat_n(b'x', 100_000));
        input.extend_from_slice(b"\nafter\nno newline");
        let mut lines = BoundedLines::new(input.as_slice(), 1000);
        let mut out = Vec::new();
        while let Some(l) = lines.next_line().await.unwrap() {
            out.push((l.text.len(), l.cut));
        }
        assert_eq!(out, vec![(5, false), (1000, true), (5, false), (10, false)]);
    }
}
