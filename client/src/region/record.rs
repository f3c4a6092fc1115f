//! What a region keeps in its own store, and how it is read and written.
//!
//! ```text
//! <prefix>:{region.<r>}          hash, written by region r's leader only:
//!                                  <policy>:claim  ppm   (see share::Share::claim)
//!                                  <policy>:share  ppm   (what r's pods use; followers read it)
//!                                  <policy>:demand f64   (smoothed offered cost per second)
//!                                  <policy>:still  "ms count": when the region's count
//!                                                  last moved, on the server's clock (ms
//!                                                  since the epoch), and that count;
//!                                                  written once it stops moving
//!                                                  (and once by each new leader)
//!                                  <policy>:s:<subject>  "claim share demand hot": an entry
//!                                                        (see split), <subject> in 16 hex
//! <prefix>:{region.<r>}:demand   hash, <policy> -> cumulative offered cost (HINCRBY by every pod)
//! <prefix>:{region.<r>}:hot      hash, <policy>:<subject> -> offered cost of the pods' busiest
//!                                subjects since the leader last took them (HINCRBY, then
//!                                read and deleted at once by the leader); <policy>:rate ->
//!                                the policy's limit per second × 1000, rounded, at least 1,
//!                                as the pods that report subjects for it know it (HSET; a
//!                                leader that has not met the policy learns its limit here)
//! <prefix>:{region.<r>}:leader   string, the leader pod's id, with a TTL (the leader lease)
//! ```
//!
//! One hash tag, so a region on a cluster answers a round trip from one node.
//!
//! Every region *reads* the others' records; no region writes to another's store. So a
//! record has one writer, a write never half-fails across regions, and a region that
//! cannot be reached only stops its peers from growing (the safe direction).

use super::split::{Claims, Subject};
use super::RegionTarget;
use crate::background::BackgroundConn;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// A store that sync talks to: one region's server or cluster.
#[derive(Clone)]
pub(crate) struct RegionStore {
    conn: BackgroundConn,
    /// `<prefix>:{region.<r>}` (the other keys add a suffix, on the same slot).
    record_key: String,
    demand_key: String,
    hot_key: String,
    leader_key: String,
}

impl std::fmt::Debug for RegionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionStore")
            .field("record_key", &self.record_key)
            .finish()
    }
}

/// One policy's figures in a record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Figures {
    pub(crate) claim: Option<u32>,
    pub(crate) share: Option<u32>,
    pub(crate) demand: Option<f64>,
    pub(crate) still: Option<Still>,
}

/// When a policy's demand count last moved, as its leader metered it: so that the next
/// leader goes on from there rather than starting the idle clock again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Still {
    /// The server's time then, in ms since the epoch.
    pub(crate) ms: u64,
    /// The count from then on.
    pub(crate) count: u64,
}

impl Still {
    fn parse(v: &str) -> Option<Self> {
        let (ms, count) = v.split_once(' ')?;
        Some(Self {
            ms: ms.parse().ok()?,
            count: count.parse().ok()?,
        })
    }
}

/// One entry's figures in a record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EntryFigures {
    pub(crate) claim: u32,
    pub(crate) share: u32,
    pub(crate) demand: f64,
    pub(crate) hot: bool,
}

impl EntryFigures {
    fn parse(v: &str) -> Option<Self> {
        let mut it = v.split(' ');
        let claim = it.next()?.parse().ok()?;
        let share = it.next()?.parse().ok()?;
        let demand = it.next()?.parse().ok()?;
        let hot = it.next()? == "1";
        Some(Self {
            claim,
            share,
            demand,
            hot,
        })
    }

    fn encode(&self) -> String {
        format!(
            "{} {} {} {}",
            self.claim,
            self.share,
            self.demand,
            u8::from(self.hot)
        )
    }
}

/// A policy's own fields in a record, each `<policy>:<figure>`.
const FIGURES: [&str; 4] = ["claim", "share", "demand", "still"];

/// A limit per second as the `hot` hash holds it: × 1000, rounded, and at least 1. A limit
/// under 0.0005/s (under 1.8 an hour) would round to 0, and a leader judging subjects by a
/// zero limit would mark nearly every subject of the policy hot; 1 (0.001/s) is within the
/// rounding of such a limit, and errs towards marking fewer.
fn milli_rate(rate: f64) -> u64 {
    (rate * 1000.0).round().max(1.0) as u64
}

/// The record field of `policy`'s entry for `subject`.
fn entry_field(policy: &str, subject: Subject) -> String {
    format!("{policy}:s:{subject:016x}")
}

/// A record as read, its entries indexed by policy once: a leader's round looks up every
/// policy it leads in every peer's record, and a scan of the fields per lookup made that
/// quadratic in the policies (thousands of run-time ones).
#[derive(Debug, Clone, Default)]
pub(crate) struct Record {
    fields: HashMap<String, String>,
    /// Each policy's entries; `None` where one of its entry fields does not parse.
    entries: HashMap<String, Option<Vec<(Subject, EntryFigures)>>>,
}

impl From<HashMap<String, String>> for Record {
    fn from(fields: HashMap<String, String>) -> Self {
        let mut entries: HashMap<String, Option<Vec<(Subject, EntryFigures)>>> = HashMap::new();
        for (k, v) in &fields {
            if figure_of(k).is_some() {
                continue;
            }
            let Some((policy, x)) = k.rsplit_once(":s:") else {
                continue;
            };
            let parsed = parse_subject(x).zip(EntryFigures::parse(v));
            let list = entries
                .entry(policy.to_owned())
                .or_insert_with(|| Some(Vec::new()));
            match (list.as_mut(), parsed) {
                (Some(list), Some(entry)) => list.push(entry),
                _ => *list = None,
            }
        }
        Self { fields, entries }
    }
}

/// The policy whose own figure `field` is (`<policy>:claim`, say).
fn figure_of(field: &str) -> Option<&str> {
    FIGURES
        .iter()
        .find_map(|f| field.strip_suffix(f)?.strip_suffix(':'))
}

impl Record {
    pub(crate) fn figures(&self, policy: &str) -> Figures {
        let get = |field: &str| self.fields.get(&format!("{policy}:{field}"));
        Figures {
            claim: get("claim").and_then(|v| v.parse().ok()),
            share: get("share").and_then(|v| v.parse().ok()),
            demand: get("demand").and_then(|v| v.parse().ok()),
            still: get("still").and_then(|v| Still::parse(v)),
        }
    }

    /// `policy`'s entries; `None` if any of its entry fields does not parse as this code
    /// writes it (16 lowercase hex digits, four figures): such a record is not trusted,
    /// since a dropped entry would read as the policy's claim, which may be lower.
    pub(crate) fn entries(&self, policy: &str) -> Option<Vec<(Subject, EntryFigures)>> {
        self.entries
            .get(policy)
            .cloned()
            .unwrap_or(Some(Vec::new()))
    }

    /// The policies this record has any field for.
    pub(crate) fn policies(&self) -> BTreeSet<&str> {
        self.fields
            .keys()
            .filter_map(|k| figure_of(k).or_else(|| k.rsplit_once(":s:").map(|(p, _)| p)))
            .collect()
    }

    /// The claims this record makes for `policy` (a missing figure counts at `floor`);
    /// `None` if its entries cannot be read (then the peer counts as unreadable: rule 3).
    pub(crate) fn claims(&self, policy: &str, floor: u32) -> Option<Claims> {
        Some(Claims {
            policy: self.figures(policy).claim.unwrap_or(floor),
            entries: self
                .entries(policy)?
                .into_iter()
                .map(|(x, e)| (x, e.claim))
                .collect(),
        })
    }
}

/// A subject as written in a field: exactly 16 lowercase hex digits.
fn parse_subject(x: &str) -> Option<Subject> {
    let canonical = x.len() == 16 && x.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    canonical
        .then(|| Subject::from_str_radix(x, 16).ok())
        .flatten()
}

/// What the leader publishes for one policy.
#[derive(Debug)]
pub(crate) struct Publication<'a> {
    pub(crate) policy: &'a str,
    pub(crate) claim: u32,
    pub(crate) share: u32,
    pub(crate) demand: f64,
    /// The idle clock, where it is to be written.
    pub(crate) still: Option<Still>,
    pub(crate) entries: Vec<(Subject, EntryFigures)>,
    /// Entries removed since the last publication.
    pub(crate) removed: Vec<Subject>,
}

/// A policy the leader forgot: its fields (figures and entries) leave the record.
#[derive(Debug, Clone)]
pub(crate) struct Forgotten {
    pub(crate) policy: Arc<str>,
    /// Its entries' subjects.
    pub(crate) entries: Vec<Subject>,
}

/// If a candidate (`ARGV[3]`), renews the lease if this pod holds it (1), takes it if
/// nobody does (2); else 0. With the server's time, in ms since the epoch.
const LEASE_LUA: &str = r"
local t = redis.call('TIME')
local held = 0
if ARGV[3] == '1' then
  local cur = redis.call('GET', KEYS[1])
  if cur == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) held = 1
  elseif not cur then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) held = 2 end
end
return {held, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}";

/// The leader's write: `KEYS` the record, the leader key and the demand hash; `ARGV` the
/// pod id, the number of record fields to delete, those fields, the number of demand
/// counters to delete, each counter with the count it was forgotten at (a missing counter
/// counts 0), then record field/value pairs to set. A counter that moved since is kept:
/// a pod counted demand after the leader's last read, and the next round leads it again.
/// Nothing unless the pod holds the lease. One field per call: no `unpack` of a list that
/// could pass Lua's limit.
const PUBLISH_LUA: &str = r"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[2])
for i = 3, 2 + n do redis.call('HDEL', KEYS[1], ARGV[i]) end
local m = tonumber(ARGV[3 + n])
for i = 4 + n, 3 + n + 2 * m, 2 do
  if (redis.call('HGET', KEYS[3], ARGV[i]) or '0') == ARGV[i + 1] then
    redis.call('HDEL', KEYS[3], ARGV[i])
  end
end
for i = 4 + n + 2 * m, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1";

/// What the leader took from the pods' reports (see [`RegionStore::take_hot`]).
#[derive(Debug, Default)]
pub(crate) struct Taken {
    /// By policy, offered cost per subject.
    pub(crate) subjects: HashMap<String, Vec<(Subject, u64)>>,
    /// By policy, its limit per second as the pods checking it know it.
    pub(crate) rates: HashMap<String, f64>,
}

/// What one sync round trip to the pod's own store answered.
#[derive(Debug)]
pub(crate) struct OwnRound {
    pub(crate) leader: bool,
    /// The lease was free and this round took it (rather than renewing it): whatever this
    /// pod knew from leading before is stale, another may have led in between.
    pub(crate) took_lease: bool,
    /// The server's time, in ms since the epoch.
    pub(crate) server_ms: u64,
    pub(crate) record: Record,
    /// Cumulative offered cost per policy, all pods of the region.
    pub(crate) offered: HashMap<String, u64>,
}

impl RegionStore {
    pub(crate) fn open(
        target: &RegionTarget,
        prefix: &str,
        region: usize,
        connect_timeout: Duration,
    ) -> redis::RedisResult<Self> {
        let conn = BackgroundConn::open(target, connect_timeout)?;
        let record_key = format!("{prefix}:{{region.{region}}}");
        Ok(Self {
            conn,
            demand_key: format!("{record_key}:demand"),
            hot_key: format!("{record_key}:hot"),
            leader_key: format!("{record_key}:leader"),
            record_key,
        })
    }

    /// One round trip: adds this pod's offered cost, its busiest subjects' and the limits
    /// (per second) of the policies it reports subjects for (`rates`), renews or takes the
    /// leader lease (if `candidate`), reads the server's time, the region's record and
    /// demand counters.
    pub(crate) async fn own_round(
        &self,
        offered: &[(&str, u64)],
        hot: &[(&str, Subject, u64)],
        rates: &[(&str, f64)],
        pod_id: &str,
        lease: Duration,
        candidate: bool,
    ) -> redis::RedisResult<OwnRound> {
        let mut pipe = redis::pipe();
        for (policy, n) in offered {
            pipe.cmd("HINCRBY")
                .arg(&self.demand_key)
                .arg(*policy)
                .arg((*n).min(i64::MAX as u64))
                .ignore();
        }
        for (policy, subject, n) in hot {
            pipe.cmd("HINCRBY")
                .arg(&self.hot_key)
                .arg(format!("{policy}:{subject:016x}"))
                .arg((*n).min(i64::MAX as u64))
                .ignore();
        }
        for (policy, rate) in rates {
            pipe.cmd("HSET")
                .arg(&self.hot_key)
                .arg(format!("{policy}:rate"))
                .arg(milli_rate(*rate))
                .ignore();
        }
        pipe.cmd("EVAL")
            .arg(LEASE_LUA)
            .arg(1)
            .arg(&self.leader_key)
            .arg(pod_id)
            .arg(lease.as_millis().max(1) as u64)
            .arg(u8::from(candidate));
        pipe.cmd("HGETALL").arg(&self.record_key);
        pipe.cmd("HGETALL").arg(&self.demand_key);
        type Reply = ((i64, u64), HashMap<String, String>, HashMap<String, u64>);
        let ((leader, server_ms), record, counters): Reply =
            pipe.query_async(&mut self.conn.live().await?).await?;
        Ok(OwnRound {
            leader: leader >= 1,
            took_lease: leader == 2,
            server_ms,
            record: record.into(),
            offered: counters,
        })
    }

    /// Writes this region's figures if `pod_id` still holds the leader's lease, in one
    /// script: a pod reads a record whole, before or after, and a leader that stalled past
    /// its lease cannot overwrite its successor's figures with stale ones (shares could then
    /// sum above the whole until the next lease ran out). Whether it wrote.
    pub(crate) async fn publish(
        &self,
        figures: &[Publication<'_>],
        forgotten: &[&Forgotten],
        counters: &[(&str, u64)],
        pod_id: &str,
    ) -> redis::RedisResult<bool> {
        let mut removed: Vec<String> = figures
            .iter()
            .flat_map(|f| f.removed.iter().map(|x| entry_field(f.policy, *x)))
            .collect();
        for f in forgotten {
            let p = &f.policy;
            removed.extend(FIGURES.map(|x| format!("{p}:{x}")));
            removed.extend(f.entries.iter().map(|x| entry_field(p, *x)));
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(PUBLISH_LUA)
            .arg(3)
            .arg(&self.record_key)
            .arg(&self.leader_key)
            .arg(&self.demand_key)
            .arg(pod_id)
            .arg(removed.len())
            .arg(removed)
            .arg(counters.len());
        for (c, count) in counters {
            cmd.arg(*c).arg(*count);
        }
        for f in figures {
            cmd.arg(format!("{}:claim", f.policy))
                .arg(f.claim)
                .arg(format!("{}:share", f.policy))
                .arg(f.share)
                .arg(format!("{}:demand", f.policy))
                .arg(f.demand);
            if let Some(still) = f.still {
                cmd.arg(format!("{}:still", f.policy))
                    .arg(format!("{} {}", still.ms, still.count));
            }
            for (x, e) in &f.entries {
                cmd.arg(entry_field(f.policy, *x)).arg(e.encode());
            }
        }
        let wrote: i64 = cmd.query_async(&mut self.conn.live().await?).await?;
        Ok(wrote == 1)
    }

    /// Takes the pods' counts of their busiest subjects since the last take (the leader
    /// only): by policy, offered cost per subject; and the policies' limits they wrote.
    pub(crate) async fn take_hot(&self) -> redis::RedisResult<Taken> {
        let (counts,): (HashMap<String, u64>,) = redis::pipe()
            .atomic()
            .cmd("HGETALL")
            .arg(&self.hot_key)
            .cmd("DEL")
            .arg(&self.hot_key)
            .ignore()
            .query_async(&mut self.conn.live().await?)
            .await?;
        let mut out = Taken::default();
        for (field, n) in counts {
            let Some((policy, x)) = field.rsplit_once(':') else {
                continue;
            };
            if x == "rate" {
                out.rates.insert(policy.to_owned(), n as f64 / 1000.0);
            } else if let Some(x) = parse_subject(x) {
                out.subjects
                    .entry(policy.to_owned())
                    .or_default()
                    .push((x, n));
            }
        }
        Ok(out)
    }

    /// Reads a region's record (a peer's, from its own store).
    pub(crate) async fn read(&self) -> redis::RedisResult<Record> {
        redis::cmd("HGETALL")
            .arg(&self.record_key)
            .query_async::<HashMap<String, String>>(&mut self.conn.live().await?)
            .await
            .map(Record::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis_ratelimit_testkit::{Flavor, Server};

    /// A leader whose lease passed to another pod writes nothing: its figures, however it
    /// stalled, cannot overwrite its successor's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_pod_holding_the_lease_publishes() {
        let server = Server::start(Flavor::Redis.or_selected());
        let target = RegionTarget::Server(server.url());
        let store = RegionStore::open(&target, "rl", 0, Duration::from_secs(1)).unwrap();
        let figures = |claim, removed: Vec<Subject>| Publication {
            policy: "api",
            claim,
            share: claim,
            demand: 1.0,
            still: None,
            entries: vec![(
                0xab,
                EntryFigures {
                    claim,
                    share: claim,
                    demand: 1.0,
                    hot: true,
                },
            )],
            removed,
        };
        // The record as a pod reads it: the policy's claim, and its entries.
        let read = || async {
            let r = store.read().await.unwrap();
            (r.figures("api").claim, r.entries("api").map(|e| e.len()))
        };
        let lease = Duration::from_secs(10);
        let round = store
            .own_round(&[], &[], &[], "a", lease, true)
            .await
            .unwrap();
        assert!(
            round.leader && round.took_lease,
            "pod a takes the free lease"
        );
        // The server's clock, as `TIME` reads it just after.
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut server.conn()).unwrap();
        let time = secs * 1000 + micros / 1000;
        assert!(
            (time.saturating_sub(1_000)..=time).contains(&round.server_ms),
            "{} against {time}",
            round.server_ms
        );
        let round = store
            .own_round(&[], &[], &[], "a", lease, true)
            .await
            .unwrap();
        assert!(round.leader && !round.took_lease, "and renews it");
        assert!(store
            .publish(&[figures(600_000, vec![])], &[], &[], "a")
            .await
            .unwrap());
        assert_eq!(read().await, (Some(600_000), Some(1)));

        // The lease runs out while pod a stalls, and pod b takes it.
        let mut c = server.conn();
        let _: () = redis::cmd("DEL")
            .arg(&store.leader_key)
            .query(&mut c)
            .unwrap();
        let round = store
            .own_round(&[("api", 4)], &[], &[], "b", lease, true)
            .await
            .unwrap();
        assert!(round.leader, "pod b takes the lease");
        assert!(store
            .publish(&[figures(300_000, vec![])], &[], &[], "b")
            .await
            .unwrap());
        // Pod a, late: neither its figures nor its removals land, nor its forgetting.
        let stale = figures(900_000, vec![0xab]);
        let forgot = Forgotten {
            policy: "api".into(),
            entries: vec![0xab],
        };
        let gone = store
            .publish(&[stale], &[&forgot], &[("api", 4)], "a")
            .await;
        assert!(!gone.unwrap());
        assert_eq!(read().await, (Some(300_000), Some(1)));
        let counted: Option<u64> = redis::cmd("HGET")
            .arg(&store.demand_key)
            .arg("api")
            .query(&mut c)
            .unwrap();
        assert_eq!(
            counted,
            Some(4),
            "the stale leader deleted a demand counter"
        );
        // Pod b's lease runs out too, and pod a takes it back: taken, not renewed, so it
        // leads from the record (b's figures), not from what it knew before.
        let _: () = redis::cmd("DEL")
            .arg(&store.leader_key)
            .query(&mut c)
            .unwrap();
        let round = store
            .own_round(&[], &[], &[], "a", lease, true)
            .await
            .unwrap();
        assert!(round.leader && round.took_lease);
    }

    /// A forgotten policy's fields, its entries' included, leave the record and its counter
    /// the demand hash; another policy's stay.
    #[tokio::test]
    async fn a_forgotten_policy_leaves_the_record_and_the_demand_hash() {
        let server = Server::start(Flavor::Redis.or_selected());
        let target = RegionTarget::Server(server.url());
        let store = RegionStore::open(&target, "rl", 0, Duration::from_secs(1)).unwrap();
        let figures = |policy| Publication {
            policy,
            claim: 300_000,
            share: 300_000,
            demand: 2.0,
            still: Some(Still {
                ms: 1_796_309_398_400,
                count: 5,
            }),
            entries: vec![(0xab, EntryFigures::parse("300000 300000 2 1").unwrap())],
            removed: vec![],
        };
        let lease = Duration::from_secs(10);
        let offered = [("api", 5), ("tenant-7", 3), ("web", 4)];
        let round = store
            .own_round(&offered, &[], &[], "a", lease, true)
            .await
            .unwrap();
        assert!(round.leader);
        let both = [figures("api"), figures("tenant-7")];
        assert!(store.publish(&both, &[], &[], "a").await.unwrap());
        let mut c = server.conn();
        let mut fields = |key: &str| -> Vec<String> {
            let mut f: Vec<String> = redis::cmd("HKEYS").arg(key).query(&mut c).unwrap();
            f.sort();
            f
        };
        assert_eq!(fields(&store.record_key).len(), 10);
        assert_eq!(fields(&store.demand_key), ["api", "tenant-7", "web"]);

        let forgot = Forgotten {
            policy: "tenant-7".into(),
            entries: vec![0xab],
        };
        // `web` forgotten at 3, but a pod has counted it since (4): its counter stays.
        let counters = [("tenant-7", 3), ("web", 3)];
        assert!(store
            .publish(&[figures("api")], &[&forgot], &counters, "a")
            .await
            .unwrap());
        let kept = [
            "api:claim",
            "api:demand",
            "api:s:00000000000000ab",
            "api:share",
            "api:still",
        ];
        assert_eq!(fields(&store.record_key), kept);
        assert_eq!(fields(&store.demand_key), ["api", "web"]);
        let read = store.read().await.unwrap();
        let still = read.figures("api").still;
        assert_eq!(still.map(|s| (s.ms, s.count)), Some((1_796_309_398_400, 5)));
        assert_eq!(read.figures("tenant-7").claim, None);
        assert_eq!(read.entries("tenant-7"), Some(vec![]));
    }

    /// The pods' subjects and limits reach the leader once, and then the hash is empty.
    #[tokio::test]
    async fn the_pods_limits_reach_the_leader_with_their_subjects() {
        let server = Server::start(Flavor::Redis.or_selected());
        let target = RegionTarget::Server(server.url());
        let store = RegionStore::open(&target, "rl", 0, Duration::from_secs(1)).unwrap();
        let lease = Duration::from_secs(10);
        let hot = [("api", 0xab, 7), ("api", 0xcd, 2), ("web:v2", 0xab, 1)];
        let rates = [
            ("api", 300.0),
            ("web:v2", 1.0 / 3.0),
            ("rare", 1.0 / 3_600.0),
        ];
        let round = store.own_round(&[], &hot, &rates, "a", lease, true);
        assert!(round.await.unwrap().leader);
        let round = store.own_round(&[], &[("api", 0xab, 1)], &[], "b", lease, false);
        let round = round.await.unwrap();
        assert!(!round.leader && round.server_ms > 0, "{round:?}");
        let mut taken = store.take_hot().await.unwrap();
        let mut api = taken.subjects.remove("api").unwrap_or_default();
        api.sort_unstable();
        assert_eq!(api, [(0xab, 8), (0xcd, 2)]);
        assert_eq!(taken.subjects.remove("web:v2"), Some(vec![(0xab, 1)]));
        assert!(taken.subjects.is_empty(), "{:?}", taken.subjects);
        assert_eq!(taken.rates.get("api"), Some(&300.0));
        assert_eq!(taken.rates.get("web:v2"), Some(&0.333));
        // One an hour: read as the smallest limit the field holds, not as no limit.
        assert_eq!(taken.rates.get("rare"), Some(&0.001));
        let again = store.take_hot().await.unwrap();
        assert!(again.subjects.is_empty() && again.rates.is_empty());
    }

    /// A record's policies, names with colons too.
    #[test]
    fn the_policies_a_record_holds() {
        let entry = |x: &str| format!("{}:s:{}", x, "0".repeat(15) + "1");
        let (a, c) = (entry("a:b"), entry("d"));
        let r = record(&[
            ("a:b:claim", "50"),
            ("a:b:share", "50"),
            (&a, "50 50 0 0"),
            ("c:share", "50"),
            (&c, "50 50 0 0"),
            ("e:demand", "1.5"),
            ("f:still", "1796309398400 12"),
            ("g:still", "1796309398400"),
        ]);
        assert_eq!(
            r.policies().into_iter().collect::<Vec<_>>(),
            ["a:b", "c", "d", "e", "f", "g"]
        );
        let still = |p| r.figures(p).still.map(|s| (s.ms, s.count));
        assert_eq!(still("f"), Some((1_796_309_398_400, 12)));
        // One figure missing: not known (the clock starts again), not read as zero.
        assert_eq!(still("g"), None);
        assert_eq!(still("e"), None);
    }

    fn record(fields: &[(&str, &str)]) -> Record {
        fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<HashMap<_, _>>()
            .into()
    }

    #[test]
    fn entries_round_trip_and_a_bad_one_distrusts_the_record() {
        let e = EntryFigures {
            claim: 700_000,
            share: 650_000,
            demand: 12.5,
            hot: true,
        };
        let field = entry_field("api", 0xab);
        assert_eq!(field, "api:s:00000000000000ab");
        let good = record(&[("api:claim", "300000"), (&field, &e.encode())]);
        assert_eq!(good.entries("api"), Some(vec![(0xab, e)]));
        let claims = good.claims("api", 50_000).unwrap();
        assert_eq!((claims.policy, claims.of(Some(0xab))), (300_000, 700_000));
        // Not as written here: upper case, short, signed, or a value missing a figure.
        for (k, v) in [
            ("api:s:00000000000000AB", "1 1 1 1"),
            ("api:s:ab", "1 1 1 1"),
            ("api:s:+0000000000000ab", "1 1 1 1"),
            ("api:s:00000000000000ab", "1 1 1"),
        ] {
            let bad = record(&[("api:claim", "300000"), (k, v)]);
            assert_eq!(bad.entries("api"), None, "{k} = {v}");
            assert_eq!(bad.claims("api", 50_000), None, "{k} = {v}");
        }
        // Another policy's bad field says nothing of this one.
        let other = record(&[("api:claim", "300000"), ("web:s:zz", "x")]);
        assert_eq!(other.entries("api"), Some(Vec::new()));
        // A good entry beside a bad one: not trusted either, whichever is indexed first.
        let mixed = record(&[(&field, &e.encode()), ("api:s:ab", "1 1 1 1")]);
        assert_eq!(mixed.entries("api"), None);
        // A policy whose name holds ":s:" has its own fields, not `api`'s.
        let nested = entry_field("api:s:v2", 0xab);
        let named = record(&[
            (&field, &e.encode()),
            (&nested, &e.encode()),
            ("api:s:v2:claim", "1"),
        ]);
        assert_eq!(named.entries("api"), Some(vec![(0xab, e)]));
        assert_eq!(named.entries("api:s:v2"), Some(vec![(0xab, e)]));
    }
}
