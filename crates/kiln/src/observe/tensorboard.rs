//! TensorBoard event files (`events.out.tfevents.*`) written directly: TFRecord framing
//! (length, masked CRC-32C, payload, masked CRC-32C) around `tensorflow.Event` protocol
//! buffers, hand-encoded — the handful of fields TensorBoard's scalar and text plugins read
//! do not justify a protobuf code generator.
//!
//! [`TensorBoardSink`] turns run events into scalars (`train/loss`, `train/lr`,
//! `train/samples_per_s`, `train/data_wait_share`, `train/loss_scale`, `train/grad_norm`,
//! `memory/peak_rss_mib`, `eval/accuracy`, `eval/loss`) and the resolved plan into a text
//! summary.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::events::Event;
use super::sink::EventSink;

/// CRC-32C (Castagnoli), reflected, as TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: rotated and offset so a CRC of CRCs is not trivially zero.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xA282_EAD8)
}

/// Protocol-buffer wire encoding of the few field kinds used here.
mod pb {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, ((field as u64) << 3) | wire as u64);
    }
    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn int(out: &mut Vec<u8>, field: u32, v: i64) {
        key(out, field, 0);
        varint(out, v as u64);
    }
    pub fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        key(out, field, 2);
        varint(out, v.len() as u64);
        out.extend_from_slice(v);
    }
}

/// `tensorflow.Event` with a `Summary` of the given encoded `Summary.Value`s.
fn event(wall_time: f64, step: i64, values: &[Vec<u8>]) -> Vec<u8> {
    let mut summary = Vec::new();
    for v in values {
        pb::bytes(&mut summary, 1, v);
    }
    let mut e = Vec::new();
    pb::double(&mut e, 1, wall_time);
    pb::int(&mut e, 2, step);
    pb::bytes(&mut e, 5, &summary);
    e
}

/// `Summary.Value { tag, simple_value }`.
fn scalar_value(tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::new();
    pb::bytes(&mut v, 1, tag.as_bytes());
    pb::float(&mut v, 2, value);
    v
}

/// `Summary.Value { tag, metadata { plugin_data { plugin_name: "text" } }, tensor { dtype:
/// DT_STRING, tensor_shape: {}, string_val: [text] } }` — what the text plugin reads.
fn text_value(tag: &str, text: &str) -> Vec<u8> {
    let mut plugin = Vec::new();
    pb::bytes(&mut plugin, 1, b"text");
    let mut metadata = Vec::new();
    pb::bytes(&mut metadata, 1, &plugin);
    let mut tensor = Vec::new();
    pb::int(&mut tensor, 1, 7); // DT_STRING
    pb::bytes(&mut tensor, 2, &[]); // scalar shape
    pb::bytes(&mut tensor, 8, text.as_bytes());
    let mut v = Vec::new();
    pb::bytes(&mut v, 1, tag.as_bytes());
    pb::bytes(&mut v, 9, &metadata);
    pb::bytes(&mut v, 8, &tensor);
    v
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes one `events.out.tfevents.*` file.
pub struct TfEventsWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TfEventsWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.<host>.<pid>` and writes the version record.
    pub fn create(dir: &Path) -> crate::error::Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| crate::error::KilnError::io(dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now() as u64,
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| crate::error::KilnError::io(&path, e))?;
        let mut w = TfEventsWriter {
            path,
            out: BufWriter::new(file),
        };
        let mut version = Vec::new();
        pb::double(&mut version, 1, now());
        pb::bytes(&mut version, 3, b"brain.Event:2");
        w.record(&version)?;
        Ok(w)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> crate::error::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(data.len() + 16);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&masked_crc(&len).to_le_bytes());
        frame.extend_from_slice(data);
        frame.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out
            .write_all(&frame)
            .map_err(|e| crate::error::KilnError::io(&self.path, e))
    }

    /// Writes scalars for one step.
    pub fn scalars(&mut self, step: i64, values: &[(&str, f32)]) -> crate::error::Result<()> {
        let encoded: Vec<Vec<u8>> = values.iter().map(|(t, v)| scalar_value(t, *v)).collect();
        self.record(&event(now(), step, &encoded))
    }

    /// Writes a text summary (Markdown).
    pub fn text(&mut self, step: i64, tag: &str, text: &str) -> crate::error::Result<()> {
        self.record(&event(now(), step, &[text_value(tag, text)]))
    }

    /// Flushes buffered records to the file.
    pub fn flush(&mut self) -> crate::error::Result<()> {
        self.out
            .flush()
            .map_err(|e| crate::error::KilnError::io(&self.path, e))
    }
}

/// An [`EventSink`] that logs a run to TensorBoard. Write errors are logged once and the
/// sink goes quiet: losing a plot must not stop training.
pub struct TensorBoardSink {
    writer: Option<TfEventsWriter>,
}

impl TensorBoardSink {
    /// A sink writing a new event file in `dir`.
    pub fn create(dir: &Path) -> crate::error::Result<Self> {
        Ok(TensorBoardSink {
            writer: Some(TfEventsWriter::create(dir)?),
        })
    }

    /// The event file, while the sink is healthy.
    pub fn path(&self) -> Option<&Path> {
        self.writer.as_ref().map(|w| w.path())
    }

    fn write(&mut self, f: impl FnOnce(&mut TfEventsWriter) -> crate::error::Result<()>) {
        if let Some(w) = self.writer.as_mut()
            && let Err(e) = f(w)
        {
            tracing::warn!("TensorBoard logging stopped: {e}");
            self.writer = None;
        }
    }
}

/// The plan as a Markdown table, for the text plugin.
fn plan_markdown(plan: &serde_json::Value) -> String {
    let mut md = format!(
        "level: **{}**\n\n| setting | value | source |\n|---|---|---|\n",
        plan["level"].as_str().unwrap_or("?")
    );
    if let Some(settings) = plan["settings"].as_object() {
        for (key, s) in settings {
            md.push_str(&format!(
                "| {key} | {} | {} |\n",
                s["value"],
                s["source"].as_str().unwrap_or("")
            ));
        }
    }
    md
}

impl EventSink for TensorBoardSink {
    fn emit(&mut self, event: &Event) {
        match event {
            Event::RunStarted {
                plan: Some(plan), ..
            } => self.write(|w| w.text(0, "plan", &plan_markdown(plan))),
            Event::Step(s) => {
                let mut values = vec![
                    ("train/loss", s.loss),
                    ("train/lr", s.lr as f32),
                    ("train/samples_per_s", s.samples_per_s as f32),
                    (
                        "train/data_wait_share",
                        (s.data_ms / s.step_ms.max(1e-9)) as f32,
                    ),
                ];
                if let Some(scale) = s.loss_scale {
                    values.push(("train/loss_scale", scale));
                }
                if let Some(norm) = s.grad_norm {
                    values.push(("train/grad_norm", norm));
                }
                if let Some(rss) = s.peak_rss_bytes {
                    values.push(("memory/peak_rss_mib", (rss as f64 / 1048576.0) as f32));
                }
                let step = s.step as i64;
                self.write(|w| w.scalars(step, &values));
            }
            Event::EpochEnd(e) => {
                let mut values = vec![("train/epoch_loss", e.train_loss)];
                if let Some(a) = e.test_accuracy {
                    values.push(("eval/accuracy", a as f32));
                }
                if let Some(l) = e.test_loss {
                    values.push(("eval/loss", l));
                }
                let epoch = e.epoch as i64 + 1;
                self.write(|w| {
                    w.scalars(epoch, &values)?;
                    w.flush()
                });
            }
            Event::MemoryWatermark(m) => {
                let (step, bytes) = (m.step as i64, m.in_use_bytes);
                self.write(|w| {
                    w.scalars(
                        step,
                        &[(
                            "memory/watermark_in_use_mib",
                            (bytes as f64 / 1048576.0) as f32,
                        )],
                    )
                });
            }
            Event::RunFinished(_) => self.write(|w| w.flush()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720 / iSCSI).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints_encode_like_protobuf() {
        let mut v = Vec::new();
        pb::varint(&mut v, 300);
        assert_eq!(v, vec![0xAC, 0x02]);
    }
}
