//! Config names of Kiln's enums (`"adam"`, `"bf16"`, `"skip"`, ...), declared once beside each
//! enum with [`config_names!`]. A bottom module: the enums live in the modules that use them
//! (training, precision, the guard, the loader), the schema above them lists their names, and
//! neither side imports the other for it.

/// Gives an enum its config names in one place: `NAMES` (the values the schema's
/// [`crate::config::schema::Kind::Enum`] accepts, in the order help lists them), `name()`
/// and `from_name()`. Because the schema takes its list from `NAMES`, a value that
/// validates always parses: the plan needs no silent fallback.
macro_rules! config_names {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $ty {
            /// Every config name, in the order help lists them.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name used in configs.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }

            /// Parses a config name; `None` for anything not in [`Self::NAMES`].
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($text => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl $crate::names::ConfigName for $ty {
            const NAMES: &'static [&'static str] = <$ty>::NAMES;

            fn from_name(name: &str) -> Option<Self> {
                <$ty>::from_name(name)
            }
        }
    };
}

/// A setting whose values are a fixed set of names ([`config_names!`] implements it), so
/// the plan can read any of them the same way.
pub trait ConfigName: Sized {
    /// Every config name.
    const NAMES: &'static [&'static str];

    /// Parses a config name; `None` for anything not in `NAMES`.
    fn from_name(name: &str) -> Option<Self>;
}
pub(crate) use config_names;
