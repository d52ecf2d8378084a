//! `flotilla answer RUN [--question ID] --json VALUE`: answers a question a run's script
//! asked with `ask()`, on a coordinator (`--coordinator`) or in the store an embedded run
//! keeps (`--store`, or the default one), which the run looks into while a question is open.
//! Without `--json` it lists the run's open questions.

use std::io::Write;

use flotilla_proto::v1;
use flotilla_proto::wire::{Question, QuestionRecord};

use crate::client::*;

#[derive(clap::Args, Debug)]
pub struct AnswerArgs {
    run_id: String,
    /// The question, by the id the run's log, status and page show (`q_…`); without it,
    /// the run's only open question.
    #[arg(long)]
    question: Option<String>,
    /// The answer, as JSON: `true`, `'"some text"'`, `'{"approve": true}'`. Without it, the
    /// run's open questions are listed.
    #[arg(long = "json", value_name = "VALUE")]
    value: Option<String>,
    #[command(flatten)]
    from: ReadFrom,
}

pub async fn answer(a: AnswerArgs) -> i32 {
    if let Err(p) = flotilla_local::sizes::check_run_id(&a.run_id) {
        return crate::refuse(p);
    }
    let value = match a.value.as_deref().map(flotilla_local::sizes::answer) {
        None => return list(&a).await,
        Some(Err(p)) => return crate::refuse(p),
        Some(Ok(v)) => v,
    };
    let said = match &a.from.coordinator {
        Some(c) => {
            let remote = ClientArgs {
                coordinator: Some(c.clone()),
                tls: a.from.tls.clone(),
            };
            let mut client = match remote.client() {
                Ok(c) => c,
                Err(p) => return crate::refuse(p),
            };
            let request = v1::ControlRequest {
                run_id: a.run_id.clone(),
                action: "answer".into(),
                question: a.question.clone().unwrap_or_default(),
                answer_json: value.to_string(),
                ..Default::default()
            };
            match client.control(request).await {
                Ok(r) => r.into_inner().message,
                Err(s) => return rpc_fail(&s),
            }
        }
        None => match crate::stored::answer(
            a.from.store.clone(),
            &a.run_id,
            a.question.as_deref(),
            value,
            "",
        )
        .await
        {
            Ok(m) => m,
            Err(p) => return crate::refuse(p),
        },
    };
    eprintln!("{said}");
    0
}

/// Prints the run's open questions: id, text, schema, deadline.
async fn list(a: &AnswerArgs) -> i32 {
    let open: Vec<QuestionRecord> = match &a.from.coordinator {
        Some(c) => match report_of(c, &a.from.tls, &a.run_id).await {
            Ok(r) => open_of(r.questions),
            Err(code) => return code,
        },
        None => match crate::stored::questions(a.from.store.clone(), &a.run_id).await {
            Ok(q) => open_of(q),
            Err(p) => return crate::refuse(p),
        },
    };
    let mut out = std::io::stdout().lock();
    if open.is_empty() {
        let _ = writeln!(out, "run {} has no open question", a.run_id);
        return 0;
    }
    for q in &open {
        let _ = writeln!(out, "{}  {}", q.id, q.question);
        if let Some(s) = &q.schema {
            let _ = writeln!(out, "    schema: {s}");
        }
        if let Some(d) = &q.deadline {
            let _ = writeln!(out, "    unanswered by {d}, it ends with null");
        }
    }
    let _ = writeln!(
        out,
        "answer with: flotilla answer {} --question ID --json VALUE",
        a.run_id
    );
    0
}

fn open_of(questions: Vec<Question>) -> Vec<QuestionRecord> {
    questions
        .into_iter()
        .filter(|q| q.answer.is_none())
        .map(|q| q.asked)
        .collect()
}
