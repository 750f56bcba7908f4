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
//! found by a probe at load and tokenized whole.
#![forbid(unsafe_code)]

pub mod pieces;
pub mod template;

use std::path::Path;

pub use pieces::{Partial, Pieces};
pub use template::ChatTemplate;

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("{path}: {why}")]
    Load { path: String, why: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

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
        Ok(self.chat(body)?.ids)
    }

    /// As [`ModelTokens::chat_ids`], with the body's `cache_salt` (engines
    /// key its blocks by it beside the tokens).
    pub fn chat(&self, body: &[u8]) -> Result<Chat, TokensError> {
        let prompt = self.render(body)?;
        let ids = self.pieces.encode(&prompt.text)?;
        Ok(Chat {
            total: ids.len(),
            ids,
            salt: prompt.salt,
        })
    }

    /// A chat request's prompt text and `cache_salt`.
    pub fn render(&self, body: &[u8]) -> Result<Rendered, TokensError> {
        let body = template::parse_body(body)?;
        let salt = (body.get_attr("cache_salt").ok()).and_then(|v| v.as_str().map(str::to_owned));
        let text = self.template.render_value(&body)?;
        Ok(Rendered { text, salt })
    }
}

/// A chat request's prompt, rendered by its template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub salt: Option<String>,
}

/// A chat request's prompt as its engine tokenizes it: its first `ids`
/// (all of them unless tokenizing stopped early, see
/// [`Pieces::encode_while`]), of about `total`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chat {
    pub ids: Vec<u32>,
    pub total: usize,
    pub salt: Option<String>,
}
