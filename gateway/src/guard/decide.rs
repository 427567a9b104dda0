//! What the guard does about a request, by the tenant's policy: pure, with time passed in.
//!
//! A blocked session is refused until cleared; one in a cooldown is refused until it ends.
//! Otherwise a loop found is flagged, throttled (refused, and the session refused for the
//! cooldown; once a cooldown has run out, the next looping request is answered, flagged, and
//! opens the next one: one step per cooldown) or blocked.

use super::signals::Loop;
use super::store::{LoopNote, Mark, SessionState};
use crate::types::guard::{GuardPolicy, LoopAction};

/// The guard's decision on one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No loop.
    Allow,
    /// Answer, flagged as a loop.
    Flag {
        /// The loop.
        found: Loop,
        /// Answered as a throttled session's one step after a cooldown (a new one is open).
        throttled: bool,
    },
    /// Refuse (429 `loop_detected`).
    Refuse(Refusal),
}

/// A refused request: what the client is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Blocked until cleared (else throttled).
    pub blocked: bool,
    /// Seconds until the cooldown ends (throttled).
    pub retry_after_secs: Option<u64>,
    /// The plain explanation: the session, what repeated, how to clear it.
    pub message: String,
    /// Steps of the loop found on this request (0: refused for the session's state alone).
    pub steps: u32,
    /// What the session's latest answered request cost: the estimate of what refusing saves.
    pub last_cost_micros: i64,
}

fn note(l: &Loop, now_ms: i64) -> LoopNote {
    LoopNote {
        what: l.what.clone(),
        repeats: u32::try_from(l.repeats).unwrap_or(u32::MAX),
        period: u32::try_from(l.period).unwrap_or(u32::MAX),
        at_ms: now_ms,
    }
}

/// "tool call `x` repeated 3 times", for people.
pub fn describe(what: &str, repeats: u32, period: u32) -> String {
    if period > 1 {
        format!("a cycle of {period} steps ({what}) repeated {repeats} times")
    } else {
        format!("{what} repeated {repeats} times with the same outcome")
    }
}

/// Decide for a request of `session` (of tenant `tenant`, as an admin names it) in `state`,
/// with `found` the loop it shows, at `now_ms`. Returns the decision and what to write back.
pub fn decide(
    policy: &GuardPolicy,
    state: &SessionState,
    found: Option<Loop>,
    tenant: &str,
    session: &str,
    now_ms: i64,
) -> (Decision, Option<Mark>) {
    let cooling = state.cooldown_until_ms > now_ms;
    if found.is_none() && state.blocked_at_ms == 0 && !cooling {
        // Nearly every request: nothing to say, nothing to write.
        return (Decision::Allow, None);
    }
    let steps = found
        .as_ref()
        .map_or(0, |l| u32::try_from(l.steps()).unwrap_or(u32::MAX));
    let what = match (&found, &state.last_loop) {
        (Some(l), _) => describe(
            &l.what,
            u32::try_from(l.repeats).unwrap_or(u32::MAX),
            u32::try_from(l.period).unwrap_or(u32::MAX),
        ),
        (None, Some(n)) => describe(&n.what, n.repeats, n.period),
        (None, None) => "the same step repeated".to_owned(),
    };
    let clear = format!("`gatewayctl sessions clear --tenant {tenant} {session}`");
    let refuse = |blocked: bool, retry_after_secs: Option<u64>, message: String| Refusal {
        blocked,
        retry_after_secs,
        message,
        steps,
        last_cost_micros: state.last_cost_micros,
    };
    let refused_mark = Mark {
        refused: Some(state.last_cost_micros),
        found: found.as_ref().map(|l| note(l, now_ms)),
        ..Mark::default()
    };
    if state.blocked_at_ms > 0 {
        let message = format!(
            "Agent loop detected in session `{session}`: {what}. The session is blocked until \
             an admin clears it ({clear}); start a new session or change the agent's next step."
        );
        return (
            Decision::Refuse(refuse(true, None, message)),
            Some(refused_mark),
        );
    }
    let cooldown_ms =
        i64::try_from(policy.cooldown_secs.unwrap_or(60).saturating_mul(1000)).unwrap_or(i64::MAX);
    let throttled = |secs: u64| {
        format!(
            "Agent loop detected in session `{session}`: {what}. The session is throttled: its \
             requests are refused for {secs} s (see Retry-After). Change the agent's next step, \
             or clear the session with {clear}."
        )
    };
    if cooling {
        let secs = u64::try_from((state.cooldown_until_ms - now_ms + 999) / 1000)
            .unwrap_or(1)
            .max(1);
        return (
            Decision::Refuse(refuse(false, Some(secs), throttled(secs))),
            Some(refused_mark),
        );
    }
    let Some(l) = found else {
        return (Decision::Allow, None);
    };
    let found_note = Some(note(&l, now_ms));
    match policy.action.unwrap_or(LoopAction::Flag) {
        LoopAction::Flag => (
            Decision::Flag {
                found: l,
                throttled: false,
            },
            Some(Mark {
                flagged: true,
                found: found_note,
                ..Mark::default()
            }),
        ),
        LoopAction::Throttle if state.cooldown_until_ms > 0 => (
            // A cooldown ran out: this step goes through and opens the next one.
            Decision::Flag {
                found: l,
                throttled: true,
            },
            Some(Mark {
                flagged: true,
                cooldown_until_ms: Some(now_ms.saturating_add(cooldown_ms)),
                found: found_note,
                ..Mark::default()
            }),
        ),
        LoopAction::Throttle => {
            let secs = u64::try_from(cooldown_ms / 1000).unwrap_or(1).max(1);
            (
                Decision::Refuse(refuse(false, Some(secs), throttled(secs))),
                Some(Mark {
                    cooldown_until_ms: Some(now_ms.saturating_add(cooldown_ms)),
                    ..refused_mark
                }),
            )
        }
        LoopAction::Block => {
            let message = format!(
                "Agent loop detected in session `{session}`: {what}. The session is now blocked \
                 until an admin clears it ({clear}); start a new session or change the agent's \
                 next step."
            );
            (
                Decision::Refuse(refuse(true, None, message)),
                Some(Mark {
                    blocked_at_ms: Some(now_ms),
                    ..refused_mark
                }),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn looped() -> Option<Loop> {
        Some(Loop {
            repeats: 3,
            period: 1,
            what: "tool call `run_tests`".into(),
        })
    }

    fn policy(action: LoopAction) -> GuardPolicy {
        GuardPolicy {
            action: Some(action),
            cooldown_secs: Some(30),
            ..GuardPolicy::default()
        }
    }

    #[test]
    fn no_loop_is_allowed_and_writes_nothing() {
        let (d, m) = decide(
            &policy(LoopAction::Block),
            &SessionState::default(),
            None,
            "t",
            "s",
            0,
        );
        assert_eq!((d, m), (Decision::Allow, None));
    }

    #[test]
    fn a_throttled_session_is_refused_for_the_cooldown_then_gets_one_step() {
        let p = policy(LoopAction::Throttle);
        let (d, m) = decide(
            &p,
            &SessionState::default(),
            looped(),
            "acme",
            "run-1",
            1_000,
        );
        let Decision::Refuse(r) = d else {
            panic!("{d:?}")
        };
        assert_eq!((r.blocked, r.retry_after_secs), (false, Some(30)));
        assert!(
            r.message.contains("run-1") && r.message.contains("run_tests"),
            "{}",
            r.message
        );
        assert!(r
            .message
            .contains("gatewayctl sessions clear --tenant acme run-1"));
        let m = m.unwrap_or_default();
        assert_eq!(m.cooldown_until_ms, Some(31_000));
        // During the cooldown, anything from the session is refused.
        let state = SessionState {
            cooldown_until_ms: 31_000,
            ..SessionState::default()
        };
        let (d, _) = decide(&p, &state, None, "acme", "run-1", 20_000);
        assert!(
            matches!(
                d,
                Decision::Refuse(Refusal {
                    retry_after_secs: Some(11),
                    ..
                })
            ),
            "{d:?}"
        );
        // After it, one looping step is answered and opens the next cooldown.
        let (d, m) = decide(&p, &state, looped(), "acme", "run-1", 31_000);
        assert!(
            matches!(
                d,
                Decision::Flag {
                    throttled: true,
                    ..
                }
            ),
            "{d:?}"
        );
        assert_eq!(m.unwrap_or_default().cooldown_until_ms, Some(61_000));
    }

    #[test]
    fn a_blocked_session_stays_refused_without_a_loop() {
        let p = policy(LoopAction::Block);
        let (d, m) = decide(&p, &SessionState::default(), looped(), "t", "s", 5);
        assert!(matches!(
            d,
            Decision::Refuse(Refusal {
                blocked: true,
                retry_after_secs: None,
                ..
            })
        ));
        assert_eq!(m.unwrap_or_default().blocked_at_ms, Some(5));
        let state = SessionState {
            blocked_at_ms: 5,
            last_cost_micros: 1_234,
            ..SessionState::default()
        };
        let (d, m) = decide(&policy(LoopAction::Flag), &state, None, "t", "s", 9_999_999);
        let Decision::Refuse(r) = d else {
            panic!("{d:?}")
        };
        assert!(r.blocked && r.last_cost_micros == 1_234);
        assert_eq!(m.unwrap_or_default().refused, Some(1_234));
    }
}
