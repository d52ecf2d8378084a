//! The trace spans of attempts, in the OpenTelemetry GenAI conventions: made when an attempt
//! is assigned ([`attempt_span`]), filled in when its outcome comes ([`record_outcome`]).

use flotilla_proto::v1;

use super::handle::CallId;

/// The span of attempt `attempt` of call `id` on worker `worker`, under its call's: an agent
/// invocation in the OpenTelemetry GenAI conventions (`invoke_agent {name}`, `gen_ai.*`), with
/// Flotilla's own attributes under `flotilla.`. Usage, the model that answered and the error
/// class are recorded when its outcome comes ([`record_outcome`]).
pub(super) fn attempt_span(
    ticket: &super::handle::Ticket,
    id: &CallId,
    attempt: u32,
    worker: &str,
) -> tracing::Span {
    let task = &ticket.task;
    let name = if task.label.is_empty() {
        "agent"
    } else {
        task.label.as_str()
    };
    let span = tracing::info_span!(
        parent: &ticket.span,
        "attempt",
        otel.name = %format_args!("invoke_agent {name}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = %name,
        gen_ai.agent.id = %format_args!("{}/{}", id.0, id.1),
        gen_ai.provider.name = provider(&task.backend),
        gen_ai.request.model = tracing::field::Empty,
        gen_ai.response.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.usage.cache_read.input_tokens = tracing::field::Empty,
        gen_ai.usage.cache_creation.input_tokens = tracing::field::Empty,
        error.type = tracing::field::Empty,
        flotilla.run_id = %id.0,
        flotilla.call = id.1,
        flotilla.attempt = attempt,
        flotilla.worker = %worker,
        flotilla.backend = %task.backend,
        flotilla.outcome = tracing::field::Empty,
    );
    if !task.model.is_empty() {
        span.record("gen_ai.request.model", task.model.as_str());
    }
    span
}

/// `gen_ai.provider.name` of a backend: the API its agents talk to (Flotilla's own for the
/// ones that call no model).
pub(super) fn provider(backend: &str) -> &'static str {
    match backend {
        "claude-code" | "anthropic" | "" => "anthropic",
        "openai" => "openai",
        "echo" => "flotilla.echo",
        "exec" => "flotilla.exec",
        _ => "flotilla.other",
    }
}

/// What an attempt of `task` is, for the OpenTelemetry instruments.
pub(super) fn operation<'a>(
    task: &'a v1::TaskSpec,
    response_model: &'a str,
) -> crate::counters::Operation<'a> {
    crate::counters::Operation {
        provider: provider(&task.backend),
        request_model: &task.model,
        response_model,
    }
}

/// What an attempt's outcome adds to its span (the tokens it used, the model that answered,
/// and for a failure its class, `error.type`, and an error status) and to the token usage
/// instrument.
pub(super) fn record_outcome(
    span: &tracing::Span,
    task: &v1::TaskSpec,
    usage: &v1::Usage,
    o: &v1::Outcome,
) {
    let answered = match &o.result {
        Some(v1::outcome::Result::Completed(done)) => done.model.as_str(),
        _ => "",
    };
    crate::counters::tokens_used(
        operation(task, answered),
        usage.input_tokens,
        usage.output_tokens,
    );
    span.record("gen_ai.usage.input_tokens", usage.input_tokens);
    span.record("gen_ai.usage.output_tokens", usage.output_tokens);
    span.record(
        "gen_ai.usage.cache_read.input_tokens",
        usage.cache_read_tokens,
    );
    span.record(
        "gen_ai.usage.cache_creation.input_tokens",
        usage.cache_write_tokens,
    );
    match &o.result {
        Some(v1::outcome::Result::Completed(done)) if !done.model.is_empty() => {
            span.record("gen_ai.response.model", done.model.as_str());
        }
        Some(v1::outcome::Result::Failure(f)) => {
            let kind = v1::FailureKind::try_from(f.kind).unwrap_or(v1::FailureKind::Terminal);
            span.record("error.type", kind.class());
            span.record("otel.status_code", "error");
        }
        _ => {}
    }
}
