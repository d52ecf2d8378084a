//! An interrupted agent's conversation, kept for its call's next attempt (issue 33, 3).
//!
//! A stalled, cancelled, timed-out or transiently failed attempt hands back what its agent
//! said and heard (`Failure.session`): for `claude-code`, the CLI's session file and its id;
//! the coordinator keeps it with the call's leftovers and gives it to the next attempt
//! (`TaskSpec.session`), on any worker, which continues that conversation — the CLI resumes
//! the session with a short note that it was interrupted — instead of paying again for
//! everything the agent read and reasoned. A conversation of another backend, of another
//! prompt, or one that cannot be read back is not continued: the attempt starts over and its
//! transcript says why.

use std::path::{Path, PathBuf};

use flotilla_proto::frag::MAX_SESSION_BYTES;
use flotilla_proto::v1;
use sha2::{Digest, Sha256};

/// What the continued agent is told first.
pub const CONTINUE_NOTE: &str = "Your previous attempt at this task was interrupted before it finished (the worker running it stopped, stalled or was restarted). Your conversation so far is above and the files you wrote are kept. Continue the task from where you left off, without redoing what is done, and end with the answer the task asks for.";

/// sha256 of a prompt, hex: a conversation is continued only for the prompt it was about.
pub fn prompt_sha256(prompt: &str) -> String {
    hex::encode(Sha256::digest(prompt.as_bytes()))
}

/// A new session id (a random version-4 UUID, as the CLI takes).
pub fn new_id() -> String {
    let mut b = [0u8; 16];
    // A failed read leaves zeros: still a well-formed id, unique enough for one config dir.
    let _ = getrandom::fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Whether `id` looks like a session id (a UUID): anything else from the wire is refused.
fn is_id(id: &str) -> bool {
    id.len() == 36
        && id.char_indices().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// Where the CLI keeps the sessions of an agent working in `workdir`: its config's
/// `projects/` directory, under the working directory's path with every character but ASCII
/// letters and digits made `-`.
fn project_dir(config: &Path, workdir: &Path) -> PathBuf {
    // The CLI names it by the directory's real path.
    let real = workdir
        .canonicalize()
        .unwrap_or_else(|_| workdir.to_path_buf());
    let name: String = real
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    config.join("projects").join(name)
}

/// How an attempt of the CLI starts: over, or continuing a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// A new session, with why an earlier one is not continued (if one was given).
    Fresh { id: String, why: Option<String> },
    /// The session `id`, restored, with its model turns and the attempt that left it.
    Continue { id: String, turns: u32, from: u32 },
}

impl Start {
    pub fn id(&self) -> &str {
        match self {
            Start::Fresh { id, .. } | Start::Continue { id, .. } => id,
        }
    }

    /// The line the attempt's transcript starts with, when there is something to say.
    pub fn line(&self) -> Option<String> {
        match self {
            Start::Fresh { why: Some(why), .. } => Some(format!("started fresh: {why}")),
            Start::Fresh { why: None, .. } => None,
            Start::Continue { turns, from, .. } => Some(format!(
                "continued the session attempt {from} left ({turns} model turns): only the rest is asked of the model"
            )),
        }
    }
}

/// Decides how the CLI's attempt of `spec` starts, and restores the conversation it
/// continues into `config` for an agent working in `workdir`.
pub fn start(spec: &v1::TaskSpec, config: &Path, workdir: &Path) -> Start {
    let fresh = |why: String| Start::Fresh {
        id: new_id(),
        why: Some(why),
    };
    let Some(s) = &spec.session else {
        return Start::Fresh {
            id: new_id(),
            why: None,
        };
    };
    if s.backend != "claude-code" {
        return fresh(format!(
            "the interrupted attempt ran on {}, whose conversation the CLI cannot continue",
            s.backend
        ));
    }
    if s.prompt_sha256 != prompt_sha256(&spec.prompt) {
        return fresh("the prompt changed since the interrupted attempt".into());
    }
    if !is_id(&s.id) || s.state.is_empty() || s.state.len() > MAX_SESSION_BYTES {
        return fresh("the interrupted attempt's session cannot be read back".into());
    }
    let dir = project_dir(config, workdir);
    let restored = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{}.jsonl", s.id)), &s.state));
    match restored {
        Ok(()) => Start::Continue {
            id: s.id.clone(),
            turns: s.turns,
            from: s.attempt,
        },
        Err(e) => fresh(format!("its session could not be restored ({e})")),
    }
}

/// The conversation session `id` holds now, for the call's next attempt: read from the CLI's
/// config only through real directories and a regular file (nothing an agent links
/// elsewhere), at most [`MAX_SESSION_BYTES`]; none before the model's first turn.
pub fn capture(config: &Path, workdir: &Path, id: &str, prompt: &str) -> Option<v1::Session> {
    let plain_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_dir());
    let dir = project_dir(config, workdir);
    if !is_id(id) || !plain_dir(config) || !plain_dir(&config.join("projects")) || !plain_dir(&dir)
    {
        return None;
    }
    let file = dir.join(format!("{id}.jsonl"));
    let meta = std::fs::symlink_metadata(&file).ok()?;
    if !meta.file_type().is_file() || meta.len() as usize > MAX_SESSION_BYTES || meta.len() == 0 {
        return None;
    }
    let mut state = read_nofollow(&file)?;
    // Read while the CLI may be writing (a checkpoint): only whole lines are its session.
    let whole = state.iter().rposition(|b| *b == b'\n')? + 1;
    state.truncate(whole);
    let turns = state
        .split(|b| *b == b'\n')
        .filter(|l| {
            // A model's turn: not the CLI's own stand-in for an API error.
            serde_json::from_slice::<serde_json::Value>(l).is_ok_and(|v| {
                v["type"] == "assistant"
                    && v["isApiErrorMessage"] != true
                    && v["message"]["model"] != "<synthetic>"
            })
        })
        .count() as u32;
    // Nothing the model said yet: nothing to save by going on; the next attempt starts over.
    if turns == 0 {
        return None;
    }
    Some(v1::Session {
        backend: "claude-code".into(),
        id: id.to_owned(),
        state,
        prompt_sha256: prompt_sha256(prompt),
        turns,
        attempt: 0,
    })
}

/// Sends `events` a checkpoint of session `id` (in `config`, for `workdir`) every `every`
/// while the model has taken a turn since the last one sent; never returns (it goes with the
/// attempt it runs beside).
pub async fn keep_checkpoints(
    every: std::time::Duration,
    (config, workdir): (&Path, &Path),
    id: &str,
    prompt: &str,
    events: &super::seam::Events,
) -> std::convert::Infallible {
    let mut sent = 0u32;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (c, w, i, p) = (
            config.to_owned(),
            workdir.to_owned(),
            id.to_owned(),
            prompt.to_owned(),
        );
        // A file of up to 32 MiB, read off the runtime's threads.
        let taken = tokio::task::spawn_blocking(move || capture(&c, &w, &i, &p))
            .await
            .ok()
            .flatten();
        if let Some(s) = taken.filter(|s| s.turns > sent) {
            sent = s.turns;
            events.checkpoint(s);
        }
    }
}

/// An API backend's conversation (`anthropic`, `openai`): its messages as JSON, when the model
/// has said something yet.
pub fn of_messages(
    backend: &str,
    messages: &[serde_json::Value],
    prompt: &str,
) -> Option<Box<v1::Session>> {
    let turns = messages.iter().filter(|m| m["role"] == "assistant").count() as u32;
    let state = serde_json::to_vec(messages).ok()?;
    (turns > 0 && state.len() <= MAX_SESSION_BYTES).then(|| {
        Box::new(v1::Session {
            backend: backend.to_owned(),
            id: String::new(),
            state,
            prompt_sha256: prompt_sha256(prompt),
            turns,
            attempt: 0,
        })
    })
}

/// The messages an API backend's attempt starts from: the interrupted attempt's, with the note
/// that it was interrupted, when it is this backend's conversation about this prompt (else
/// `None`); and the line its transcript starts with (none when there was nothing to continue).
pub fn messages_to_continue(
    spec: &v1::TaskSpec,
    backend: &str,
) -> (Option<Vec<serde_json::Value>>, Option<String>) {
    let Some(s) = spec.session.as_ref() else {
        return (None, None);
    };
    let why = if s.backend != backend {
        format!(
            "the interrupted attempt ran on {}, whose conversation {backend} cannot continue",
            s.backend
        )
    } else if s.prompt_sha256 != prompt_sha256(&spec.prompt) {
        "the prompt changed since the interrupted attempt".to_owned()
    } else {
        match serde_json::from_slice::<Vec<serde_json::Value>>(&s.state) {
            Ok(mut messages) if !messages.is_empty() => {
                messages.push(serde_json::json!({"role": "user", "content": CONTINUE_NOTE}));
                let line = format!(
                    "continued the conversation attempt {} left ({} model turns): only the rest is asked of the model",
                    s.attempt, s.turns
                );
                return (Some(messages), Some(line));
            }
            _ => "the interrupted attempt's conversation cannot be read back".to_owned(),
        }
    };
    (None, Some(format!("started fresh: {why}")))
}

/// A regular file's bytes, never through a link in its last component; at most
/// [`MAX_SESSION_BYTES`].
fn read_nofollow(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.file_type().is_file() {
        return None;
    }
    let mut out = Vec::new();
    f.take(MAX_SESSION_BYTES as u64 + 1)
        .read_to_end(&mut out)
        .ok()?;
    (out.len() <= MAX_SESSION_BYTES).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(prompt: &str, session: Option<v1::Session>) -> v1::TaskSpec {
        v1::TaskSpec {
            prompt: prompt.into(),
            session,
            ..Default::default()
        }
    }

    /// A checkpoint reads the file while the CLI writes it: a line half written is left out.
    #[test]
    fn a_capture_keeps_only_whole_lines() {
        let (config, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let id = new_id();
        let dir = project_dir(config.path(), work.path());
        std::fs::create_dir_all(&dir).unwrap();
        let whole = "{\"type\":\"user\"}\n{\"type\":\"assistant\"}\n";
        std::fs::write(
            dir.join(format!("{id}.jsonl")),
            format!("{whole}{{\"type\":\"assis"),
        )
        .unwrap();
        let s = capture(config.path(), work.path(), &id, "p").expect("captured");
        assert_eq!((s.state.as_slice(), s.turns), (whole.as_bytes(), 1));
    }

    #[test]
    fn a_session_goes_round_to_the_next_attempt_only_for_its_backend_and_prompt() {
        let (config, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let id = new_id();
        assert!(is_id(&id), "{id}");
        let dir = project_dir(config.path(), work.path());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(format!("{id}.jsonl")),
            "{\"type\":\"user\"}\n{\"type\":\"assistant\"}\n{\"type\":\"assistant\"}\n",
        )
        .unwrap();
        let mut s = capture(config.path(), work.path(), &id, "do it").expect("captured");
        assert_eq!((s.turns, s.backend.as_str()), (2, "claude-code"));
        s.attempt = 1;
        // Another worker: another config and another working directory.
        let (config2, work2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let started = start(
            &spec("do it", Some(s.clone())),
            config2.path(),
            work2.path(),
        );
        assert_eq!(
            started,
            Start::Continue {
                id: id.clone(),
                turns: 2,
                from: 1
            }
        );
        let back =
            std::fs::read(project_dir(config2.path(), work2.path()).join(format!("{id}.jsonl")))
                .unwrap();
        assert_eq!(back, s.state);
        // Another prompt, another backend, a forged id: fresh, and the line says why.
        let other = start(
            &spec("do something else", Some(s.clone())),
            config2.path(),
            work2.path(),
        );
        assert!(
            other.line().unwrap().contains("the prompt changed"),
            "{other:?}"
        );
        let mut api = s.clone();
        api.backend = "anthropic".into();
        let line = start(&spec("do it", Some(api)), config2.path(), work2.path())
            .line()
            .unwrap();
        assert!(line.contains("ran on anthropic"), "{line}");
        let mut forged = s;
        forged.id = "../../etc/x".into();
        assert!(matches!(
            start(&spec("do it", Some(forged)), config2.path(), work2.path()),
            Start::Fresh { why: Some(_), .. }
        ));
        assert_eq!(
            start(&spec("do it", None), config2.path(), work2.path()).line(),
            None
        );
    }

    #[test]
    fn a_session_file_an_agent_made_a_link_is_not_read() {
        let (config, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let id = new_id();
        let dir = project_dir(config.path(), work.path());
        std::fs::create_dir_all(&dir).unwrap();
        let secret = config.path().join("secret");
        std::fs::write(&secret, "the worker's key").unwrap();
        std::os::unix::fs::symlink(&secret, dir.join(format!("{id}.jsonl"))).unwrap();
        assert_eq!(capture(config.path(), work.path(), &id, "p"), None);
        // Nor through a linked directory.
        let (config2, elsewhere) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let other = project_dir(elsewhere.path(), work.path());
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join(format!("{id}.jsonl")), "x").unwrap();
        std::os::unix::fs::symlink(
            elsewhere.path().join("projects"),
            config2.path().join("projects"),
        )
        .unwrap();
        assert_eq!(capture(config2.path(), work.path(), &id, "p"), None);
    }

    #[test]
    fn an_api_backend_s_history_goes_on_with_the_note_for_its_own_backend_and_prompt() {
        use serde_json::json;
        let first = vec![json!({"role": "user", "content": "p"})];
        assert_eq!(
            of_messages("anthropic", &first, "p"),
            None,
            "no model turn yet"
        );
        let history = vec![
            json!({"role": "user", "content": "p"}),
            json!({"role": "assistant", "content": "a wrong answer"}),
            json!({"role": "user", "content": "it does not match the schema"}),
        ];
        let mut s = *of_messages("anthropic", &history, "p").expect("a session");
        assert_eq!((s.turns, s.backend.as_str()), (1, "anthropic"));
        s.attempt = 1;
        let (go_on, line) = messages_to_continue(&spec("p", Some(s.clone())), "anthropic");
        let go_on = go_on.expect("continued");
        assert_eq!(&go_on[..3], &history[..]);
        assert_eq!(go_on[3]["content"], CONTINUE_NOTE);
        assert!(
            line.unwrap()
                .starts_with("continued the conversation attempt 1 left (1 model turns)")
        );
        let (none, line) = messages_to_continue(&spec("q", Some(s.clone())), "anthropic");
        assert!(none.is_none() && line.unwrap().contains("the prompt changed"));
        let (none, line) = messages_to_continue(&spec("p", Some(s)), "openai");
        assert!(none.is_none() && line.unwrap().contains("ran on anthropic"));
        assert_eq!(
            messages_to_continue(&spec("p", None), "openai"),
            (None, None)
        );
    }
}
