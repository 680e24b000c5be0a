//! The fault-injecting relay against small in-process TCP servers (no database needed): it
//! forwards, pauses and resumes, holds back only the connections open when asked, cuts a
//! connection after a pattern without relaying the reply, counts round trips, and closes its
//! connections when dropped.

use std::net::SocketAddr;
use std::time::Duration;

use lockstep_testkit::relay::Relay;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Long enough that a byte the relay does not hold would have arrived.
const SETTLE: Duration = Duration::from_millis(200);
/// Bound of any read that must succeed.
const LIMIT: Duration = Duration::from_secs(5);

/// An upstream that echoes every chunk it reads.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0_u8; 4096];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// An upstream that answers `ok\n` to every line, and reports every byte it reads.
async fn line_server() -> (SocketAddr, mpsc::UnboundedReceiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let (seen, seen_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = vec![0_u8; 4096];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    let _ = seen.send(buf[..n].to_vec());
                    for _ in buf[..n].iter().filter(|b| **b == b'\n') {
                        if socket.write_all(b"ok\n").await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, seen_rx)
}

/// Reads exactly `len` bytes, within [`LIMIT`].
async fn read_exactly(socket: &mut TcpStream, len: usize) -> Vec<u8> {
    let mut buf = vec![0_u8; len];
    tokio::time::timeout(LIMIT, socket.read_exact(&mut buf))
        .await
        .expect("the bytes arrive in time")
        .expect("read");
    buf
}

/// The relay closes `socket` within [`LIMIT`] without sending anything more (in particular
/// not the server's reply to a cut request).
async fn assert_closed_with_nothing_more(socket: &mut TcpStream) {
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(LIMIT, socket.read_to_end(&mut rest))
        .await
        .expect("the relay closed the connection");
    assert!(
        closed.is_err() || rest.is_empty(),
        "bytes arrived before the close: {rest:?}"
    );
}

/// Whether anything arrives on `socket` within [`SETTLE`].
async fn anything_within_settle(socket: &mut TcpStream) -> bool {
    let mut buf = [0_u8; 64];
    tokio::time::timeout(SETTLE, socket.read(&mut buf))
        .await
        .is_ok()
}

#[tokio::test]
async fn a_paused_relay_holds_every_byte_on_old_and_new_connections_until_resumed() {
    let relay = Relay::start(echo_server().await).await.expect("relay");
    let mut old = TcpStream::connect(relay.addr()).await.expect("connect");
    old.write_all(b"before").await.expect("write");
    assert_eq!(read_exactly(&mut old, 6).await, b"before");

    relay.pause();
    old.write_all(b"held").await.expect("write");
    let mut new = TcpStream::connect(relay.addr()).await.expect("connect");
    new.write_all(b"new").await.expect("write");
    assert!(
        !anything_within_settle(&mut old).await,
        "paused, an open connection's bytes still went through"
    );
    assert!(
        !anything_within_settle(&mut new).await,
        "paused, a new connection's bytes still went through"
    );
    old.write_all(b"-more").await.expect("write");

    relay.resume();
    assert_eq!(
        read_exactly(&mut old, 9).await,
        b"held-more",
        "the held bytes arrive in order"
    );
    assert_eq!(read_exactly(&mut new, 3).await, b"new");
}

#[tokio::test]
async fn held_back_bytes_of_open_connections_arrive_late_without_adding_up_and_new_ones_go_straight_through()
 {
    let relay = Relay::start(echo_server().await).await.expect("relay");
    let mut slow = TcpStream::connect(relay.addr()).await.expect("connect");
    slow.write_all(b"x").await.expect("write");
    assert_eq!(read_exactly(&mut slow, 1).await, b"x");

    let delay = Duration::from_millis(300);
    assert_eq!(relay.hold_back(delay), 1, "the one open connection");
    let sent = Instant::now();
    slow.write_all(b"a").await.expect("write");
    // A connection opened now is not held back: its echo comes before the first held byte.
    let mut fast = TcpStream::connect(relay.addr()).await.expect("connect");
    fast.write_all(b"f").await.expect("write");
    assert_eq!(read_exactly(&mut fast, 1).await, b"f");
    assert!(
        sent.elapsed() < delay,
        "the new connection was held back too ({:?})",
        sent.elapsed()
    );
    for (chunk, at) in [(b"b", 100), (b"c", 200)] {
        tokio::time::sleep_until(sent + Duration::from_millis(at)).await;
        slow.write_all(chunk).await.expect("write");
    }

    assert_eq!(read_exactly(&mut slow, 1).await, b"a");
    let first = sent.elapsed();
    assert!(first >= delay, "held back only {first:?}");
    assert_eq!(read_exactly(&mut slow, 2).await, b"bc");
    // Sent 100 and 200 ms after the first: if the delays added up, 'c' would come ≥ 900 ms.
    let last = sent.elapsed();
    assert!(
        last < Duration::from_millis(800),
        "the delays added up: {last:?}"
    );

    assert_eq!(
        relay.hold_back(Duration::ZERO),
        2,
        "both connections are open"
    );
    let again = Instant::now();
    slow.write_all(b"d").await.expect("write");
    assert_eq!(read_exactly(&mut slow, 1).await, b"d");
    assert!(again.elapsed() < delay, "the hold-back did not end");
}

#[tokio::test]
async fn a_cut_forwards_the_chunk_with_the_pattern_then_closes_without_relaying_the_reply() {
    let (upstream, mut seen) = line_server().await;
    let relay = Relay::start(upstream).await.expect("relay");
    let mut client = TcpStream::connect(relay.addr()).await.expect("connect");
    client.write_all(b"hello\n").await.expect("write");
    assert_eq!(read_exactly(&mut client, 3).await, b"ok\n");
    assert_eq!(seen.recv().await.expect("seen"), b"hello\n");

    relay.cut_after_client_sends(b"COMMIT");
    client.write_all(b"BEGIN; COMMIT\n").await.expect("write");
    let forwarded = tokio::time::timeout(LIMIT, seen.recv())
        .await
        .expect("the server got the chunk")
        .expect("seen");
    assert_eq!(forwarded, b"BEGIN; COMMIT\n");
    assert_closed_with_nothing_more(&mut client).await;

    // One-shot: another connection with the pattern is relayed normally.
    let mut other = TcpStream::connect(relay.addr()).await.expect("connect");
    other.write_all(b"COMMIT\n").await.expect("write");
    assert_eq!(read_exactly(&mut other, 3).await, b"ok\n");
}

#[tokio::test]
async fn a_cut_pattern_split_across_two_writes_still_fires() {
    let (upstream, mut seen) = line_server().await;
    let relay = Relay::start(upstream).await.expect("relay");
    let mut client = TcpStream::connect(relay.addr()).await.expect("connect");
    relay.cut_after_client_sends(b"COMMIT");
    client.write_all(b"BEGIN; COM").await.expect("write");
    let first = tokio::time::timeout(LIMIT, seen.recv())
        .await
        .expect("the first half is forwarded")
        .expect("seen");
    assert_eq!(first, b"BEGIN; COM", "half a pattern does not cut");
    client.write_all(b"MIT\n").await.expect("write");
    let second = tokio::time::timeout(LIMIT, seen.recv())
        .await
        .expect("the second half is forwarded")
        .expect("seen");
    assert_eq!(second, b"MIT\n");
    assert_closed_with_nothing_more(&mut client).await;
}

#[tokio::test]
async fn round_trips_count_bursts_that_follow_the_server_or_open_a_connection() {
    let (upstream, _seen) = line_server().await;
    let relay = Relay::start(upstream).await.expect("relay");
    let mut client = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(relay.round_trips(), 0);

    // Two writes before the server answers are one burst.
    client.write_all(b"one").await.expect("write");
    tokio::time::sleep(Duration::from_millis(50)).await;
    client.write_all(b" two\n").await.expect("write");
    assert_eq!(read_exactly(&mut client, 3).await, b"ok\n");
    assert_eq!(relay.round_trips(), 1);

    client.write_all(b"three\n").await.expect("write");
    assert_eq!(read_exactly(&mut client, 3).await, b"ok\n");
    assert_eq!(relay.round_trips(), 2);

    // A second connection's first burst counts too.
    let mut second = TcpStream::connect(relay.addr()).await.expect("connect");
    second.write_all(b"four\n").await.expect("write");
    assert_eq!(read_exactly(&mut second, 3).await, b"ok\n");
    assert_eq!(relay.round_trips(), 3);
}

#[tokio::test]
async fn dropping_the_relay_closes_its_connections() {
    let relay = Relay::start(echo_server().await).await.expect("relay");
    let mut client = TcpStream::connect(relay.addr()).await.expect("connect");
    client.write_all(b"x").await.expect("write");
    assert_eq!(read_exactly(&mut client, 1).await, b"x");
    drop(relay);
    assert_closed_with_nothing_more(&mut client).await;
}

#[tokio::test]
async fn an_upstream_that_refuses_ends_that_connection_only() {
    let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let nobody = gone.local_addr().expect("address");
    drop(gone);
    let relay = Relay::start(nobody).await.expect("relay");
    let mut client = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_closed_with_nothing_more(&mut client).await;
    // The relay still accepts (and closes) connections.
    let mut again = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_closed_with_nothing_more(&mut again).await;
}
