//! prefix-router's routing core, pure: a request body in, a replica out.
//!
//! - [`request`]: request body -> canonical prompt text and shape signals, and
//!   the checkpoints a long conversation's next turn is read from.
//! - [`kv`]: the engines' KV events and what each replica holds as they say.
//! - [`policy`]: the routing rule (shape, prefix chain and index, counter,
//!   room and load bounds), with liveness, load and time passed in.
//!
//! Its manifest has no I/O dependency: the crate cannot reach the network, a
//! runtime or the clock, so its decisions are deterministic under test.
#![forbid(unsafe_code)]

pub mod kv;
pub mod policy;
pub mod request;
