//! Usage and what it costs: token counters and per-model prices.
//!
//! A leaf: settings (which name prices), storage (which records usage) and the namespaces'
//! quotas all use these without importing each other.

use serde::{Deserialize, Serialize};

/// Token and cost counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    #[serde(default)]
    pub cache_read_tokens: u64,
    #[serde(default)]
    pub cache_write_tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
    #[serde(default)]
    pub tool_calls: u64,
}

impl UsageRecord {
    pub fn add(&mut self, other: &UsageRecord) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens += other.cache_read_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
        self.cost_usd += other.cost_usd;
        self.tool_calls += other.tool_calls;
    }
}

/// What a model costs, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    /// Cache reads; a tenth of `input` unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read: Option<f64>,
    /// Cache writes; 1.25 times `input` unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
}

impl Price {
    pub fn cost(&self, u: &UsageRecord) -> f64 {
        (u.input_tokens as f64 * self.input
            + u.output_tokens as f64 * self.output
            + u.cache_read_tokens as f64 * self.cache_read.unwrap_or(self.input * 0.1)
            + u.cache_write_tokens as f64 * self.cache_write.unwrap_or(self.input * 1.25))
            / 1e6
    }

    pub fn valid(&self) -> bool {
        [
            Some(self.input),
            Some(self.output),
            self.cache_read,
            self.cache_write,
        ]
        .into_iter()
        .flatten()
        .all(|p| p.is_finite() && p >= 0.0)
    }
}

/// The usage a worker reports for an attempt.
impl From<&crate::v1::Usage> for UsageRecord {
    fn from(u: &crate::v1::Usage) -> Self {
        UsageRecord {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            cache_read_tokens: u.cache_read_tokens,
            cache_write_tokens: u.cache_write_tokens,
            cost_usd: u.cost_usd,
            tool_calls: u64::from(u.tool_calls),
        }
    }
}
