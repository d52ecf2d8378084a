//! Namespaces (M40): every run belongs to one. A fleet serves several teams; a namespace is
//! one team's share of it.
//!
//! - **Who is in which**: a client certificate names its namespaces in its subject's
//!   organisation (`O=team-a`, or `O=team-a,team-b`; `O=*` for an operator who sees them
//!   all; none: `default`). A launch runs in the namespace it asks for (`--namespace`) when
//!   the certificate names it, else in the certificate's first. Embedded runs are in
//!   `default`. A caller sees, waits for and controls only its namespaces' runs ([`Scope`]);
//!   session tokens carry the scope of the certificate that asked for them.
//! - **What the operator sets** ([`Policy`], `[namespaces.NAME]` in the coordinator's
//!   config; `[namespaces."*"]` for the rest): a weight (the dispatcher shares slots between
//!   namespaces by weight, then between runs within one), a cap on agents running at once
//!   (more queue), daily quotas of agents, tokens and money (past one, launches and new
//!   agents are refused with `QUOTA_EXCEEDED`, naming the quota and when it resets), and a
//!   model policy — allowed models, a default model, labels every agent's worker must carry,
//!   and a price table that costs its agents' tokens. Model policy, labels and prices are
//!   fixed into a run's settings when it is launched, so its resumes and adoptions keep them.
//! - **Daily use** ([`Quotas`]) is counted by the leading coordinator and kept in the store
//!   (`namespaces/{ns}/usage/{day}.json`, rewritten every [`FLUSH`] while it changes), so a
//!   successor goes on from it. A day is a UTC day. Tokens and money count when an agent's
//!   attempt ends, so agents already running when a quota is reached may pass it a little.

use flotilla_proto::Problem;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::store::Store;
use crate::store::records::UsageRecord;

pub use crate::ids::DEFAULT_NAMESPACE as DEFAULT;
/// In a certificate's organisation: every namespace.
pub const ALL: &str = flotilla_proto::names::ALL_NAMESPACES;
/// How often daily use that changed is written to the store.
pub const FLUSH: Duration = Duration::from_secs(2);

pub use crate::ids::valid_namespace as valid_name;

pub use crate::usage::Price;

/// The price in `prices` of `model`: its own entry, else its family's (`sonnet` prices every
/// Sonnet model id).
pub fn price_of<'a>(prices: &'a BTreeMap<String, Price>, model: &str) -> Option<&'a Price> {
    prices.get(model).or_else(|| {
        prices
            .iter()
            .find(|(m, _)| crate::settings::model_allowed(m, model))
            .map(|(_, p)| p)
    })
}

/// What an operator sets for one namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// Its share of the fleet against the other namespaces' when all want more slots.
    pub weight: u32,
    /// Agents of its runs running at once; more wait in their queues.
    pub max_agents: Option<u32>,
    /// Agents its runs may start in a UTC day (calls served from a resume source are free).
    pub agents_per_day: Option<u64>,
    /// Input and output tokens its agents may use in a UTC day.
    pub tokens_per_day: Option<u64>,
    /// Dollars its agents may cost in a UTC day.
    pub usd_per_day: Option<f64>,
    /// Models its agents may run on (W18's allowlist); empty: any.
    pub allowed_models: Vec<String>,
    /// The model of its runs that name none.
    pub default_model: Option<String>,
    /// Labels every worker that runs one of its agents must carry.
    pub labels: BTreeMap<String, String>,
    /// What its agents' tokens cost, by model or family (else what the backend says).
    pub prices: BTreeMap<String, Price>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            weight: 1,
            max_agents: None,
            agents_per_day: None,
            tokens_per_day: None,
            usd_per_day: None,
            allowed_models: Vec::new(),
            default_model: None,
            labels: BTreeMap::new(),
            prices: BTreeMap::new(),
        }
    }
}

impl Policy {
    /// Checks what an operator wrote for namespace `name`; the error names the key and what it
    /// takes.
    pub fn validate(&self, name: &str) -> Result<(), Problem> {
        let at = |key: &str, what: &str| format!("namespaces.{name}.{key}: {what}");
        if name != ALL && !valid_name(name) {
            return Err(Problem::invalid(format!(
                "{name:?} is not a namespace name: 1 to 63 lower-case letters, digits, - _ and ., or \"*\" for the namespaces not listed"
            )));
        }
        if self.weight == 0 || self.weight > 1000 {
            return Err(Problem::invalid(at(
                "weight",
                "a whole number from 1 to 1000",
            )));
        }
        if self.max_agents == Some(0) {
            return Err(Problem::invalid(at(
                "max_agents",
                "at least 1 (leave it out for no cap)",
            )));
        }
        if self
            .usd_per_day
            .is_some_and(|d| !(d.is_finite() && d >= 0.0))
        {
            return Err(Problem::invalid(at(
                "usd_per_day",
                "an amount of dollars, 0 or more",
            )));
        }
        for (k, v) in &self.labels {
            if !crate::settings::valid_label_key(k) || !crate::settings::valid_label_value(v) {
                return Err(Problem::invalid(at(
                    "labels",
                    &format!(
                        "{k:?}={v:?} is not a worker label (keys: lower-case letters, digits, - _ . /)"
                    ),
                )));
            }
        }
        if let Some((m, _)) = self.prices.iter().find(|(_, p)| !p.valid()) {
            return Err(Problem::invalid(at(
                &format!("prices.{m}"),
                "dollars per million tokens, finite and 0 or more",
            )));
        }
        Ok(())
    }
}

/// The namespaces a coordinator knows: their policies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Namespaces {
    named: BTreeMap<String, Policy>,
    /// `"*"`: the policy of namespaces not named.
    rest: Option<Policy>,
}

impl Namespaces {
    /// From the config's `[namespaces.*]` tables, checked.
    pub fn new(tables: BTreeMap<String, Policy>) -> Result<Namespaces, Problem> {
        let mut out = Namespaces::default();
        for (name, policy) in tables {
            policy.validate(&name)?;
            if name == ALL {
                out.rest = Some(policy);
            } else {
                out.named.insert(name, policy);
            }
        }
        Ok(out)
    }

    /// The policy of namespace `ns`.
    pub fn policy(&self, ns: &str) -> Policy {
        self.named
            .get(ns)
            .or(self.rest.as_ref())
            .cloned()
            .unwrap_or_default()
    }

    /// The namespaces named in the config.
    pub fn named(&self) -> impl Iterator<Item = &str> {
        self.named.keys().map(String::as_str)
    }
}

/// The namespaces a caller may act in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace: an operator (`O=*`), a coordinator, or a coordinator without TLS.
    All,
    /// These, the first being where its launches go unless they say.
    Only(Vec<String>),
}

impl Scope {
    /// From a certificate's organisation: `*`, or namespaces separated by commas; none (or
    /// nothing usable) is `default`.
    pub fn from_organisation(org: Option<&str>) -> Scope {
        let mut names = Vec::new();
        for part in org.unwrap_or("").split(',').map(str::trim) {
            if part == ALL {
                return Scope::All;
            }
            if valid_name(part) && !names.iter().any(|n| n == part) {
                names.push(part.to_owned());
            }
        }
        if names.is_empty() {
            names.push(DEFAULT.to_owned());
        }
        Scope::Only(names)
    }

    pub fn may(&self, ns: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Only(names) => names.iter().any(|n| n == effective(ns)),
        }
    }

    /// The namespace a launch that asks for `asked` (empty: none) runs in, or why it may not.
    pub fn choose(&self, asked: &str, who: &str) -> Result<String, Problem> {
        let asked = asked.trim();
        if asked.is_empty() {
            return Ok(match self {
                Scope::All => DEFAULT.to_owned(),
                Scope::Only(names) => names[0].clone(),
            });
        }
        if !valid_name(asked) {
            return Err(Problem::denied(format!(
                "--namespace {asked:?} is not a namespace name: 1 to 63 lower-case letters, digits, - _ and ."
            )));
        }
        if self.may(asked) {
            Ok(asked.to_owned())
        } else {
            Err(Problem::denied(format!(
                "certificate {who:?} may act in namespace(s) {} only, not {asked:?}: launch without --namespace, or use a certificate issued with `flotilla certs issue --namespace {asked}`",
                self.list()
            )))
        }
    }

    /// The namespaces, for messages.
    pub fn list(&self) -> String {
        match self {
            Scope::All => "all".into(),
            Scope::Only(names) => names.join(", "),
        }
    }

    /// As carried in a token or a forwarded request: `*` or the names, comma-separated.
    pub fn encode(&self) -> String {
        match self {
            Scope::All => ALL.into(),
            Scope::Only(names) => names.join(","),
        }
    }

    pub fn decode(text: &str) -> Scope {
        Scope::from_organisation(Some(text))
    }

    /// The namespaces, `None` for all (for filters).
    pub fn names(&self) -> Option<&[String]> {
        match self {
            Scope::All => None,
            Scope::Only(n) => Some(n),
        }
    }
}

pub use crate::ids::effective_namespace as effective;

/// What a namespace used in one UTC day.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DayUse {
    pub agents: u64,
    /// Input and output tokens.
    pub tokens: u64,
    pub cost_usd: f64,
}

impl DayUse {
    fn add(&mut self, o: &DayUse) {
        self.agents += o.agents;
        self.tokens += o.tokens;
        self.cost_usd += o.cost_usd;
    }
}

/// A daily quota that is used up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "QUOTA_EXCEEDED: namespace {namespace} has used its {quota} ({used} of {limit} on {day}, UTC); it resets at {resets}, in {left}"
)]
pub struct Exceeded {
    pub namespace: String,
    /// `agents per day`, `tokens per day` or `dollars per day`.
    pub quota: &'static str,
    pub used: String,
    pub limit: String,
    pub day: String,
    /// RFC 3339: the next midnight, UTC.
    pub resets: String,
    pub left: String,
}

/// Counts of one namespace and day, as `/metrics` and the pages show them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaView {
    pub namespace: String,
    pub day: String,
    pub used: DayUse,
    pub policy: Policy,
    /// Refusals today, by quota.
    pub refused: BTreeMap<&'static str, u64>,
}

#[derive(Debug, Default)]
struct Counted {
    /// The [`Quotas::reset`] it was made after: a read of the store started before a reset
    /// is not added to an entry made after it.
    epoch: u64,
    total: DayUse,
    /// Read from the store (what was counted before this process); until then nothing is
    /// written, so a write never replaces more than it knows.
    loaded: bool,
    loading: bool,
    dirty: bool,
    refused: BTreeMap<&'static str, u64>,
}

/// The daily use of every namespace, and the policies it is held to. One per coordinator;
/// only the leader counts (it runs the runs).
pub struct Quotas {
    policies: std::sync::RwLock<Namespaces>,
    store: Option<Store>,
    counts: Mutex<HashMap<(String, String), Counted>>,
    /// Resets so far ([`Counted::epoch`]).
    epoch: std::sync::atomic::AtomicU64,
    /// Refusals since start, by namespace and quota (a counter for `/metrics`).
    refusals: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// Where its writer and its readers run.
    tasks: crate::tasks::Tasks,
}

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quotas").finish_non_exhaustive()
    }
}

/// Today (UTC) as `YYYY-MM-DD`, and how long until it ends.
fn today() -> (String, Duration) {
    let at = flotilla_proto::clock::now() + tests_shift();
    let now = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let day = humantime::format_rfc3339_seconds(at).to_string()[..10].to_owned();
    let left = 86_400 - now.as_secs() % 86_400;
    (day, Duration::from_secs(left))
}

impl Quotas {
    /// Policies `namespaces`; daily use kept in `store` (none: in memory only), written and
    /// read back by tasks among `tasks` (stopped with them).
    pub fn new(
        namespaces: Namespaces,
        store: Option<Store>,
        tasks: crate::tasks::Tasks,
    ) -> Arc<Quotas> {
        let q = Arc::new(Quotas {
            policies: std::sync::RwLock::new(namespaces),
            store,
            counts: Mutex::new(HashMap::new()),
            epoch: std::sync::atomic::AtomicU64::new(0),
            refusals: Mutex::new(BTreeMap::new()),
            tasks,
        });
        if q.store.is_some() {
            let weak = Arc::downgrade(&q);
            q.tasks.spawn_until_stopped(async move {
                loop {
                    tokio::time::sleep(FLUSH).await;
                    let Some(q) = weak.upgrade() else { return };
                    q.flush().await;
                }
            });
        }
        q
    }

    pub fn policy(&self, ns: &str) -> Policy {
        self.policies
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .policy(effective(ns))
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Counted>> {
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets what was counted (this coordinator leads again: what it counted before may be
    /// stale); the store's counts are read again.
    pub fn reset(&self) {
        let mut counts = self.counts();
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        counts.clear();
    }

    /// The entry of `ns` today, its stored count being read if it is not yet.
    fn with<T>(self: &Arc<Self>, ns: &str, f: impl FnOnce(&mut Counted, &str) -> T) -> T {
        let (day, _) = today();
        let mut counts = self.counts();
        // Days that ended and are written go.
        counts.retain(|(_, d), c| *d == day || c.dirty);
        let epoch = self.epoch.load(std::sync::atomic::Ordering::Acquire);
        let c = counts
            .entry((ns.to_owned(), day.clone()))
            .or_insert_with(|| Counted {
                epoch,
                ..Counted::default()
            });
        if !c.loaded && !c.loading {
            match &self.store {
                None => c.loaded = true,
                Some(store) => {
                    c.loading = true;
                    let (me, store, ns, day) =
                        (self.clone(), store.clone(), ns.to_owned(), day.clone());
                    self.tasks
                        .spawn_until_stopped(async move { me.load(store, ns, day, epoch).await });
                }
            }
        }
        f(c, &day)
    }

    async fn load(&self, store: Store, ns: String, day: String, epoch: u64) {
        let mut wait = Duration::from_millis(200);
        let stored = loop {
            match store
                .get(&crate::store::keys::namespace_usage(&ns, &day))
                .await
            {
                Ok(Some(body)) => break serde_json::from_slice::<DayUse>(&body).ok(),
                Ok(None) => break None,
                Err(e) => {
                    tracing::warn!(namespace = %ns, error = %e, "cannot read the namespace's use today; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        };
        let mut counts = self.counts();
        if let Some(c) = counts.get_mut(&(ns, day))
            && c.epoch == epoch
            && !c.loaded
        {
            if let Some(s) = stored {
                c.total.add(&s);
            }
            c.loaded = true;
            c.loading = false;
        }
    }

    /// Writes the counts that changed.
    pub async fn flush(&self) {
        let Some(store) = &self.store else { return };
        let dirty: Vec<((String, String), DayUse)> = self
            .counts()
            .iter_mut()
            .filter(|(_, c)| c.dirty && c.loaded)
            .map(|(k, c)| {
                c.dirty = false;
                (k.clone(), c.total)
            })
            .collect();
        for ((ns, day), total) in dirty {
            let body = serde_json::to_vec(&total).unwrap_or_default();
            if let Err(e) = store
                .put_overwrite(
                    &crate::store::keys::namespace_usage(&ns, &day),
                    Bytes::from(body),
                )
                .await
            {
                tracing::warn!(namespace = %ns, error = %e, "cannot store the namespace's use today; kept for the next try");
                if let Some(c) = self.counts().get_mut(&(ns, day)) {
                    c.dirty = true;
                }
            }
        }
    }

    /// The first daily quota of `ns` that is used up.
    fn over(ns: &str, policy: &Policy, used: &DayUse, day: &str) -> Option<Exceeded> {
        let (_, left) = today();
        let resets =
            humantime::format_rfc3339_seconds(flotilla_proto::clock::now() + left).to_string();
        let left = format!("{}h {}m", left.as_secs() / 3600, left.as_secs() % 3600 / 60);
        let exceeded = |quota, used: String, limit: String| Exceeded {
            namespace: ns.to_owned(),
            quota,
            used,
            limit,
            day: day.to_owned(),
            resets: resets.clone(),
            left: left.clone(),
        };
        let quotas = [
            (
                "agents per day",
                policy
                    .agents_per_day
                    .map(|l| (used.agents >= l, l.to_string())),
                used.agents.to_string(),
            ),
            (
                "tokens per day",
                policy
                    .tokens_per_day
                    .map(|l| (used.tokens >= l, l.to_string())),
                used.tokens.to_string(),
            ),
            (
                "dollars per day",
                policy
                    .usd_per_day
                    .map(|l| (used.cost_usd >= l, format!("${l}"))),
                format!("${:.4}", used.cost_usd),
            ),
        ];
        for (quota, limit, used) in quotas {
            if let Some((true, limit)) = limit {
                return Some(exceeded(quota, used, limit));
            }
        }
        None
    }

    fn refused(&self, c: &mut Counted, e: &Exceeded) {
        *c.refused.entry(e.quota).or_default() += 1;
        *self
            .refusals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((e.namespace.clone(), e.quota))
            .or_default() += 1;
        tracing::info!(namespace = %e.namespace, quota = e.quota, "refused: {e}");
    }

    /// Waits (a while at most) until today's stored count of `ns` is read, so that a check
    /// right after a start or a failover knows what was used before it.
    pub async fn ready(self: &Arc<Self>, ns: &str) {
        let ns = effective(ns);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !self.with(ns, |c, _| c.loaded) {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(namespace = %ns, "the namespace's use today is not read yet; counting from what this coordinator saw");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether `ns` may launch a run now: none of its daily quotas is used up.
    pub async fn check(self: &Arc<Self>, ns: &str) -> Result<(), Box<Exceeded>> {
        let ns = effective(ns);
        self.ready(ns).await;
        let policy = self.policy(ns);
        self.with(ns, |c, day| match Self::over(ns, &policy, &c.total, day) {
            None => Ok(()),
            Some(e) => {
                self.refused(c, &e);
                Err(Box::new(e))
            }
        })
    }

    /// Counts an agent of `ns` that starts, unless a daily quota is used up.
    pub fn take_agent(self: &Arc<Self>, ns: &str) -> Result<(), Box<Exceeded>> {
        let ns = effective(ns);
        let policy = self.policy(ns);
        self.with(ns, |c, day| {
            if let Some(e) = Self::over(ns, &policy, &c.total, day) {
                self.refused(c, &e);
                return Err(Box::new(e));
            }
            c.total.agents += 1;
            c.dirty = true;
            Ok(())
        })
    }

    /// The daily tokens or dollars quota of `ns` that is used up, if one is: a coordinator's
    /// run pauses at it (until it resets) instead of failing its agents. Not a refusal.
    pub fn spent(self: &Arc<Self>, ns: &str) -> Option<Box<Exceeded>> {
        let ns = effective(ns);
        let policy = Policy {
            agents_per_day: None,
            ..self.policy(ns)
        };
        self.with(ns, |c, day| {
            Self::over(ns, &policy, &c.total, day).map(Box::new)
        })
    }

    /// Counts an agent of `ns` that waits in a run held at its namespace's quota: it is
    /// admitted, and starts once the quota resets.
    pub fn count_agent(self: &Arc<Self>, ns: &str) {
        self.with(effective(ns), |c, _| {
            c.total.agents += 1;
            c.dirty = true;
        });
    }

    /// Counts what an attempt of an agent of `ns` used.
    pub fn add(self: &Arc<Self>, ns: &str, u: &UsageRecord) {
        if u.input_tokens == 0 && u.output_tokens == 0 && u.cost_usd == 0.0 {
            return;
        }
        self.with(effective(ns), |c, _| {
            c.total.tokens += u.input_tokens + u.output_tokens;
            c.total.cost_usd += u.cost_usd;
            c.dirty = true;
        });
    }

    /// Today's counts of the namespaces named in the config and of those counted.
    pub fn views(self: &Arc<Self>) -> Vec<QuotaView> {
        let named: Vec<String> = self
            .policies
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .named()
            .map(str::to_owned)
            .collect();
        let (day, _) = today();
        let mut names: Vec<String> = self
            .counts()
            .keys()
            .filter(|(_, d)| *d == day)
            .map(|(n, _)| n.clone())
            .chain(named)
            .collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|ns| {
                let policy = self.policy(&ns);
                let (used, refused) = self.with(&ns, |c, _| (c.total, c.refused.clone()));
                QuotaView {
                    namespace: ns,
                    day: day.clone(),
                    used,
                    policy,
                    refused,
                }
            })
            .collect()
    }

    /// Refusals since start, by namespace and quota.
    pub fn refusals(&self) -> BTreeMap<(String, &'static str), u64> {
        self.refusals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// How far this thread's tests moved the quotas' day (none outside tests).
#[cfg(not(test))]
fn tests_shift() -> Duration {
    Duration::ZERO
}

#[cfg(test)]
thread_local! {
    static SHIFT: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
}

#[cfg(test)]
fn tests_shift() -> Duration {
    SHIFT.with(std::cell::Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A namespace past its daily tokens or dollars is `spent` (what holds a coordinator's run,
    /// issue 33, 2) until its day turns, when the quota resets and the run goes on; agents
    /// counted while it waited count against the day they were admitted in.
    #[test]
    fn a_spent_daily_quota_holds_until_the_day_turns() {
        let q = Quotas::new(
            Namespaces::new(BTreeMap::from([(
                "team-t".to_owned(),
                Policy {
                    tokens_per_day: Some(100),
                    ..Policy::default()
                },
            )]))
            .unwrap(),
            None,
            crate::tasks::Tasks::default(),
        );
        assert!(q.spent("team-t").is_none());
        q.add(
            "team-t",
            &UsageRecord {
                input_tokens: 90,
                output_tokens: 30,
                ..UsageRecord::default()
            },
        );
        let e = q.spent("team-t").expect("spent");
        assert_eq!(
            (e.quota, e.used.as_str(), e.limit.as_str()),
            ("tokens per day", "120", "100")
        );
        assert!(e.resets.ends_with("T00:00:00Z"), "{}", e.resets);
        q.count_agent("team-t");
        // Another namespace is not held by it.
        assert!(q.spent("team-x").is_none());
        // The next UTC day: reset.
        SHIFT.with(|s| s.set(Duration::from_secs(86_400)));
        assert!(q.spent("team-t").is_none(), "a new day, a new quota");
        SHIFT.with(|s| s.set(Duration::ZERO));
        assert!(q.spent("team-t").is_some(), "today's use is still today's");
    }

    #[test]
    fn a_certificate_s_organisation_is_its_scope() {
        assert_eq!(
            Scope::from_organisation(None),
            Scope::Only(vec!["default".into()])
        );
        assert_eq!(Scope::from_organisation(Some("*")), Scope::All);
        assert_eq!(
            Scope::from_organisation(Some("team-a, team-b,team-a,Bad Name")),
            Scope::Only(vec!["team-a".into(), "team-b".into()])
        );
        let s = Scope::from_organisation(Some("team-a,team-b"));
        assert_eq!(s.choose("", "alice").unwrap(), "team-a");
        assert_eq!(s.choose("team-b", "alice").unwrap(), "team-b");
        let e = s.choose("team-c", "alice").unwrap_err();
        assert!(
            e.message.contains("team-a, team-b") && e.message.contains("--namespace team-c"),
            "{e}"
        );
        assert!(
            s.choose("../x", "alice")
                .unwrap_err()
                .message
                .contains("not a namespace name")
        );
        assert_eq!(Scope::decode(&s.encode()), s);
        assert!(
            Scope::from_organisation(None).may(""),
            "runs from before namespaces"
        );
        assert!(!s.may("default"));
        assert_eq!(Scope::All.choose("", "op").unwrap(), DEFAULT);
        // A session token from before namespaces (no `ns`) shows `default` only.
        let old = crate::web::Claims {
            sub: "alice".into(),
            exp: u64::MAX,
            ns: None,
        };
        assert_eq!(old.scope(), Scope::Only(vec![DEFAULT.into()]));
    }

    #[test]
    fn policies_are_checked_and_the_rest_take_the_star_one() {
        let mut tables = BTreeMap::new();
        tables.insert(
            "team-a".to_owned(),
            Policy {
                weight: 3,
                ..Policy::default()
            },
        );
        tables.insert(
            "*".to_owned(),
            Policy {
                max_agents: Some(2),
                ..Policy::default()
            },
        );
        let n = Namespaces::new(tables).unwrap();
        assert_eq!(n.policy("team-a").weight, 3);
        assert_eq!(n.policy("other").max_agents, Some(2));
        for (name, bad, what) in [
            ("Team", Policy::default(), "not a namespace name"),
            (
                "t",
                Policy {
                    weight: 0,
                    ..Policy::default()
                },
                "namespaces.t.weight",
            ),
            (
                "t",
                Policy {
                    max_agents: Some(0),
                    ..Policy::default()
                },
                "max_agents",
            ),
            (
                "t",
                Policy {
                    usd_per_day: Some(f64::NAN),
                    ..Policy::default()
                },
                "usd_per_day",
            ),
        ] {
            let mut t = BTreeMap::new();
            t.insert(name.to_owned(), bad);
            let e = Namespaces::new(t).unwrap_err();
            assert!(e.message.contains(what), "{e}");
        }
    }

    #[test]
    fn a_price_costs_tokens_by_model_or_family() {
        let mut prices = BTreeMap::new();
        prices.insert(
            "sonnet".to_owned(),
            Price {
                input: 2.0,
                output: 10.0,
                cache_read: None,
                cache_write: None,
            },
        );
        let p = price_of(&prices, "claude-sonnet-4-5").expect("family");
        let u = UsageRecord {
            input_tokens: 1_000_000,
            output_tokens: 100_000,
            cache_read_tokens: 1_000_000,
            ..UsageRecord::default()
        };
        assert!((p.cost(&u) - (2.0 + 1.0 + 0.2)).abs() < 1e-9);
        assert!(price_of(&prices, "claude-opus-4-1").is_none());
    }

    /// A read of the stored count that was under way when the counts were reset (this
    /// coordinator leads again) is not added to what is counted after: the stored count is
    /// taken once.
    #[tokio::test]
    async fn a_reset_during_a_read_of_the_stored_count_counts_it_once() {
        let store = crate::store::open("memory://").unwrap();
        let (day, _) = today();
        store
            .put_overwrite(
                &crate::store::keys::namespace_usage("team-r", &day),
                Bytes::from(r#"{"agents":0,"tokens":100,"cost_usd":0.0}"#),
            )
            .await
            .unwrap();
        let q = Quotas::new(Namespaces::default(), Some(store), Default::default());
        q.take_agent("team-r").unwrap(); // starts a read of the stored count
        q.reset();
        q.ready("team-r").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let used = q
            .views()
            .into_iter()
            .find(|v| v.namespace == "team-r")
            .unwrap()
            .used;
        assert_eq!((used.agents, used.tokens), (0, 100), "{used:?}");
    }

    #[tokio::test]
    async fn daily_quotas_refuse_once_used_up_and_say_which_and_when_they_reset() {
        let mut tables = BTreeMap::new();
        tables.insert(
            "team-a".to_owned(),
            Policy {
                agents_per_day: Some(2),
                tokens_per_day: Some(1000),
                ..Policy::default()
            },
        );
        let store = crate::store::open("memory://").unwrap();
        let q = Quotas::new(
            Namespaces::new(tables.clone()).unwrap(),
            Some(store.clone()),
            Default::default(),
        );
        q.take_agent("team-a").unwrap();
        q.add(
            "team-a",
            &UsageRecord {
                input_tokens: 600,
                output_tokens: 500,
                ..UsageRecord::default()
            },
        );
        let e = q.take_agent("team-a").unwrap_err();
        assert_eq!(e.quota, "tokens per day");
        let text = e.to_string();
        assert!(
            text.starts_with(
                "QUOTA_EXCEEDED: namespace team-a has used its tokens per day (1100 of 1000"
            ) && text.contains("T00:00:00Z"),
            "{text}"
        );
        assert!(q.check("team-a").await.is_err());
        assert!(q.take_agent("team-b").is_ok(), "other namespaces go on");
        assert_eq!(
            q.refusals().get(&("team-a".to_owned(), "tokens per day")),
            Some(&2)
        );
        // Stored, and a successor (another process) goes on from it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            q.flush().await;
            let (day, _) = today();
            if let Some(body) = store
                .get(&crate::store::keys::namespace_usage("team-a", &day))
                .await
                .unwrap()
            {
                let used: DayUse = serde_json::from_slice(&body).unwrap();
                if used.tokens == 1100 {
                    break;
                }
            }
            assert!(std::time::Instant::now() < deadline, "never stored");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let next = Quotas::new(
            Namespaces::new(tables).unwrap(),
            Some(store),
            Default::default(),
        );
        let e = next.check("team-a").await.unwrap_err();
        assert_eq!(
            e.quota, "tokens per day",
            "the successor reads the stored count first"
        );
        assert_eq!(
            next.views()
                .iter()
                .find(|v| v.namespace == "team-a")
                .unwrap()
                .used
                .agents,
            1
        );
    }
}
