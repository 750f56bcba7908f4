//! Which request paths the router reads the body of, after the normalisation
//! an engine's HTTP server may apply, so no spelling of a routed path skips
//! the body limit or placement: the prompt paths (OpenAI's and Anthropic's,
//! and the engines' native generation paths: placed by prompt and model),
//! and the engines' other JSON paths (placed by model only).

/// A routed request: the path it is forwarded as, and how its body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Chat completions, completions, Anthropic messages: a prompt (a long
    /// one read from its conversation's checkpoint).
    Prompt(&'static str),
    /// OpenAI's Responses API: a prompt, read by `request::responses`.
    Responses,
    /// A JSON body of vLLM or SGLang read for its `model` only (spread
    /// within the model's replicas).
    Model(&'static str),
    /// A multipart form (audio), read for its `model` field.
    Form(&'static str),
}

impl Route {
    /// The path it is forwarded as.
    pub fn path(self) -> &'static str {
        match self {
            Route::Prompt(p) | Route::Model(p) | Route::Form(p) => p,
            Route::Responses => "/v1/responses",
        }
    }

    /// Its body carries a prompt (else only its `model` is read).
    pub fn carries_prompt(self) -> bool {
        matches!(self, Route::Prompt(_) | Route::Responses)
    }
}

/// Every routed path.
const ROUTES: [Route; 20] = [
    Route::Prompt("/v1/chat/completions"),
    Route::Prompt("/v1/completions"),
    Route::Prompt("/v1/messages"),
    // The engines' native generation paths, placed by prompt alike:
    // llama.cpp's `/completion` (and its `/completions`, `/chat/completions`
    // aliases), SGLang's `/generate` (`text` or `input_ids`), and vLLM's
    // SageMaker `/invocations` (a chat or completions body).
    Route::Prompt("/completion"),
    Route::Prompt("/completions"),
    Route::Prompt("/chat/completions"),
    Route::Prompt("/generate"),
    Route::Prompt("/invocations"),
    Route::Responses,
    Route::Model("/v1/embeddings"),
    Route::Model("/v1/rerank"),
    Route::Model("/v2/rerank"),
    Route::Model("/rerank"),
    Route::Model("/v1/score"),
    Route::Model("/score"),
    Route::Model("/tokenize"),
    Route::Model("/detokenize"),
    Route::Model("/pooling"),
    Route::Form("/v1/audio/transcriptions"),
    Route::Form("/v1/audio/translations"),
];

/// The response id a `GET`/`DELETE /v1/responses/{id}` (or a sub-path such
/// as `/input_items` or `/cancel`) names.
pub fn response_id(path: &str) -> Option<&str> {
    let id = path.strip_prefix("/v1/responses/")?;
    let id = id.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// The route `path` (without query) names, if any, after the normalisation
/// an engine's HTTP server may apply: percent-decoding, empty and `.`
/// segments dropped, `..` applied, a trailing slash ignored. So
/// `/v1//chat/%63ompletions/` is routed (size limit, placement) like
/// `/v1/chat/completions`, and is forwarded as that.
pub fn route(path: &str) -> Option<Route> {
    if let Some(r) = ROUTES.iter().find(|r| r.path() == path) {
        return Some(*r);
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
    ROUTES.iter().copied().find(|r| {
        let mut want = r.path().split('/').filter(|s| !s.is_empty());
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
            assert_eq!(route(p), Some(Route::Prompt("/v1/chat/completions")), "{p}");
        }
        assert_eq!(route("/v1/messages/"), Some(Route::Prompt("/v1/messages")));
        for native in [
            "/completion",
            "/generate",
            "/invocations",
            "/chat/completions",
        ] {
            assert!(route(native).is_some_and(Route::carries_prompt), "{native}");
        }
        assert_eq!(
            route("/v1//embeddings"),
            Some(Route::Model("/v1/embeddings"))
        );
        assert_eq!(route("/v1/responses/"), Some(Route::Responses));
        assert_eq!(
            route("/v1/audio//translations"),
            Some(Route::Form("/v1/audio/translations"))
        );
        assert!(
            Route::Responses.carries_prompt() && !Route::Model("/v1/embeddings").carries_prompt()
        );
        for p in [
            "/v1/models",
            "/v1/chat/completionsx",
            "/v1/chat",
            "/%zz",
            "/",
        ] {
            assert_eq!(route(p), None, "{p}");
        }
    }

    proptest::proptest! {
        /// Any path is looked up without a panic, and a routed path written
        /// another way (doubled slashes, `.` segments, percent escapes, a
        /// trailing slash) is routed as it.
        #[test]
        fn spellings_of_a_routed_path_route_as_it(
            any in "\\PC{0,80}",
            which in 0usize..ROUTES.len(),
            edits in proptest::collection::vec((0u8..4, 0usize..64), 0..6),
        ) {
            let _ = route(&any);
            let want = ROUTES[which];
            let mut p = want.path().to_owned();
            for (kind, at) in edits {
                let slashes: Vec<usize> = p.match_indices('/').map(|(i, _)| i).collect();
                let slash = slashes[at % slashes.len()];
                match kind {
                    0 => p.insert(slash, '/'),
                    1 => p.insert_str(slash + 1, "./"),
                    2 => {
                        let letters: Vec<usize> = p
                            .char_indices()
                            .filter(|(_, c)| c.is_ascii_lowercase())
                            .map(|(i, _)| i)
                            .collect();
                        if let Some(i) = letters.get(at % letters.len().max(1)) {
                            let c = p.as_bytes()[*i];
                            p.replace_range(*i..*i + 1, &format!("%{c:02X}"));
                        }
                    }
                    _ => p.push('/'),
                }
            }
            proptest::prop_assert_eq!(route(&p), Some(want), "{}", p);
        }
    }
}
