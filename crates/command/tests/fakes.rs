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
}

runner_suite!(Fakes::default());
