//! What an engine renders into the prompt besides the messages' text, as the
//! prefix identity sees it.
//!
//! Chat templates render the tool list before the messages (Llama 3.x, Qwen
//! 2.5/3, Mistral), may be chosen or parameterised per request
//! (`chat_template`, `chat_template_kwargs`, vLLM's `documents`), and the
//! engine keys its cache by the model or adapter too (vLLM's LoRA id) and by
//! `cache_salt`. Two requests that differ in any of those share no cached
//! tokens even when their messages' text is the same, so they are the
//! prompt's *identity*: the seed of its prefix chain (see
//! `policy::prefix`). Each such value is hashed as the client wrote it (a
//! client re-sends its own tool list byte for byte; one written another way
//! only costs a pin, never sends a request to a cache it does not match).
//!
//! Inside the messages, what is rendered at a message's place without being
//! text (an assistant's `tool_calls`, a part's image, audio, file or
//! tool-use input) adds a marker to the canonical text where it stands:
//! `0x1D` and the value's hash in hex, so a conversation with another image
//! or another tool call in turn 3 shares turns 1 and 2 only.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Top-level fields the chat template renders (or is chosen by).
pub const RENDERED: [&[u8]; 5] = [
    b"tools",
    b"functions",
    b"chat_template",
    b"chat_template_kwargs",
    b"documents",
];

/// Fields of a message rendered at its place besides its content.
pub const CALLS: [&[u8]; 2] = [b"tool_calls", b"function_call"];

/// Fields of a content part rendered at its place besides its text: media
/// (OpenAI's `image_url`, `input_audio`, vLLM's `video_url` / `audio_url`,
/// Anthropic's `source`, files) and a tool-use part's `name` and `input`.
pub const PARTS: [&[u8]; 11] = [
    b"image_url",
    b"input_audio",
    b"audio_url",
    b"video_url",
    b"source",
    b"image",
    b"file",
    b"file_id",
    b"file_data",
    b"input",
    b"name",
];

const MARK: u8 = 0x1D;

/// The top-level rendered fields found, by their place in [`RENDERED`]; a
/// repeated key counts once, with its last value.
pub type Rendered = [Option<u64>; RENDERED.len()];

/// Where `key` is in [`RENDERED`].
pub fn rendered(key: &[u8]) -> Option<usize> {
    RENDERED.iter().position(|k| *k == key)
}

/// The hash of a value as written.
pub fn hash(raw: &[u8]) -> u64 {
    xxh3_64(raw)
}

/// The marker a rendered value leaves in the canonical text.
pub fn marker(raw: &[u8]) -> [u8; 17] {
    let mut out = [MARK; 17];
    let h = hash(raw);
    for (i, b) in out[1..].iter_mut().enumerate() {
        *b = b"0123456789abcdef"[(h >> (60 - 4 * i) & 0xF) as usize];
    }
    out
}

/// The prompt's identity: `None` for a request that names none of salt,
/// model or rendered fields (the plain prefix chain).
pub fn of(salt: Option<&str>, model: Option<&str>, rendered: &Rendered) -> Option<u64> {
    if salt.is_none() && model.is_none() && rendered.iter().all(Option::is_none) {
        return None;
    }
    // Chained, each part seeded by the hash so far and its tag: no buffer.
    let mut h = 0x6964_656e_7469_7479; // "identity"
    for (tag, s) in [(1u64, salt), (2, model)] {
        if let Some(s) = s {
            h = xxh3_64_with_seed(s.as_bytes(), h ^ tag);
        }
    }
    for (i, part) in rendered.iter().enumerate() {
        if let Some(part) = part {
            h = xxh3_64_with_seed(&part.to_le_bytes(), h ^ (16 + i as u64));
        }
    }
    Some(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_part_of_the_identity_counts_once_and_apart() {
        let none: Rendered = Default::default();
        assert_eq!(of(None, None, &none), None);
        let mut tools = none;
        tools[0] = Some(hash(b"[]"));
        let ids = [
            of(Some("s"), None, &none),
            of(None, Some("s"), &none),
            of(None, None, &tools),
            of(Some("s"), Some("m"), &none),
            of(Some("sm"), None, &none),
        ];
        for (i, a) in ids.iter().enumerate() {
            assert!(a.is_some());
            for b in &ids[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(ids[2], of(None, None, &tools));
    }

    #[test]
    fn a_marker_is_the_mark_and_sixteen_hex_digits() {
        let m = marker(b"{\"url\":\"data:image/png;base64,AAAA\"}");
        assert_eq!(m[0], 0x1D);
        assert!(m[1..].iter().all(u8::is_ascii_hexdigit));
        assert_ne!(m, marker(b"{\"url\":\"data:image/png;base64,AAAB\"}"));
    }
}
