//! The floor of the gateway's stack for proxy-overhead benchmarks (issue 19): a reverse proxy with
//! no logic at all, built from the same parts as the gateway (tokio's multi-threaded runtime,
//! hyper's HTTP/1.1 server, `hyper_util`'s pooled client). Each request is forwarded as it came
//! (method, path, headers, body bytes) to one upstream and its answer is passed back. Whatever
//! separates this from nginx is the stack's cost on this machine, not the gateway's pipeline.
//!
//! ```sh
//! cargo run --release -p gateway --example min_proxy -- --port 19102 --upstream 127.0.0.1:19101
//! ```

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::expect_used,
    reason = "a command-line benchmark tool: a bad argument or a taken port ends it"
)]

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Upstream = Client<HttpConnector, Full<Bytes>>;

async fn forward(
    client: Upstream,
    upstream: &'static str,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (mut parts, body) = req.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = match format!("http://{upstream}{path}").parse::<Uri>() {
        Ok(uri) => uri,
        Err(_) => return Ok(status(StatusCode::BAD_REQUEST)),
    };
    parts.headers.remove(hyper::header::HOST);
    let answer = match client
        .request(Request::from_parts(parts, Full::new(bytes)))
        .await
    {
        Ok(answer) => answer,
        Err(_) => return Ok(status(StatusCode::BAD_GATEWAY)),
    };
    let (parts, body) = answer.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Ok(Response::from_parts(parts, Full::new(bytes)))
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = code;
    r
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut port, mut upstream) = (19102u16, String::from("127.0.0.1:19101"));
    let mut per_core = 0usize;
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--port", Some(v)) => port = v.parse().expect("--port takes a number"),
            ("--upstream", Some(v)) => upstream = v,
            ("--per-core", Some(v)) => per_core = v.parse().expect("--per-core takes a number"),
            _ => {
                eprintln!(
                    "usage: min_proxy [--port N] [--upstream HOST:PORT] [--per-core THREADS]"
                );
                std::process::exit(2);
            }
        }
    }
    let upstream: &'static str = Box::leak(upstream.into_boxed_str());
    if per_core == 0 {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .expect("bind the port");
            println!("min_proxy on 127.0.0.1:{port} -> {upstream}");
            accept_loop(listener, upstream).await;
        });
        return;
    }
    // One single-threaded runtime per thread, each with its own listener on the port
    // (SO_REUSEPORT: the kernel spreads connections over them) and its own upstream pool.
    let threads: Vec<_> = (0..per_core)
        .map(|_| {
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a tokio runtime");
                rt.block_on(async move {
                    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
                    socket.set_reuseport(true).expect("SO_REUSEPORT");
                    socket.set_reuseaddr(true).expect("SO_REUSEADDR");
                    socket
                        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
                        .expect("bind the port");
                    let listener = socket.listen(1024).expect("listen");
                    accept_loop(listener, upstream).await;
                });
            })
        })
        .collect();
    println!("min_proxy on 127.0.0.1:{port} -> {upstream} ({per_core} single-threaded runtimes)");
    for t in threads {
        let _ = t.join();
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, upstream: &'static str) {
    let client: Upstream = Client::builder(TokioExecutor::new()).build_http();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req| forward(client.clone(), upstream, req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
