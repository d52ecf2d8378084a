//! A webhook receiver for tests (`--notify`).

/// A webhook receiver on loopback: answers each request with the next status of `answers`
/// (then 200), and keeps what it was sent.
pub struct Hook {
    pub port: u16,
    got: std::sync::Arc<std::sync::Mutex<Vec<Request>>>,
}

/// A request a [`Hook`] received: its headers (names lower-cased) and body.
pub type Request = (Vec<(String, String)>, String);

impl Hook {
    pub fn start(answers: Vec<u16>) -> Hook {
        Self::start_on(0, answers)
    }

    /// A receiver on `port` (0: any free one).
    pub fn start_on(port: u16, answers: Vec<u16>) -> Hook {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))
            .expect("a port for the webhook receiver");
        let port = listener.local_addr().expect("its address").port();
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = got.clone();
        std::thread::spawn(move || {
            let mut answers = answers.into_iter();
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let Ok(read_half) = conn.try_clone() else {
                    continue;
                };
                let mut reader = BufReader::new(read_half);
                let mut headers = Vec::new();
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                loop {
                    line.clear();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = line.trim_end().split_once(':') {
                        headers.push((k.to_ascii_lowercase(), v.trim().to_owned()));
                    }
                }
                let len: usize = headers
                    .iter()
                    .find(|(k, _)| k == "content-length")
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0);
                let mut body = vec![0; len];
                let _ = reader.read_exact(&mut body);
                kept.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((headers, String::from_utf8_lossy(&body).into_owned()));
                let status = answers.next().unwrap_or(200);
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
            }
        });
        Hook { port, got }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    pub fn requests(&self) -> Vec<Request> {
        self.got
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}
