//! The stdio framing of `flotilla mcp`, in front of rmcp's transport: one JSON-RPC message a
//! line.
//!
//! rmcp drops a line that is not JSON, and one longer than its bound, without a word, so the
//! client waits for an answer that never comes. Here every line is looked at first: one that
//! is not JSON is answered with a JSON-RPC parse error (-32700, id null), and one longer than
//! [`MAX_LINE_BYTES`] with the same code naming the bound, as soon as it crosses it and
//! without keeping it (the rest of it is read and dropped); the next line is served as
//! usual. Lines that are JSON go on to rmcp unchanged (which answers those that are not
//! requests itself), and its answers and these errors share the output a whole line at a
//! time.

use std::sync::Arc;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// The longest line (one message, its newline included) the server reads: 16 MiB, rmcp's own
/// bound, which holds the largest script (2 MiB) and large `args`.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// JSON-RPC's code for input that cannot be parsed.
pub const PARSE_ERROR: i64 = -32700;

/// How much of each side is buffered between this framing and rmcp.
const PIPE_BYTES: usize = 64 << 10;

/// The server's side of the framing: what rmcp reads and writes, and the task that must end
/// (its last answers written) before the process does.
pub struct Framed {
    pub read: DuplexStream,
    pub write: DuplexStream,
    pub done: JoinHandle<()>,
}

/// Frames `input` and `output` (the process's stdin and stdout) for rmcp.
pub fn frame<R, W>(input: R, output: W) -> Framed
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (rmcp_reads, to_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let (rmcp_writes, from_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let output = Arc::new(Mutex::new(output));
    tokio::spawn(inbound(input, to_rmcp, output.clone()));
    let done = tokio::spawn(outbound(from_rmcp, output));
    Framed {
        read: rmcp_reads,
        write: rmcp_writes,
        done,
    }
}

/// Writes one whole line to the shared output.
async fn say<W: AsyncWrite + Unpin>(output: &Mutex<W>, line: &[u8]) -> std::io::Result<()> {
    let mut out = output.lock().await;
    out.write_all(line).await?;
    out.flush().await
}

/// A JSON-RPC parse error (id null), as a line.
fn parse_error(message: String) -> Vec<u8> {
    let mut line = json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": { "code": PARSE_ERROR, "message": message },
    })
    .to_string()
    .into_bytes();
    line.push(b'\n');
    line
}

fn too_long() -> Vec<u8> {
    parse_error(format!(
        "parse error: a message longer than {} MiB (the most one line may hold) was refused unread; send a smaller one (a script may hold 2 MiB; give large inputs as a file the workflow reads)",
        MAX_LINE_BYTES >> 20
    ))
}

/// Reads lines from `input` (each at most [`MAX_LINE_BYTES`]), answers those that are not
/// JSON, and passes the rest to rmcp; at the input's end, ends rmcp's.
async fn inbound<R, W>(input: R, mut to_rmcp: DuplexStream, output: Arc<Mutex<W>>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut input = BufReader::with_capacity(PIPE_BYTES, input);
    let mut line: Vec<u8> = Vec::new();
    // Inside a line already refused as too long: its rest is dropped.
    let mut dropping = false;
    loop {
        let (taken, ended, crossed) = {
            let Ok(buf) = input.fill_buf().await else {
                break;
            };
            if buf.is_empty() {
                break;
            }
            let newline = buf.iter().position(|&b| b == b'\n');
            let taken = newline.map_or(buf.len(), |i| i + 1);
            let mut crossed = false;
            if !dropping {
                if line.len() + taken > MAX_LINE_BYTES {
                    (dropping, crossed) = (true, true);
                    line = Vec::new();
                } else {
                    line.extend_from_slice(&buf[..taken]);
                }
            }
            (taken, newline.is_some(), crossed)
        };
        input.consume(taken);
        if crossed && say(&output, &too_long()).await.is_err() {
            return;
        }
        if ended {
            if dropping {
                dropping = false;
            } else {
                if pass(&line, &mut to_rmcp, &output).await.is_err() {
                    return;
                }
                // A big message's room is not kept for the small ones after it.
                if line.capacity() > PIPE_BYTES * 16 {
                    line = Vec::new();
                }
                line.clear();
            }
        }
    }
    // A last line without its newline is still a message.
    if !dropping && !line.is_empty() {
        let _ = pass(&line, &mut to_rmcp, &output).await;
    }
    let _ = to_rmcp.shutdown().await;
}

/// One whole line: to rmcp if it is JSON, else answered here. Blank lines are skipped.
async fn pass<W: AsyncWrite + Unpin>(
    line: &[u8],
    to_rmcp: &mut DuplexStream,
    output: &Mutex<W>,
) -> std::io::Result<()> {
    let text = line.strip_suffix(b"\n").unwrap_or(line);
    let text = text.strip_suffix(b"\r").unwrap_or(text);
    if text.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    match serde_json::from_slice::<serde::de::IgnoredAny>(text) {
        Ok(_) => {
            to_rmcp.write_all(text).await?;
            to_rmcp.write_all(b"\n").await
        }
        // serde_json's words name a position, never the input.
        Err(e) => {
            say(
                output,
                &parse_error(format!(
                    "parse error: the line is not JSON ({e}); send one JSON-RPC message per line"
                )),
            )
            .await
        }
    }
}

/// Copies rmcp's answers to the output, a whole line at a time.
async fn outbound<W: AsyncWrite + Unpin>(from_rmcp: DuplexStream, output: Arc<Mutex<W>>) {
    let mut from_rmcp = BufReader::new(from_rmcp);
    let mut line = Vec::new();
    loop {
        line.clear();
        match from_rmcp.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if say(&output, &line).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    #[tokio::test]
    async fn lines_that_are_not_json_or_too_long_are_answered_and_the_next_goes_on() {
        let (mut client, server_in) = tokio::io::duplex(1 << 20);
        let (server_out, answers) = tokio::io::duplex(1 << 20);
        let framed = frame(server_in, server_out);
        let mut long = vec![b' '; MAX_LINE_BYTES];
        long.extend_from_slice(b"{}\n");
        let sent = tokio::spawn(async move {
            for chunk in [
                &b"not json\n"[..],
                b"{\"jsonrpc\":\"2.0\",\"id\":1,\n",
                b"\xff\xfe\n",
                b"\r\n",
                &long,
                b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\"}\r\n",
                b"[1,2]",
            ] {
                client.write_all(chunk).await.unwrap();
            }
        });
        let mut rmcp = BufReader::new(framed.read);
        let mut got = String::new();
        rmcp.read_line(&mut got).await.unwrap();
        assert_eq!(got, "{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\"}\n");
        got.clear();
        // The last line has no newline: it goes on when the input ends.
        rmcp.read_line(&mut got).await.unwrap();
        assert_eq!(got, "[1,2]\n");
        sent.await.unwrap();
        got.clear();
        assert_eq!(
            rmcp.read_line(&mut got).await.unwrap(),
            0,
            "rmcp sees the end"
        );
        // rmcp's own answers share the output.
        let mut write = framed.write;
        write
            .write_all(b"{\"id\":2,\"result\":{}}\n")
            .await
            .unwrap();
        drop(write);
        framed.done.await.unwrap();
        let mut out = BufReader::new(answers);
        let mut lines = Vec::new();
        let mut line = String::new();
        while out.read_line(&mut line).await.unwrap() > 0 {
            lines.push(serde_json::from_str::<serde_json::Value>(&line).unwrap());
            line.clear();
        }
        assert_eq!(lines.len(), 5, "{lines:?}");
        for e in &lines[..4] {
            assert_eq!(e["id"], serde_json::Value::Null, "{e}");
            assert_eq!(e["error"]["code"], PARSE_ERROR, "{e}");
        }
        assert!(
            lines[3]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("16 MiB")
        );
        assert_eq!(lines[4]["id"], 2);
    }
}
