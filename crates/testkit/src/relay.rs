//! A fault-injecting TCP relay (feature `relay`): put it between a client and a server (in
//! lockstep's tests, between a connection pool and PostgreSQL) and misbehave on purpose.
//!
//! [`Relay::start`] listens on a free port of 127.0.0.1 and forwards every connection it
//! accepts to the upstream server, byte for byte, until told otherwise:
//!
//! - [`Relay::pause`] / [`Relay::resume`]: a network stall. Paused, it holds every byte, in both
//!   directions, on every connection (new ones included); on resume the held bytes are
//!   delivered, in order.
//! - [`Relay::hold_back`]: a slow link for the connections open now. Each chunk their clients
//!   send is delivered a fixed delay after the relay read it (the delays do not add up);
//!   connections opened later go straight through. This is how a PostgreSQL cancel request
//!   (which travels on a connection of its own) is made to reach the server before the
//!   statement it is meant for.
//! - [`Relay::cut_after_client_sends`]: a lost reply. Armed once, it forwards the next client
//!   chunk containing a pattern (say `COMMIT`), then ends that connection without relaying
//!   the server's answer: the client hears the end once the server has acted on the request.
//! - [`Relay::round_trips`]: counts round trips — every burst of client bytes that follows
//!   server bytes, or opens a connection, is one (pipelined statements travel in one burst).
//!
//! Dropping the relay stops it: it accepts nothing more and closes all its connections.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use lockstep_testkit::relay::Relay;
//!
//! let relay = Relay::start(("127.0.0.1", 5432)).await?;
//! // Point the client at `relay.addr()` instead of the server (with the `pg-harness` feature:
//! // `TestDatabase::pool_through(relay.addr(), size)`), then:
//! relay.pause();
//! // ... the client's requests and the server's replies are held ...
//! relay.resume();
//! # Ok(())
//! # }
//! ```
//!
//! The relay runs its tasks on the runtime [`Relay::start`] is called on, and its delays on
//! tokio's clock. It never panics on what the network does: a connection that fails (the
//! upstream refuses it, a peer resets it) ends that connection only.

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// The most the relay reads at once.
const CHUNK: usize = 64 * 1024;

/// Chunks read from a client and not yet written to the server, per connection. Bounded, so a
/// paused or held-back connection pushes back on its client instead of buffering without end.
const QUEUE: usize = 64;

/// Client bytes kept from the previous chunk when looking for the cut pattern, so a pattern of
/// up to `TAIL + 1` bytes is found even when split across two reads.
const TAIL: usize = 1024;

/// How long a relayed connection waits for the upstream to accept it before giving up (and
/// closing the client's side): an upstream that drops packets must not hang the relay's task.
const UPSTREAM_CONNECT: Duration = Duration::from_secs(10);

/// How long the accept loop waits after a failed `accept` (e.g. out of file descriptors)
/// before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// A TCP relay in front of one upstream server that can stall, slow down, cut and count the
/// traffic it forwards. See the [module documentation](self).
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

/// What the relay's handle and its tasks share.
struct Shared {
    /// Every address the upstream resolved to, tried in order for each connection.
    upstream: Vec<SocketAddr>,
    paused: watch::Sender<bool>,
    round_trips: AtomicU64,
    /// The armed cut's pattern (taken by the connection that matches it).
    cut: Mutex<Option<Vec<u8>>>,
    /// The connections accepted so far; dead ones are pruned on each accept.
    connections: Mutex<Vec<Weak<Connection>>>,
}

/// One relayed connection's settings the handle can change while it runs.
#[derive(Default)]
struct Connection {
    hold_back: Mutex<Duration>,
}

/// A chunk read from a client, on its way to the server.
struct Chunk {
    /// When it may be written (read time + hold-back); `None`: a hold-back too long for the
    /// clock, never.
    due: Option<Instant>,
    bytes: Vec<u8>,
    /// It completed the armed cut pattern: forward it, then close the connection.
    cut: bool,
}

/// Locks `mutex`, also when a panicking thread poisoned it (the data is plain settings).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Relay {
    /// Listens on a free port of 127.0.0.1 and relays every connection to `upstream` (a
    /// `SocketAddr`, or a host and port such as `("127.0.0.1", 5432)`, resolved once, here).
    ///
    /// Must be called within a tokio runtime (with the `net` and `time` drivers enabled):
    /// the relay's tasks run on it. Fails if `upstream` does not resolve or no port can be
    /// bound; an upstream that refuses connections only fails the connections relayed to it.
    pub async fn start(upstream: impl ToSocketAddrs) -> io::Result<Relay> {
        let upstream: Vec<SocketAddr> = tokio::net::lookup_host(upstream).await?.collect();
        if upstream.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::AddrNotAvailable,
                "the relay's upstream address resolves to nothing",
            ));
        }
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            paused: watch::Sender::new(false),
            round_trips: AtomicU64::new(0),
            cut: Mutex::new(None),
            connections: Mutex::new(Vec::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(Relay {
            addr,
            shared,
            accept,
        })
    }

    /// Where clients connect (127.0.0.1 and the relay's port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds every byte from now on, in both directions, on every connection — those open now
    /// and those opened while paused — until [`resume`](Self::resume). Bytes the relay had
    /// already read but not yet written are held too.
    pub fn pause(&self) {
        self.shared.paused.send_replace(true);
    }

    /// Ends a [`pause`](Self::pause): the held bytes are delivered, in order, and forwarding
    /// goes on.
    pub fn resume(&self) {
        self.shared.paused.send_replace(false);
    }

    /// Slows the client-to-server direction of the connections open now: from now on each
    /// chunk read from their clients is written to the server `delay` after the relay read it.
    /// The delays do not add up (chunks read 10 ms apart arrive 10 ms apart, each `delay`
    /// late), and the order is kept. The server-to-client direction is not slowed.
    ///
    /// Connections accepted later go straight through — e.g. PostgreSQL cancel requests, which
    /// travel on a connection of their own, so a cancel reaches the server before a statement
    /// sent earlier on a held-back connection. `Duration::ZERO` ends the hold-back (for chunks
    /// read from then on).
    ///
    /// Returns how many connections it applies to (those the relay has accepted and not yet
    /// closed), so a test can check that the connection it means to slow is among them.
    pub fn hold_back(&self, delay: Duration) -> usize {
        let connections = lock(&self.shared.connections);
        let mut applied = 0;
        for connection in connections.iter().filter_map(Weak::upgrade) {
            *lock(&connection.hold_back) = delay;
            applied += 1;
        }
        applied
    }

    /// Arms a one-shot cut: the next chunk a client sends (on any connection) that contains
    /// `pattern` is forwarded to the server, then the server's side is shut down behind it and
    /// nothing the server sends afterwards is relayed; once the server has acted on the
    /// request and closed, the client's side is closed — the server acts on the request, the
    /// client never hears back (a lost reply), and by the time it notices, the request's effect
    /// is visible to everyone. Later chunks and other connections are not affected; arming
    /// again replaces a pattern that has not fired yet.
    ///
    /// The pattern is found also when split across two reads of the same connection, if it is
    /// at most 1025 bytes long. An empty pattern cuts after the next chunk.
    ///
    /// It is a plain byte substring: `b"COMMIT"` also matches the `READ COMMITTED` of a
    /// `BEGIN ISOLATION LEVEL READ COMMITTED`, so arm it after the transaction began (or use a
    /// longer pattern).
    pub fn cut_after_client_sends(&self, pattern: &[u8]) {
        *lock(&self.shared.cut) = Some(pattern.to_vec());
    }

    /// Round trips so far, over all connections: every burst of client bytes that follows
    /// bytes from the server, or is the first on its connection, counts once (bytes a client
    /// sends before the server answers belong to the same burst, so pipelined statements are
    /// one round trip). Counted when the relay reads the bytes, whatever it then delays.
    pub fn round_trips(&self) -> u64 {
        self.shared.round_trips.load(Ordering::SeqCst)
    }
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("paused", &*self.shared.paused.borrow())
            .field("round_trips", &self.round_trips())
            .finish_non_exhaustive()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // The accept task owns the connections' JoinSet: aborting it aborts them all, and
        // their sockets close as their tasks are dropped.
        self.accept.abort();
    }
}

impl Shared {
    /// Records a newly accepted connection (and forgets the closed ones).
    fn register(&self) -> Arc<Connection> {
        let connection = Arc::new(Connection::default());
        let mut connections = lock(&self.connections);
        connections.retain(|c| c.strong_count() > 0);
        connections.push(Arc::downgrade(&connection));
        connection
    }

    /// Whether the armed cut fires on `chunk` (read after `tail` on the same connection);
    /// disarms it if so.
    fn take_cut(&self, tail: &[u8], chunk: &[u8]) -> bool {
        let mut armed = lock(&self.cut);
        let Some(pattern) = armed.as_deref() else {
            return false;
        };
        if !contains_ending_in(tail, chunk, pattern) {
            return false;
        }
        *armed = None;
        true
    }
}

impl Connection {
    fn hold_back(&self) -> Duration {
        *lock(&self.hold_back)
    }
}

/// Whether `pattern` occurs in `tail` followed by `chunk`, ending inside `chunk` (an
/// occurrence wholly in `tail` was sent before and does not count).
fn contains_ending_in(tail: &[u8], chunk: &[u8], pattern: &[u8]) -> bool {
    if pattern.is_empty() {
        return true;
    }
    // At most `pattern.len() - 1` bytes of the tail: an occurrence must end in `chunk`.
    let keep = tail.len().min(pattern.len() - 1);
    let mut haystack = Vec::with_capacity(keep + chunk.len());
    haystack.extend_from_slice(tail.get(tail.len() - keep..).unwrap_or_default());
    haystack.extend_from_slice(chunk);
    haystack.windows(pattern.len()).any(|w| w == pattern)
}

/// Accepts connections until the relay is dropped (which aborts this task and, with it, the
/// connection tasks in its `JoinSet`).
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    let connection = shared.register();
                    connections.spawn(relay_connection(client, Arc::clone(&shared), connection));
                }
                // A failed accept concerns one connection (or a passing shortage of file
                // descriptors): the relay goes on.
                Err(_) => tokio::time::sleep(ACCEPT_RETRY).await,
            },
            // Reap finished connections (their errors only ever ended themselves).
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Relays one connection until both directions have ended (after a cut: the server's end).
async fn relay_connection(
    client: TcpStream,
    shared: Arc<Shared>,
    connection: Arc<Connection>,
) -> io::Result<()> {
    let server = tokio::time::timeout(
        UPSTREAM_CONNECT,
        TcpStream::connect(shared.upstream.as_slice()),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting to the upstream"))??;
    // Small writes go out at once: the relay must not add Nagle delays of its own.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();

    // The three parts run in this one task, so what one sets the next poll of another sees.
    // True when the server spoke last: the client's next bytes start a round trip.
    let server_spoke = AtomicBool::new(true);
    // Set just before the cut's chunk is written: from then on nothing goes to the client.
    let cut = AtomicBool::new(false);
    let (queue, queued) = mpsc::channel(QUEUE);

    let read_client = read_client(client_read, queue, &shared, &connection, &server_spoke);
    let write_server = write_server(server_write, queued, &shared, &cut);
    let to_client = to_client(server_read, client_write, &shared, &server_spoke, &cut);
    tokio::pin!(read_client, write_server, to_client);
    let (mut reading, mut writing, mut replying) = (true, true, true);
    while reading || writing || replying {
        tokio::select! {
            () = &mut read_client, if reading => reading = false,
            () = &mut write_server, if writing => {
                // After the cut's chunk the server's write side is shut down (a FIN behind the
                // chunk): the server reads the request, acts on it and sees the end. The
                // connection ends once `to_client` has drained the server's replies to its
                // end, so that no unread byte makes the relay's close a reset that could reach
                // the server before it read the request.
                writing = false;
            }
            () = &mut to_client, if replying => replying = false,
        }
    }
    Ok(())
}

/// Reads the client and queues each chunk for the server, stamped with when it is due; counts
/// round trips and looks for the armed cut. Ends at the client's EOF, or after the cut's chunk.
async fn read_client(
    mut from: OwnedReadHalf,
    queue: mpsc::Sender<Chunk>,
    shared: &Shared,
    connection: &Connection,
    server_spoke: &AtomicBool,
) {
    let mut buf = vec![0_u8; CHUNK];
    let mut tail: Vec<u8> = Vec::with_capacity(TAIL);
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let bytes = buf.get(..n).unwrap_or_default().to_vec();
        if server_spoke.swap(false, Ordering::SeqCst) {
            shared.round_trips.fetch_add(1, Ordering::SeqCst);
        }
        // Due a fixed delay after it was read, not after the previous chunk was written: the
        // delays of a held-back connection do not add up.
        let due = Instant::now().checked_add(connection.hold_back());
        let cut = shared.take_cut(&tail, &bytes);
        tail.extend_from_slice(&bytes);
        tail.drain(..tail.len().saturating_sub(TAIL));
        if queue.send(Chunk { due, bytes, cut }).await.is_err() || cut {
            return;
        }
    }
}

/// Writes the queued client chunks to the server, each when due and not paused. Ends when the
/// client's side has ended (shutting the server's write side down), or after the cut's chunk.
async fn write_server(
    mut to: OwnedWriteHalf,
    mut queued: mpsc::Receiver<Chunk>,
    shared: &Shared,
    cut: &AtomicBool,
) {
    let mut paused = shared.paused.subscribe();
    while let Some(chunk) = queued.recv().await {
        match chunk.due {
            Some(due) if due > Instant::now() => tokio::time::sleep_until(due).await,
            Some(_) => {}
            None => std::future::pending().await,
        }
        if paused.wait_for(|paused| !*paused).await.is_err() {
            return;
        }
        if chunk.cut {
            cut.store(true, Ordering::SeqCst);
        }
        if to.write_all(&chunk.bytes).await.is_err() {
            return;
        }
        if chunk.cut {
            let _ = to.shutdown().await;
            return;
        }
    }
    let _ = to.shutdown().await;
}

/// Copies the server's bytes to the client, holding them while paused; after the cut, relays
/// nothing more: it reads the server's bytes to their end and drops them. Ends at the server's
/// EOF (shutting the client's write side down: after a cut, the client hears the end only once
/// the server has acted on the request and closed).
async fn to_client(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    server_spoke: &AtomicBool,
    cut: &AtomicBool,
) {
    let mut paused = shared.paused.subscribe();
    let mut buf = vec![0_u8; CHUNK];
    loop {
        // Paused: read nothing more (the server's bytes wait in the kernel's buffers).
        if paused.wait_for(|paused| !*paused).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        server_spoke.store(true, Ordering::SeqCst);
        // Read just before the pause began: hold it too.
        if paused.wait_for(|paused| !*paused).await.is_err() {
            return;
        }
        if cut.load(Ordering::SeqCst) {
            // A reply the cut must never deliver: the server's bytes are read to its end and
            // dropped, and only then does the client hear the end — after the server has acted
            // on everything it was sent (a reply to an earlier statement of the same chunk
            // must not end the connection before the server has read the rest).
            continue;
        }
        if to
            .write_all(buf.get(..n).unwrap_or_default())
            .await
            .is_err()
        {
            break;
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::contains_ending_in;

    #[test]
    fn a_pattern_is_found_across_two_reads_but_not_wholly_in_the_earlier_one() {
        assert!(contains_ending_in(b"", b"xxCOMMITyy", b"COMMIT"));
        assert!(contains_ending_in(b"aaCOM", b"MITbb", b"COMMIT"));
        assert!(!contains_ending_in(b"COMMIT", b"xx", b"COMMIT"));
        assert!(!contains_ending_in(b"aaCOM", b"MXT", b"COMMIT"));
        assert!(contains_ending_in(b"anything", b"x", b""));
    }
}
