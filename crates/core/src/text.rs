//! The one check that a name is not a look-alike of another: every validated name newtype
//! ([`crate::PerspectiveName`], [`crate::AggregateType`]) runs it, so two names that print
//! alike are never two different names.
//!
//! A name is refused when it begins or ends with whitespace (`Seq ` prints like `Seq`), when
//! it contains a control character (Unicode general category Cc: a newline, a tab, DEL), a
//! format character (Cf: U+200B ZERO WIDTH SPACE, U+200E LEFT-TO-RIGHT MARK, U+2060 WORD
//! JOINER, U+FEFF, the bidirectional overrides) or whitespace other than a plain space
//! (U+00A0 NO-BREAK SPACE prints like U+0020), and when it is not in Unicode normalization form
//! C (`Café` with a combining accent, NFD, prints like the precomposed `Café`). Refusing rather
//! than normalising keeps a name exactly as given: what is stored, listed and typed on the
//! command line is the text the caller wrote.

use unicode_normalization::is_nfc;
use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};

use crate::error::{Result, ValidationError};

/// Checks that `value`, the `field` of a name, is not a look-alike (see the
/// [module docs](self)). Run after the blank, length and NUL checks of the name.
pub(crate) fn check_unambiguous(field: &'static str, value: &str) -> Result<()> {
    let first_or_last = [value.chars().next(), value.chars().next_back()];
    if first_or_last.into_iter().flatten().any(char::is_whitespace) {
        return Err(ValidationError::SurroundingWhitespace { field }.into());
    }
    if let Some(character) = value.chars().find(|&c| look_alike(c)) {
        return Err(ValidationError::LookAlikeCharacter { field, character }.into());
    }
    if !is_nfc(value) {
        return Err(ValidationError::NotNfc { field }.into());
    }
    Ok(())
}

/// A character that prints as nothing, or like another character.
fn look_alike(c: char) -> bool {
    matches!(
        c.general_category(),
        GeneralCategory::Control | GeneralCategory::Format
    ) || (c.is_whitespace() && c != ' ')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    #[test]
    fn every_look_alike_is_refused_and_plain_names_pass() {
        let space = |field| Err(ValidationError::SurroundingWhitespace { field });
        let hidden =
            |field, character| Err(ValidationError::LookAlikeCharacter { field, character });
        let f = "name";
        let cases: &[(&str, std::result::Result<(), ValidationError>)] = &[
            ("Seq", Ok(())),
            ("Order View", Ok(())),
            ("Café", Ok(())),
            ("Straße-Übersicht 2", Ok(())),
            ("注文一覧", Ok(())),
            ("Seq ", space(f)),
            (" Seq", space(f)),
            ("Seq\n", space(f)),
            ("\tSeq", space(f)),
            ("Seq\u{3000}", space(f)),
            ("Seq\u{a0}", space(f)),
            ("Seq\u{200B}", hidden(f, '\u{200B}')),
            ("\u{200B}Seq", hidden(f, '\u{200B}')),
            ("Se\u{200E}q", hidden(f, '\u{200E}')),
            ("\u{FEFF}Seq", hidden(f, '\u{FEFF}')),
            ("Seq\u{2060}", hidden(f, '\u{2060}')),
            ("Seq\u{202E}", hidden(f, '\u{202E}')),
            ("Se\u{AD}q", hidden(f, '\u{AD}')),
            ("Se\nq", hidden(f, '\n')),
            ("Se\tq", hidden(f, '\t')),
            ("Se\u{7F}q", hidden(f, '\u{7F}')),
            ("Se\u{85}q", hidden(f, '\u{85}')),
            ("Order\u{a0}View", hidden(f, '\u{a0}')),
            ("Order\u{2009}View", hidden(f, '\u{2009}')),
            ("Order\u{2028}View", hidden(f, '\u{2028}')),
            ("Cafe\u{301}", Err(ValidationError::NotNfc { field: f })),
            ("\u{212B}ngström", Err(ValidationError::NotNfc { field: f })),
        ];
        for (name, want) in cases {
            assert_eq!(
                &typed(check_unambiguous(f, name)),
                want,
                "{name:?} ({})",
                name.escape_unicode()
            );
        }
    }
}
