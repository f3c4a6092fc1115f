//! The load client of `scripts/bench/guard`: HTTP/1.1 keep-alive over raw TCP, so accepted
//! and refused latencies can be told apart (wrk reports only one histogram).
//!
//! ```text
//! guard_load closed --addr 127.0.0.1:8090 --path /report --clients 64 --duration 10 --label x
//!     64 clients in a closed loop (each sends its next request when the last is answered,
//!     refused or not) for 10 s; prints one table row: accepted/s, accepted p50/p99,
//!     refused/s, refused p50/p99 (ms). `--refused-pause-ms N`: a client waits N ms after
//!     a refusal before its next request (default 0: at once).
//! guard_load paced --addr 127.0.0.1:8090 --path /sms --method POST --requests 50 --over 1
//!     50 requests evenly spread over 1 s on one connection; prints admitted vs 10 + 10·t.
//! ```

use hdrhistogram::Histogram;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Args {
    mode: String,
    addr: String,
    path: String,
    method: String,
    clients: usize,
    duration: f64,
    requests: u32,
    over: f64,
    label: String,
    refused_pause_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        mode: String::new(),
        addr: "127.0.0.1:8090".into(),
        path: "/report".into(),
        method: "GET".into(),
        clients: 64,
        duration: 10.0,
        requests: 50,
        over: 1.0,
        label: "run".into(),
        refused_pause_ms: 0,
    };
    let mut it = std::env::args().skip(1);
    a.mode = it.next().unwrap_or_default();
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => a.addr = v,
            "--path" => a.path = v,
            "--method" => a.method = v,
            "--clients" => a.clients = v.parse().expect("--clients"),
            "--duration" => a.duration = v.parse().expect("--duration"),
            "--requests" => a.requests = v.parse().expect("--requests"),
            "--over" => a.over = v.parse().expect("--over"),
            "--label" => a.label = v,
            "--refused-pause-ms" => a.refused_pause_ms = v.parse().expect("--refused-pause-ms"),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// One keep-alive connection.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    request: Vec<u8>,
}

impl Conn {
    async fn open(addr: &str, method: &str, path: &str) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: 0\r\n\r\n")
                .into_bytes();
        Ok(Self {
            stream,
            buf: Vec::with_capacity(4096),
            request,
        })
    }

    /// Sends the request and reads one response; its status.
    async fn send(&mut self) -> std::io::Result<u16> {
        self.stream.write_all(&self.request).await?;
        self.buf.clear();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                let head = std::str::from_utf8(&self.buf[..end]).unwrap_or("");
                let status = head
                    .split(' ')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let len: usize = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0);
                while self.buf.len() < end + 4 + len {
                    let n = self.stream.read(&mut chunk).await?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                return Ok(status);
            }
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

/// The quantile in ms, `-` when nothing was recorded.
fn ms(h: &Histogram<u64>, q: f64) -> String {
    if h.is_empty() {
        return "-".into();
    }
    let ms = h.value_at_quantile(q) as f64 / 1000.0;
    if q < 1.0 && ms < 10.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.1}")
    }
}

async fn closed(a: Args) {
    let deadline = Instant::now() + Duration::from_secs_f64(a.duration);
    let mut tasks = Vec::new();
    for _ in 0..a.clients {
        let (addr, method, path) = (a.addr.clone(), a.method.clone(), a.path.clone());
        let pause = Duration::from_millis(a.refused_pause_ms);
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut refused, mut errors) = (hist(), hist(), 0u64);
            let mut conn = None;
            while Instant::now() < deadline {
                if conn.is_none() {
                    conn = Conn::open(&addr, &method, &path).await.ok();
                }
                let Some(c) = conn.as_mut() else {
                    errors += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                let t = Instant::now();
                match c.send().await {
                    Ok(status) => {
                        let us = t.elapsed().as_micros() as u64;
                        if status == 200 {
                            let _ = ok.record(us.max(1));
                        } else {
                            let _ = refused.record(us.max(1));
                            if !pause.is_zero() {
                                tokio::time::sleep(pause).await;
                            }
                        }
                    }
                    Err(_) => {
                        errors += 1;
                        conn = None;
                    }
                }
            }
            (ok, refused, errors)
        }));
    }
    let (mut ok, mut refused, mut errors) = (hist(), hist(), 0);
    for t in tasks {
        let (o, r, e) = t.await.expect("client task");
        ok.add(o).expect("merge");
        refused.add(r).expect("merge");
        errors += e;
    }
    let secs = a.duration;
    println!(
        "{:<34} {:>7.1} {:>7} {:>7} {:>7} {:>8.0} {:>7} {:>7} {:>6}",
        a.label,
        ok.len() as f64 / secs,
        ms(&ok, 0.5),
        ms(&ok, 0.99),
        ms(&ok, 1.0),
        refused.len() as f64 / secs,
        ms(&refused, 0.5),
        ms(&refused, 0.99),
        errors
    );
}

async fn paced(a: Args) {
    let mut conn = Conn::open(&a.addr, &a.method, &a.path)
        .await
        .expect("connect");
    let start = Instant::now();
    let step = Duration::from_secs_f64(a.over) / a.requests.max(1);
    let (mut admitted, mut refused, mut last) = (0u32, 0u32, Duration::ZERO);
    for i in 0..a.requests {
        tokio::time::sleep_until((start + step * i).into()).await;
        last = start.elapsed();
        match conn.send().await.expect("request") {
            200 => admitted += 1,
            _ => refused += 1,
        }
    }
    let t = last.as_secs_f64();
    println!(
        "{:<34} {:>9} {:>9} {:>9.3} {:>12.1}",
        a.label,
        admitted,
        refused,
        t,
        10.0 + 10.0 * t
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    match a.mode.as_str() {
        "closed" => closed(a).await,
        "paced" => paced(a).await,
        _ => {
            eprintln!(
                "usage: guard_load closed|paced [--addr A] [--path P] [--method M] [--clients N] \
                 [--duration S] [--refused-pause-ms N] [--requests N] [--over S] [--label L]"
            );
            std::process::exit(2);
        }
    }
}
