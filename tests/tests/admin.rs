//! The admin API, the real `gatewayctl` binary, and key revocation across replicas.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::Duration;

use e2e::{chat_body, config, replica, Sim, StoreKind, TestApp, TestStore, ADMIN_TOKEN};
use reqwest::Method;
use serde_json::{json, Value};

async fn app_on(store: TestStore, seed: bool, sim: &Sim) -> TestApp {
    let c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    TestApp::spawn_on(c, store, seed).await
}

/// Deny by default: every `/v1` route answers 401 in OpenAI shape without a valid tenant key
/// (each handler authenticates through its first extractor, so a route added without it would
/// be open: this list names them all), and the edge still stamps the answer with its request id.
#[tokio::test]
async fn every_v1_route_needs_a_tenant_key() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(TestStore::new(StoreKind::Sqlite).await.unwrap(), true, &sim).await;
    let routes = [
        (Method::POST, "/v1/chat/completions"),
        (Method::POST, "/v1/completions"),
        (Method::POST, "/v1/embeddings"),
        (Method::GET, "/v1/models"),
        (Method::GET, "/v1/models/fast"),
    ];
    // The route's request, with a chat body when it takes one.
    let request = |method: &Method, path: &str| {
        let req = app
            .http
            .request(method.clone(), format!("{}{path}", app.base));
        if *method == Method::POST {
            req.json(&chat_body("fast", "hi"))
        } else {
            req
        }
    };
    for (method, path) in routes {
        for key in [None, Some("sk-gw-not-a-key"), Some(ADMIN_TOKEN)] {
            let mut req = request(&method, path).header("x-request-id", "client-7");
            if let Some(key) = key {
                req = req.bearer_auth(key);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{method} {path} with {key:?}");
            let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
            assert!(id.starts_with("req_"), "{id}");
            assert_eq!(r.headers()["x-client-request-id"], "client-7");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "authentication_error", "{v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains("key"),
                "{v}"
            );
        }
        let status = request(&method, path)
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap()
            .status();
        assert_ne!(status, 401, "{method} {path} with the tenant's key");
    }
}

#[tokio::test]
async fn the_admin_api_needs_the_admin_token_and_is_off_without_one() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(TestStore::new(StoreKind::Sqlite).await.unwrap(), true, &sim).await;
    let url = format!("{}/admin/v1/tenants", app.base);
    assert_eq!(app.http.get(&url).send().await.unwrap().status(), 401);
    assert_eq!(
        app.http
            .get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        app.http
            .get(&url)
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap()
            .status(),
        401,
        "tenant keys are not admin tokens"
    );
    assert_eq!(
        app.http
            .get(&url)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    c.admin.token = None;
    let off = TestApp::spawn(c, StoreKind::Sqlite).await;
    let resp = off
        .http
        .get(format!("{}/admin/v1/tenants", off.base))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
}

/// `gateway serve` with the given admin token in the environment (`None`: unset) and an
/// otherwise valid config; the process, which either exits or serves on the returned port.
fn serve_with_admin_env(
    dir: &std::path::Path,
    token: Option<&str>,
) -> (tokio::process::Child, u16) {
    gateway::telemetry::install_crypto_provider();
    let port = e2e::free_port();
    let db = format!("sqlite://{}", dir.join("g.db").display());
    let toml = e2e::offline_toml(port, &db, dir);
    let child = e2e::serve_binary(dir, &toml, &[("GATEWAY__ADMIN__TOKEN", token)]);
    (child, port)
}

#[tokio::test]
async fn an_empty_or_short_admin_token_refuses_to_start_naming_the_setting() {
    for token in ["", "hunter2"] {
        let dir = tempfile::tempdir().unwrap();
        let (child, port) = serve_with_admin_env(dir.path(), Some(token));
        let mut child = child;
        let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .expect("the gateway exits instead of serving")
            .unwrap();
        let text = std::fs::read_to_string(dir.path().join("gateway.log")).unwrap();
        assert!(!status.success(), "{token:?} started:\n{text}");
        assert!(text.contains("admin.token"), "{token:?}:\n{text}");
        // It exited, so nothing of it listens (probing its port would race other tests that
        // may be given the same port once it is free).
        let _ = port;
    }
}

#[tokio::test]
async fn without_an_admin_token_the_real_binary_answers_403_to_every_admin_request() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, port) = serve_with_admin_env(dir.path(), None);
    let base = format!("http://127.0.0.1:{port}");
    e2e::until_healthy(&base, &mut child).await;
    let http = reqwest::Client::new();
    for auth in [None, Some("Bearer "), Some("Basic Og==")] {
        let mut req = http.get(format!("{base}/admin/v1/tenants"));
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        assert_eq!(req.send().await.unwrap().status(), 403, "{auth:?}");
    }
    child.kill().await.unwrap();
}

#[tokio::test]
async fn admin_api_validates_input_and_reports_conflicts() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(TestStore::new(StoreKind::Sqlite).await.unwrap(), true, &sim).await;
    let r = app
        .admin(Method::POST, "tenants", Some(json!({"name": "acme"})))
        .await;
    assert_eq!(r.status(), 409);
    let r = app
        .admin(Method::POST, "tenants", Some(json!({"name": "has space"})))
        .await;
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["param"], "name");
    let r = app
        .admin(Method::POST, "tenants", Some(json!({"nam": "x"})))
        .await;
    assert_eq!(r.status(), 400);
    let r = app
        .admin(Method::POST, "keys", Some(json!({"tenant": "ghost"})))
        .await;
    assert_eq!(r.status(), 404);
    let r = app.admin(Method::DELETE, "keys/key_nope", None).await;
    assert_eq!(r.status(), 404);
}

async fn ctl(app: &TestApp, args: &[&str]) -> (bool, String) {
    app.ctl(args).await
}

#[tokio::test]
async fn gatewayctl_manages_tenants_and_keys_and_a_revoked_key_stops_working() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(
        TestStore::new(StoreKind::Sqlite).await.unwrap(),
        false,
        &sim,
    )
    .await;
    let (ok, out) = ctl(&app, &["tenants", "create", "globex"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("created tenant globex"), "{out}");
    let (ok, out) = ctl(&app, &["tenants", "list"]).await;
    assert!(
        ok && out.contains("globex") && out.contains("NAME"),
        "{out}"
    );

    let (ok, out) = ctl(
        &app,
        &[
            "--json",
            "keys",
            "create",
            "--tenant",
            "globex",
            "--name",
            "web",
            "--tag",
            "feature=chat",
        ],
    )
    .await;
    assert!(ok, "{out}");
    let created: Value = serde_json::from_str(&out).unwrap();
    let secret = created["key"].as_str().unwrap().to_owned();
    let id = created["id"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("sk-gw-"));
    assert_eq!(created["tags"]["feature"], "chat");

    let chat = |key: String| {
        let http = app.http.clone();
        let url = format!("{}/v1/chat/completions", app.base);
        async move {
            http.post(url)
                .bearer_auth(key)
                .json(&chat_body("fast", "hi"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(chat(secret.clone()).await, 200);

    let (ok, out) = ctl(&app, &["keys", "list", "--tenant", "globex"]).await;
    assert!(
        ok && out.contains(&id) && out.contains("active") && out.contains("feature=chat"),
        "{out}"
    );
    assert!(!out.contains(&secret), "the secret is never listed");

    let (ok, out) = ctl(&app, &["keys", "revoke", &id]).await;
    assert!(ok, "{out}");
    assert_eq!(chat(secret).await, 401, "revoked on this replica at once");
    let (_, out) = ctl(&app, &["keys", "list"]).await;
    assert!(out.contains("revoked"), "{out}");

    let (ok, out) = ctl(&app, &["keys", "revoke", &id]).await;
    assert!(
        !ok && out.contains("404"),
        "revoking twice is an error: {out}"
    );
    let (ok, out) = ctl(&app, &["tenants", "delete", "globex"]).await;
    assert!(ok, "{out}");
    let out = tokio::process::Command::new(e2e::binary("gatewayctl"))
        .args(["tenants", "list"])
        .env("GATEWAY_URL", &app.base)
        .env_remove("GATEWAY_ADMIN_TOKEN")
        .output()
        .await
        .unwrap();
    let (ok, out) = (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(!ok && out.contains("admin token"), "{out}");
}

/// Two replicas on one Postgres store; the second uses the first's key.
async fn two_replicas() -> (TestApp, TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let store_a = TestStore::new(StoreKind::Postgres).await.unwrap();
    let store_b = store_a.reopen().await.unwrap();
    let a = app_on(store_a, true, &sim).await;
    let mut b = app_on(store_b, false, &sim).await;
    b.api_key = a.api_key.clone();
    (a, b, sim)
}

#[tokio::test]
async fn a_key_revoked_on_one_replica_stops_working_on_another_within_two_seconds() {
    let (a, b, _sim) = two_replicas().await;
    assert_eq!(
        b.chat(chat_body("fast", "hi")).await.status(),
        200,
        "replica B knows the key"
    );
    assert_eq!(
        a.admin(Method::DELETE, &format!("keys/{}", a.key_id), None)
            .await
            .status(),
        200
    );
    e2e::eventually(
        "the other replica refuses the revoked key",
        Duration::from_secs(2),
        || async { (b.chat(chat_body("fast", "hi")).await.status() == 401).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn deleting_a_tenant_revokes_its_keys_through_the_api() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(TestStore::new(StoreKind::Sqlite).await.unwrap(), true, &sim).await;
    assert_eq!(app.chat(chat_body("fast", "hi")).await.status(), 200);
    assert_eq!(
        app.admin(Method::DELETE, "tenants/acme", None)
            .await
            .status(),
        200
    );
    assert_eq!(app.chat(chat_body("fast", "hi")).await.status(), 401);
    assert_eq!(
        app.admin(Method::DELETE, "tenants/acme", None)
            .await
            .status(),
        404
    );
}

#[tokio::test]
async fn a_new_key_used_at_once_and_concurrently_works_on_every_replica() {
    let (a, b, _sim) = two_replicas().await;
    let created: Value = a
        .admin(Method::POST, "keys", Some(json!({"tenant": "acme"})))
        .await
        .json()
        .await
        .unwrap();
    let key = created["key"].as_str().unwrap().to_owned();
    let body = chat_body("fast", "hi");
    for app in [&a, &b] {
        let answers =
            futures_util::future::join_all((0..12).map(|_| app.chat_as(&key, &body))).await;
        let statuses: Vec<u16> = answers.iter().map(|r| r.status().as_u16()).collect();
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    }
}

#[tokio::test]
async fn a_deleted_tenant_leaves_the_metrics_of_every_replica() {
    let (a, b, _sim) = two_replicas().await;
    let series = "tenant=\"acme\"";
    for app in [&a, &b] {
        assert_eq!(app.chat(chat_body("fast", "hi")).await.status(), 200);
        assert!(app.metrics().await.contains(series));
    }
    assert_eq!(
        a.admin(Method::DELETE, "tenants/acme", None).await.status(),
        200
    );
    assert!(
        !a.metrics().await.contains(series),
        "gone at once where deleted"
    );
    e2e::eventually(
        "the other replica drops the deleted tenant's series",
        Duration::from_secs(5),
        || async { (!b.metrics().await.contains(series)).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn admin_writes_need_a_bearer_token_and_json_so_a_cross_site_form_cannot_send_one() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(TestStore::new(StoreKind::Sqlite).await.unwrap(), true, &sim).await;
    let url = |path: &str| format!("{}{path}", app.base);
    // What a browser that opened the dashboard would attach by itself to a cross-site form.
    let basic = |r: reqwest::RequestBuilder| r.basic_auth("admin", Some(ADMIN_TOKEN));
    let form = basic(app.http.post(url("/admin/v1/tenants")))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("name=evil");
    assert_eq!(form.send().await.unwrap().status(), 401);
    let json = basic(app.http.post(url("/admin/v1/tenants"))).json(&json!({"name": "evil"}));
    assert_eq!(
        json.send().await.unwrap().status(),
        401,
        "Basic is for the page only"
    );
    let reads = basic(app.http.get(url("/admin/v1/tenants")));
    assert_eq!(reads.send().await.unwrap().status(), 401);
    // (This gateway writes no ledger, so the page itself is a 404 once past the credential.)
    let page = basic(app.http.get(url("/dashboard")));
    assert_eq!(
        page.send().await.unwrap().status(),
        404,
        "the page takes Basic"
    );

    // With the bearer token, a body must be JSON (a form cannot send that cross-site).
    for content_type in ["text/plain", "application/x-www-form-urlencoded"] {
        let r = app
            .http
            .post(url("/admin/v1/tenants"))
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", content_type)
            .body(r#"{"name": "evil"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 415, "{content_type}");
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("application/json"));
    }
    let r = app
        .admin(Method::POST, "tenants", Some(json!({"name": "fine"})))
        .await;
    assert_eq!(r.status(), 201);
    let r = app.admin(Method::DELETE, "tenants/fine", None).await;
    assert!(
        r.status().is_success(),
        "a DELETE without a body needs no type"
    );
    let (ok, out) = app.ctl(&["tenants", "list"]).await;
    assert!(ok && out.contains("acme"), "{out}");
    let list: Value = app
        .admin(Method::GET, "tenants", None)
        .await
        .json()
        .await
        .unwrap();
    assert!(
        !list.to_string().contains("evil"),
        "no forged tenant: {list}"
    );
}

#[tokio::test]
async fn gatewayctl_exits_quietly_when_its_reader_goes_away() {
    let sim = Sim::zero("sim-small").await;
    let app = app_on(TestStore::new(StoreKind::Sqlite).await.unwrap(), true, &sim).await;
    // `gatewayctl keys list | head -0`: the pipe is closed before anything is written.
    let mut child = tokio::process::Command::new(e2e::binary("gatewayctl"))
        .args(["keys", "list"])
        .env("GATEWAY_URL", &app.base)
        .env("GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}
