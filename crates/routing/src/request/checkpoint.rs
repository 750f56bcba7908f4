//! Checkpoints: where the parse of a long conversation stopped, so that its
//! next turn is read from there.
//!
//! An agent loop sends its whole conversation again on every turn, a few
//! hundred bytes longer. A body of at least [`MIN_BODY`] bytes with one
//! message list, read whole, leaves a checkpoint: the body itself (shared,
//! not copied), the offset just past its last message, the fields read
//! before the list, and the request's prefix chain (its canonical text
//! shared, its block hashes). A later body that starts with the same bytes
//! up to that offset is read from there: the walk resumes inside the message
//! list in the state it had at the offset, with the list's text, message
//! ends and block hashes known, and scans only the bytes after it. The
//! candidate is picked by the body's first [`HEAD`] bytes and the [`WINDOW`]
//! bytes before the offset, then compared byte for byte up to the offset,
//! not hashed: a crafted body cannot pass for another's. What a resumed walk
//! reads is what a walk from the start reads, and an error it meets is the
//! one a walk from the start meets (its state at the offset is the same; a
//! property test holds the two equal).
//!
//! A body whose `cache_salt` is set (or changed) after its list leaves none:
//! a checkpoint is found only by bodies with its bytes up to the list's end,
//! so one with a salt is found only by requests of that salt, and a resumed
//! parse's shorter time tells nothing across salts. A body naming a model no
//! replica serves leaves none either (see [`Checkpoints::serving`]): it is
//! answered 404 and would only push others out.
//!
//! The store holds at most `limits.max_checkpoint_bytes` (bodies counted by
//! their length, texts and hashes, and what a layer above keeps with a
//! checkpoint: see [`Turn`]), least recently used dropped first; the
//! checkpoint a longer turn resumed from is replaced by that turn's. It is
//! sharded by the hash of a body's head (every candidate for a body is in
//! one shard, keyed by that hash): a shard's lock is taken twice per long
//! body (to pick a candidate, to store), never held while a body is compared
//! or parsed nor while checkpoints are freed, and never with another's.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

use super::walk::{self, Mark};
use super::{Prompt, RequestError};
use crate::policy::{PrefixChain, Request};
use resume::{system_text, Left};

/// Bodies shorter than this parse in a few tens of µs: no checkpoint.
pub const MIN_BODY: usize = 32 << 10;
/// A candidate's body starts with the same this many bytes ...
const HEAD: usize = 256;
/// ... and has the same this many bytes before its offset.
const WINDOW: usize = 64;
/// What a checkpoint holds besides its body, text and hashes.
const OVERHEAD: usize = 256;
/// Shards of the store.
const SHARDS: usize = 16;
/// A trim takes the store this share of its budget below it (1/16).
const TRIM_SLACK: usize = 16;
/// What a trim leaves the store at most: no checkpoint larger is kept.
fn floor(budget: usize) -> usize {
    budget - budget / TRIM_SLACK
}

/// Whether some replica serves a model.
type Serves = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// The checkpoints of one router (see the module header).
pub struct Checkpoints {
    min_body: usize,
    shards: [Mutex<Shard>; SHARDS],
    /// Bytes held by every shard together.
    held: AtomicUsize,
    /// The clock of uses, for least-recently-used order across shards.
    tick: AtomicU64,
    /// Held by the one thread trimming the store to its budget.
    trimming: Mutex<()>,
    /// Requests naming a model this refuses leave no checkpoint.
    serves: Option<Serves>,
}

/// The checkpoints whose head hashes fall in one shard, by head hash, each
/// with the tick it was last used at.
#[derive(Default)]
struct Shard(HashMap<u64, Vec<(Arc<Checkpoint>, u64)>>);

impl Shard {
    /// The tick and head of each checkpoint.
    fn uses(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (self.0.iter()).flat_map(|(head, list)| list.iter().map(move |(_, t)| (*t, *head)))
    }
}

struct Checkpoint {
    body: Bytes,
    mark: Mark,
    /// `max_text_bytes` of its parse.
    max: usize,
    /// Its request's chain: the text is the `system` section's, then the
    /// list's (whole: nothing was cut), then any `prompt`.
    chain: PrefixChain,
    /// The `system` section's text length and message ends in `chain`.
    system_text: usize,
    system_ends: usize,
    bytes: usize,
    /// What a layer above keeps with it, and its bytes (see [`Turn`]).
    kept: OnceLock<(Kept, usize)>,
}

/// A value a layer above keeps with a checkpoint.
pub type Kept = Arc<dyn Any + Send + Sync>;

/// A checkpoint as the layers above see it: where its body's message list
/// ends, and what they keep with it ([`Checkpoints::keep_with`]; the
/// `exact` layer keeps the turn's tokens). A later body that resumed from
/// it has the same bytes up to [`Turn::list_end`].
#[derive(Clone)]
pub struct Turn {
    checkpoint: Arc<Checkpoint>,
    head: u64,
}

impl Turn {
    /// The offset just past its body's last message.
    pub fn list_end(&self) -> usize {
        self.checkpoint.mark.raw_len
    }

    /// What was kept with it, when it is a `T`.
    pub fn kept<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let (kept, _) = self.checkpoint.kept.get()?;
        Arc::clone(kept).downcast().ok()
    }
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn")
            .field("list_end", &self.list_end())
            .finish()
    }
}

/// Where a body is read from: the hash of its head, and the checkpoint
/// whose bytes it may start with (compared in full as it is read).
pub struct Start {
    head: u64,
    from: Option<Arc<Checkpoint>>,
    /// `from` covers the body: compared already.
    confirmed: bool,
}

impl Start {
    /// Compares `body` with the checkpoint found now rather than as it is
    /// read (forgetting the checkpoint if they differ): whether it covers
    /// the body.
    pub fn confirm(&mut self, body: &[u8]) -> bool {
        self.confirmed = self.from.as_ref().is_some_and(|c| c.covers(body));
        if !self.confirmed {
            self.from = None;
        }
        self.confirmed
    }

    /// The bytes of a body of `len` bytes left to read after the checkpoint.
    pub fn unread(&self, len: usize) -> usize {
        len - self.from.as_ref().map_or(0, |c| c.mark.raw_len)
    }
}

/// Where a checkpoint is stored: its body's head hash, its parse's text
/// cap, and the store's budget.
struct Keep {
    head: u64,
    max: usize,
    budget: usize,
}

/// A body read into the policy's view.
#[derive(Debug)]
pub struct Parsed {
    pub request: Request,
    pub turns: Turns,
}

/// The checkpoints of a body's parse.
#[derive(Debug, Clone, Default)]
pub struct Turns {
    /// The one it was read from (not from its first byte) ...
    pub from: Option<Turn>,
    /// ... and the one it left (none when its list ends where `from`'s did,
    /// or none was kept: see [`Checkpoints::parse`]).
    pub left: Option<Turn>,
}

impl Parsed {
    /// Read from a checkpoint, not from its first byte.
    pub fn resumed(&self) -> bool {
        self.turns.from.is_some()
    }
}

impl Default for Checkpoints {
    fn default() -> Self {
        Self::new()
    }
}

impl Checkpoints {
    pub fn new() -> Self {
        Self::with_min_body(MIN_BODY)
    }

    fn with_min_body(min_body: usize) -> Self {
        Self {
            min_body,
            shards: Default::default(),
            held: AtomicUsize::new(0),
            tick: AtomicU64::new(0),
            trimming: Mutex::new(()),
            serves: None,
        }
    }

    /// Checkpoints kept only for requests that name no model or one
    /// `serves` accepts (a request for another is refused before any replica
    /// sees it).
    pub fn serving(serves: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        Self {
            serves: Some(Box::new(serves)),
            ..Self::new()
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.held.load(Relaxed)
    }

    /// Reads a chat or messages body as [`Prompt::parse`] and
    /// [`Prompt::into_request`] do, from a checkpoint when one matches, and
    /// leaves one for the next turn, holding at most `budget` bytes in all.
    pub fn parse(
        &self,
        body: &Bytes,
        max: usize,
        block_bytes: usize,
        budget: usize,
        header_key: Option<&str>,
    ) -> Result<Parsed, RequestError> {
        let start = self.start(body, max, budget);
        self.parse_from(start, body, max, block_bytes, budget, header_key)
    }

    /// Where [`Checkpoints::parse`] would read `body` from: `None` when it
    /// keeps no checkpoint for it (too short, no budget).
    pub fn start(&self, body: &[u8], max: usize, budget: usize) -> Option<Start> {
        if self.held.load(Relaxed) > budget {
            // A reload lowered the budget.
            self.trim(budget);
        }
        if body.len() < self.min_body || budget == 0 {
            return None;
        }
        let head = xxh3_64(&body[..HEAD.min(body.len())]);
        let from = self.find(head, body, max);
        Some(Start {
            head,
            from,
            confirmed: false,
        })
    }

    /// [`Checkpoints::parse`] from `start`, found for this body.
    pub fn parse_from(
        &self,
        start: Option<Start>,
        body: &Bytes,
        max: usize,
        block_bytes: usize,
        budget: usize,
        header_key: Option<&str>,
    ) -> Result<Parsed, RequestError> {
        let Some(start) = start else {
            let prompt = Prompt::parse(body, max)?;
            return Ok(Parsed {
                request: prompt.into_request(block_bytes, header_key),
                turns: Turns::default(),
            });
        };
        let at = Keep {
            head: start.head,
            max,
            budget,
        };
        let confirmed = start.confirmed;
        let from = start.from.filter(|c| confirmed || c.covers(body));
        if let Some(from) = from {
            if let Some(resumed) = from.resume(body, max) {
                let resumed = resumed?;
                let (mut fields, mark) = (resumed.fields, resumed.mark);
                // The text up to the end of the list as it was, when the
                // `system` before it is the same and the list is the one
                // resumed: the checkpoint's chain holds it (shared, not
                // copied). Else the list's first bytes are put back.
                let known = resumed.continued && from.system_is(system_text(&fields));
                let skip = from.system_text + from.mark.list.text;
                // (The chain holds them: `resume` checked; else it is read whole.)
                let list = fields.messages.as_mut();
                if known || list.is_none_or(|l| from.give_back(l)) {
                    let known = known.then_some((&from.chain, skip));
                    let left = Left::of(&fields, mark);
                    let prompt = fields.assemble(max, known.map_or(0, |(_, n)| n));
                    let request = prompt.into_request_after(block_bytes, header_key, known);
                    let moved = left
                        .as_ref()
                        .is_none_or(|l| l.mark.raw_len != from.mark.raw_len);
                    let head = at.head;
                    let left = match moved {
                        true => self.keep(at, body, left, &request, Some(&from)),
                        false => None,
                    };
                    let from = Some(Turn {
                        checkpoint: from,
                        head,
                    });
                    return Ok(Parsed {
                        request,
                        turns: Turns { from, left },
                    });
                }
            }
        }
        let (fields, mark) = walk::read(body, max, true)?;
        let left = Left::of(&fields, mark);
        let request = fields
            .assemble(max, 0)
            .into_request(block_bytes, header_key);
        let left = self.keep(at, body, left, &request, None);
        Ok(Parsed {
            request,
            turns: Turns { from: None, left },
        })
    }

    /// Every checkpoint held (tests).
    #[cfg(test)]
    fn entries(&self) -> Vec<Arc<Checkpoint>> {
        (self.shards.iter())
            .flat_map(|s| {
                let shard = s.lock().unwrap_or_else(|e| e.into_inner());
                shard
                    .0
                    .values()
                    .flatten()
                    .map(|(c, _)| c.clone())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The shard of checkpoints whose head hashes to `head`, locked.
    fn lock(&self, head: u64) -> MutexGuard<'_, Shard> {
        self.shards[(head % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The checkpoint with the longest prefix of `body`, by its head and
    /// window (the caller compares the rest).
    fn find(&self, head: u64, body: &[u8], max: usize) -> Option<Arc<Checkpoint>> {
        let tick = self.tick.fetch_add(1, Relaxed) + 1;
        let mut shard = self.lock(head);
        let (found, used) = shard
            .0
            .get_mut(&head)?
            .iter_mut()
            .filter(|(c, _)| {
                let at = c.mark.raw_len;
                let window = at.saturating_sub(WINDOW)..at;
                c.max == max && at < body.len() && body.get(window.clone()) == c.body.get(window)
            })
            .max_by_key(|(c, _)| c.mark.raw_len)?;
        *used = tick;
        Some(found.clone())
    }

    /// Stores the checkpoint a parse left, in place of `from` (the one it
    /// resumed from) and of any other at the same offset with the same head
    /// and window (most likely the same bytes; at worst one dropped early).
    fn keep(
        &self,
        Keep { head, max, budget }: Keep,
        body: &Bytes,
        left: Option<Left>,
        request: &Request,
        from: Option<&Arc<Checkpoint>>,
    ) -> Option<Turn> {
        // A text cut at `max` is not the list's whole text; a list that ends
        // within the head would not be found by it.
        let whole = |l: &Left| request.chain.len() < max && l.mark.raw_len >= HEAD;
        let left = left.filter(whole)?;
        if let (Some(serves), Some(model)) = (&self.serves, &request.model) {
            if !serves(model) {
                return None;
            }
        }
        let chain = request.chain.clone();
        let bytes = body.len() + chain.heap_bytes() + left.mark.fields.heap_bytes() + OVERHEAD;
        let checkpoint = Arc::new(Checkpoint {
            body: body.clone(),
            max,
            chain,
            system_text: left.system_text,
            system_ends: left.system_ends,
            mark: left.mark,
            bytes,
            kept: OnceLock::new(),
        });
        // Larger than what a trim leaves: it would trim itself away.
        if checkpoint.bytes > floor(budget) {
            return None;
        }
        let at = checkpoint.mark.raw_len;
        let window = at.saturating_sub(WINDOW)..at;
        // The one it resumed from has the same head (it was found by it).
        let same = |c: &Checkpoint| {
            from.is_some_and(|f| std::ptr::eq(f.as_ref(), c))
                || (c.mark.raw_len == at && c.body.get(window.clone()) == body.get(window.clone()))
        };
        let tick = self.tick.fetch_add(1, Relaxed) + 1;
        let added = checkpoint.bytes;
        let mut shard = self.lock(head);
        let list = shard.0.entry(head).or_default();
        let mut gone = Vec::new();
        let mut i = 0;
        while i < list.len() {
            if same(&list[i].0) {
                gone.push(list.swap_remove(i).0);
            } else {
                i += 1;
            }
        }
        list.push((Arc::clone(&checkpoint), tick));
        let freed: usize = gone.iter().map(|c| c.held()).sum();
        // Under the shard's lock, so a trim never sees this one's bytes
        // before the checkpoint itself; one change, never a passing excess.
        if added >= freed {
            self.held.fetch_add(added - freed, Relaxed);
        } else {
            self.held.fetch_sub(freed - added, Relaxed);
        }
        drop(shard);
        // Freed (bodies, texts) after the lock is released.
        drop(gone);
        self.trim(budget);
        Some(Turn { checkpoint, head })
    }

    /// Keeps `value` with `turn`'s checkpoint while the store holds it,
    /// counted as `bytes` more against `budget`: false when it is no longer
    /// held, something was kept with it already, or the two would not fit
    /// what a trim leaves of the budget alone (they would displace every
    /// other, then themselves).
    pub fn keep_with(&self, turn: &Turn, value: Kept, bytes: usize, budget: usize) -> bool {
        if turn.checkpoint.bytes + bytes > floor(budget) {
            return false;
        }
        let shard = self.lock(turn.head);
        let held = (shard.0.get(&turn.head))
            .is_some_and(|list| list.iter().any(|(c, _)| Arc::ptr_eq(c, &turn.checkpoint)));
        // Under the shard's lock: a checkpoint is dropped under it too, and
        // its bytes then counted with what it keeps.
        let kept = held && turn.checkpoint.kept.set((value, bytes)).is_ok();
        if kept {
            self.held.fetch_add(bytes, Relaxed);
        }
        drop(shard);
        self.trim(budget);
        kept
    }

    /// Drops the least recently used checkpoints (over every shard) when
    /// the store is over `budget`, until it holds at most
    /// `budget - budget / TRIM_SLACK`: the slack spares the next turns a
    /// trim each (a full store of 40 KiB turns, trimmed to its budget
    /// exactly, read and sorted every checkpoint's use on every request).
    /// One thread trims at a time (others go on: the one trimming brings
    /// the store under its budget); it reads every shard's uses once, one
    /// shard's lock at a time, then takes the oldest out in order.
    fn trim(&self, budget: usize) {
        if self.held.load(Relaxed) <= budget {
            return;
        }
        let Ok(_one) = self.trimming.try_lock() else {
            return;
        };
        let floor = floor(budget);
        while self.held.load(Relaxed) > floor {
            let mut uses: Vec<(u64, u64)> = Vec::new();
            for shard in &self.shards {
                let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
                uses.extend(shard.uses());
            }
            if uses.is_empty() {
                return;
            }
            uses.sort_unstable();
            for (tick, head) in uses {
                if self.held.load(Relaxed) <= floor {
                    return;
                }
                let mut shard = self.lock(head);
                let Some(list) = shard.0.get_mut(&head) else {
                    continue;
                };
                // Used again since it was read: no longer the oldest.
                let Some(i) = list.iter().position(|(_, t)| *t == tick) else {
                    continue;
                };
                let (gone, _) = list.swap_remove(i);
                if list.is_empty() {
                    shard.0.remove(&head);
                }
                self.held.fetch_sub(gone.held(), Relaxed);
                drop(shard);
                drop(gone);
            }
        }
    }
}

impl Checkpoint {
    /// Bytes it holds, with what is kept with it.
    fn held(&self) -> usize {
        self.bytes + self.kept.get().map_or(0, |(_, b)| *b)
    }
}

mod resume;
#[cfg(test)]
mod tests;
