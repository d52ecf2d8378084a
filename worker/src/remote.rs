//! A worker attached to a remote coordinator over gRPC (mTLS unless `--insecure`).
//!
//! [`serve`] runs the [`Worker`] and hands it one [`Link`] per connection: connect, open the
//! `Attach` stream, bridge it. When the stream breaks, the worker keeps its attempts (see
//! [`Worker::serve`]) and this reconnects with exponential backoff, up to [`MAX_BACKOFF`]
//! between tries, until `cancel` fires or the coordinator refuses the worker.

use std::time::Duration;

use flotilla_proto::frag;
use flotilla_proto::link::Link;
use flotilla_proto::tls::TlsFiles;
use flotilla_proto::v1::WorkerMessage;
use flotilla_proto::v1::worker_service_client::WorkerServiceClient;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::Worker;

/// Hang-ups right after the TLS handshake, in a row, that mean the certificate is refused.
const REJECTED_AFTER: u32 = 3;

/// Longest wait between reconnection attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Where and how to reach the coordinator.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// `https://host:port` (or `http://` with no TLS); several, comma-separated, for a group
    /// of coordinators (the worker attaches to whichever leads).
    pub endpoint: String,
    /// `None`: plain text.
    pub tls: Option<TlsFiles>,
    /// The operator listener's address (`--metrics-listen`), served once the worker's
    /// certificates are read.
    pub metrics_listen: Option<std::net::SocketAddr>,
}

/// Errors that end the worker instead of a retry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Connect(String),
    #[error("the coordinator refused this worker: {0}")]
    Refused(String),
}

/// Serves the coordinator until `cancel` fires or the coordinator refuses this worker.
pub async fn serve(
    worker: Worker,
    opts: RemoteOptions,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let endpoints: Vec<String> = opts
        .endpoint
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect();
    if endpoints.is_empty() {
        return Err(Error::Connect(
            "no coordinator address: pass --coordinator https://host:port".into(),
        ));
    }
    let channels = endpoints
        .iter()
        .map(|e| {
            flotilla_proto::tls::channel(e, opts.tls.as_ref())
                .map(|c| (e.clone(), c))
                .map_err(|p| Error::Connect(p.message))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meters = match opts.metrics_listen {
        Some(at) => {
            let listener = crate::meters::bind(at)
                .await
                .map_err(|p| Error::Connect(p.message))?;
            tracing::info!("operator metrics on http://{at}/metrics");
            Some(listener)
        }
        None => None,
    };
    let (links_tx, links_rx) = mpsc::unbounded_channel();
    // `cancel` stops the worker: it interrupts what it runs and sends those outcomes (with
    // what each attempt left, W58) on the link it has; the link goes only then, or after
    // DRAIN_WAIT.
    let stop = cancel.child_token();
    let link_stop = CancellationToken::new();
    let connected = CancellationToken::new();
    let run = {
        let (stop, link_stop, connected) = (stop.clone(), link_stop.clone(), connected.clone());
        async move {
            worker.serve(links_rx, stop).await;
            tokio::select! {
                () = connected.cancelled() => {}
                () = tokio::time::sleep(DRAIN_WAIT) => link_stop.cancel(),
            }
        }
    };
    let served_until = connected.clone();
    let connect = async move {
        let res = connect_loop(channels, &opts, &links_tx, &link_stop, &stop).await;
        drop(links_tx);
        // Refused or cancelled: the worker stops and cancels what it runs.
        stop.cancel();
        connected.cancel();
        res
    };
    // The operator listener serves until the worker has stopped.
    let meters = async move {
        if let Some(listener) = meters {
            crate::meters::serve(listener, served_until).await;
        }
    };
    let (res, (), ()) = tokio::join!(connect, run, meters);
    res
}

/// Longest a stopping worker keeps its link for the outcomes of what it interrupted.
const DRAIN_WAIT: Duration = Duration::from_secs(10);

/// Attaches, and again whenever a link ends, until `cancel` fires; once `stopping` fires no
/// new link is made (the current one stays for the worker's last outcomes).
async fn connect_loop(
    channels: Vec<(String, Channel)>,
    opts: &RemoteOptions,
    links: &mpsc::UnboundedSender<Link>,
    cancel: &CancellationToken,
    stopping: &CancellationToken,
) -> Result<(), Error> {
    let mut backoff = Duration::from_millis(100);
    let mut hangups = 0u32;
    let mut at = 0usize;
    while !cancel.is_cancelled() && !stopping.is_cancelled() {
        let (endpoint, channel) = &channels[at % channels.len()];
        match attach_once(channel.clone(), links, cancel).await {
            Ok(()) => {
                backoff = Duration::from_millis(100);
                hangups = 0;
                at += 1;
            }
            Err(status)
                if status.code() == tonic::Code::Unavailable
                    && status.message().contains("standby") =>
            {
                // Not the leader: try the next coordinator of the group soon.
                tracing::info!(endpoint = %endpoint, "{}", status.message());
                at += 1;
                backoff = Duration::from_millis(100);
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = stopping.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                continue;
            }
            Err(status) => {
                at += 1;
                crate::meters::LINK_FAILURES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // A conflict (`FailedPrecondition`) is also how the coordinator says another
                // worker process is attached under this name. That one keeps serving; this one
                // stops with the reason rather than retry, so its supervisor shows it failed (a
                // worker that stays up refused serves nothing and hides the clash), and the
                // supervisor's restart back-off is the retry should the other one be gone.
                let refused = matches!(
                    status.code(),
                    tonic::Code::PermissionDenied
                        | tonic::Code::Unauthenticated
                        | tonic::Code::FailedPrecondition
                );
                if refused {
                    return Err(Error::Refused(status.message().to_owned()));
                }
                if flotilla_proto::tls::is_tls_rejection(&status) {
                    return Err(Error::Refused(flotilla_proto::tls::explain(&status)));
                }
                // A server that hangs up right after the handshake, again and again, is refusing
                // our certificate (TLS 1.3 reports it that way); a coordinator that is merely
                // restarting refuses the TCP connection instead.
                if opts.tls.is_some()
                    && flotilla_proto::tls::looks_like_rejected_client_cert(&status)
                {
                    hangups += 1;
                    if hangups >= REJECTED_AFTER {
                        return Err(Error::Refused(flotilla_proto::tls::explain(&status)));
                    }
                } else {
                    hangups = 0;
                }
                tracing::warn!(endpoint = %endpoint, error = %flotilla_proto::tls::explain(&status), retry_in = ?backoff, "cannot reach the coordinator");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = stopping.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
    Ok(())
}

/// One `Attach` stream over `channel` as a [`Link`], carried by a task of its own until the
/// stream ends or `cancel` fires (the link's `rx` then ends). What [`serve`] gives the worker
/// for each connection; the link suite holds it to the same rules as an in-process link.
pub async fn link_over(
    channel: Channel,
    cancel: CancellationToken,
) -> Option<(Link, tokio::task::JoinHandle<Result<(), tonic::Status>>)> {
    let (links_tx, mut links_rx) = mpsc::unbounded_channel();
    let carried = tokio::spawn(async move { attach_once(channel, &links_tx, &cancel).await });
    let link = links_rx.recv().await?;
    Some((link, carried))
}

/// `flotilla_worker_attached` is 1 while one of these lives.
struct Attached;

impl Attached {
    fn now() -> Attached {
        crate::meters::ATTACHED.store(1, std::sync::atomic::Ordering::Relaxed);
        Attached
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        crate::meters::ATTACHED.store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One connection: hands the worker a link and carries it until the stream ends.
async fn attach_once(
    channel: Channel,
    links: &mpsc::UnboundedSender<Link>,
    cancel: &CancellationToken,
) -> Result<(), tonic::Status> {
    let mut client = WorkerServiceClient::new(channel)
        .max_decoding_message_size(frag::MAX_FRAME_BYTES)
        .max_encoding_message_size(frag::MAX_FRAME_BYTES);
    let (out_tx, out_rx) = mpsc::unbounded_channel::<WorkerMessage>();
    let (in_tx, in_rx) = mpsc::unbounded_channel();
    // Big outcomes and transcripts go out in fragments (see `frag`); outcomes are fitted to
    // the limit before they are sent.
    let frames_rx = frag::splitting(out_rx, "coordinator");
    // The worker sends Hello first; the call only returns once the coordinator answers.
    if links
        .send(Link {
            tx: out_tx,
            rx: in_rx,
        })
        .is_err()
    {
        return Ok(());
    }
    let call = async move {
        let mut inbound = client.attach(frames_rx).await?.into_inner();
        tracing::info!("attached to the coordinator");
        crate::meters::LINKS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _up = Attached::now();
        let mut pieces = frag::Reassembler::default();
        while let Some(msg) = inbound.next().await {
            match pieces.push(msg?) {
                Ok(Some(m)) => {
                    if in_tx.send(m).is_err() {
                        break;
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "dropped a message from the coordinator"),
            }
        }
        Ok(())
    };
    // Dropping the call drops `in_tx`: the worker sees the link end.
    tokio::select! {
        r = call => r,
        _ = cancel.cancelled() => Ok(()),
    }
}
