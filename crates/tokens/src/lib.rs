//! A model's prompt as its engine sees it, for matching the engine's KV
//! events token for token: its chat template rendered ([`template`]) and
//! the text tokenized ([`pieces`]) from the model's own `tokenizer.json` and
//! `tokenizer_config.json` (a directory as Hugging Face ships it; never a
//! download at run time).
//!
//! Tokenizing is done piece by piece between special tokens (chat templates
//! put them at every message boundary), each piece's ids kept in a bounded
//! cache: a conversation's next turn tokenizes only its new text. That is
//! what `tokenizers` itself does inside (it splits at added tokens first and
//! never merges across them); a tokenizer for which the pieces would not
//! give the same ids as the whole text (added tokens that strip spaces or
//! are normalized, a pre-tokenizer that treats the text's start apart) is
//! found by a probe at load and tokenized whole. A byte-level BPE's pieces
//! are turned into ids by [`bpe`], `tokenizers`' own steps without its
//! `Encoding`, where probes at load give `tokenizers`' ids.
#![forbid(unsafe_code)]

pub mod bpe;
pub mod pieces;
pub mod template;
pub mod turn;

use std::path::Path;

pub use pieces::{Deferred, Partial, Pieces};
pub use template::{ChatTemplate, Window};
pub use turn::{Earlier, Prompt};

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("{path}: {why}")]
    Load { path: String, why: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenize(String),
    /// The engine builds this request's prompt in a way not rendered here.
    #[error("not rendered here: {0}")]
    Unsupported(&'static str),
}

/// Request fields that make the engine's prompt (or its cache keys) other
/// than this crate renders: another template, a salt engines key blocks by
/// apart from the tokens, a continued final message, RAG documents.
const NOT_RENDERED: [&str; 5] = [
    "chat_template",
    "cache_salt",
    "continue_final_message",
    "documents",
    "mm_processor_kwargs",
];

/// One model's template and tokenizer.
pub struct ModelTokens {
    pub template: ChatTemplate,
    pub pieces: Pieces,
}

impl ModelTokens {
    /// Reads `dir/tokenizer.json` and `dir/tokenizer_config.json`; the
    /// cache holds at most `cache_ids` token ids.
    pub fn load(dir: &Path, cache_ids: usize) -> Result<Self, TokensError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = std::fs::read_to_string(&config_path).map_err(|e| TokensError::Load {
            path: config_path.display().to_string(),
            why: e.to_string(),
        })?;
        let config: serde_json::Value =
            serde_json::from_str(&config).map_err(|e| TokensError::Load {
                path: config_path.display().to_string(),
                why: e.to_string(),
            })?;
        let template = ChatTemplate::from_config(&config)?;
        let pieces = Pieces::load(&dir.join("tokenizer.json"), cache_ids)?;
        Ok(Self { template, pieces })
    }

    /// The token ids of a chat request's prompt (its JSON body: `messages`,
    /// `tools`, `chat_template_kwargs`), the generation prompt added.
    pub fn chat_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokensError> {
        self.pieces.encode(&self.render(body)?)
    }

    /// A chat request's prompt text, as the engine builds it. A request
    /// naming a field this crate does not render (see [`NOT_RENDERED`]), or
    /// `add_generation_prompt: false`, or with a content part other than
    /// text (an image: the engine adds its own placeholder tokens) is
    /// [`TokensError::Unsupported`].
    pub fn render(&self, body: &[u8]) -> Result<String, TokensError> {
        self.template.render_value(&self.checked(body)?)
    }

    /// A chat request's body parsed, when this crate renders its prompt as
    /// the engine does (see [`ModelTokens::render`]).
    fn checked(&self, body: &[u8]) -> Result<minijinja::Value, TokensError> {
        let body = template::parse_body(body)?;
        let set = |k: &str| {
            body.get_attr(k)
                .is_ok_and(|v| !v.is_undefined() && !v.is_none())
        };
        if let Some(field) = NOT_RENDERED.into_iter().find(|k| set(k)) {
            return Err(TokensError::Unsupported(field));
        }
        let generation = body.get_attr("add_generation_prompt").unwrap_or_default();
        if generation.kind() == minijinja::value::ValueKind::Bool && !generation.is_true() {
            return Err(TokensError::Unsupported("add_generation_prompt"));
        }
        Ok(body)
    }
}
