//! `--floor`: each check sent through the least a tokio client can do, in place of the
//! library. One hand-written connection per pod writes `RL.CHECK` and reads its four
//! integers, with nothing else: no reconnection, no AUTH, no cluster, no policy logic, no
//! fallback, no metrics. Pacing, tasks, the timeout and recording are loadgen's as in every
//! other row, so the CPU per check it reports is the floor under the library's: what tokio
//! and loadgen cost by themselves, to set beside the C client's.
//!
//! A benchmark reference, not a client. It takes plain `redis://host:port` servers, and its
//! keys are the subject itself (`rl:{key123}:loadgen`), not the library's hashed tag.

use redis_ratelimit_client::{Decision, Error, Policy, Source, Verdict};
use std::collections::VecDeque;
use std::fmt::Display;
use std::future::poll_fn;
use std::io::ErrorKind::WouldBlock;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// `RL.CHECK`'s reply, `[allowed, remaining, retry_after_ms, reset_after_ms]`.
pub(crate) type Reply = [i64; 4];

/// An encoded command and where its reply goes (`None`: an error reply).
struct Request {
    command: Vec<u8>,
    reply: oneshot::Sender<Option<Reply>>,
}

/// One pod's connection: requests queue to the task that owns the socket, which writes all
/// queued ones in one write and hands replies back in order, as redis-rs' multiplexer does.
#[derive(Clone)]
pub(crate) struct Floor {
    queue: mpsc::UnboundedSender<Request>,
    /// The arguments between the key and the cost, encoded once: rate and burst.
    tail: Arc<[u8]>,
    /// How long a check waits for its reply, as the library's timeout.
    timeout: Duration,
}

impl Floor {
    /// Connects to `url` (`redis://host:port`) for `policy`'s bucket (its rate and burst),
    /// each check waiting up to `timeout`.
    pub(crate) async fn connect(
        url: &str,
        policy: &Policy,
        timeout: Duration,
    ) -> std::io::Result<Floor> {
        let addr = url.trim_start_matches("redis://").trim_end_matches('/');
        let socket = TcpStream::connect(addr).await?;
        socket.set_nodelay(true)?;
        let (queue, requests) = mpsc::unbounded_channel();
        tokio::spawn(drive(socket, requests));
        Ok(Floor {
            queue,
            tail: encode_tail(policy.rate(), policy.burst()).into(),
            timeout,
        })
    }

    /// Takes `cost` tokens from `subject`'s bucket of `policy` and answers as the library
    /// would from the store; no reply within the timeout, an error reply or a connection gone
    /// is an error (there is no fallback).
    pub(crate) async fn check_one(
        &self,
        policy: &Policy,
        subject: &str,
        cost: u64,
    ) -> Result<Decision, Error> {
        let reply = tokio::time::timeout(self.timeout, self.ask(subject, cost)).await;
        let [allowed, remaining, retry_after_ms, reset_after_ms] = reply
            .ok()
            .flatten()
            .ok_or_else(|| Error::Protocol("no reply (floor)".into()))?;
        let ms = |v: i64| Duration::from_millis(v.max(0) as u64);
        Ok(Decision {
            verdict: if allowed == 1 {
                Verdict::Allowed
            } else {
                Verdict::Denied {
                    retry_after: ms(retry_after_ms),
                }
            },
            source: Source::Store,
            policy: policy.clone(),
            remaining: remaining.max(0) as u64,
            reset_after: ms(reset_after_ms),
            outcomes: Vec::new(),
        })
    }

    /// The server's reply to `cost` tokens of `subject`: `None` if the connection is gone or
    /// the server answered with an error.
    async fn ask(&self, subject: &str, cost: u64) -> Option<Reply> {
        let command = encode(subject, &self.tail, cost);
        let (reply, answer) = oneshot::channel();
        self.queue.send(Request { command, reply }).ok()?;
        answer.await.ok().flatten()
    }
}

/// Rate and burst as bulk strings. f64's `Display` is the shortest text that parses back
/// exactly, as the library sends it.
fn encode_tail(rate: f64, burst: u64) -> Vec<u8> {
    let (rate, burst) = (rate.to_string(), burst.to_string());
    format!(
        "${}\r\n{rate}\r\n${}\r\n{burst}\r\n",
        rate.len(),
        burst.len()
    )
    .into_bytes()
}

/// `RL.CHECK rl:{subject}:loadgen <tail> cost` in RESP, in one allocation of its size.
fn encode(subject: &str, tail: &[u8], cost: u64) -> Vec<u8> {
    let key_len = Decimal::new((subject.len() + "rl:{}:loadgen".len()) as u64);
    let cost = Decimal::new(cost);
    let mut command = Vec::with_capacity(72 + subject.len() + tail.len());
    command.extend_from_slice(b"*5\r\n$8\r\nRL.CHECK\r\n$");
    command.extend_from_slice(key_len.as_bytes());
    command.extend_from_slice(b"\r\nrl:{");
    command.extend_from_slice(subject.as_bytes());
    command.extend_from_slice(b"}:loadgen\r\n");
    command.extend_from_slice(tail);
    command.push(b'$');
    command.extend_from_slice(Decimal::new(cost.as_bytes().len() as u64).as_bytes());
    command.extend_from_slice(b"\r\n");
    command.extend_from_slice(cost.as_bytes());
    command.extend_from_slice(b"\r\n");
    command
}

/// A number's decimal digits on the stack: `fmt` on every check cost more than the rest of
/// the encoding.
struct Decimal {
    digits: [u8; 20],
    from: usize,
}

impl Decimal {
    /// `n`'s digits (u64::MAX has 20).
    fn new(mut n: u64) -> Self {
        let mut digits = [0u8; 20];
        let mut from = digits.len();
        loop {
            from -= 1;
            digits[from] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                return Self { digits, from };
            }
        }
    }

    /// The digits, most significant first.
    fn as_bytes(&self) -> &[u8] {
        &self.digits[self.from..]
    }
}

/// The connection's task: takes what is queued, writes it, reads what has arrived, and
/// answers the oldest requests with the complete replies, until the queue closes with
/// nothing waiting. On a socket error, or a reply it cannot pair with a request, it says
/// why and ends: every check after that fails (loadgen counts them as errors).
async fn drive(socket: TcpStream, mut requests: mpsc::UnboundedReceiver<Request>) {
    let mut out = Vec::with_capacity(16 << 10);
    let mut input = vec![0u8; 64 << 10];
    let mut filled = 0;
    let mut waiting: VecDeque<oneshot::Sender<Option<Reply>>> = VecDeque::with_capacity(256);
    let mut open = true;
    poll_fn(|cx| {
        while open {
            match requests.poll_recv(cx) {
                Poll::Ready(Some(r)) => {
                    out.extend_from_slice(&r.command);
                    waiting.push_back(r.reply);
                }
                Poll::Ready(None) => open = false,
                Poll::Pending => break,
            }
        }
        while !out.is_empty() {
            match socket.try_write(&out) {
                Ok(0) => return end("the socket took no bytes"),
                Ok(n) => drop(out.drain(..n)),
                // Registers for the socket's next writability, unless it is writable again.
                Err(e) if e.kind() == WouldBlock => match socket.poll_write_ready(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(e)) => return end(e),
                },
                Err(e) => return end(e),
            }
        }
        // Read until the socket has nothing more: the last try registers for the next data.
        while let Poll::Ready(ready) = socket.poll_read_ready(cx) {
            if let Err(e) = ready {
                return end(e);
            }
            if filled == input.len() {
                return end("64 KiB of input without a complete reply");
            }
            match socket.try_read(&mut input[filled..]) {
                Ok(0) => return end("the server closed the connection"),
                Ok(n) => {
                    filled += n;
                    let mut at = 0;
                    loop {
                        let (reply, next) = match parse(&input[..filled], at) {
                            Parsed::Reply(r, next) => (Some(r), next),
                            Parsed::Error(next) => (None, next),
                            Parsed::Partial => break,
                            Parsed::Lost => return end("a reply that is not RL.CHECK's"),
                        };
                        at = next;
                        // A timed-out check's receiver is gone: its reply is dropped here.
                        match waiting.pop_front() {
                            Some(to) => drop(to.send(reply)),
                            None => return end("a reply with no request waiting"),
                        }
                    }
                    input.copy_within(at..filled, 0);
                    filled -= at;
                }
                Err(e) if e.kind() == WouldBlock => {}
                Err(e) => return end(e),
            }
        }
        if open || !waiting.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await
}

/// Ends the connection's task, saying why.
fn end(why: impl Display) -> Poll<()> {
    eprintln!("loadgen --floor: connection ended: {why}");
    Poll::Ready(())
}

/// What starts at a position of the input.
#[derive(Debug, PartialEq)]
enum Parsed {
    /// A check's reply, and where the next reply starts.
    Reply(Reply, usize),
    /// An error reply (one line), and where the next reply starts.
    Error(usize),
    /// A reply not all arrived yet.
    Partial,
    /// Any other shape: past it, replies can no longer be told apart.
    Lost,
}

/// The line starting at `at`, without its CRLF, and where the next one starts.
fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let rest = buf.get(at..)?;
    let end = rest.windows(2).position(|w| w == b"\r\n")?;
    Some((rest.get(..end)?, at + end + 2))
}

/// The reply starting at `at`: `RL.CHECK`'s four integers or an error line; anything else
/// is `Lost`, as the parser here does not know how long it is.
fn parse(buf: &[u8], at: usize) -> Parsed {
    let Some((head, mut at)) = line(buf, at) else {
        return Parsed::Partial;
    };
    if head.starts_with(b"-") {
        return Parsed::Error(at);
    }
    if head != b"*4" {
        return Parsed::Lost;
    }
    let mut reply = [0i64; 4];
    for v in reply.iter_mut() {
        let Some((text, next)) = line(buf, at) else {
            return Parsed::Partial;
        };
        at = next;
        match text
            .strip_prefix(b":")
            .and_then(|d| std::str::from_utf8(d).ok()?.parse().ok())
        {
            Some(n) => *v = n,
            None => return Parsed::Lost,
        }
    }
    Parsed::Reply(reply, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_whole_or_not_at_all() {
        let two = b"*4\r\n:1\r\n:19\r\n:-1\r\n:3000\r\n*4\r\n:0\r\n:0\r\n:2500\r\n:60000\r\n";
        let Parsed::Reply(first, next) = parse(two, 0) else {
            panic!("the first reply is complete");
        };
        assert_eq!(first, [1, 19, -1, 3000]);
        assert_eq!(
            parse(two, next),
            Parsed::Reply([0, 0, 2500, 60000], two.len())
        );
        for cut in next..two.len() {
            assert_eq!(parse(&two[..cut], next), Parsed::Partial, "cut at {cut}");
        }
    }

    #[test]
    fn an_error_is_one_line_and_other_shapes_are_lost() {
        assert_eq!(parse(b"-ERR rate\r\n*4\r\n", 0), Parsed::Error(11));
        assert_eq!(parse(b"$3\r\nabc\r\n", 0), Parsed::Lost);
        assert_eq!(parse(b"*5\r\n:1\r\n", 0), Parsed::Lost);
        assert_eq!(
            parse(b"*4\r\n:1\r\n$3\r\nabc\r\n:1\r\n:1\r\n", 0),
            Parsed::Lost
        );
        assert_eq!(parse(b"*4\r\n:1\r\n:x\r\n", 0), Parsed::Lost);
    }

    #[test]
    fn the_command_is_rl_check_in_resp() {
        let tail = encode_tail(100.0 / 60.0, 20);
        assert_eq!(
            encode("key7", &tail, 1),
            b"*5\r\n$8\r\nRL.CHECK\r\n$17\r\nrl:{key7}:loadgen\r\n$18\r\n1.6666666666666667\r\n\
              $2\r\n20\r\n$1\r\n1\r\n"
                .to_vec()
        );
        assert!(encode("key7", &tail, 12_345).ends_with(b"$5\r\n12345\r\n"));
    }

    #[test]
    fn decimals_are_written_as_fmt_writes_them() {
        for n in [0, 7, 10, 24, 99, 100, 65_535, u64::MAX] {
            assert_eq!(Decimal::new(n).as_bytes(), n.to_string().as_bytes());
        }
    }
}
