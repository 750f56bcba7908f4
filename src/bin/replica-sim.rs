//! replica-sim: a simulated single-GPU OpenAI-compatible replica; the code
//! is the `replica-sim` crate (`crates/replica-sim`).
#![forbid(unsafe_code)]

fn main() -> std::io::Result<()> {
    replica_sim::main()
}
