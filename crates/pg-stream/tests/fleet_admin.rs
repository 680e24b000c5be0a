//! The operators' side of the fleet on PostgreSQL: a row lockstep cannot read is listed as
//! unreadable beside the others, one instance that died is forgotten at once (a live one is
//! kept), and the stale instances not seen for a given time are pruned. Every call runs inside
//! `tokio::spawn`, with the concrete locker, as an operator's program runs it.

mod common;

use std::time::Duration;

use common::{Db, long_options};
use lockstep_core::{
    Fleet, FleetAdmin, InstanceAnnouncement, InstanceEntry, InstanceId, PerspectiveName,
};
use lockstep_pg_stream::{ForgetInstance, PgStreamLocker};

async fn announce(locker: &PgStreamLocker, name: &str) -> InstanceId {
    let me = InstanceId::random();
    let announced = InstanceAnnouncement::new(
        me,
        name,
        "host",
        1,
        "1.0",
        vec![PerspectiveName::new("Orders").expect("valid")],
    )
    .expect("valid");
    let locker = locker.clone();
    tokio::spawn(async move { locker.announce(&announced).await })
        .await
        .expect("task")
        .expect("announce");
    me
}

/// Sets `instance`'s last-seen time by hand (`at`: an SQL expression).
async fn seen_at(db: &Db, instance: InstanceId, at: &str) {
    db.client()
        .await
        .execute(
            &format!("UPDATE wh_worker_instances SET last_seen_at = {at} WHERE instance_id = $1"),
            &[&instance.as_uuid()],
        )
        .await
        .expect("an operator's update");
}

async fn ids(locker: &PgStreamLocker) -> Vec<InstanceId> {
    let locker = locker.clone();
    tokio::spawn(async move { locker.list_instance_entries().await })
        .await
        .expect("task")
        .expect("listing")
        .iter()
        .map(|e| match e {
            InstanceEntry::Instance(i) => i.announcement.instance,
            InstanceEntry::Unreadable(u) => InstanceId::from_uuid(u.instance_id).expect("not nil"),
        })
        .collect()
}

async fn forget(locker: &PgStreamLocker, instance: InstanceId) -> ForgetInstance {
    let locker = locker.clone();
    tokio::spawn(async move { locker.forget_instance(instance).await })
        .await
        .expect("task")
        .expect("forget")
}

#[tokio::test]
async fn an_unreadable_fleet_row_is_an_entry_of_its_own_beside_the_others() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (a, b, c) = (
        announce(&locker, "a").await,
        announce(&locker, "b").await,
        announce(&locker, "c").await,
    );
    seen_at(&db, b, "'infinity'").await;
    let listed = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.list_instance_entries().await })
            .await
            .expect("task")
            .expect("the listing does not fail for one row")
    };
    assert_eq!(listed.len(), 3, "{listed:?}");
    match &listed[1] {
        InstanceEntry::Unreadable(u) => {
            assert_eq!(u.instance_id, b.as_uuid());
            assert_eq!(u.name.as_deref(), Some("b"));
            assert!(u.problem.contains("last_seen_at"), "{u:?}");
            assert!(u.problem.contains(&b.to_string()), "names the row: {u:?}");
        }
        other => panic!("b is unreadable: {other:?}"),
    }
    for (entry, id) in [(&listed[0], a), (&listed[2], c)] {
        assert!(
            matches!(entry, InstanceEntry::Instance(i) if i.announcement.instance == id),
            "{listed:?}"
        );
    }
    assert!(
        locker.list_instances().await.is_err(),
        "the strict listing still refuses the row"
    );
}

#[tokio::test]
async fn forget_removes_a_stale_instance_and_keeps_a_live_one() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (live, stale, infinite) = (
        announce(&locker, "live").await,
        announce(&locker, "stale").await,
        announce(&locker, "infinite").await,
    );
    seen_at(&db, stale, "clock_timestamp() - interval '2 hours'").await;
    seen_at(&db, infinite, "'infinity'").await;

    assert_eq!(forget(&locker, live).await, ForgetInstance::Live);
    assert_eq!(forget(&locker, stale).await, ForgetInstance::Forgotten);
    assert_eq!(forget(&locker, stale).await, ForgetInstance::NotAnnounced);
    assert_eq!(
        forget(&locker, infinite).await,
        ForgetInstance::Forgotten,
        "a row whose last-seen time cannot be read is not live"
    );
    assert_eq!(
        forget(&locker, InstanceId::random()).await,
        ForgetInstance::NotAnnounced
    );
    assert_eq!(ids(&locker).await, vec![live]);
}

#[tokio::test]
async fn prune_forgets_only_the_stale_instances_not_seen_for_that_long() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (live, old, recent, infinite) = (
        announce(&locker, "live").await,
        announce(&locker, "old").await,
        announce(&locker, "recent").await,
        announce(&locker, "infinite").await,
    );
    seen_at(&db, old, "clock_timestamp() - interval '2 hours'").await;
    seen_at(&db, recent, "clock_timestamp() - interval '10 minutes'").await;
    seen_at(&db, infinite, "'infinity'").await;
    let prune = |unseen_for: Duration| {
        let locker = locker.clone();
        async move {
            tokio::spawn(async move { locker.forget_stale_instances(unseen_for).await })
                .await
                .expect("task")
                .expect("prune")
        }
    };
    let forgotten = prune(Duration::from_secs(3600)).await;
    assert_eq!(forgotten, vec![(old.as_uuid(), "old".to_owned())]);
    let mut left = ids(&locker).await;
    left.sort();
    let mut expected = vec![live, recent, infinite];
    expected.sort();
    assert_eq!(left, expected);
    // Not seen for 0 s or more: every stale one, never the live one.
    let forgotten = prune(Duration::ZERO).await;
    assert_eq!(forgotten, vec![(recent.as_uuid(), "recent".to_owned())]);
    assert!(ids(&locker).await.contains(&live));
}
