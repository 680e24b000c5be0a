//! The command runner on the testkit's fakes: the shared suite (every command handled from
//! inside `tokio::spawn` with the concrete fake types).

mod suite;

use lockstep_testkit::{FakeDatabase, InMemoryEventStore};

use suite::Backend;

#[derive(Clone, Default)]
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

    fn lose_next_commit_reply(&self) {
        self.db.lose_next_commit_replies(1);
    }
}

runner_suite!(Fakes::default());
