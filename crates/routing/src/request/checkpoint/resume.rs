//! A body read from a checkpoint: what the checkpoint's walk resumes from
//! and gives back, and what a parse leaves for the next checkpoint.

use super::Checkpoint;
use crate::request::walk::{self, Mark};
use crate::request::{Fields, JsonError, Section};

impl Checkpoint {
    /// Whether its chain starts with this `system` text.
    pub(super) fn system_is(&self, system: &[u8]) -> bool {
        let text = self.chain.text.get(0..self.system_text);
        text.is_some_and(|t| *t == *system)
    }

    /// Puts back in front of a message list read from here (unless another
    /// list replaced it) the bytes it had here, which its chain holds; false
    /// when the chain no longer holds them (the body is then read whole).
    pub(super) fn give_back(&self, list: &mut Section) -> bool {
        let start = self.system_text;
        if list.base == 0 {
            return true;
        }
        let Some(had) = self.chain.text.get(start..start + list.base) else {
            return false;
        };
        list.text.splice(0..0, had.iter().copied());
        list.base = 0;
        true
    }

    /// Whether `body` starts with the same bytes up to this checkpoint.
    pub(super) fn covers(&self, body: &[u8]) -> bool {
        let at = self.mark.raw_len;
        body.get(..at) == self.body.get(..at)
    }

    /// Reads a body it covers from this checkpoint. An error is the body's,
    /// the one a walk from its first byte meets (its state at the offset is
    /// the same).
    pub(super) fn resume(
        &self,
        body: &[u8],
        max: usize,
    ) -> Option<Result<walk::Resumed, JsonError>> {
        let at = self.mark.raw_len;
        let shape = self.mark.list;
        let start = self.system_text;
        if start + shape.text > self.chain.len() {
            return None;
        }
        let ends = self
            .chain
            .message_ends
            .get(self.system_ends..self.system_ends + shape.ends)?;
        // The list's bytes so far stay in the chain (its `base`); room for
        // the rest, as a parse from the start reserves.
        let list = Section {
            text: Vec::with_capacity((body.len() - at).min(max) + 32),
            base: shape.text,
            message_ends: ends.iter().map(|e| e - start).collect(),
            model_turn: shape.model_turn,
            root_end: shape.root_end,
            messages: shape.messages,
        };
        Some(walk::resume(body, max, &self.mark, list))
    }
}

/// The `system` section's text, if any.
pub(super) fn system_text(fields: &Fields) -> &[u8] {
    fields.system.as_ref().map_or(&[], |s| &s.text)
}

/// What a parse leaves for a checkpoint: its mark, and where the `system`
/// section put the list in the text.
pub(super) struct Left {
    pub(super) mark: Mark,
    pub(super) system_text: usize,
    pub(super) system_ends: usize,
}

impl Left {
    /// `None` also when the salt was set or changed after the list: a
    /// checkpoint is only found by bodies with its bytes up to the list's end,
    /// so one with a salt is found only by requests of that salt.
    pub(super) fn of(fields: &Fields, mark: Option<Mark>) -> Option<Self> {
        let mark = mark?;
        let before = &mark.fields;
        if fields.salt != before.salt || fields.odd_salt != before.odd_salt {
            return None;
        }
        let system = fields.system.as_ref();
        Some(Left {
            mark,
            system_text: system.map_or(0, |s| s.text.len()),
            system_ends: system.map_or(0, |s| s.message_ends.len()),
        })
    }
}
