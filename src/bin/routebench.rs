//! routebench: the seed's scenarios against any OpenAI-compatible endpoint;
//! the code is the `routebench` crate (`crates/routebench`).
#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    routebench::main()
}
