//! Host memory readings from the operating system.

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if available.
pub fn peak_rss_bytes() -> Option<u64> {
    status_field("VmHWM:")
}

/// Current resident set size of this process in bytes (Linux `VmRSS`), if available.
pub fn current_rss_bytes() -> Option<u64> {
    status_field("VmRSS:")
}

/// Resets the peak resident set size to the current one (Linux: `5` written to
/// `/proc/self/clear_refs`), so that [`peak_rss_bytes`] then measures the peak of what runs
/// next. Returns whether it worked (older kernels and other systems: no).
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The reading a memory watermark compares: the peak of the counted heap since the previous
/// reading where a [`super::heap::CountingAlloc`] is installed (the `kiln` binary installs
/// one), so it falls once tensors are freed whatever the allocator keeps mapped; otherwise
/// the current resident set size.
pub fn in_use_reading() -> Option<u64> {
    super::heap::take_peak_bytes().or_else(current_rss_bytes)
}

/// The reading a memory watermark compares for a run on `device`: on an accelerator with a
/// memory pool (the CubeCL backends: CUDA), the bytes the pool has reserved on the device —
/// what the device really holds, as `torch.cuda.memory_reserved` reports; it includes the
/// step's activations, which are freed by the time the step ends, because the pool keeps
/// their pages — else the host reading ([`in_use_reading`]). The trainer releases the pool's
/// idle pages ([`release_device_pages`]) after halving a micro-batch, so the next reading
/// shows what the smaller micro-batch needs.
pub fn in_use_reading_on(device: &burn::tensor::Device) -> Option<u64> {
    device_reserved_bytes(device).or_else(in_use_reading)
}

/// The bytes `device`'s memory pool has reserved (it keeps freed pages, so this covers the
/// largest need since its last cleanup); `None` on a backend without a pool (`flex`).
pub fn device_reserved_bytes(device: &burn::tensor::Device) -> Option<u64> {
    device.memory_pool_usage().map(|pool| pool.bytes_reserved)
}

/// Asks `device`'s memory pool to release the pages it holds idle (a no-op on backends
/// without one: `flex` returns freed memory to the allocator at once).
pub fn release_device_pages(device: &burn::tensor::Device) {
    device.memory_cleanup();
}

/// The memory this process may use, bytes, and where that figure comes from: the cgroup's
/// limit when one is set (containers, CI runners), else the machine's physical memory.
pub fn memory_limit() -> Option<(u64, &'static str)> {
    let physical = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map(|kib| kib * 1024);
    // cgroup v2, then v1; v1 writes a huge number when there is no limit.
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|path| {
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    });
    match (cgroup, physical) {
        (Some(c), Some(p)) if c < p => Some((c, "cgroup memory limit")),
        (Some(c), None) => Some((c, "cgroup memory limit")),
        (_, Some(p)) => Some((p, "physical memory")),
        (None, None) => None,
    }
}

fn status_field(name: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `/proc/self/statm` kept open, so a reading costs one `pread` (about a microsecond) instead
/// of an open + read + close of `/proc/self/status`: cheap enough for the profiler's span
/// boundaries and the memory-mapped datasets' residency checks. Readings are `None` where
/// `/proc` is missing.
#[derive(Debug)]
pub struct Statm(Option<std::fs::File>);

/// statm counts pages; 4 KiB on the Linux targets Kiln builds for (x86_64, default aarch64).
const PAGE_BYTES: u64 = 4096;

impl Statm {
    /// Opens `/proc/self/statm`.
    pub fn open() -> Self {
        Statm(std::fs::File::open("/proc/self/statm").ok())
    }

    /// Whether readings are available.
    pub fn available(&self) -> bool {
        self.0.is_some()
    }

    fn field(&self, index: usize) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 128];
        let n = self.0.as_ref()?.read_at(&mut buf, 0).ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let pages: u64 = text.split_whitespace().nth(index)?.parse().ok()?;
        Some(pages * PAGE_BYTES)
    }

    /// Resident set size, bytes.
    pub fn resident_bytes(&self) -> Option<u64> {
        self.field(1)
    }

    /// File-backed (and shared) resident bytes: what mapped files occupy.
    pub fn file_backed_bytes(&self) -> Option<u64> {
        self.field(2)
    }
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

    /// Arms the watermark again at once, so that the next reading at or above the threshold
    /// is a new crossing. The trainer calls it after halving its micro-batch: a reading still
    /// above means halving was not enough, and it halves again.
    pub fn rearm(&mut self) {
        self.above = false;
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
