//! A video stream's settings as the config file states them (`[stream]`: the decode queue's
//! size and overload policy, the gate's and the regions' thresholds), and the techniques
//! they make.

use super::frame_stream::{RegionConfig, VideoTechniques};
use super::gate::GateConfig;
use super::queue::OverloadPolicy;

/// The `stream.*` keys, resolved ([`crate::plan::Plan::stream`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamSettings {
    /// What a full decode queue does with a new frame (`stream.on_overload`).
    pub on_overload: OverloadPolicy,
    /// Decoded frames the decoder may run ahead (`stream.queue_frames`).
    pub queue_frames: usize,
    /// The frame gate's largest tile change (`stream.gate_threshold`).
    pub gate_threshold: f32,
    /// A region tile's change threshold (`stream.region_threshold`).
    pub region_threshold: f32,
    /// Context and crop alignment around a changed region, input pixels
    /// (`stream.region_margin`).
    pub region_margin: usize,
    /// Frames a result may be reused before it runs again (`stream.region_max_age`).
    pub region_max_age: u32,
}

impl Default for StreamSettings {
    /// The schema's defaults.
    fn default() -> Self {
        StreamSettings {
            on_overload: OverloadPolicy::Block,
            queue_frames: 8,
            gate_threshold: 0.01,
            region_threshold: 0.01,
            region_margin: 48,
            region_max_age: 60,
        }
    }
}

impl StreamSettings {
    /// The frame gate these settings describe.
    pub fn frame_gate(&self) -> GateConfig {
        GateConfig {
            threshold: self.gate_threshold,
            max_reuse_age: self.region_max_age,
        }
    }

    /// The regions of interest these settings describe: crops aligned to 32 pixels (a
    /// stride-32 backbone's grid, a multiple of stride 8's and 16's), or to the margin when
    /// it is smaller.
    pub fn regions(&self) -> RegionConfig {
        let margin = self.region_margin.max(1);
        RegionConfig {
            threshold: self.region_threshold,
            margin,
            align: margin.min(32),
            max_reuse_age: self.region_max_age,
            ..RegionConfig::default()
        }
    }

    /// Temporal coherence and regions of interest together, as these settings describe them.
    pub fn techniques(&self) -> VideoTechniques {
        VideoTechniques {
            frame_gate: Some(self.frame_gate()),
            regions: Some(self.regions()),
            multiscale: None,
        }
    }
}
