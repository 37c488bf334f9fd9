//! Host memory readings from the operating system.

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if available.
pub fn peak_rss_bytes() -> Option<u64> {
    status_field("VmHWM:")
}

/// Current resident set size of this process in bytes (Linux `VmRSS`), if available.
pub fn current_rss_bytes() -> Option<u64> {
    status_field("VmRSS:")
}

fn status_field(name: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Formats a byte count for people (`123.4 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A resident-memory watermark: [`Watermark::check`] says when RSS first reaches the threshold
/// and re-arms once it falls below 90% of it (so a run hovering at the line reports once per
/// crossing, not every step).
#[derive(Debug, Clone)]
pub struct Watermark {
    threshold: u64,
    above: bool,
}

impl Watermark {
    /// A watermark at `threshold` bytes.
    pub fn new(threshold: u64) -> Self {
        Watermark {
            threshold,
            above: false,
        }
    }

    /// The threshold in bytes.
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Feeds a reading; returns true when it is a new crossing.
    pub fn check(&mut self, rss: u64) -> bool {
        if rss >= self.threshold {
            let new = !self.above;
            self.above = true;
            new
        } else {
            if rss < self.threshold / 10 * 9 {
                self.above = false;
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermark_fires_once_per_crossing() {
        let mut w = Watermark::new(1000);
        assert!(!w.check(999));
        assert!(w.check(1000));
        assert!(!w.check(1500), "still above: no new event");
        assert!(!w.check(950), "not re-armed above 90%");
        assert!(!w.check(1001));
        assert!(!w.check(800), "re-armed");
        assert!(w.check(1200));
    }
}
