//! Parsers for the command line's numbers and durations that refuse what no
//! setting can mean: a zero where something must happen, a rate that is not
//! a finite number, a duration so long that adding it to a clock overflows.
//! Each used to be taken as given and then panicked a task (`--relay-interval
//! 0s` stopped the relay and left the process serving), or was quietly
//! replaced by something else (`--max-in-flight 0`). An operator should hear
//! of a mistake when typing it, not find it in a graph a day later.

use std::time::Duration;

/// The shortest TTL: stores keep TTLs in whole seconds.
pub const SECOND: Duration = Duration::from_secs(1);

/// The longest duration any setting takes. Clocks plus a duration must not
/// overflow, and nothing here is meant to wait for more than a year.
pub const LONGEST: Duration = Duration::from_secs(366 * 24 * 3600);

/// An address to listen on, `HOST:PORT`: checked when typed, not after the
/// stores were connected to (`--listen 8080` used to be found out only
/// when the server bound it, after every store had answered).
pub fn listen_address(s: &str) -> Result<String, String> {
    use std::net::ToSocketAddrs;
    match s.to_socket_addrs().map(|mut addrs| addrs.next()) {
        Ok(Some(_)) => Ok(s.to_owned()),
        Ok(None) => Err(format!("{s:?} names no address")),
        Err(e) => Err(format!(
            "expected HOST:PORT such as 127.0.0.1:8080, not {s:?} ({e})"
        )),
    }
}

/// A duration of at most a year, zero allowed (zero means "do not wait").
pub fn duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("expected a duration such as 500ms, 20s or 1h, not {s:?} ({e})"))?;
    if d > LONGEST {
        return Err(format!("{s:?} is longer than a year"));
    }
    Ok(d)
}

/// A duration above zero and of at most a year: for timeouts, periods and
/// TTLs, where zero would time out everything, spin, or keep nothing.
pub fn duration_above_zero(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d.is_zero() {
        return Err(format!("{s:?} must be longer than zero"));
    }
    Ok(d)
}

/// A duration from `least` to `most`, for a setting a library bounds (a
/// Kafka delivery timeout must exceed the producer's linger and fit its
/// 32-bit milliseconds) or a store keeps in whole seconds (a TTL under a
/// second would be rounded to nothing).
pub fn duration_within(
    least: Duration,
    most: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync {
    move |s: &str| {
        let d = duration(s)?;
        if d < least || d > most {
            return Err(format!(
                "{s:?} is not from {} to {}",
                humantime::format_duration(least),
                humantime::format_duration(most)
            ));
        }
        Ok(d)
    }
}

/// The slowest and fastest rates a per-second setting takes: a vote or a
/// sweep less often than every 1,000 s is a limit no one means, and above
/// the fastest is no limit in all but name (0 says that where it is allowed).
const SLOWEST: f64 = 0.001;
const FASTEST: f64 = 1e9;

/// A rate per second from 0.001 to 1e9.
pub fn per_second(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(n) if (SLOWEST..=FASTEST).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a number per second from {SLOWEST} to {FASTEST:e}, not {s:?}"
        )),
    }
}

/// 0 (as fast as it goes), or a rate per second as `per_second` takes it.
pub fn per_second_or_unlimited(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(0.0) => Ok(0.0),
        _ => per_second(s).map_err(|e| format!("{e}; 0 for no limit")),
    }
}

/// A count from 1 to `most`: of places, threads or writes at once, where 0
/// would admit nothing or never run, and a count past `most` would ask for
/// more threads or permits than a process can hold.
pub fn count(most: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    move |s: &str| match s.trim().parse::<usize>() {
        Ok(n) if (1..=most).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a whole number from 1 to {most}, not {s:?}"
        )),
    }
}

/// A count of tokens from 1 up, where 0 would let nothing through.
pub fn at_least_one_u32(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "expected a whole number from 1 to {}, not {s:?}",
            u32::MAX
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_is_refused_when_it_is_not_one_or_longer_than_a_year() {
        assert_eq!(duration("0s"), Ok(Duration::ZERO));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("366d"), Ok(LONGEST));
        for bad in ["", "5", "-1s", "soon", "367d", "1000000000y"] {
            assert!(duration(bad).is_err(), "{bad:?} taken");
        }
    }

    #[test]
    fn zero_is_refused_where_something_must_happen() {
        assert_eq!(duration_above_zero("1ms"), Ok(Duration::from_millis(1)));
        for bad in ["0s", "0ms", "0", "367d"] {
            match duration_above_zero(bad) {
                Err(e) => assert!(e.contains(bad), "{e}"),
                Ok(d) => panic!("{bad:?} taken as {d:?}"),
            }
        }
    }

    #[test]
    fn a_bounded_duration_names_its_bounds() {
        let ttl = duration_within(Duration::from_secs(1), Duration::from_secs(3600));
        assert_eq!(ttl("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(ttl("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["500ms", "0s", "61m", "soon"] {
            assert!(ttl(bad).is_err(), "{bad:?} taken");
        }
        assert_eq!(
            ttl("999ms"),
            Err("\"999ms\" is not from 1s to 1h".to_owned())
        );
    }

    #[test]
    fn a_rate_is_a_finite_number_in_range() {
        assert_eq!(per_second("20"), Ok(20.0));
        assert_eq!(per_second("0.001"), Ok(0.001));
        for bad in ["0", "-1", "NaN", "inf", "-inf", "1e-300", "2e9", "fast"] {
            assert!(per_second(bad).is_err(), "{bad:?} taken");
        }
        assert_eq!(per_second_or_unlimited("0"), Ok(0.0));
        assert_eq!(per_second_or_unlimited("100"), Ok(100.0));
        for bad in ["inf", "NaN", "1e-300", "-0.5"] {
            match per_second_or_unlimited(bad) {
                Err(e) => assert!(e.contains("0 for no limit"), "{e}"),
                Ok(n) => panic!("{bad:?} taken as {n}"),
            }
        }
    }

    #[test]
    fn a_count_starts_at_one_and_ends_at_its_most() {
        let places = count(1_000);
        assert_eq!(places("1"), Ok(1));
        assert_eq!(places("1000"), Ok(1_000));
        for bad in ["0", "-3", "1.5", "many", "", "1001", "18446744073709551615"] {
            assert!(places(bad).is_err(), "{bad:?} taken");
        }
        assert_eq!(at_least_one_u32("60"), Ok(60));
        for bad in ["0", "4294967296"] {
            assert!(at_least_one_u32(bad).is_err(), "{bad:?} taken");
        }
    }
}
