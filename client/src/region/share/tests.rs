use super::*;
use proptest::prelude::*;

const FLOOR: u32 = 50_000;
const LEASE: Duration = Duration::from_millis(500);
/// Equal to the lease: the tightest hold the proof allows (a pod's lease starts when its
/// read starts, before the write it did not see).
const HOLD: Duration = LEASE;

#[test]
fn targets_follow_demand_with_a_floor() {
    // (demands, floor, expected) numbered table cases.
    let cases: [(&[f64], u32, &[u32]); 6] = [
        (&[80.0, 10.0, 10.0], FLOOR, &[800_000, 100_000, 100_000]),
        (&[1.0, 1.0, 1.0], FLOOR, &[333_333, 333_333, 333_333]),
        (&[0.0, 0.0, 0.0], FLOOR, &[333_333, 333_333, 333_333]),
        // An idle region keeps the floor, for a sudden burst.
        (&[100.0, 0.0, 0.0], FLOOR, &[900_000, 50_000, 50_000]),
        (&[98.0, 1.0, 1.0], FLOOR, &[900_000, 50_000, 50_000]),
        (&[3.0, 1.0], 0, &[750_000, 250_000]),
    ];
    for (i, (demand, floor, want)) in cases.iter().enumerate() {
        assert_eq!(targets(demand, *floor), *want, "case {i}");
    }
}

#[test]
fn shrink_is_immediate_but_the_claim_holds_until_written_plus_hold() {
    let t0 = Instant::now();
    let mut s = Share::new(500_000);
    s.retarget(200_000, t0);
    assert_eq!(s.share(), 200_000);
    assert_eq!(
        s.claim(t0 + HOLD * 10),
        500_000,
        "not written yet: held for ever"
    );
    let w = t0 + Duration::from_millis(30);
    s.written(w, HOLD);
    assert_eq!(s.claim(w + HOLD - Duration::from_millis(1)), 500_000);
    assert_eq!(s.claim(w + HOLD), 200_000);
}

#[test]
fn step_by_step_shrinks_release_each_step_after_its_own_hold() {
    let t0 = Instant::now();
    let step = HOLD / 3;
    let mut s = Share::new(600_000);
    s.retarget(500_000, t0);
    s.written(t0, HOLD);
    s.retarget(400_000, t0 + step);
    s.written(t0 + step, HOLD);
    assert_eq!(s.claim(t0 + step), 600_000);
    assert_eq!(
        s.claim(t0 + HOLD),
        500_000,
        "the first step's hold is over, the second's is not"
    );
    assert_eq!(s.claim(t0 + step + HOLD), 400_000);
    // Expired holds are dropped as it keeps shrinking: the list stays short.
    for i in 0..100u32 {
        let at = t0 + step * (i + 2);
        s.retarget(400_000 - 1_000 * (i + 1), at);
        s.written(at, HOLD);
    }
    assert!(s.claim(t0 + step * 200) <= 300_000);
}

#[test]
fn growth_needs_every_peer_read_and_room() {
    let mut s = Share::new(FLOOR);
    s.retarget(800_000, Instant::now());
    let intent = s.intent(Instant::now());
    assert_eq!(intent, 800_000);
    assert!(!s.grow(intent, &[Some(100_000), None]), "a peer unread");
    assert_eq!(s.share(), FLOOR);
    assert!(s.grow(intent, &[Some(333_333), Some(333_333)]));
    assert_eq!(s.share(), 333_334, "only the room left");
    assert!(s.grow(intent, &[Some(100_000), Some(100_000)]));
    assert_eq!(s.share(), 800_000);
    // Never beyond what was published as the intent, even if the target rose since.
    s.retarget(900_000, Instant::now());
    assert!(!s.grow(intent, &[Some(FLOOR), Some(FLOOR)]));
    assert_eq!(s.share(), 800_000);
}

#[test]
fn restore_holds_the_records_claim() {
    let t0 = Instant::now();
    let s = Share::restore(300_000, 600_000, t0, HOLD);
    assert_eq!(s.share(), 300_000);
    assert_eq!(s.claim(t0), 600_000);
    assert_eq!(s.claim(t0 + HOLD), 300_000);
}

/// What a region's store holds: its published claim and share.
#[derive(Debug, Clone, Copy)]
struct Record {
    claim: u32,
    share: u32,
}

/// A pod that follows its region's record: it may use what it read until its lease ends,
/// then at most the floor.
#[derive(Debug, Clone, Copy)]
struct Follower {
    share: u32,
    lease_until: Instant,
}

impl Follower {
    fn uses(&self, now: Instant) -> u32 {
        if now < self.lease_until {
            self.share
        } else {
            self.share.min(FLOOR)
        }
    }
}

#[derive(Debug)]
struct Region {
    leader: Share,
    record: Option<Record>,
    followers: Vec<Follower>,
    /// A growth under way: the intent published and what was read of each peer so far
    /// (`Some(None)`: could not be read).
    growing: Option<(u32, Vec<Option<Option<u32>>>)>,
}

#[derive(Debug, Clone)]
enum Op {
    Retarget(usize, u32),
    Publish(usize),
    BeginGrow(usize),
    Read(usize, usize, bool),
    Apply(usize),
    Fetch(usize, usize),
    Failover(usize),
    Advance(u64),
}

fn op(n: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..n, FLOOR..=WHOLE).prop_map(|(r, t)| Op::Retarget(r, t)),
        (0..n).prop_map(Op::Publish),
        (0..n).prop_map(Op::BeginGrow),
        (0..n, 0..n, prop::bool::weighted(0.8)).prop_map(|(r, q, ok)| Op::Read(r, q, ok)),
        (0..n).prop_map(Op::Apply),
        (0..n, 0..2usize).prop_map(|(r, f)| Op::Fetch(r, f)),
        (0..n).prop_map(Op::Failover),
        (0..700u64).prop_map(Op::Advance),
    ]
}

struct World {
    regions: Vec<Region>,
    now: Instant,
}

impl World {
    fn new(n: usize) -> Self {
        let now = Instant::now();
        let regions = (0..n)
            .map(|_| Region {
                leader: Share::new(FLOOR),
                record: None,
                followers: vec![
                    Follower {
                        share: FLOOR,
                        lease_until: now,
                    };
                    2
                ],
                growing: None,
            })
            .collect();
        Self { regions, now }
    }

    /// A missing record counts at the floor.
    fn claim_of(&self, q: usize) -> u32 {
        self.regions[q].record.map_or(FLOOR, |r| r.claim)
    }

    fn in_use(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| {
                let followers = r.followers.iter().map(|f| f.uses(self.now));
                u64::from(followers.fold(r.leader.share(), u32::max))
            })
            .sum()
    }

    fn apply(&mut self, op: &Op) {
        let now = self.now;
        match *op {
            Op::Retarget(r, t) => self.regions[r].leader.retarget(t, now),
            Op::Publish(r) => {
                let reg = &mut self.regions[r];
                // The intent of a growth under way stays published until it is applied.
                if reg.growing.is_none() {
                    reg.record = Some(Record {
                        claim: reg.leader.claim(now),
                        share: reg.leader.share(),
                    });
                    reg.leader.written(now, HOLD);
                }
            }
            Op::BeginGrow(r) => {
                let reg = &mut self.regions[r];
                if reg.growing.is_none() {
                    let intent = reg.leader.intent(now);
                    let share = reg.record.map_or(FLOOR, |rec| rec.share);
                    reg.record = Some(Record {
                        claim: intent,
                        share,
                    });
                    let n = self.regions.len();
                    self.regions[r].growing = Some((intent, vec![None; n]));
                }
            }
            Op::Read(r, q, ok) => {
                let claim = self.claim_of(q);
                if let Some((_, reads)) = &mut self.regions[r].growing {
                    reads[q] = Some(ok.then_some(claim));
                }
            }
            Op::Apply(r) => {
                let Some((intent, reads)) = self.regions[r].growing.take() else {
                    return;
                };
                let others: Vec<Option<u32>> = reads
                    .iter()
                    .enumerate()
                    .filter(|(q, _)| *q != r)
                    .map(|(_, read)| read.flatten())
                    .collect();
                let reg = &mut self.regions[r];
                reg.leader.grow(intent, &others);
                reg.record = Some(Record {
                    claim: reg.leader.claim(now),
                    share: reg.leader.share(),
                });
                reg.leader.written(now, HOLD);
            }
            Op::Fetch(r, f) => {
                let reg = &mut self.regions[r];
                let share = reg.record.map_or(FLOOR, |rec| rec.share);
                reg.followers[f] = Follower {
                    share,
                    lease_until: now + LEASE,
                };
            }
            Op::Failover(r) => {
                // The old leader's pod becomes a follower with a lease from its last access;
                // the new one restores from the record.
                let reg = &mut self.regions[r];
                reg.followers.push(Follower {
                    share: reg.leader.share(),
                    lease_until: now + LEASE,
                });
                reg.growing = None;
                reg.leader = match reg.record {
                    Some(rec) => Share::restore(rec.share, rec.claim, now, HOLD),
                    None => Share::new(FLOOR),
                };
            }
            Op::Advance(ms) => self.now += Duration::from_millis(ms),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The invariant, under any interleaving of the regions' steps, unreadable peers,
    /// followers reading at any moment, leader failovers and arbitrary targets (they need
    /// not sum to the whole: regions compute them from figures of different ages).
    #[test]
    fn shares_in_use_never_sum_above_the_whole(
        (n, ops) in (2..=4usize).prop_flat_map(|n| (Just(n), prop::collection::vec(op(n), 1..200)))
    ) {
        let mut w = World::new(n);
        for (i, o) in ops.iter().enumerate() {
            w.apply(o);
            let used = w.in_use();
            prop_assert!(used <= u64::from(WHOLE), "after op {i} {o:?}: {used} in use");
        }
    }

    /// Targets never sum above the whole and give every region its floor.
    #[test]
    fn targets_fit(demands in prop::collection::vec(0.0..1e6f64, 1..6), floor in 0..200_000u32) {
        let t = targets(&demands, floor);
        let floor = floor.min(WHOLE / demands.len() as u32);
        prop_assert!(t.iter().map(|&x| u64::from(x)).sum::<u64>() <= u64::from(WHOLE));
        prop_assert!(t.iter().all(|&x| x >= floor), "{t:?}");
    }
}

/// With every step completing and figures readable, shares converge to the targets.
#[test]
fn converges_when_all_can_be_read() {
    let mut w = World::new(3);
    let wanted = targets(&[80.0, 10.0, 10.0], FLOOR);
    for round in 0..4 {
        for (r, &target) in wanted.iter().enumerate() {
            w.apply(&Op::Retarget(r, target));
            w.apply(&Op::Publish(r));
        }
        w.apply(&Op::Advance(HOLD.as_millis() as u64));
        for r in 0..3 {
            w.apply(&Op::Publish(r));
            w.apply(&Op::BeginGrow(r));
            for q in 0..3 {
                w.apply(&Op::Read(r, q, true));
            }
            w.apply(&Op::Apply(r));
        }
        assert!(w.in_use() <= u64::from(WHOLE), "round {round}");
    }
    let shares: Vec<u32> = w.regions.iter().map(|r| r.leader.share()).collect();
    assert_eq!(shares, wanted);
}
