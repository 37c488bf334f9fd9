//! `kiln check gpu|cpu`: runs [`kiln::check::run_checks`] and prints one line per check
//! (or JSON lines); a failed check makes the command fail, so a script (the GPU lease's)
//! stops on it.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use kiln::check::run_checks;
use kiln::plan::Backend;

/// Which device `kiln check` checks.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum CheckTarget {
    /// The first CUDA device, against the CPU.
    Gpu,
    /// The CPU: Kiln's kernels against Burn's own ops.
    Cpu,
}

/// Arguments of `kiln check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The device to check.
    #[arg(value_enum, default_value = "gpu")]
    target: CheckTarget,
    /// One JSON object per check instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs the checks; fails when one does.
pub fn run(args: CheckArgs) -> Result<()> {
    let backend = match args.target {
        CheckTarget::Gpu => Backend::Cuda,
        CheckTarget::Cpu => Backend::Flex,
    };
    let results = run_checks(backend);
    for r in &results {
        if args.json {
            println!("{}", serde_json::to_string(r)?);
        } else {
            let verdict = if r.passed { "ok  " } else { "FAIL" };
            println!("{verdict} {:<12} {:>6.2}s  {}", r.name, r.seconds, r.detail);
        }
    }
    let failed: Vec<&str> = results
        .iter()
        .filter(|r| !r.passed)
        .map(|r| r.name)
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} of {} checks failed: {}",
            failed.len(),
            results.len(),
            failed.join(", ")
        );
    }
    Ok(())
}
