//! The engines' own account of their KV cache: their events, decoded
//! ([`event`]), and what each replica holds as they tell it ([`blocks`]).

pub mod blocks;
pub mod event;

pub use blocks::{chain_keys, Applied, CacheState, EngineBlocks};
pub use event::{namespace, Batch, EngineHash, Event};

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// Encoded by msgspec with vLLM's classes (`array_like`, tagged by
    /// class name): `BlockStored([-5, 2**64-1], None, [1,2,3,4], 2, None,
    /// "GPU")`, `BlockRemoved([-5], "GPU")`, `AllBlocksCleared()`.
    const ARRAY: &str = "93cb3ff80000000000009397ab426c6f636b53746f72656492fbcfffffffffffffffffc0940102030402c0a347505593ac426c6f636b52656d6f76656491fba347505591b0416c6c426c6f636b73436c6561726564c0";

    /// Encoded by msgspec as SGLang does (maps tagged `type`, defaults
    /// omitted): `BlockStored([b"\x01\x02", 7], 3, [1,2,3,4], 2,
    /// medium="GPU", lora_name="ad")`, `BlockStored([8], None, [1,2], 2,
    /// medium="CPU_PINNED")`, `BlockRemoved([7])`, `AllBlocksCleared()`,
    /// `attn_dp_rank=0`.
    const MAP: &str = "93cb40040000000000009487a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c402010207b1706172656e745f626c6f636b5f6861736803a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a66d656469756da3475055a96c6f72615f6e616d65a2616486a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739108b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a66d656469756daa4350555f50494e4e454482a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573910781a474797065b0416c6c426c6f636b73436c656172656400";

    #[test]
    fn both_encodings_decode() {
        let a: Batch = rmp_serde::from_slice(&hex(ARRAY)).expect("array form");
        assert_eq!(a.ts, 1.5);
        assert_eq!(
            a.events,
            vec![
                Event::Stored {
                    hashes: vec![EngineHash(-5i64 as u64), EngineHash(u64::MAX)],
                    parent: None,
                    tokens: vec![1, 2, 3, 4],
                    block_size: 2,
                    namespace: 0,
                },
                Event::Removed {
                    hashes: vec![EngineHash(-5i64 as u64)],
                },
                Event::Cleared,
            ]
        );
        let m: Batch = rmp_serde::from_slice(&hex(MAP)).expect("map form");
        assert_eq!(m.ts, 2.5);
        let Event::Stored {
            hashes,
            parent,
            namespace,
            ..
        } = &m.events[0]
        else {
            panic!("{:?}", m.events[0]);
        };
        assert_eq!(hashes[0], EngineHash(xxhash_rust::xxh3::xxh3_64(&[1, 2])));
        assert_eq!(hashes[1], EngineHash(7));
        assert_eq!(*parent, Some(EngineHash(3)));
        assert_ne!(*namespace, 0, "an adapter's blocks are its own");
        assert_eq!(m.events[1], Event::Other, "CPU_PINNED is an offload tier");
        assert_eq!(
            m.events[2],
            Event::Removed {
                hashes: vec![EngineHash(7)]
            }
        );
        assert_eq!(m.events[3], Event::Cleared);
    }

    #[test]
    fn one_event_never_costs_its_batch() {
        let enc = |v: serde_json::Value| rmp_serde::to_vec(&v).expect("encode");
        let stored = |extra: serde_json::Value| {
            let mut e = serde_json::json!({"type": "BlockStored", "block_hashes": [1],
                "parent_block_hash": null, "token_ids": [1, 2], "block_size": 2});
            for (k, v) in extra.as_object().expect("fields") {
                e[k] = v.clone();
            }
            e
        };
        let batch = enc(serde_json::json!([0.0, [
            stored(serde_json::json!({"new_field": {"x": [1]}})),
            stored(serde_json::json!({"group_idx": 1})),
            stored(serde_json::json!({"kv_cache_spec_kind": "sliding_window"})),
            stored(serde_json::json!({"token_ids": [[1, 2], [3, 4]]})),
            stored(serde_json::json!({"block_size": 0})),
            stored(serde_json::json!({"block_size": 1_000_000, "token_ids": []})),
            stored(serde_json::json!({"block_hashes": [1, 2]})),
            stored(serde_json::json!({"extra_keys": [["salt"]]})),
            stored(serde_json::json!({"locality": "REMOTE"})),
            {"type": "SomethingNew", "a": 1},
            {"block_hashes": [1]},
            ["BlockRemoved", [1], "GPU", 0, "LOCAL", null, "a later field"],
            ["BlockRemoved", [1]],
            ["BlockStored", [1], null, [1, 2], 2, null, "GPU", null, null, 1],
            {"type": "AllBlocksCleared"}
        ], 0, "later"]));
        let b: Batch = rmp_serde::from_slice(&batch).expect("decodes");
        let kinds: Vec<&str> = b
            .events
            .iter()
            .map(|e| match e {
                Event::Stored { .. } => "stored",
                Event::Removed { .. } => "removed",
                Event::Cleared => "cleared",
                Event::Other => "other",
                Event::Unreadable { .. } => "unreadable",
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "stored",
                "other",
                "other",
                "unreadable",
                "unreadable",
                "unreadable",
                "unreadable",
                "unreadable",
                "other",
                "other",
                "other",
                "removed",
                "removed",
                "other",
                "cleared"
            ]
        );
        for bad in [
            serde_json::json!([0.0]),
            serde_json::json!({"ts": 0.0}),
            serde_json::json!([0.0, 7]),
        ] {
            assert!(
                rmp_serde::from_slice::<Batch>(&enc(bad.clone())).is_err(),
                "{bad}"
            );
        }
    }
}
