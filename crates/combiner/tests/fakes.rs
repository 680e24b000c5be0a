//! The combiner on the testkit's fakes: the shared suite, plus the public entry points called
//! from inside `tokio::spawn` with the concrete fake types, as a web handler would.

mod suite;

use std::time::Duration;

use lockstep_combiner::{CombineError, Combiner};
use lockstep_core::{ErrorKind, Uuid};
use lockstep_testkit::{FakeDatabase, InMemoryEventStore};

use suite::{Backend, Cmd, Shop};

/// One fake database and store; "another process" is a second combiner on the same ones.
#[derive(Default)]
struct Fakes {
    db: FakeDatabase,
    store: InMemoryEventStore,
}

impl Backend for Fakes {
    type Src = FakeDatabase;
    type Store = InMemoryEventStore;

    fn process(&self) -> (FakeDatabase, InMemoryEventStore) {
        (self.db.clone(), self.store.clone())
    }

    fn another_process(&self) -> (FakeDatabase, InMemoryEventStore) {
        self.process()
    }

    fn lose_next_commit_reply(&self) {
        self.db.lose_next_commit_replies(1);
    }
}

combiner_suite!(async { Fakes::default() });

/// `Combiner::submit` from inside `tokio::spawn`, with the concrete fake types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_runs_inside_a_spawned_task_with_concrete_fake_types() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let (shop, _handle) = Shop::new();
    let combiner: Combiner<FakeDatabase, InMemoryEventStore, Shop> =
        Combiner::new(db.clone(), store.clone(), shop);
    let id = Uuid::now_v7();
    let c = combiner.clone();
    let stocked = tokio::spawn(async move { c.submit(id, Cmd::Stock(3)).await })
        .await
        .expect("task");
    assert_eq!(stocked.expect("stocked").last_version(), 1);
    let handlers: Vec<_> = (0..5u32)
        .map(|tag| {
            let c = combiner.clone();
            tokio::spawn(async move {
                c.submit(
                    id,
                    Cmd::Reserve {
                        qty: 1,
                        tag,
                        wait: false,
                    },
                )
                .await
            })
        })
        .collect();
    let mut ok = 0;
    for h in handlers {
        match h.await.expect("task") {
            Ok(_) => ok += 1,
            Err(CombineError::Rejected(_)) => {}
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(ok, 3);
    assert_eq!(suite::reserved_tags(&db, &store, id).await.len(), 3);
}

/// Without a runtime, a submission is answered `Unsupported` at once and nothing is queued.
#[test]
fn submit_without_a_runtime_is_unsupported_and_queues_nothing() {
    let (shop, _handle) = Shop::new();
    let combiner = Combiner::new(FakeDatabase::new(), InMemoryEventStore::new(), shop);
    let submission = combiner.submit(Uuid::now_v7(), Cmd::Stock(1));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let err = rt.block_on(submission).expect_err("no runtime at submit");
    assert_eq!(err.kind(), Some(ErrorKind::Unsupported));
}

/// A submission whose aggregate task was spawned on a runtime that had shut down (the task is
/// dropped before it runs) is answered `Cancelled`, and the aggregate does not stay wedged: the
/// next submission, on a live runtime, starts a task of its own.
#[test]
fn a_task_dropped_before_it_ran_answers_its_queue_and_frees_the_aggregate() {
    let (shop, _handle) = Shop::new();
    let c = Combiner::new(FakeDatabase::default(), InMemoryEventStore::default(), shop);
    let id = Uuid::now_v7();
    let dead = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let handle = dead.handle().clone();
    drop(dead);
    let orphan = {
        let _in_dead_runtime = handle.enter();
        c.submit(id, Cmd::Stock(1))
    };
    let live = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    live.block_on(async {
        let answer = tokio::time::timeout(Duration::from_secs(5), orphan)
            .await
            .expect("answered, not left waiting");
        let err = answer.expect_err("never decided");
        assert_eq!(err.kind(), Some(ErrorKind::Cancelled), "{err:?}");
        let next = tokio::time::timeout(Duration::from_secs(5), c.submit(id, Cmd::Stock(2)))
            .await
            .expect("the aggregate is not wedged")
            .expect("accepted");
        assert_eq!(next.last_version(), 1);
    });
}
