//! The built-in cost dashboard (`GET /dashboard`) on the embedded SQLite ledger: admin-token
//! protected (HTTP Basic for browsers), self-contained HTML, and, loaded in headless Chromium,
//! one bar per tenant whose amount matches the weekly report computed through the library.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration as StdDuration;

use chrono::{DateTime, Duration, Utc};
use e2e::{config, replica, Sim, StoreKind, TestApp, TestStore, ADMIN_TOKEN};
use gateway::ledger::report::{self, IsoWeek};
use gateway::usage::UsageEvent;

/// A tenant name that breaks the page unless it is escaped.
const TRICKY: &str = "o'hara & <co>";

fn event(
    i: usize,
    tenant: &str,
    model: &str,
    at: DateTime<Utc>,
    prompt: u64,
    hit: bool,
) -> UsageEvent {
    let (in_price, out_price) = if model.ends_with("large") {
        (5, 20)
    } else {
        (1, 4)
    };
    let id = format!("dash-{i}-{}", at.timestamp_micros());
    let billed = e2e::Billed {
        tenant,
        model,
        at,
        prompt,
        completion: 100,
        in_price,
        out_price,
    };
    let mut e = e2e::ledger_event(id, billed);
    e.tenant_id = format!("ten_{i}");
    e.tags.insert("feature".to_owned(), "dash".to_owned());
    e.status = if i % 17 == 1 { 500 } else { 200 };
    e.fingerprint = format!("fp{i}");
    if tenant == "beta" {
        e.tags
            .insert("session".to_owned(), format!("run-{}", i % 3));
    }
    if tenant == "alpha" && !hit {
        // alpha sends `auto`: the tier router put it on small, saving the large price (a cache
        // hit is answered before the route step).
        e.requested_model = "auto".into();
        e.route_reason = Some("classifier".into());
        e.all_large_micros = Some(prompt as i64 * 5 + 100 * 20);
    }
    if hit {
        e2e::into_cache_hit(e)
    } else {
        e
    }
}

/// Rows in the previous week and in the current week so far (from its start to now).
fn rows(now: DateTime<Utc>) -> Vec<UsageEvent> {
    let this = IsoWeek::containing(now);
    let previous = this.previous();
    let tenants = [
        ("alpha", "m-small", 1000u64),
        ("beta", "m-large", 500),
        (TRICKY, "m-small", 300),
    ];
    let mut out = Vec::new();
    let mut i = 0;
    for (t, (tenant, model, prompt)) in tenants.iter().enumerate() {
        // Last week: 20 requests each.
        for n in 0..20 {
            i += 1;
            let at = previous.start() + Duration::hours(10) + Duration::minutes(n * 13 + t as i64);
            out.push(event(i, tenant, model, at, *prompt, n % 5 == 0));
        }
        // This week: a different volume per tenant, spread between the week's start and now.
        let count = 10 + 15 * t as i64;
        let elapsed = (now - this.start()).num_microseconds().unwrap_or(i64::MAX);
        for n in 0..count {
            i += 1;
            let offset = elapsed / (count + 2) * (n + 1);
            let at = this.start() + Duration::microseconds(offset);
            assert!(at >= this.start() && at < now);
            out.push(event(i, tenant, model, at, *prompt * 2, n % 4 == 0));
        }
    }
    out
}

/// Micro-dollars as the page shows them.
fn usd(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    let abs = micros.unsigned_abs();
    format!("{sign}${}.{:06}", abs / 1_000_000, abs % 1_000_000)
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&apos;", "'")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

/// Every `<tag …>` start tag in `html`, as its attributes (values unescaped).
fn tags(html: &str, tag: &str) -> Vec<BTreeMap<String, String>> {
    let open = format!("<{tag} ");
    let mut out = Vec::new();
    let mut rest = html;
    while let Some(pos) = rest.find(&open) {
        rest = &rest[pos + open.len()..];
        let mut attrs = BTreeMap::new();
        let mut chars = rest.char_indices().peekable();
        let mut end = rest.len();
        loop {
            while chars.peek().is_some_and(|(_, c)| c.is_whitespace()) {
                chars.next();
            }
            let Some(&(start, c)) = chars.peek() else {
                break;
            };
            if c == '>' || c == '/' {
                end = start;
                break;
            }
            let mut name_end = start;
            while let Some(&(j, c)) = chars.peek() {
                if c == '=' || c == '>' || c.is_whitespace() {
                    break;
                }
                name_end = j + c.len_utf8();
                chars.next();
            }
            let name = rest[start..name_end].to_owned();
            let mut value = String::new();
            if chars.peek().is_some_and(|(_, c)| *c == '=') {
                chars.next();
                let quote = chars.next().map(|(_, q)| q).unwrap_or('"');
                for (_, c) in chars.by_ref() {
                    if c == quote {
                        break;
                    }
                    value.push(c);
                }
            }
            attrs.insert(name, unescape(&value));
        }
        out.push(attrs);
        rest = &rest[end..];
    }
    out
}

/// The part of `html` from the element with `id` to the next `</section>`.
fn section<'a>(html: &'a str, id: &str) -> &'a str {
    let marker = format!("id=\"{id}\"");
    let start = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let end = html[start..]
        .find("</section>")
        .map_or(html.len(), |e| start + e);
    &html[start..end]
}

fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "chromium is not installed: the dashboard test needs a headless browser \
         (apt-get install chromium; scripts/test.sh installs it)"
    );
}

/// Run headless Chromium with `args` and `url`; its stdout.
async fn run_chromium(profile: &Path, args: &[String], url: &str) -> String {
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args)
    .arg(url)
    .kill_on_drop(true);
    let out = tokio::time::timeout(StdDuration::from_secs(90), cmd.output())
        .await
        .expect("chromium finished within 90 s")
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 DOM")
}

#[tokio::test]
async fn the_dashboard_renders_the_weekly_report_in_headless_chromium() {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    let spool = tempfile::tempdir().unwrap();
    c.ledger.spool_dir = spool.path().to_owned();
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    let now = Utc::now();
    let ledger = gateway::ledger::open(&store.url).await.unwrap();
    ledger.insert(&rows(now)).await.unwrap();
    let app = TestApp::spawn_with_ledger(c, store).await;
    let budget = app
        .admin(
            reqwest::Method::POST,
            "budgets",
            Some(serde_json::json!({"tenant": "acme", "window": "month", "limit_usd": 10.0})),
        )
        .await;
    assert_eq!(budget.status(), 201);

    let week = IsoWeek::containing(now);
    let expected = report::weekly(ledger.as_ref(), week, None).await.unwrap();
    let explanation = report::explain(ledger.as_ref(), week.previous(), week, None)
        .await
        .unwrap();
    assert_eq!(expected.by["tenant"].len(), 3);
    assert!(expected.total.this.cost > 0 && expected.total.previous.cost > 0);

    // Plain HTTP: a browser is asked for credentials, Basic and bearer both work.
    let url = format!("{}/dashboard", app.base);
    let anonymous = app.http.get(&url).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    assert_eq!(
        anonymous.headers()["www-authenticate"],
        "Basic realm=\"llm-gateway\""
    );
    let wrong = app
        .http
        .get(&url)
        .basic_auth("admin", Some("not-the-token"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let ok = app
        .http
        .get(&url)
        .basic_auth("anyone", Some(ADMIN_TOKEN))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(ok.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let csp = "default-src 'none'; style-src 'unsafe-inline'; img-src data:";
    assert_eq!(ok.headers()["content-security-policy"], csp);
    let served = ok.text().await.unwrap();
    assert!(served.contains("http-equiv=\"Content-Security-Policy\""));
    assert!(
        served.contains("o&#39;hara &amp; &lt;co&gt;"),
        "tenant escaped"
    );
    assert!(!served.contains(TRICKY), "no raw tenant name in the page");
    for external in ["<script", "<link", " src=", "url(", "@import"] {
        assert!(
            !served.contains(external),
            "the page loads nothing: {external}"
        );
    }
    let bearer = app
        .http
        .get(&url)
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(bearer.status(), 200);
    let bogus = app
        .http
        .get(format!("{url}?week=bogus"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(bogus.status(), 400);
    let body: serde_json::Value = bogus.json().await.unwrap();
    assert_eq!(body["error"]["param"], "week");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    // The admin API is unchanged: no WWW-Authenticate there.
    let api = app
        .http
        .get(format!("{}/admin/v1/tenants", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(api.status(), 401);
    assert!(api.headers().get("www-authenticate").is_none());

    // Headless Chromium, authenticating with the URL's user info (HTTP Basic).
    let port = app.base.rsplit(':').next().unwrap();
    let browser_url = format!("http://admin:{ADMIN_TOKEN}@127.0.0.1:{port}/dashboard");
    let profile = tempfile::tempdir().unwrap();
    let dom = run_chromium(profile.path(), &["--dump-dom".to_owned()], &browser_url).await;
    assert!(
        dom.contains("Cost dashboard"),
        "Chromium did not load the page: {dom}"
    );

    // One bar per tenant, with this week's cost from the library's report.
    let bars = tags(section(&dom, "by-tenant"), "rect");
    let shown: BTreeMap<String, i64> = bars
        .iter()
        .map(|a| {
            (
                a["data-key"].clone(),
                a["data-cost-micros"].parse().unwrap(),
            )
        })
        .collect();
    let want: BTreeMap<String, i64> = expected.by["tenant"]
        .iter()
        .map(|l| (l.key.clone(), l.this.cost))
        .collect();
    assert_eq!(shown, want);
    assert!(shown.contains_key(TRICKY));
    // The biggest spender's bar spans the whole bar area; the others are proportional.
    let top = &expected.by["tenant"][0];
    let top_bar = bars.iter().find(|a| a["data-key"] == top.key).unwrap();
    assert_eq!(top_bar["width"], "560.00");
    for bar in &bars {
        let cost: f64 = bar["data-cost-micros"].parse().unwrap();
        let width: f64 = bar["width"].parse().unwrap();
        assert!((width - cost / top.this.cost as f64 * 560.0).abs() < 0.01);
    }
    for (dim, section_id) in [("model", "by-model"), ("tier", "by-tier")] {
        let rects = tags(section(&dom, section_id), "rect");
        assert_eq!(rects.len(), expected.by[dim].len(), "{dim}");
        for (rect, line) in rects.iter().zip(&expected.by[dim]) {
            assert_eq!(rect["data-key"], line.key);
            assert_eq!(rect["data-cost-micros"], line.this.cost.to_string());
        }
    }

    // The headline cost matches the report, to the micro-dollar.
    let headline = section(&dom, "headline-cost");
    assert!(headline.contains(&format!(
        "data-cost-micros=\"{}\"",
        expected.total.this.cost
    )));
    let value = |s: &str| {
        s.split("class=\"value\">")
            .nth(1)
            .and_then(|v| v.split('<').next())
            .unwrap()
            .to_owned()
    };
    assert_eq!(value(headline), usd(expected.total.this.cost), "{headline}");
    let requests = section(&dom, "headline-requests");
    assert_eq!(value(requests), expected.total.this.requests.to_string());

    // The explanation's terms, as the library computes them, adding up to the change.
    let terms = tags(section(&dom, "explanation"), "tr");
    let shown_terms: Vec<(String, i64)> = terms
        .iter()
        .filter(|a| a.contains_key("data-term"))
        .map(|a| {
            (
                a["data-term"].clone(),
                a["data-cost-micros"].parse().unwrap(),
            )
        })
        .collect();
    let want_terms: Vec<(String, i64)> = explanation
        .terms
        .iter()
        .map(|t| (t.term.to_owned(), t.micros))
        .collect();
    assert_eq!(shown_terms, want_terms);
    assert_eq!(
        shown_terms.iter().map(|(_, m)| m).sum::<i64>(),
        expected.total.this.cost - expected.total.previous.cost
    );

    // The tier router's table: alpha's savings against everything on large, then the total.
    let routing = tags(section(&dom, "routing"), "tr");
    let shown_routing: Vec<(String, i64)> = routing
        .iter()
        .filter(|a| a.contains_key("data-tenant"))
        .map(|a| {
            (
                a["data-tenant"].clone(),
                a["data-saved-micros"].parse().unwrap(),
            )
        })
        .collect();
    let want_routing: Vec<(String, i64)> = expected
        .routing
        .iter()
        .map(|l| (l.key.clone(), l.to_saved_micros))
        .collect();
    assert_eq!(shown_routing, want_routing);
    assert_eq!(
        want_routing.len(),
        2,
        "alpha and the total: {want_routing:?}"
    );
    assert!(want_routing[0].1 > 0, "{want_routing:?}");

    // Day by day: each weekday's cost this week beside the same day last week.
    let day_bars = tags(section(&dom, "daily"), "rect");
    assert_eq!(day_bars.len(), 14, "two bars a day");
    assert_eq!(expected.daily.len(), 7);
    for (pair, day) in day_bars.chunks(2).zip(&expected.daily) {
        assert_eq!(pair[0]["class"], "prev");
        assert_eq!(pair[0]["data-cost-micros"], day.previous.cost.to_string());
        assert_eq!(pair[1]["class"], "this");
        assert_eq!(pair[1]["data-cost-micros"], day.this.cost.to_string());
    }
    assert_eq!(
        expected.daily.iter().map(|d| d.this.cost).sum::<i64>(),
        expected.total.this.cost
    );
    // Cost by feature tag, the top keys and sessions, as in the report.
    let features = tags(section(&dom, "by-feature"), "rect");
    assert_eq!(features.len(), expected.by["feature"].len());
    let top_rows = tags(section(&dom, "top"), "tr");
    let shown_top: Vec<(String, String)> = top_rows
        .iter()
        .filter(|a| a.contains_key("data-key"))
        .map(|a| (a["data-key"].clone(), a["data-cost-micros"].clone()))
        .collect();
    let want_top: Vec<(String, String)> = ["key", "session"]
        .iter()
        .flat_map(|d| &expected.top[*d])
        .map(|l| (l.key.clone(), l.this.cost.to_string()))
        .collect();
    assert_eq!(shown_top, want_top);
    assert_eq!(expected.top["session"].len(), 3, "beta's three sessions");
    // Savings and waste by cause.
    let sw = section(&dom, "savings-waste");
    for (id, micros) in [
        ("headline-cache-saved", expected.total.this.saved),
        ("headline-waste-loops", expected.total.this.waste_loops),
        ("headline-waste-retries", expected.total.this.waste_retries),
        ("headline-waste-errors", expected.total.this.waste_errors),
    ] {
        assert!(
            sw.contains(&format!("id=\"{id}\" data-cost-micros=\"{micros}\"")),
            "{id} = {micros}: {sw}"
        );
    }
    assert!(
        sw.contains(&format!(
            "id=\"fallbacks\" data-value=\"{}\" data-cost-micros=\"{}\"",
            expected.total.this.fallback_requests, expected.total.this.fallback_cost
        )),
        "{sw}"
    );
    // The budget set above, with what it has used.
    let budget_rows = tags(section(&dom, "budgets"), "tr");
    assert!(
        budget_rows
            .iter()
            .any(|a| a.get("data-tenant").map(String::as_str) == Some("acme")),
        "acme's budget is shown: {budget_rows:?}"
    );
    assert!(
        !dom.contains("id=\"demo-data\""),
        "real rows are not demo data"
    );

    // And it paints: full-page screenshots at a laptop's width and a phone's, kept in the
    // build's temporary folder (docs/dashboard.png is one of the demo's).
    for (name, size) in [("1280", "1280,2400"), ("phone", "390,3200")] {
        let shot =
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("dashboard-{name}.png"));
        let shot_profile = tempfile::tempdir().unwrap();
        run_chromium(
            shot_profile.path(),
            &[
                format!("--screenshot={}", shot.display()),
                format!("--window-size={size}"),
                "--hide-scrollbars".to_owned(),
            ],
            &browser_url,
        )
        .await;
        let png = std::fs::read(&shot).expect("screenshot written");
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 10 * 1024, "screenshot is {} bytes", png.len());
        println!("screenshot: {}", shot.display());
    }

    app.stop().await;
}
