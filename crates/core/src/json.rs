//! JSON values lockstep stores and must read back: event payloads ([`crate::NewEvent`]) and
//! perspective states ([`crate::StateCommit`]).
//!
//! A value is *storable* when every backend can write it and read it back unchanged: it nests
//! arrays and objects at most [`MAX_DEPTH`] levels deep, and no string or key contains U+0000
//! (PostgreSQL's `jsonb` cannot store it). [`check_storable`] is the check; constructors and
//! stores refuse anything else before it is written, with a typed [`ValidationError`].
//!
//! ```
//! use lockstep_core::json::{self, MAX_DEPTH};
//! use lockstep_core::ValidationError;
//!
//! let deep = |depth: usize| (0..depth).fold(serde_json::json!(1), |v, _| serde_json::json!([v]));
//! assert!(json::check_storable(&deep(MAX_DEPTH), "event payload").is_ok());
//! let err = json::check_storable(&deep(MAX_DEPTH + 1), "event payload").unwrap_err();
//! assert_eq!(
//!     err.validation(),
//!     Some(&ValidationError::JsonTooDeep { field: "event payload", max: 127 })
//! );
//! ```

use serde_json::Value;

use crate::error::{Result, ValidationError};

/// The deepest nesting of arrays and objects a stored JSON value may have: **127**.
///
/// Depth counts the arrays and objects around the innermost value: a scalar is at depth 0,
/// `[]`, `{}` and `[1, "a"]` at 1, `{"k": [1]}` at 2. Stored values are read back with
/// serde_json (the Postgres backends decode `jsonb` columns with it), whose parser has a
/// recursion limit of 128 that every array and object it enters counts against: a document
/// nested 127 levels deep parses, one nested 128 levels deep fails with "recursion limit
/// exceeded". PostgreSQL itself accepts far deeper `jsonb`, so without this bound a value could
/// be written and then fail every later read (a stream that can no longer be loaded, a
/// perspective pair that can no longer be claimed). Pinned by the tests of this module.
pub const MAX_DEPTH: usize = 127;

/// Checks that `value` is storable (see the [module docs](self)): nested at most
/// [`MAX_DEPTH`] levels deep ([`ValidationError::JsonTooDeep`] otherwise) and free of U+0000
/// in every string and key ([`ValidationError::ContainsNul`]). `field` names the value in the
/// error (`"event payload"`, `"perspective state"`).
///
/// Never recurses more than [`MAX_DEPTH`] + 1 levels, however deep `value` is.
pub fn check_storable(value: &Value, field: &'static str) -> Result<()> {
    if deeper_than(value, MAX_DEPTH) {
        return Err(ValidationError::JsonTooDeep {
            field,
            max: MAX_DEPTH,
        }
        .into());
    }
    // Bounded by the depth check above.
    if contains_nul(value) {
        return Err(ValidationError::ContainsNul { field }.into());
    }
    Ok(())
}

/// Whether `value` nests arrays and objects more than `room` levels deep; stops descending
/// as soon as it is.
fn deeper_than(value: &Value, room: usize) -> bool {
    // `room == 0 ||` first: `room - 1` never underflows.
    match value {
        Value::Array(items) => room == 0 || items.iter().any(|v| deeper_than(v, room - 1)),
        Value::Object(map) => room == 0 || map.values().any(|v| deeper_than(v, room - 1)),
        _ => false,
    }
}

/// Drops `value` without recursing more than [`MAX_DEPTH`] + 1 levels, however deep it is.
///
/// Dropping a `serde_json::Value` recurses once per level of nesting, so a value nested tens of
/// thousands of levels deep (it cannot come from parsed JSON — serde_json's parser stops at 128
/// levels — but code can build one) overflows the thread's stack when it is dropped and aborts
/// the process. A value within [`MAX_DEPTH`] is dropped as usual; a deeper one is taken apart
/// with an explicit stack, so that each value is dropped once its children have been moved
/// out. Constructors that refuse a value as too deep ([`crate::NewEvent::new`]) drop it here.
pub fn drop_iteratively(value: Value) {
    if !deeper_than(&value, MAX_DEPTH) {
        return;
    }
    let mut stack = vec![value];
    while let Some(mut value) = stack.pop() {
        match &mut value {
            Value::Array(items) => stack.append(items),
            Value::Object(map) => stack.extend(std::mem::take(map).into_iter().map(|(_, v)| v)),
            _ => {}
        }
        // `value` has no children left: dropping it recurses no further.
    }
}

fn contains_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    /// `depth` arrays and objects, alternating, each with a scalar beside the nested value.
    fn nested(depth: usize) -> Value {
        (0..depth).fold(serde_json::json!("leaf"), |value, level| {
            if level % 2 == 0 {
                serde_json::json!([1, value])
            } else {
                serde_json::json!({ "a": 1, "k": value })
            }
        })
    }

    fn reads_back(value: &Value) -> bool {
        let bytes = serde_json::to_vec(value).expect("serializes");
        serde_json::from_slice::<Value>(&bytes).is_ok_and(|back| &back == value)
    }

    #[test]
    fn max_depth_is_the_deepest_value_serde_json_reads_back() {
        let arrays = |d: usize| (0..d).fold(serde_json::json!(0), |v, _| serde_json::json!([v]));
        let objects =
            |d: usize| (0..d).fold(serde_json::json!(0), |v, _| serde_json::json!({ "k": v }));
        for build in [&nested as &dyn Fn(usize) -> Value, &arrays, &objects] {
            assert!(reads_back(&build(MAX_DEPTH)));
            assert!(!reads_back(&build(MAX_DEPTH + 1)));
            assert!(check_storable(&build(MAX_DEPTH), "v").is_ok());
            assert_eq!(
                typed(check_storable(&build(MAX_DEPTH + 1), "v")),
                Err(ValidationError::JsonTooDeep {
                    field: "v",
                    max: 127
                })
            );
        }
        let bytes = serde_json::to_vec(&nested(MAX_DEPTH + 1)).expect("serializes");
        let err = serde_json::from_slice::<Value>(&bytes).expect_err("too deep for serde_json");
        assert!(err.to_string().contains("recursion limit"), "{err}");
    }

    #[test]
    fn depth_counts_arrays_and_objects_on_the_deepest_branch() {
        let depth = |v: Value| (0..=MAX_DEPTH + 1).find(|&room| !deeper_than(&v, room));
        assert_eq!(depth(serde_json::json!(null)), Some(0));
        assert_eq!(depth(serde_json::json!("s")), Some(0));
        assert_eq!(depth(serde_json::json!([])), Some(1));
        assert_eq!(depth(serde_json::json!({})), Some(1));
        assert_eq!(depth(serde_json::json!([1, "a"])), Some(1));
        assert_eq!(depth(serde_json::json!({ "k": [1] })), Some(2));
        assert_eq!(depth(serde_json::json!([[], [[{}]], 1])), Some(4));
        // The deep branch after shallow siblings is found too (2 levels + the nested value).
        let late = serde_json::json!([1, [2], { "k": nested(MAX_DEPTH - 2) }]);
        assert_eq!(depth(late.clone()), Some(MAX_DEPTH));
        assert!(check_storable(&late, "v").is_ok());
        let late = serde_json::json!([1, [2], { "k": nested(MAX_DEPTH - 1) }]);
        assert!(check_storable(&late, "v").is_err());
    }

    #[test]
    fn a_value_far_deeper_than_the_limit_is_dropped_without_recursing() {
        // Arrays and objects alternating, each with siblings beside the deep branch.
        let deep = (0..200_000).fold(serde_json::json!("leaf"), |value, level| {
            if level % 2 == 0 {
                Value::Array(vec![serde_json::json!(1), value, serde_json::json!([2])])
            } else {
                let mut map = serde_json::Map::new();
                map.insert("a".to_owned(), serde_json::json!({ "b": [] }));
                map.insert("k".to_owned(), value);
                Value::Object(map)
            }
        });
        drop_iteratively(deep);
        // Shallow values take the ordinary path.
        drop_iteratively(nested(MAX_DEPTH));
        drop_iteratively(serde_json::json!(null));
    }

    #[test]
    fn a_nul_anywhere_is_refused_and_depth_is_checked_first() {
        for bad in [
            serde_json::json!({ "note": "a\u{0}b" }),
            serde_json::json!({ "a\u{0}": 1 }),
            serde_json::json!([[{ "deep": ["x\u{0}"] }]]),
        ] {
            assert_eq!(
                typed(check_storable(&bad, "event payload")),
                Err(ValidationError::ContainsNul {
                    field: "event payload"
                })
            );
        }
        let deep_with_nul =
            (0..MAX_DEPTH + 1).fold(serde_json::json!("\u{0}"), |v, _| serde_json::json!([v]));
        assert_eq!(
            typed(check_storable(&deep_with_nul, "v")),
            Err(ValidationError::JsonTooDeep {
                field: "v",
                max: MAX_DEPTH
            })
        );
    }
}
