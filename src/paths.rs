//! Which request paths the router reads the body of, after the normalisation
//! an engine's HTTP server may apply, so no spelling of a routed path skips
//! the body limit or placement: the prompt paths (placed by prompt and
//! model), and the engines' other JSON paths (placed by model only).

/// Paths whose body is read and routed by prompt.
const PROMPT_PATHS: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    RESPONSES_PATH,
];

/// Every routed path: the prompt paths, then the JSON paths of vLLM and
/// SGLang whose body is read for its `model` only (spread within the
/// model's replicas).
pub const ROUTED_PATHS: [&str; 15] = [
    PROMPT_PATHS[0],
    PROMPT_PATHS[1],
    PROMPT_PATHS[2],
    PROMPT_PATHS[3],
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    "/tokenize",
    "/detokenize",
    "/pooling",
    AUDIO_PATHS[0],
    AUDIO_PATHS[1],
];

/// Audio paths: multipart form bodies, whose `model` field is read.
pub const AUDIO_PATHS: [&str; 2] = ["/v1/audio/transcriptions", "/v1/audio/translations"];

/// A routed path whose body carries a prompt (else only its `model` is read).
pub fn carries_prompt(routed: &str) -> bool {
    PROMPT_PATHS.contains(&routed)
}

/// OpenAI's Responses API (its body is read by `request::responses`).
pub const RESPONSES_PATH: &str = "/v1/responses";

/// The response id a `GET`/`DELETE /v1/responses/{id}` (or a sub-path such
/// as `/input_items` or `/cancel`) names.
pub fn response_id(path: &str) -> Option<&str> {
    let id = path.strip_prefix("/v1/responses/")?;
    let id = id.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// The routed path that `path` (without query) names, if any, after the
/// normalisation an engine's HTTP server may apply: percent-decoding, empty
/// and `.` segments dropped, `..` applied, a trailing slash ignored. So
/// `/v1//chat/%63ompletions/` is routed (size limit, placement) like
/// `/v1/chat/completions`, and is forwarded as that.
pub fn routed_path(path: &str) -> Option<&'static str> {
    if let Some(p) = ROUTED_PATHS.iter().find(|p| **p == path) {
        return Some(p);
    }
    let decoded = percent_decode(path.as_bytes());
    let mut segments: Vec<&[u8]> = Vec::new();
    for seg in decoded.split(|b| *b == b'/') {
        match seg {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    ROUTED_PATHS.iter().copied().find(|p| {
        let mut want = p.split('/').filter(|s| !s.is_empty());
        segments.len() == want.clone().count()
            && segments
                .iter()
                .all(|s| want.next().is_some_and(|w| w.as_bytes() == *s))
    })
}

/// `%XX` escapes decoded once, as an engine's HTTP server does; invalid
/// escapes are kept as they are.
fn percent_decode(path: &[u8]) -> Vec<u8> {
    let hex = |b: Option<&u8>| b.and_then(|b| (*b as char).to_digit(16));
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        match (path[i], hex(path.get(i + 1)), hex(path.get(i + 2))) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_variants_of_a_routed_path_are_routed_as_it() {
        for p in [
            "/v1/chat/completions",
            "/v1/chat/completions/",
            "//v1/chat//completions",
            "/v1/chat/%63ompletions",
            "/v1/./chat/x/../completions",
            "/v1%2Fchat%2Fcompletions",
        ] {
            assert_eq!(routed_path(p), Some("/v1/chat/completions"), "{p}");
        }
        assert_eq!(routed_path("/v1/messages/"), Some("/v1/messages"));
        assert_eq!(routed_path("/v1//embeddings"), Some("/v1/embeddings"));
        assert!(carries_prompt("/v1/responses") && !carries_prompt("/v1/embeddings"));
        for p in [
            "/v1/models",
            "/v1/chat/completionsx",
            "/v1/chat",
            "/%zz",
            "/",
        ] {
            assert_eq!(routed_path(p), None, "{p}");
        }
    }
}
