//! The minimal upstream for proxy-overhead benchmarks (issue 19): an OpenAI-shaped model server
//! as light as a hello-world hyper server, so that on a 2-core machine what a benchmark measures
//! is the proxy in front of it, not the upstream (the simulator, which parses the request and
//! builds its answer, costs more per request than the proxies under test).
//!
//! Every `POST .../chat/completions` (or `.../completions`) is answered with one fixed body: 16
//! completion tokens and a `usage` block, written in one write; a request asking for
//! `"stream": true` gets the same as three SSE events (one chunk, the usage chunk, `[DONE]`).
//! `GET .../models` lists the one model. The request body is read to its end (keep-alive needs
//! it) and looked at only for `"stream":true`.
//!
//! ```sh
//! cargo run --release -p gateway --example min_upstream -- --port 19101 --threads 1
//! ```

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool"
)]

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

const MODEL: &str = "sim-small";

const COMPLETION: &str = r#"{"id":"chatcmpl-min","object":"chat.completion","created":1764547200,"model":"sim-small","choices":[{"index":0,"message":{"role":"assistant","content":"one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"},"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28}}"#;

const STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-min","object":"chat.completion.chunk","created":1764547200,"model":"sim-small","choices":[{"index":0,"delta":{"role":"assistant","content":"one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"},"finish_reason":"length"}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-min","object":"chat.completion.chunk","created":1764547200,"model":"sim-small","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28}}"#,
    "\n\n",
    "data: [DONE]\n\n"
);

const MODELS: &str = r#"{"object":"list","data":[{"id":"sim-small","object":"model","created":0,"owned_by":"bench"}]}"#;

fn answer(
    status: StatusCode,
    content_type: &'static str,
    body: &'static str,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

async fn serve(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    // Read the whole body: the connection is reused only once it is consumed.
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    Ok(match (method, path.as_str()) {
        (Method::POST, p) if p.ends_with("/completions") => {
            if streamed(&body) {
                answer(StatusCode::OK, "text/event-stream", STREAM)
            } else {
                answer(StatusCode::OK, "application/json", COMPLETION)
            }
        }
        (Method::GET, p) if p.ends_with("/models") => {
            answer(StatusCode::OK, "application/json", MODELS)
        }
        _ => answer(
            StatusCode::NOT_FOUND,
            "application/json",
            r#"{"error":{"message":"not found","type":"invalid_request_error"}}"#,
        ),
    })
}

/// Whether the body says `"stream": true` (any spacing).
fn streamed(body: &[u8]) -> bool {
    memchr::memmem::find_iter(body, b"\"stream\"").any(|at| {
        let rest = body[at + 8..]
            .iter()
            .skip_while(|b| b.is_ascii_whitespace());
        let rest = rest
            .skip_while(|b| **b == b':')
            .skip_while(|b| b.is_ascii_whitespace());
        rest.take(4).copied().eq(*b"true")
    })
}

fn main() -> std::io::Result<()> {
    let mut port = 19101u16;
    let mut threads = 1usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = args.next();
        match (a.as_str(), value.as_deref().map(str::parse::<usize>)) {
            ("--port", Some(Ok(v))) => port = u16::try_from(v).unwrap_or(port),
            ("--threads", Some(Ok(v))) => threads = v.max(1),
            _ => {
                eprintln!("usage: min_upstream [--port N] [--threads N]");
                std::process::exit(2);
            }
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        println!(
            "minimal upstream ({MODEL}) on http://{}/v1",
            listener.local_addr()?
        );
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), hyper::service::service_fn(serve))
                    .await;
            });
        }
    })
}
