//! Coalescing: a client retry of a request that is still running upstream (same API key, same
//! request fingerprint) waits for that request's answer instead of sending a second one, so an
//! SDK that times out and retries never doubles the work, and the tenant is charged once. The
//! retry's ledger row says `cache_status = coalesced` at cost 0.
//!
//! A non-streamed answer is shared whole. A streamed one is shared as it comes: the stream's
//! driver writes every chunk it sends its own client into a [`StreamLog`] (whether that client
//! is still there or not: the one that timed out usually is not), and a follower replays the
//! log from its first chunk, then follows it live to its end. The request stays joinable until
//! its stream ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use tokio::sync::Notify;

/// An answer, shared with the requests that joined it (its fields are private).
#[derive(Debug)]
pub struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Shared,
}

/// A shared answer's body.
#[derive(Debug)]
enum Shared {
    Whole(Bytes),
    Stream(Arc<StreamLog>),
}

/// The chunks a streamed answer sent so far, for requests that join it late.
#[derive(Debug, Default)]
pub struct StreamLog {
    state: Mutex<LogState>,
    more: Notify,
}

#[derive(Debug, Default)]
struct LogState {
    chunks: Vec<Bytes>,
    /// The driver attached to it: the answer is a stream (not an error before any).
    attached: bool,
    done: bool,
    /// The leader, kept (joinable) until the stream ends.
    leader: Option<Leader>,
}

impl StreamLog {
    fn state(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The stream's driver starts writing: the answer is this stream.
    pub fn attach(&self) {
        self.state().attached = true;
    }

    /// A chunk the leader's client was sent (or would have been, had it stayed).
    pub fn push(&self, chunk: Bytes) {
        self.state().chunks.push(chunk);
        self.more.notify_waiters();
    }

    /// The stream ended: followers end too, and the request is no longer joinable.
    pub fn finish(&self) {
        let leader = {
            let mut state = self.state();
            state.done = true;
            state.leader.take()
        };
        drop(leader);
        self.more.notify_waiters();
    }

    /// The body of a follower: every chunk from the first, then each new one, to the end.
    fn replay(self: Arc<Self>) -> Body {
        let chunks = futures_util::stream::unfold((self, 0usize), |(log, next)| async move {
            let chunk = wait_until(&log.more, || {
                let state = log.state();
                match state.chunks.get(next) {
                    Some(chunk) => Some(Some(chunk.clone())),
                    None if state.done => Some(None),
                    None => None,
                }
            })
            .await?;
            Some((Ok::<_, std::io::Error>(chunk), (log, next + 1)))
        });
        Body::from_stream(chunks)
    }
}

/// Ends a stream's log however its driver ends (a panic, a cancelled task included).
#[derive(Debug)]
pub struct LogWriter(pub Arc<StreamLog>);

impl Drop for LogWriter {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Where a leader's answer is left for its followers: set once (the answer, or `None` when the
/// leader ended without one), with the followers waiting on it counted. One small allocation
/// per request that leads (a watch channel was 352 bytes, with eight wait lists to make and to
/// notify when dropped).
#[derive(Debug, Default)]
struct Rendezvous {
    outcome: OnceLock<Option<Arc<Answer>>>,
    ready: Notify,
    followers: AtomicUsize,
}

impl Rendezvous {
    /// Leave the outcome (the first one stays) and wake whoever waits.
    fn settle(&self, outcome: Option<Arc<Answer>>) {
        let _ = self.outcome.set(outcome);
        self.ready.notify_waiters();
    }
}

/// Wait until `look` finds something, looking again each time `notify` wakes its waiters. It
/// listens before it looks, so a change made (and notified) in between is not missed.
async fn wait_until<T>(notify: &Notify, mut look: impl FnMut() -> Option<T>) -> T {
    loop {
        let woken = notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if let Some(found) = look() {
            return found;
        }
        woken.await;
    }
}

/// Where a follower waits for the answer.
#[derive(Debug)]
pub struct Slot(Arc<Rendezvous>);

impl Slot {
    fn new(rendezvous: &Arc<Rendezvous>) -> Self {
        rendezvous.followers.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(rendezvous))
    }

    /// The leader's answer, once it has one; `None` when it ended without.
    async fn outcome(&self) -> Option<Arc<Answer>> {
        wait_until(&self.0.ready, || self.0.outcome.get().cloned()).await
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.followers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The non-streamed requests in flight in this process, by (API key, fingerprint).
#[derive(Debug, Default)]
pub struct Inflight {
    /// Keyed by the API key's id, a NUL, and the fingerprint (one allocation, shared with the
    /// leader that removes it).
    running: Mutex<crate::FastMap<Arc<str>, Arc<Rendezvous>>>,
}

/// A request that runs upstream and shares its answer with whoever joins it.
#[derive(Debug)]
pub struct Leader {
    key: Arc<str>,
    rendezvous: Arc<Rendezvous>,
    owner: Arc<Inflight>,
    /// Where a streamed answer's driver writes its chunks (made only for streams).
    log: Option<Arc<StreamLog>>,
    /// Out of the map already (see [`Leader::retire`]): a later leader of the same request
    /// may own its entry now.
    retired: bool,
}

/// What a request does about an identical one in flight.
#[derive(Debug)]
pub enum Join {
    /// Run, sharing the answer.
    Lead(Leader),
    /// Wait for the running one's answer.
    Follow(Slot),
    /// Run on its own (an identical request is running, but this one is not a retry).
    Alone,
}

impl Inflight {
    /// Lead, or (for a client retry) follow the identical request in flight.
    pub fn join(self: &Arc<Self>, key_id: &str, fingerprint: &str, retry: bool) -> Join {
        // The key is put together on the stack (a key id and a fingerprint fit), and allocated
        // once, shared, only when this request leads.
        let len = key_id.len() + 1 + fingerprint.len();
        let mut stack = [0u8; 128];
        let on_stack = stack.get_mut(..len).and_then(|buf| {
            let (id, rest) = buf.split_at_mut(key_id.len());
            id.copy_from_slice(key_id.as_bytes());
            rest[0] = 0;
            rest[1..].copy_from_slice(fingerprint.as_bytes());
            std::str::from_utf8(buf).ok()
        });
        let heap;
        let joined: &str = match on_stack {
            Some(joined) => joined,
            None => {
                heap = [key_id, fingerprint].join("\0");
                &heap
            }
        };
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rendezvous) = running.get(joined) {
            // Counted under the map's lock: a leader retiring sees every follower that joined.
            return if retry {
                Join::Follow(Slot::new(rendezvous))
            } else {
                Join::Alone
            };
        }
        let rendezvous = Arc::new(Rendezvous::default());
        let key: Arc<str> = Arc::from(joined);
        running.insert(Arc::clone(&key), Arc::clone(&rendezvous));
        Join::Lead(Leader {
            key,
            rendezvous,
            owner: Arc::clone(self),
            log: None,
            retired: false,
        })
    }

    /// Requests in flight that others may join.
    pub fn len(&self) -> usize {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Leader {
    /// Where a streamed answer's driver writes what it sends its client (made on first ask:
    /// a non-streamed request never needs one).
    pub fn log(&mut self) -> Arc<StreamLog> {
        Arc::clone(self.log.get_or_insert_with(Arc::default))
    }

    /// Leave the map, so that no retry joins from now on, and say whether any joined before.
    fn retire(&mut self) -> bool {
        let mut running = self.owner.running.lock().unwrap_or_else(|p| p.into_inner());
        // Its entry goes (retiring once: a later leader of the same request owns the next).
        drop(running.remove(&self.key));
        self.retired = true;
        self.rendezvous.followers.load(Ordering::Relaxed) > 0
    }

    /// Share `response` with the followers, and return it: a stream (its driver attached to
    /// the log) as it comes, the leader staying joinable until it ends; anything else read
    /// whole, when a follower waits for it (most answers have none: those are returned as
    /// they are, without a copy of their headers or a second pass over their body).
    pub async fn publish(mut self, response: Response, limit: usize) -> Response {
        let (parts, body) = response.into_parts();
        let attached = self.log.clone().filter(|log| log.state().attached);
        if let Some(log) = attached {
            let answer = Arc::new(Answer {
                status: parts.status,
                headers: parts.headers.clone(),
                body: Shared::Stream(Arc::clone(&log)),
            });
            self.rendezvous.settle(Some(answer));
            {
                let mut state = log.state();
                if !state.done {
                    // Joinable until the stream ends (its log's finish drops it).
                    state.leader = Some(self);
                }
            }
            return Response::from_parts(parts, body);
        }
        if !self.retire() {
            return Response::from_parts(parts, body);
        }
        let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
            // Unreadable (it cannot be: the pipeline built it whole); followers run alone.
            return Response::from_parts(parts, Body::empty());
        };
        let answer = Arc::new(Answer {
            status: parts.status,
            headers: parts.headers.clone(),
            body: Shared::Whole(bytes.clone()),
        });
        self.rendezvous.settle(Some(answer));
        Response::from_parts(parts, Body::from(bytes))
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if !self.retired {
            self.retire();
        }
        // Ended without an answer (or after one, which stays): followers stop waiting.
        self.rendezvous.settle(None);
    }
}

/// Headers of the leader's answer a follower must not repeat: its budget accounting (the
/// follower reserved nothing) and its cache outcome.
fn own_header(name: &str) -> bool {
    name.starts_with("x-gateway-budget-") || name == "x-gateway-cache"
}

/// Wait for the leader's answer; `None` when it ended without one (the follower then runs on
/// its own).
pub async fn follow(slot: Slot) -> Option<Response> {
    let answer = slot.outcome().await?;
    let body = match &answer.body {
        Shared::Whole(bytes) => Body::from(bytes.clone()),
        Shared::Stream(log) => Arc::clone(log).replay(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = answer.status;
    for (name, value) in &answer.headers {
        if !own_header(name.as_str()) {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    response.headers_mut().insert(
        crate::headers::CACHE,
        HeaderValue::from_static(crate::usage::CacheStatus::Coalesced.header_value()),
    );
    Some(response)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_retry_follows_the_running_request_and_gets_its_answer() {
        let inflight = Arc::new(Inflight::default());
        let Join::Lead(leader) = inflight.join("key", "fp", false) else {
            panic!("the first one leads")
        };
        assert!(matches!(inflight.join("key", "fp", false), Join::Alone));
        assert!(matches!(inflight.join("other", "fp", true), Join::Lead(_)));
        let Join::Follow(slot) = inflight.join("key", "fp", true) else {
            panic!("a retry follows")
        };
        let waiter = tokio::spawn(follow(slot));
        let mut answer = Response::new(Body::from("{\"ok\":true}"));
        answer
            .headers_mut()
            .insert("x-gateway-budget-policy", HeaderValue::from_static("b1"));
        let mine = leader.publish(answer, 1 << 20).await;
        assert_eq!(
            axum::body::to_bytes(mine.into_body(), 1 << 20)
                .await
                .unwrap(),
            "{\"ok\":true}"
        );
        let theirs = waiter.await.unwrap().unwrap();
        assert_eq!(theirs.headers()["x-gateway-cache"], "coalesced");
        assert!(!theirs.headers().contains_key("x-gateway-budget-policy"));
        assert_eq!(
            axum::body::to_bytes(theirs.into_body(), 1 << 20)
                .await
                .unwrap(),
            "{\"ok\":true}"
        );
        assert!(
            matches!(inflight.join("key", "fp", true), Join::Lead(_)),
            "done: gone"
        );
    }

    #[test]
    fn keys_of_any_length_join_only_their_own_request() {
        let inflight = Arc::new(Inflight::default());
        let long = "k".repeat(200);
        let mut leaders = Vec::new();
        for (key, fp) in [("ab", "c"), ("a", "bc"), (long.as_str(), "fp"), ("k", "fp")] {
            match inflight.join(key, fp, false) {
                Join::Lead(l) => leaders.push(l),
                _ => panic!("{key:?}/{fp:?} joined another request"),
            }
        }
        for (key, fp) in [("ab", "c"), ("a", "bc"), (long.as_str(), "fp")] {
            assert!(matches!(inflight.join(key, fp, true), Join::Follow(_)));
        }
        assert_eq!(inflight.len(), 4);
    }

    #[tokio::test]
    async fn an_answer_nobody_joined_is_returned_as_is_and_a_retired_leader_leaves_the_next_alone()
    {
        let inflight = Arc::new(Inflight::default());
        let Join::Lead(leader) = inflight.join("key", "fp", false) else {
            panic!("the first one leads")
        };
        let mut answer = Response::new(Body::from("{\"ok\":true}"));
        answer
            .headers_mut()
            .insert("x-gateway-cache", HeaderValue::from_static("miss"));
        let mine = leader.publish(answer, 1 << 20).await;
        assert_eq!(mine.headers()["x-gateway-cache"], "miss");
        assert_eq!(
            axum::body::to_bytes(mine.into_body(), 1 << 20)
                .await
                .unwrap(),
            "{\"ok\":true}"
        );
        assert!(inflight.is_empty());
        // Retired, a leader no longer owns the request's entry: the next leader's survives it.
        let Join::Lead(mut first) = inflight.join("key", "fp", false) else {
            panic!("leads again")
        };
        assert!(!first.retire(), "nobody joined");
        let Join::Lead(_second) = inflight.join("key", "fp", false) else {
            panic!("a new request leads once the first retired")
        };
        drop(first);
        assert!(matches!(inflight.join("key", "fp", true), Join::Follow(_)));
    }

    #[tokio::test]
    async fn a_retry_of_a_stream_replays_what_was_sent_then_follows_it_to_the_end() {
        let inflight = Arc::new(Inflight::default());
        let Join::Lead(mut leader) = inflight.join("key", "fp", false) else {
            panic!("the first one leads")
        };
        let log = leader.log();
        let writer = LogWriter(Arc::clone(&log));
        log.attach();
        log.push(Bytes::from_static(b"data: 1\n\n"));
        let mine = leader.publish(Response::new(Body::empty()), 1 << 20).await;
        drop(mine);
        // The leader's client is gone; a retry joins while the stream runs.
        let Join::Follow(slot) = inflight.join("key", "fp", true) else {
            panic!("still joinable while the stream runs")
        };
        let theirs = follow(slot).await.unwrap();
        assert_eq!(theirs.headers()["x-gateway-cache"], "coalesced");
        log.push(Bytes::from_static(b"data: 2\n\n"));
        drop(writer);
        let body = axum::body::to_bytes(theirs.into_body(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(body, "data: 1\n\ndata: 2\n\n");
        assert!(inflight.is_empty(), "ended: no longer joinable");
    }

    #[tokio::test]
    async fn a_leader_that_ends_without_an_answer_lets_its_followers_run() {
        let inflight = Arc::new(Inflight::default());
        let Join::Lead(leader) = inflight.join("key", "fp", false) else {
            panic!()
        };
        let Join::Follow(slot) = inflight.join("key", "fp", true) else {
            panic!()
        };
        drop(leader);
        assert!(follow(slot).await.is_none());
        assert!(inflight.is_empty());
    }
}
