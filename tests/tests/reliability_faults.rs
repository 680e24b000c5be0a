//! Issue 8's faults scenario, short: a PostgreSQL restart on a private server, terminated
//! backends and a stalled keepalive (`lockstep_tests::reliability::faults`), with every check
//! counted in a tally that must come out clean; and the checks themselves shown to fail on the
//! outcomes they exist to catch.

use std::time::Duration;

use lockstep_core::{Error, ErrorKind};
use lockstep_testkit::relay::Relay;
use lockstep_tests::reliability::faults::{
    Ended, bounded, expect_failure, lost_before_takeover, lost_connection,
};
use lockstep_tests::reliability::{Scale, Tally, faults};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_short_run_keeps_every_promise() {
    let started = Instant::now();
    let tally = faults::run(Scale::Short)
        .await
        .expect("the faults scenario runs");
    eprintln!("{tally} in {:?}", started.elapsed());
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
    assert!(tally.cases > 0, "no case ran");
    assert!(tally.is_clean(), "{tally}: {:#?}", tally.details);
}

fn err(kind: ErrorKind) -> Error {
    Error::new(kind, "made up")
}

/// The check on an interrupted operation fails on a success, a wrong kind, a hang and a panic,
/// and passes on a lost connection.
#[tokio::test]
async fn an_interrupted_operation_must_end_typed() {
    let mut tally = Tally::default();
    assert!(expect_failure::<()>(
        &mut tally,
        "lost",
        Ended::Returned(Err(err(ErrorKind::ConnectionLost))),
        lost_connection
    ));
    assert!(tally.is_clean());
    let failing: [Ended<lockstep_core::Result<()>>; 4] = [
        Ended::Returned(Ok(())),
        Ended::Returned(Err(err(ErrorKind::Backend))),
        Ended::Hung(Duration::from_secs(1)),
        Ended::Panicked("boom".into()),
    ];
    for ended in failing {
        assert!(!expect_failure(&mut tally, "bad", ended, lost_connection));
    }
    assert_eq!((tally.violations, tally.panics, tally.cases), (3, 1, 5));

    // `bounded` reports a hang and a panic as such.
    let hung = bounded(
        Duration::from_millis(50),
        tokio::spawn(tokio::time::sleep(Duration::from_secs(60))),
    )
    .await;
    assert!(matches!(hung, Ended::Hung(_)));
    let panicked = bounded(
        Duration::from_secs(5),
        tokio::spawn(async { std::panic::panic_any("boom") }),
    )
    .await;
    assert!(
        matches!(panicked, Ended::Panicked(ref m) if m == "boom"),
        "{panicked:?}"
    );
}

/// The stall check fails when the lost signal fired after the takeover, or never.
#[test]
fn the_lost_signal_must_fire_before_the_takeover() {
    let mut tally = Tally::default();
    let now = Instant::now();
    let later = now + Duration::from_millis(5);
    assert!(lost_before_takeover(&mut tally, "ok", Some(now), later));
    assert!(!lost_before_takeover(&mut tally, "late", Some(later), now));
    assert!(!lost_before_takeover(&mut tally, "never", None, now));
    assert_eq!((tally.violations, tally.cases), (2, 3));
}

/// The stall fault is real: a paused relay holds a query's bytes until resumed.
#[tokio::test]
async fn a_paused_relay_stalls_traffic_until_resumed() {
    let echo = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let target = echo.local_addr().expect("addr");
    tokio::spawn(async move {
        if let Ok((mut socket, _)) = echo.accept().await {
            let mut buf = [0_u8; 4];
            while let Ok(n) = socket.read(&mut buf).await {
                if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    let relay = Relay::start(target).await.expect("relay");
    let mut client = tokio::net::TcpStream::connect(relay.addr())
        .await
        .expect("connect");
    let mut buf = [0_u8; 4];
    client.write_all(b"ping").await.expect("write");
    client.read_exact(&mut buf).await.expect("echo");
    assert_eq!(&buf, b"ping");

    relay.pause();
    client.write_all(b"pong").await.expect("write");
    let stalled =
        tokio::time::timeout(Duration::from_millis(300), client.read_exact(&mut buf)).await;
    assert!(stalled.is_err(), "the paused relay let bytes through");
    relay.resume();
    tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut buf))
        .await
        .expect("resumed in time")
        .expect("echo");
    assert_eq!(&buf, b"pong");
}
