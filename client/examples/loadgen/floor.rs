//! `--floor`: each check sent through the least a tokio client can do, in place of the
//! library. One hand-written connection per pod writes `RL.CHECK` and reads its four
//! integers, with nothing else: no reconnection, no AUTH, no cluster, no policy logic, no
//! fallback, no metrics. Pacing, tasks, the timeout and recording are loadgen's as in every
//! other row, so the CPU per check it reports is the floor under the library's: what tokio
//! and loadgen cost by themselves, to set beside the C client's.
//!
//! A benchmark reference, not a client. It takes plain `redis://host:port` servers, and its
//! keys are the subject itself (`rl:{key123}:loadgen`), not the library's hashed tag.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io::ErrorKind::WouldBlock;
use std::sync::Arc;
use std::task::Poll;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// `RL.CHECK`'s reply, `[allowed, remaining, retry_after_ms, reset_after_ms]`.
pub(crate) type Reply = [i64; 4];

/// An encoded command and where its reply goes (`None`: an error reply, or another shape).
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
}

impl Floor {
    /// Connects to `url` (`redis://host:port`) for a bucket of `rate` tokens per second and
    /// `burst`.
    pub(crate) async fn connect(url: &str, rate: f64, burst: u64) -> std::io::Result<Floor> {
        let addr = url.trim_start_matches("redis://").trim_end_matches('/');
        let socket = TcpStream::connect(addr).await?;
        socket.set_nodelay(true)?;
        let (queue, requests) = mpsc::unbounded_channel();
        tokio::spawn(drive(socket, requests));
        // f64's Display is the shortest text that parses back exactly, as the library sends.
        let (rate, burst) = (rate.to_string(), burst.to_string());
        let tail = format!(
            "${}\r\n{rate}\r\n${}\r\n{burst}\r\n",
            rate.len(),
            burst.len()
        );
        Ok(Floor {
            queue,
            tail: tail.into_bytes().into(),
        })
    }

    /// Takes `cost` tokens from `subject`'s bucket: `None` if the connection is gone or the
    /// server answered anything but a check's reply.
    pub(crate) async fn check(&self, subject: &str, cost: u64) -> Option<Reply> {
        let key_len = subject.len() + "rl:{}:loadgen".len();
        let mut command = Vec::with_capacity(48 + key_len + self.tail.len());
        command.extend_from_slice(b"*5\r\n$8\r\nRL.CHECK\r\n$");
        push_decimal(&mut command, key_len);
        command.extend_from_slice(b"\r\nrl:{");
        command.extend_from_slice(subject.as_bytes());
        command.extend_from_slice(b"}:loadgen\r\n");
        command.extend_from_slice(&self.tail);
        let cost = Decimal::new(cost);
        command.push(b'$');
        push_decimal(&mut command, cost.as_bytes().len());
        command.extend_from_slice(b"\r\n");
        command.extend_from_slice(cost.as_bytes());
        command.extend_from_slice(b"\r\n");
        let (reply, answer) = oneshot::channel();
        self.queue.send(Request { command, reply }).ok()?;
        answer.await.ok().flatten()
    }
}

/// A number's decimal digits, written on the stack without going through `fmt`.
struct Decimal {
    digits: [u8; 20],
    from: usize,
}

impl Decimal {
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

    fn as_bytes(&self) -> &[u8] {
        &self.digits[self.from..]
    }
}

fn push_decimal(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(Decimal::new(n as u64).as_bytes());
}

/// The connection's task: takes what is queued, writes it, reads what has arrived, and
/// answers the oldest requests with the complete replies, until the socket or the queue
/// closes.
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
                Ok(n) => drop(out.drain(..n)),
                // Registers for the socket's next writability, unless it is writable again.
                Err(e) if e.kind() == WouldBlock => {
                    if socket.poll_write_ready(cx).is_pending() {
                        break;
                    }
                }
                Err(_) => return Poll::Ready(()),
            }
        }
        // Read until the socket has nothing more: the last try registers for the next data.
        while let Poll::Ready(ready) = socket.poll_read_ready(cx) {
            if ready.is_err() || filled == input.len() {
                return Poll::Ready(());
            }
            match socket.try_read(&mut input[filled..]) {
                Ok(0) => return Poll::Ready(()),
                Ok(n) => {
                    filled += n;
                    let mut at = 0;
                    while let Some((reply, next)) = parse(&input[..filled], at) {
                        at = next;
                        if let Some(to) = waiting.pop_front() {
                            let _ = to.send(reply);
                        }
                    }
                    input.copy_within(at..filled, 0);
                    filled -= at;
                }
                Err(e) if e.kind() == WouldBlock => {}
                Err(_) => return Poll::Ready(()),
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

/// The line starting at `at`, without its CRLF, and where the next one starts.
fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let rest = buf.get(at..)?;
    let end = rest.windows(2).position(|w| w == b"\r\n")?;
    Some((rest.get(..end)?, at + end + 2))
}

/// The complete reply starting at `at` and where the next one starts, or `None` if it has
/// not all arrived. A reply other than four integers (an error, say) is read as `None`;
/// only its first line is taken, which is all of an error reply.
fn parse(buf: &[u8], at: usize) -> Option<(Option<Reply>, usize)> {
    let (head, mut at) = line(buf, at)?;
    if head != b"*4" {
        return Some((None, at));
    }
    let mut reply = [0i64; 4];
    for v in reply.iter_mut() {
        let (text, next) = line(buf, at)?;
        at = next;
        match text
            .strip_prefix(b":")
            .and_then(|d| std::str::from_utf8(d).ok()?.parse().ok())
        {
            Some(n) => *v = n,
            None => return Some((None, at)),
        }
    }
    Some((Some(reply), at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_whole_or_not_at_all() {
        let two = b"*4\r\n:1\r\n:19\r\n:-1\r\n:3000\r\n*4\r\n:0\r\n:0\r\n:2500\r\n:60000\r\n";
        let (first, next) = parse(two, 0).expect("complete");
        assert_eq!(first, Some([1, 19, -1, 3000]));
        assert_eq!(
            parse(two, next),
            Some((Some([0, 0, 2500, 60000]), two.len()))
        );
        for cut in 0..two.len() - next {
            assert_eq!(parse(&two[..next + cut], next), None, "cut at {cut}");
        }
        assert_eq!(parse(b"-ERR rate\r\n:1\r\n", 0), Some((None, 11)));
    }

    #[test]
    fn decimals_are_written_as_fmt_writes_them() {
        for n in [0, 7, 10, 24, 99, 100, 65_535, u64::MAX] {
            assert_eq!(Decimal::new(n).as_bytes(), n.to_string().as_bytes());
        }
    }
}
