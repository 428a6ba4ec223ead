//! Servers a test owns alone, to stop, freeze and restart without touching
//! the shared stack.

/// A real redis-server of this test's own, so stopping it disturbs no other test.
pub struct PrivateRedis {
    pub port: u16,
    child: std::process::Child,
    /// Where it keeps its snapshot, if it keeps one.
    dir: Option<std::path::PathBuf>,
}

impl PrivateRedis {
    pub fn start(port: u16) -> PrivateRedis {
        PrivateRedis::spawn(port, None)
    }

    /// One that writes its snapshot (on `SAVE`) in a directory of its own
    /// and loads it when started again (`restart`).
    pub fn start_keeping_snapshots(port: u16) -> PrivateRedis {
        let dir = std::env::temp_dir().join(format!("tally-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        PrivateRedis::spawn(port, Some(dir))
    }

    fn spawn(port: u16, dir: Option<std::path::PathBuf>) -> PrivateRedis {
        let mut command = std::process::Command::new("redis-server");
        command.args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ]);
        if let Some(dir) = &dir {
            command.arg("--dir").arg(dir);
        }
        let child = command
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("redis-server: {e}"));
        PrivateRedis { port, child, dir }
    }

    /// Kills it (kill -9) and starts it again on its port, from its last
    /// snapshot if it keeps one.
    pub fn restart(mut self) -> PrivateRedis {
        let _ = self.child.kill();
        let _ = self.child.wait();
        PrivateRedis::spawn(self.port, self.dir.take())
    }

    /// Freezes it (SIGSTOP): it keeps its connections and answers nothing.
    pub fn freeze(&self) {
        assert!(
            signal("-STOP", self.child.id()),
            "could not freeze redis-server"
        );
    }

    pub fn thaw(&self) {
        assert!(
            signal("-CONT", self.child.id()),
            "could not thaw redis-server"
        );
    }

    pub fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        // A frozen process is killed just the same.
        let _ = self.child.kill();
        if let Some(dir) = &self.dir {
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A child process of the test's, killed (kill -9) when dropped.
pub struct Proc(pub std::process::Child);

impl Proc {
    pub fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends a signal with kill(1); whether it was delivered.
pub fn signal(sig: &str, pid: u32) -> bool {
    std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// A port on 127.0.0.1 that nothing listens on, below the kernel's range
/// of ephemeral ports, and not handed out before by this process. A port
/// the kernel lends for port 0 is one it may lend again, to any outgoing
/// connection (a Cassandra or Kafka client of a process the test just
/// started), before the test's own server binds it: a cluster run once
/// lost its second `tally vote` to "Address already in use" that way.
/// Below the range only a listener takes a port, and the bind checks that.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (lo, hi) = (ephemeral / 2, ephemeral);
    // Processes running tests at once draw differently, and so do the
    // calls of one process.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32)
        ^ DRAWS.fetch_add(1, Ordering::Relaxed);
    let mut rng = super::Rng(seed);
    for _ in 0..1_000 {
        let port = lo + (rng.below(u64::from(hi - lo)) as u16);
        let mut taken = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if taken.contains(&port) || std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        taken.push(port);
        return port;
    }
    panic!("no free port between {lo} and {hi}")
}

/// A listener on a free port of 127.0.0.1 that opens a connection to
/// `upstream` for each it accepts and gives both to `carry`; dropped, it
/// accepts no more.
struct Link {
    port: u16,
    accepting: tokio::task::JoinHandle<()>,
}

impl Link {
    async fn start<F, Fut>(upstream: u16, carry: F) -> Link
    where
        F: Fn(tokio::net::TcpStream, tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", free_port()))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port = listener.local_addr().map_or(0, |a| a.port());
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await {
                    tokio::spawn(carry(client, server));
                }
            }
        });
        Link { port, accepting }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// Copies what `from` sends to `to` until either side ends, in a task of
/// its own.
fn pass(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf) {
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from, &mut to).await;
    });
}

/// A TCP link to a server on 127.0.0.1 that, once told to hold, delivers the
/// next script call (`EVALSHA`) sent through it `late` after it came, and
/// loses every byte sent to the server after that one: a network that
/// delays one command past its caller's timeout, then drops the link.
/// Answers from the server pass as they come.
pub struct LateLink {
    pub port: u16,
    mode: std::sync::Arc<std::sync::Mutex<LinkMode>>,
    delivered: std::sync::Arc<std::sync::atomic::AtomicBool>,
    _link: Link,
}

#[derive(Clone, Copy)]
enum LinkMode {
    Pass,
    Hold(std::time::Duration),
    Lose,
}

impl LateLink {
    pub async fn start(upstream: u16) -> LateLink {
        let mode = std::sync::Arc::new(std::sync::Mutex::new(LinkMode::Pass));
        let delivered = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (m, d) = (mode.clone(), delivered.clone());
        let link = Link::start(upstream, move |client, server| {
            carry(client, server, m.clone(), d.clone())
        })
        .await;
        LateLink {
            port: link.port,
            mode,
            delivered,
            _link: link,
        }
    }

    pub fn hold_next_script(&self, late: std::time::Duration) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = LinkMode::Hold(late);
    }

    /// Whether the held script call has reached the server.
    pub fn delivered(&self) -> bool {
        self.delivered.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn carry(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    mode: std::sync::Arc<std::sync::Mutex<LinkMode>>,
    delivered: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from_client, to_client) = client.into_split();
    let (from_server, mut to_server) = server.into_split();
    pass(from_server, to_client);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from_client.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let chunk = buf[..n].to_vec();
        let now = *mode.lock().unwrap_or_else(|e| e.into_inner());
        match now {
            LinkMode::Hold(late) if chunk.windows(7).any(|w| w == b"EVALSHA") => {
                *mode.lock().unwrap_or_else(|e| e.into_inner()) = LinkMode::Lose;
                let delivered = delivered.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(late).await;
                    if to_server.write_all(&chunk).await.is_ok() {
                        delivered.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    // Kept open, so the server does not see the link go.
                    std::future::pending::<()>().await;
                });
                while matches!(from_client.read(&mut buf).await, Ok(n) if n > 0) {}
                return;
            }
            LinkMode::Pass | LinkMode::Hold(_) => {
                if to_server.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            LinkMode::Lose => {}
        }
    }
}

/// A TCP link to a server on 127.0.0.1 that can be shut like a gate: while
/// shut it takes what clients send and holds it, counting the times a word
/// appears in what it holds, and when opened it delivers everything held,
/// in order, at once. What many clients sent over a while reaches the
/// server together, so their requests race there as a crowd's would.
pub struct GatedLink {
    pub port: u16,
    open: tokio::sync::watch::Sender<bool>,
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _link: Link,
}

impl GatedLink {
    /// Open at first; `word` is what `held` counts.
    pub async fn start(upstream: u16, word: &'static [u8]) -> GatedLink {
        let (open, _) = tokio::sync::watch::channel(true);
        let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (gate, counted) = (open.clone(), held.clone());
        let link = Link::start(upstream, move |client, server| {
            gated(client, server, gate.subscribe(), counted.clone(), word)
        })
        .await;
        GatedLink {
            port: link.port,
            open,
            held,
            _link: link,
        }
    }

    pub fn shut(&self) {
        self.held.store(0, std::sync::atomic::Ordering::SeqCst);
        self.open.send_replace(false);
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// How many times the word appears in what the gate holds now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn gated(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    mut open: tokio::sync::watch::Receiver<bool>,
    counted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    word: &'static [u8],
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from_client, to_client) = client.into_split();
    let (from_server, mut to_server) = server.into_split();
    pass(from_server, to_client);
    let count = |bytes: &[u8]| bytes.windows(word.len()).filter(|w| *w == word).count();
    let mut held: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            read = from_client.read(&mut buf) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let before = count(&held);
                held.extend_from_slice(&buf[..n]);
                if *open.borrow() {
                    if to_server.write_all(&held).await.is_err() {
                        return;
                    }
                    held.clear();
                } else {
                    counted.fetch_add(count(&held) - before, std::sync::atomic::Ordering::SeqCst);
                }
            }
            changed = open.changed() => {
                if changed.is_err() {
                    return;
                }
                if *open.borrow_and_update() && !held.is_empty() {
                    if to_server.write_all(&held).await.is_err() {
                        return;
                    }
                    held.clear();
                }
            }
        }
    }
}

/// A TCP link to a Redis on 127.0.0.1 whose `TIME` answers come through
/// `shift` seconds later than Redis gave them (earlier when negative): what
/// a client sees of a Redis whose clock is that far off. Everything else
/// passes as it is.
pub struct SkewedLink {
    pub port: u16,
    _link: Link,
}

impl SkewedLink {
    pub async fn start(upstream: u16, shift: i64) -> SkewedLink {
        let link = Link::start(upstream, move |client, server| {
            skewed(client, server, shift)
        })
        .await;
        SkewedLink {
            port: link.port,
            _link: link,
        }
    }
}

async fn skewed(client: tokio::net::TcpStream, server: tokio::net::TcpStream, shift: i64) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (from_client, mut to_client) = client.into_split();
    let (mut from_server, to_server) = server.into_split();
    pass(from_client, to_server);
    // TIME's answer: an array of two bulk strings, the first ten digits of
    // seconds (until 2286).
    const TIME: &[u8] = b"*2\r\n$10\r\n";
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from_server.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        let mut at = 0;
        while let Some(i) = chunk[at..].windows(TIME.len()).position(|w| w == TIME) {
            let digits = at + i + TIME.len();
            let Some(secs) = chunk
                .get(digits..digits + 10)
                .and_then(|d| std::str::from_utf8(d).ok())
                .and_then(|d| d.parse::<i64>().ok())
            else {
                break;
            };
            chunk[digits..digits + 10].copy_from_slice(format!("{:010}", secs + shift).as_bytes());
            at = digits + 10;
        }
        if to_client.write_all(chunk).await.is_err() {
            return;
        }
    }
}
