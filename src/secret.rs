//! A secret from a flag or a `TALLY_*` variable: a JWT signing secret or a
//! store's password. It never prints, in logs, errors or `Debug`.

use std::fmt;

#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::str::FromStr for Secret {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err("the secret is empty".into());
        }
        Ok(Secret(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_shows_in_debug() {
        let s: Secret = "hunter2-hunter2".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(format!("{s:?}"), "Secret(***)");
        assert_eq!(s.expose(), "hunter2-hunter2");
        assert!("".parse::<Secret>().is_err());
    }
}
