use super::*;

fn name(s: &str) -> Arc<str> {
    Arc::from(s)
}

fn terms(now: Instant) -> Terms {
    Terms {
        max_waiting: 100,
        window: Duration::from_secs(10),
        now,
    }
}

/// Enters and expects to wait.
fn wait(
    q: &Arc<Queue>,
    tenant: &str,
    class: Class,
    weight: u32,
    places: Places,
    now: Instant,
) -> Waiter {
    match q.enter(&name(tenant), class, weight, || places, terms(now)) {
        Ok(Entry::Wait(w)) => w,
        Ok(Entry::Pass(_)) => panic!("{tenant} passed"),
        Err(e) => panic!("{tenant}: {e:?}"),
    }
}

fn pass(q: &Arc<Queue>, tenant: &str, places: Places, now: Instant) -> Pass {
    match q.enter(&name(tenant), Class::Standard, 1, || places, terms(now)) {
        Ok(Entry::Pass(p)) => p,
        Ok(Entry::Wait(_)) => panic!("{tenant} waits"),
        Err(e) => panic!("{tenant}: {e:?}"),
    }
}

/// Which of `waiters` were let through (their passes kept in `passes`).
fn through(waiters: &mut [(String, Waiter)], passes: &mut Vec<Pass>) -> Vec<String> {
    let mut out = Vec::new();
    for (who, w) in waiters.iter_mut() {
        if let Ok(Verdict::Go(p)) = w.rx.try_recv() {
            out.push(who.clone());
            passes.push(p);
        }
    }
    out
}

const FULL: Places = Places {
    free: 0,
    total: 100,
};

#[test]
fn tenants_take_turns_by_weight() {
    let q = Arc::new(Queue::default());
    let now = Instant::now();
    let mut waiters = Vec::new();
    for i in 0..8 {
        waiters.push((
            format!("a{i}"),
            wait(&q, "a", Class::Standard, 3, FULL, now),
        ));
        waiters.push((
            format!("b{i}"),
            wait(&q, "b", Class::Standard, 1, FULL, now),
        ));
    }
    let mut passes = Vec::new();
    let mut order = Vec::new();
    for _ in 0..8 {
        let free = passes.len() + 1;
        q.dispatch(|| Places { free, total: 100 }, terms(now));
        order.extend(through(&mut waiters, &mut passes));
    }
    assert_eq!(order, ["a0", "a1", "a2", "b0", "a3", "a4", "a5", "b1"]);
    assert_eq!(q.waiting(), 16, "waiters count until they drop");
}

#[test]
fn priority_goes_first_and_a_pass_holds_its_free_place_until_placed() {
    let q = Arc::new(Queue::default());
    let now = Instant::now();
    let mut waiters = vec![
        ("s".to_owned(), wait(&q, "s", Class::Standard, 1, FULL, now)),
        ("p".to_owned(), wait(&q, "p", Class::Priority, 1, FULL, now)),
        (
            "s2".to_owned(),
            wait(&q, "s", Class::Standard, 1, FULL, now),
        ),
    ];
    let mut passes = Vec::new();
    let one = Places {
        free: 1,
        total: 100,
    };
    q.dispatch(|| one, terms(now));
    assert_eq!(through(&mut waiters, &mut passes), ["p"]);
    // Let through, not placed: the free place is its.
    q.dispatch(|| one, terms(now));
    assert!(through(&mut waiters, &mut passes).is_empty());
    passes[0].placed();
    q.dispatch(|| one, terms(now));
    assert_eq!(through(&mut waiters, &mut passes), ["s"]);
    q.dispatch(
        || Places {
            free: 2,
            total: 100,
        },
        terms(now),
    );
    assert_eq!(through(&mut waiters, &mut passes), ["s2"]);
}

#[test]
fn a_flood_is_held_to_what_a_quiet_tenant_leaves_and_has_everything_alone() {
    let q = Arc::new(Queue::default());
    let t0 = Instant::now();
    let places = |free| Places { free, total: 4 };
    // An agent's turn, then its pause: it keeps the one place it used.
    drop(pass(&q, "agent", places(4), t0));
    let mut flood: Vec<Pass> = (0..3).map(|_| pass(&q, "flood", places(4), t0)).collect();
    flood.iter_mut().for_each(Pass::placed);
    let mut waiting = wait(&q, "flood", Class::Standard, 1, places(1), t0);
    // The agent comes back: the free place is its own.
    let agent = wait(&q, "agent", Class::Standard, 1, places(1), t0);
    let mut agent = [("agent".to_owned(), agent)];
    let mut passes = Vec::new();
    assert_eq!(through(&mut agent, &mut passes), ["agent"]);
    assert!(waiting.rx.try_recv().is_err());
    // Alone past the window, the flood has every place.
    drop(passes);
    let later = t0 + Duration::from_secs(11);
    q.dispatch(|| places(1), terms(later));
    assert!(matches!(waiting.rx.try_recv(), Ok(Verdict::Go(_))));
}

#[test]
fn a_full_queue_pushes_out_the_longest_tenant_never_a_shorter_one() {
    let q = Arc::new(Queue::default());
    let now = Instant::now();
    let t = Terms {
        max_waiting: 4,
        ..terms(now)
    };
    let flood = name("flood");
    let enter = |tenant: &Arc<str>| q.enter(tenant, Class::Standard, 1, || FULL, t);
    let mut held: Vec<Waiter> = (0..4)
        .map(|_| match enter(&flood) {
            Ok(Entry::Wait(w)) => w,
            _ => panic!("flood"),
        })
        .collect();
    // The flood cannot grow past the bound...
    assert_eq!(enter(&flood).err(), Some(Turned::Full));
    // ...and a quiet tenant gets in: the flood's newest is pushed out.
    let Ok(Entry::Wait(mut quiet)) = enter(&name("quiet")) else {
        panic!("quiet")
    };
    assert!(matches!(held[3].rx.try_recv(), Ok(Verdict::PushedOut)));
    held.pop();
    assert_eq!(q.waiting(), 4);
    q.dispatch(
        || Places {
            free: 2,
            total: 100,
        },
        t,
    );
    assert!(matches!(held[0].rx.try_recv(), Ok(Verdict::Go(_))));
    assert!(matches!(quiet.rx.try_recv(), Ok(Verdict::Go(_))));
}

#[test]
fn waiters_that_gave_up_are_skipped_and_purged() {
    let q = Arc::new(Queue::default());
    let now = Instant::now();
    let t = Terms {
        max_waiting: 4,
        ..terms(now)
    };
    for _ in 0..100 {
        drop(q.enter(&name("a"), Class::Standard, 1, || FULL, t));
    }
    assert_eq!(q.waiting(), 0);
    assert!(q.lock().entries <= 2 * 4 + 16 + 1, "{}", q.lock().entries);
    let Ok(Entry::Wait(mut live)) = q.enter(&name("a"), Class::Standard, 1, || FULL, t) else {
        panic!("a")
    };
    q.dispatch(
        || Places {
            free: 1,
            total: 100,
        },
        t,
    );
    assert!(matches!(live.rx.try_recv(), Ok(Verdict::Go(_))));
    assert_eq!(q.lock().entries, 0);
}

#[test]
fn a_waiter_gives_up_at_its_deadline_and_looks_for_room_meanwhile() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let q = Arc::new(Queue::default());
    let looks = std::cell::Cell::new(0);
    let w = wait(&q, "a", Class::Standard, 1, FULL, Instant::now());
    let deadline = Instant::now() + Duration::from_millis(120);
    let r = rt.block_on(w.wait(deadline, || looks.set(looks.get() + 1)));
    assert_eq!(r.err(), Some(Turned::Deadline));
    assert!(looks.get() >= 2, "{}", looks.get());
    assert_eq!(q.waiting(), 0);
}

#[test]
fn shares_are_max_min_fair_by_weight() {
    let shares = allocate(
        10,
        vec![(name("a"), 1, 1), (name("b"), 100, 1), (name("c"), 100, 3)],
    );
    // b and c share the 9 left 1:3, rounded to add up: 2 and 7.
    assert_eq!((shares["a"], shares["b"], shares["c"]), (1, 2, 7));
    // Two floods on 5 places: all 5 given (3 and 2), none idle.
    let two = allocate(5, vec![(name("x"), 100, 1), (name("y"), 100, 1)]);
    assert_eq!(two["x"] + two["y"], 5);
    let alone = allocate(10, vec![(name("b"), 100, 1)]);
    assert_eq!(alone["b"], 10);
}

#[test]
fn a_turn_longer_than_the_window_keeps_its_place_from_when_it_ended() {
    let q = Arc::new(Queue::default());
    let now = Instant::now();
    let Some(long_ago) = now.checked_sub(Duration::from_secs(20)) else {
        return;
    };
    let places = |free| Places { free, total: 4 };
    // A 20 s turn, ended just now.
    drop(pass(&q, "agent", places(4), long_ago));
    let mut flood: Vec<Pass> = (0..3).map(|_| pass(&q, "flood", places(4), now)).collect();
    flood.iter_mut().for_each(Pass::placed);
    // The fourth place stays the agent's.
    let _waiting = wait(&q, "flood", Class::Standard, 1, places(1), now);
}

#[test]
fn a_tenants_priority_requests_go_before_its_standard_ones() {
    let q = Arc::new(Queue::default());
    let now = Instant::now();
    let mut waiters = vec![
        (
            "standard".to_owned(),
            wait(&q, "t", Class::Standard, 1, FULL, now),
        ),
        (
            "priority".to_owned(),
            wait(&q, "t", Class::Priority, 1, FULL, now),
        ),
    ];
    let mut passes = Vec::new();
    q.dispatch(
        || Places {
            free: 1,
            total: 100,
        },
        terms(now),
    );
    assert_eq!(through(&mut waiters, &mut passes), ["priority"]);
}
