//! `WorkerService`: a remote worker's `Attach` stream, bridged onto the channels an in-process
//! worker uses, so the dispatcher cannot tell them apart. Only a worker certificate attaches,
//! under its certificate's name (and an instance of it); the call answers once the dispatcher
//! has taken the `Hello` or refused it (a name another process holds).

use std::pin::Pin;
use std::sync::Arc;
use tokio_util::task::TaskTracker;

use flotilla_proto::ErrorKind;
use flotilla_proto::frag;
use flotilla_proto::link::CoordinatorEnd;
use flotilla_proto::tls::{self, Role};
use flotilla_proto::v1::worker_service_server::WorkerService;
use flotilla_proto::v1::{self, CoordinatorMessage, WorkerMessage, worker_message};
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::coordinator::Coordinator;

pub(super) fn check_version(theirs: &str) -> Result<(), Status> {
    if flotilla_proto::protocol_compatible(theirs) {
        Ok(())
    } else {
        Err(ErrorKind::Conflict.status(format!(
            "protocol version {theirs:?} is not compatible with this coordinator's {}; upgrade the older side",
            flotilla_proto::PROTOCOL_VERSION
        )))
    }
}

/// Longest an `Attach` waits for the dispatcher to take or refuse the worker's `Hello`.
const HELLO_VERDICT: std::time::Duration = std::time::Duration::from_secs(30);

pub(super) struct WorkerSvc {
    pub(super) coordinator: Arc<Coordinator>,
    pub(super) secure: bool,
    /// The server's tasks: each worker stream's reader is one.
    pub(super) tasks: TaskTracker,
}

pub type StreamOf<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A worker's name: its certificate's `cn`, and the instance it calls itself after a slash
/// (`cn/INSTANCE` when it says `INSTANCE` or `cn/INSTANCE`; INSTANCE: 1 to 63 letters,
/// digits, `-`, `_` and `.`, such as a pod's host name). Replicas that share one certificate
/// are told apart; the identity is still the certificate's.
pub fn instance_name(cn: &str, said: &str) -> String {
    if said == cn {
        return cn.to_owned();
    }
    let instance = said
        .strip_prefix(cn)
        .and_then(|r| r.strip_prefix('/'))
        .unwrap_or(said);
    let valid = !instance.is_empty()
        && instance.len() <= 63
        && instance
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        format!("{cn}/{instance}")
    } else {
        cn.to_owned()
    }
}

#[cfg(test)]
mod instance_tests {
    #[test]
    fn replicas_of_one_certificate_are_told_apart_and_nothing_else_is_taken() {
        use super::instance_name as n;
        assert_eq!(
            n("worker", "worker/flotilla-worker-7d9f-x2"),
            "worker/flotilla-worker-7d9f-x2"
        );
        assert_eq!(n("worker", "worker"), "worker");
        assert_eq!(n("worker", "other/pod"), "worker");
        assert_eq!(
            n("worker", "flotilla-worker-7d9f-x2"),
            "worker/flotilla-worker-7d9f-x2"
        );
        assert_eq!(n("worker", "worker/"), "worker");
        assert_eq!(n("worker", "worker/a/b"), "worker");
        assert_eq!(n("worker", "workerx/a"), "worker");
        assert_eq!(n("worker", &format!("worker/{}", "a".repeat(64))), "worker");
    }
}

#[tonic::async_trait]
impl WorkerService for WorkerSvc {
    type AttachStream = StreamOf<CoordinatorMessage>;

    async fn attach(
        &self,
        req: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let name = if self.secure {
            Some(tls::require_role(&req, &[Role::Worker], "attach as a worker")?.name)
        } else {
            None
        };
        let peer = req
            .remote_addr()
            .map_or_else(|| "an unknown address".to_owned(), |a| a.to_string());
        if let Some(l) = self.coordinator.leadership()
            && !l.is_leader()
        {
            return Err(ErrorKind::Unavailable.status(format!(
                "this coordinator is a standby; the leader is {}",
                l.leader().unwrap_or_else(|| "not known yet".into())
            )));
        }
        let mut inbound = req.into_inner();
        // The first message must be a compatible Hello.
        let first = inbound.message().await?.ok_or_else(|| {
            ErrorKind::Invalid.status("the worker closed its stream before Hello")
        })?;
        let Some(worker_message::Msg::Hello(mut hello)) = first.msg else {
            return Err(ErrorKind::Invalid.status("a worker stream must start with Hello"));
        };
        check_version(&hello.protocol_version)?;
        if let Some(name) = name {
            // A worker is known by its certificate, whatever it calls itself; replicas that
            // share one certificate (a Kubernetes Deployment) are told apart by the instance
            // they name (`CN/INSTANCE`: their host names).
            hello.name = instance_name(&name, &hello.name);
        }
        let (worker, slots) = (hello.name.clone(), hello.slots);
        let (end, out) = bridge(hello, inbound, &self.tasks);
        let out = match self.coordinator.leadership() {
            Some(l) => hand_back_out_of_office(out, l.office()),
            None => out,
        };
        // The answer waits for the dispatcher's verdict on the Hello: a worker whose name is
        // taken hears why as the call's status, and stops instead of taking the name back.
        let verdict = self.coordinator.dispatch().attach_remote(end, &peer);
        match tokio::time::timeout(HELLO_VERDICT, verdict).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(taken))) => {
                return Err(ErrorKind::Conflict.status(taken.to_string()));
            }
            Ok(Err(_)) | Err(_) => {
                return Err(ErrorKind::Unavailable.status(
                    "the coordinator did not take the worker's Hello (it is stopping, or busy); the worker tries again",
                ));
            }
        }
        tracing::info!(worker = %worker, peer = %peer, slots, "worker attached");
        Ok(Response::new(out))
    }
}

/// `out`, ended with a standby's refusal once `office` says this coordinator no longer leads
/// (suspended, or stepped down). The worker then tries the next coordinator of its group, as
/// it does when a standby turns it away, and keeps running what it holds: whoever leads next
/// takes the link and the attempts over. A suspension that ends with the lease renewed
/// (nobody took over) brings the workers straight back here.
fn hand_back_out_of_office(
    out: StreamOf<CoordinatorMessage>,
    office: watch::Receiver<bool>,
) -> StreamOf<CoordinatorMessage> {
    let handed_back = ErrorKind::Unavailable.status(
        "this coordinator is a standby now: it could not renew its lease in etcd in time; attach to the coordinator that leads",
    );
    Box::pin(futures::stream::unfold(Some((out, office)), move |state| {
        let handed_back = handed_back.clone();
        async move {
            let (mut out, mut office) = state?;
            let next = tokio::select! {
                m = out.next() => m,
                // A closed sender means the leadership itself is gone: the process stops.
                _ = office.wait_for(|leads| !leads) => return Some((Err(handed_back), None)),
            };
            next.map(|m| (m, Some((out, office))))
        }
    }))
}

/// Bridges a worker's `Attach` stream (its `Hello` read already) onto the channels an
/// in-process worker uses: the coordinator's end of the link, and the stream of messages to
/// send the worker. Big messages travel in fragments both ways (see `frag`); when the worker's
/// stream ends, the end's `rx` ends.
pub fn bridge(
    hello: v1::Hello,
    mut inbound: Streaming<WorkerMessage>,
    tasks: &TaskTracker,
) -> (CoordinatorEnd, StreamOf<CoordinatorMessage>) {
    let worker = hello.name.clone();
    let (to_worker_tx, to_worker_rx) = mpsc::unbounded_channel();
    let (from_worker_tx, from_worker_rx) = mpsc::unbounded_channel();
    let _ = from_worker_tx.send(WorkerMessage {
        msg: Some(worker_message::Msg::Hello(hello)),
    });
    // Ends with the worker's stream (or once the dispatcher has gone).
    tasks.spawn(async move {
        let mut pieces = frag::Reassembler::default();
        loop {
            match inbound.message().await {
                Ok(Some(msg)) => match pieces.push(msg) {
                    Ok(Some(msg)) => {
                        if from_worker_tx.send(msg).is_err() {
                            break;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(worker = %worker, error = %e, "dropped a message from the worker");
                    }
                },
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(worker = %worker, error = %e, "worker stream ended");
                    break;
                }
            }
        }
        // Dropping the sender tells the dispatcher the worker is gone.
    });
    // Big assignments go out in fragments (see `frag`); the run engine refuses an agent()
    // call too big to send at all before it is queued.
    let frames_rx = frag::splitting(to_worker_rx, "worker");
    let out = frames_rx.map(Ok);
    (
        CoordinatorEnd {
            tx: to_worker_tx,
            rx: from_worker_rx,
        },
        Box::pin(out),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::wrappers::UnboundedReceiverStream;

    #[tokio::test]
    async fn a_link_is_handed_back_with_a_standby_s_refusal_once_out_of_office() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (office, watching) = watch::channel(true);
        let mut out =
            hand_back_out_of_office(Box::pin(UnboundedReceiverStream::new(rx).map(Ok)), watching);
        tx.send(CoordinatorMessage::default()).unwrap();
        assert!(out.next().await.unwrap().is_ok());
        office.send_replace(false);
        let refused = out.next().await.unwrap().unwrap_err();
        // The worker's connect loop moves on to the next coordinator on exactly this.
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        assert!(refused.message().contains("standby"), "{refused:?}");
        assert!(
            out.next().await.is_none(),
            "the stream ends after the refusal"
        );
    }
}
