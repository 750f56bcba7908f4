//! What a 64-byte block of a JSON body holds, found with SSE2 compares (through
//! `safe_arch`, no `unsafe` here) and a byte-at-a-time fallback on other
//! architectures (the SSE2 versions' test oracle): quotes, backslashes,
//! control and non-ASCII bytes, escape letters, brackets; which bytes a
//! backslash escapes (simdjson's branchless scan, with a carry across blocks);
//! and which are inside strings.

/// Whether `e` after a `\` makes an escape of the canonical form.
pub(super) const fn canonical_escape(e: u8) -> bool {
    matches!(e, b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't')
}

/// Bit `i` set where byte `i` of a 64-byte block is `"`, `\`, a control byte,
/// or non-ASCII.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Masks {
    pub(super) quote: u64,
    pub(super) backslash: u64,
    pub(super) control: u64,
    pub(super) high: u64,
}

/// Sixteen bytes per SSE2 compare, gathered by `movemask`; control and
/// non-ASCII bytes (rare in a JSON body) are located only in a block that
/// has one.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
pub(super) fn classify(block: &[u8; 64]) -> Masks {
    use safe_arch::{
        bitor_m128i as or, cmp_eq_mask_i8_m128i as eq, load_unaligned_m128i, min_u8_m128i,
        move_mask_i8_m128i as bits, set_splat_i8_m128i as splat,
    };
    let (quote, backslash, unit_separator) = (splat(b'"' as i8), splat(b'\\' as i8), splat(0x1f));
    let control = |v| eq(min_u8_m128i(v, unit_separator), v);
    let mut m = Masks::default();
    let (chunks, _) = block.as_chunks::<16>();
    let at = |i: usize, mask: i32| u64::from(mask as u16) << (16 * i);
    let mut unusual = splat(0);
    for (i, chunk) in chunks.iter().enumerate() {
        let v = load_unaligned_m128i(chunk);
        m.quote |= at(i, bits(eq(v, quote)));
        m.backslash |= at(i, bits(eq(v, backslash)));
        // A control byte's flag and a non-ASCII byte both have the top bit.
        unusual = or(unusual, or(control(v), v));
    }
    if bits(unusual) != 0 {
        for (i, chunk) in chunks.iter().enumerate() {
            let v = load_unaligned_m128i(chunk);
            m.control |= at(i, bits(control(v)));
            m.high |= at(i, bits(v));
        }
    }
    m
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
pub(super) fn classify(block: &[u8; 64]) -> Masks {
    classify_bytes(block)
}

/// A byte at a time: the other architectures, and the SSE2 version's oracle.
#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "sse2", not(test)),
    allow(dead_code)
)]
fn classify_bytes(block: &[u8; 64]) -> Masks {
    let mut m = Masks::default();
    for (i, &b) in block.iter().enumerate() {
        m.quote |= u64::from(b == b'"') << i;
        m.backslash |= u64::from(b == b'\\') << i;
        m.control |= u64::from(b < 0x20) << i;
        m.high |= u64::from(b >= 0x80) << i;
    }
    m
}

/// `f` of the 64-byte block at `at`; past the end the input reads as `"`
/// bytes, which the caller finds are not there.
#[inline(always)]
pub(super) fn block<R>(bytes: &[u8], at: usize, f: impl Fn(&[u8; 64]) -> R) -> R {
    match bytes.get(at..).and_then(|s| s.first_chunk::<64>()) {
        Some(block) => f(block),
        None => {
            let mut pad = [b'"'; 64];
            for (d, s) in pad.iter_mut().zip(bytes.get(at..).unwrap_or_default()) {
                *d = *s;
            }
            f(&pad)
        }
    }
}

/// Bit `i` set where byte `i` is `n`: with the quotes and backslashes
/// [`classify`] finds, the letters of the escapes most text has (`\n`, `\"`,
/// `\\`), one compare, so a block needs [`letters`] only for any other.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
pub(super) fn letter_n(block: &[u8; 64]) -> u64 {
    use safe_arch::{
        cmp_eq_mask_i8_m128i as eq, load_unaligned_m128i, move_mask_i8_m128i as bits,
        set_splat_i8_m128i as splat,
    };
    let n = splat(b'n' as i8);
    let (chunks, _) = block.as_chunks::<16>();
    chunks.iter().enumerate().fold(0, |mask, (i, chunk)| {
        mask | u64::from(bits(eq(load_unaligned_m128i(chunk), n)) as u16) << (16 * i)
    })
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
pub(super) fn letter_n(block: &[u8; 64]) -> u64 {
    letter_n_bytes(block)
}

#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "sse2", not(test)),
    allow(dead_code)
)]
fn letter_n_bytes(block: &[u8; 64]) -> u64 {
    let hits = block.iter().enumerate();
    hits.fold(0, |m, (i, &b)| m | u64::from(b == b'n') << i)
}

/// Bit `i` set where byte `i` is the letter of a canonical escape.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
pub(super) fn letters(block: &[u8; 64]) -> u64 {
    use safe_arch::{
        bitor_m128i as or, cmp_eq_mask_i8_m128i as eq, load_unaligned_m128i,
        move_mask_i8_m128i as bits, set_splat_i8_m128i as splat,
    };
    let want = [b'"', b'\\', b'b', b'f', b'n', b'r', b't'].map(|c| splat(c as i8));
    let mut mask = 0;
    let (chunks, _) = block.as_chunks::<16>();
    for (i, chunk) in chunks.iter().enumerate() {
        let v = load_unaligned_m128i(chunk);
        let hit = want
            .iter()
            .fold(eq(v, want[0]), |acc, &c| or(acc, eq(v, c)));
        mask |= u64::from(bits(hit) as u16) << (16 * i);
    }
    mask
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
pub(super) fn letters(block: &[u8; 64]) -> u64 {
    letters_bytes(block)
}

#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "sse2", not(test)),
    allow(dead_code)
)]
fn letters_bytes(block: &[u8; 64]) -> u64 {
    let hits = block.iter().enumerate();
    hits.fold(0, |m, (i, &b)| m | u64::from(canonical_escape(b)) << i)
}

/// Bit `i` set where byte `i` of a 64-byte block is `"`, `\`, an opening
/// bracket (`[`, `{`) or a closing one.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Brackets {
    pub(super) quote: u64,
    pub(super) backslash: u64,
    pub(super) open: u64,
    pub(super) close: u64,
}

#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
pub(super) fn brackets(block: &[u8; 64]) -> Brackets {
    use safe_arch::{
        bitor_m128i as or, cmp_eq_mask_i8_m128i as eq, load_unaligned_m128i,
        move_mask_i8_m128i as bits, set_splat_i8_m128i as splat,
    };
    // `[` and `{`, `]` and `}`, differ only in bit 5.
    let [quote, backslash, bit5, open, close] =
        [b'"', b'\\', 0x20, b'{', b'}'].map(|c| splat(c as i8));
    let mut m = Brackets::default();
    let (chunks, _) = block.as_chunks::<16>();
    for (i, chunk) in chunks.iter().enumerate() {
        let v = load_unaligned_m128i(chunk);
        let at = |mask: i32| u64::from(mask as u16) << (16 * i);
        let folded = or(v, bit5);
        m.quote |= at(bits(eq(v, quote)));
        m.backslash |= at(bits(eq(v, backslash)));
        m.open |= at(bits(eq(folded, open)));
        m.close |= at(bits(eq(folded, close)));
    }
    m
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
pub(super) fn brackets(block: &[u8; 64]) -> Brackets {
    brackets_bytes(block)
}

#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "sse2", not(test)),
    allow(dead_code)
)]
fn brackets_bytes(block: &[u8; 64]) -> Brackets {
    let mut m = Brackets::default();
    for (i, &b) in block.iter().enumerate() {
        m.quote |= u64::from(b == b'"') << i;
        m.backslash |= u64::from(b == b'\\') << i;
        m.open |= u64::from(matches!(b, b'[' | b'{')) << i;
        m.close |= u64::from(matches!(b, b']' | b'}')) << i;
    }
    m
}

/// Bit `i` is the parity of the bits at and below `i`: over the quotes of a
/// block, the bytes from an opening quote up to its closing one.
#[inline(always)]
pub(super) fn prefix_xor(mut x: u64) -> u64 {
    for shift in [1, 2, 4, 8, 16, 32] {
        x ^= x << shift;
    }
    x
}

/// The length of a string starting at `at` that ends (`"`) within 16 bytes
/// with only plain ASCII before its end: no escape, no control byte. Keys,
/// roles and ids are such strings, of many lengths: one compare of 16 bytes,
/// no loop whose exit is mispredicted.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
pub(super) fn short_plain(bytes: &[u8], at: usize) -> Option<usize> {
    use safe_arch::{
        bitor_m128i as or, cmp_eq_mask_i8_m128i as eq, load_unaligned_m128i, min_u8_m128i,
        move_mask_i8_m128i as bits, set_splat_i8_m128i as splat,
    };
    let Some(chunk) = bytes.get(at..).and_then(|s| s.first_chunk::<16>()) else {
        return short_plain_bytes(bytes, at);
    };
    let v = load_unaligned_m128i(chunk);
    let quote = bits(eq(v, splat(b'"' as i8))) as u32 | 1 << 16;
    // A control byte's flag and a non-ASCII byte both have the top bit.
    let control = eq(min_u8_m128i(v, splat(0x1f)), v);
    let unusual = bits(or(eq(v, splat(b'\\' as i8)), or(control, v))) as u32;
    let end = quote.trailing_zeros();
    (end < 16 && unusual & ((1 << end) - 1) == 0).then_some(end as usize)
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
pub(super) fn short_plain(bytes: &[u8], at: usize) -> Option<usize> {
    short_plain_bytes(bytes, at)
}

/// A byte at a time: near the end of the input, other architectures, and
/// the SSE2 version's oracle.
#[inline(always)]
fn short_plain_bytes(bytes: &[u8], at: usize) -> Option<usize> {
    let window = bytes.get(at..).unwrap_or_default().iter().take(16);
    for (i, &b) in window.enumerate() {
        if b == b'"' {
            return Some(i);
        }
        if b == b'\\' || !(0x20..0x80).contains(&b) {
            return None;
        }
    }
    None
}

/// Bits of the bytes a `\` escapes (the second of each pair in a run of
/// backslashes); `carry` says whether the block before ended in an unpaired
/// one, and is updated for the next (simdjson's branchless scan).
#[inline(always)]
pub(super) fn escaped(backslash: u64, carry: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    let backslash = backslash & !*carry;
    let follows = backslash << 1 | *carry;
    let odd_starts = backslash & !EVEN & !follows;
    let (even_starts, overflow) = odd_starts.overflowing_add(backslash);
    *carry = u64::from(overflow);
    (EVEN ^ (even_starts << 1)) & follows
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The bytes a `\` escapes, one at a time.
    fn escaped_naive(bytes: &[u8]) -> Vec<bool> {
        let mut out = vec![false; bytes.len()];
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'\\' {
                if let Some(e) = out.get_mut(i + 1) {
                    *e = true;
                }
                i += 2;
            } else {
                i += 1;
            }
        }
        out
    }

    #[test]
    fn short_strings_agree_at_every_end_with_every_byte_before_and_after_it() {
        for end in 0..=17 {
            for at in 0..=17 {
                for b in 0..=255u8 {
                    let mut bytes = [b'a'; 20];
                    if let Some(q) = bytes.get_mut(end) {
                        *q = b'"';
                    }
                    bytes[at] = b;
                    assert_eq!(
                        short_plain(&bytes, 0),
                        short_plain_bytes(&bytes, 0),
                        "quote at {end}, byte {b:#x} at {at}"
                    );
                }
            }
        }
    }

    proptest! {
        #[test]
        fn sse2_and_bytewise_classification_agree(block in prop::array::uniform32(any::<u8>()), tail in prop::array::uniform32(any::<u8>())) {
            let mut all = [0u8; 64];
            all[..32].copy_from_slice(&block);
            all[32..].copy_from_slice(&tail);
            all[7] = b'n';
            all[40] = b't';
            all[9] = b'[';
            all[50] = b'}';
            prop_assert_eq!(classify(&all), classify_bytes(&all));
            prop_assert_eq!(letters(&all), letters_bytes(&all));
            prop_assert_eq!(letter_n(&all), letter_n_bytes(&all));
            prop_assert_eq!(brackets(&all), brackets_bytes(&all));
        }

        #[test]
        fn sse2_and_bytewise_short_strings_agree(
            bytes in prop::collection::vec(prop::sample::select(vec![b'a', b'"', b'\\', 0x1f, 0x20, 0x7f, 0x80, 0xff]), 0..60),
            at in 0usize..24,
        ) {
            prop_assert_eq!(short_plain(&bytes, at), short_plain_bytes(&bytes, at));
        }

        #[test]
        fn backslash_runs_escape_across_blocks(
            bytes in prop::collection::vec(prop::sample::select(vec![b'\\', b'\\', b'a', b'"']), 0..400)
        ) {
            let want = escaped_naive(&bytes);
            let mut carry = 0;
            for (k, chunk) in bytes.chunks(64).enumerate() {
                let mut block = [b'a'; 64];
                block[..chunk.len()].copy_from_slice(chunk);
                let got = escaped(classify_bytes(&block).backslash, &mut carry);
                for (i, &w) in want[64 * k..64 * k + chunk.len()].iter().enumerate() {
                    prop_assert_eq!(got >> i & 1 == 1, w, "byte {}", 64 * k + i);
                }
            }
        }
    }
}
