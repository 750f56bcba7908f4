//! Long prompts as the router reads them: bodies of 32 KiB and more parsed
//! from their first byte or from a checkpoint, the bytes the checkpoints
//! hold, and chat prompts tokenized for token-exact placement.

use super::family::{IntCounter, IntGauge, Register};

pub struct PromptMetrics {
    /// Chat and messages bodies of 32 KiB and more read from their first
    /// byte, and from a checkpoint; bytes the checkpoints hold.
    long_parses: [IntCounter; 2],
    checkpoint_bytes: IntGauge,
    /// Chat prompts tokenized for token-exact placement: rendered whole,
    /// and continued from their conversation's earlier turn.
    chat_prompts: [IntCounter; 2],
}

impl PromptMetrics {
    pub fn new(r: &mut Register) -> Self {
        Self {
            long_parses: {
                let v = r.counter_vec("prefix_router_long_body_parses_total", "Chat and messages bodies of 32 KiB and more read into a prompt, from their first byte (from=start) or from where an earlier turn of the conversation ended (from=checkpoint)", &["from"]);
                ["start", "checkpoint"].map(|from| v.with_label_values(&[from]))
            },
            chat_prompts: {
                let v = r.counter_vec("prefix_router_chat_prompts_tokenized_total", "Chat prompts tokenized for token-exact placement (tokenizers): the chat template rendered and the text tokenized from the start (from=start), or only the messages after those of the conversation's earlier turn, whose tokens were kept with its checkpoint (from=turn)", &["from"]);
                ["start", "turn"].map(|from| v.with_label_values(&[from]))
            },
            checkpoint_bytes: r.gauge("prefix_router_checkpoint_bytes", "Bytes held by checkpoints of long conversations' latest turns, with the tokens of their turns kept with them (bounded by limits.max_checkpoint_bytes)"),
        }
    }

    /// Counts a chat prompt tokenized: from the start, or `continued` from
    /// its conversation's earlier turn.
    pub fn chat_prompt(&self, continued: bool) {
        self.chat_prompts[usize::from(continued)].inc();
    }

    /// Counts a long body read, and what the checkpoints now hold.
    pub fn long_parse(&self, resumed: bool, checkpoint_bytes: usize) {
        self.long_parses[usize::from(resumed)].inc();
        self.checkpoint_bytes
            .set(i64::try_from(checkpoint_bytes).unwrap_or(i64::MAX));
    }
}
