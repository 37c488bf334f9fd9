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
