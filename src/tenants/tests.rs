use std::time::Duration;

use super::*;
use crate::auth::ApiKeys;

fn tenants(yaml: &str) -> (Arc<Tenants>, Arc<Rules>) {
    let c: config::Tenants = serde_yaml::from_str(yaml).unwrap();
    (
        Tenants::new(Metrics::standalone()),
        Arc::new(Rules::new(&c)),
    )
}

fn named(rules: &Rules, name: &str) -> Tenant {
    rules.identify(None, Some(name.as_bytes())).unwrap()
}

fn retry_ms(e: RouterError) -> u64 {
    match e {
        RouterError::RateLimited { retry_after_ms, .. } => retry_after_ms,
        e => panic!("{e:?}"),
    }
}

#[test]
fn requests_in_progress_are_capped_until_one_ends() {
    let (t, rules) = tenants("{header: x-tenant, default: {max_concurrent: 2}}");
    let a = named(&rules, "a");
    let now = Instant::now();
    let first = t.arrive(&rules, &a, now).unwrap();
    let _second = t.arrive(&rules, &a, now).unwrap();
    assert_eq!(retry_ms(t.arrive(&rules, &a, now).err().unwrap()), 1000);
    // Another tenant is not held back.
    t.arrive(&rules, &named(&rules, "b"), now).unwrap();
    drop(first);
    t.arrive(&rules, &a, now).unwrap();
}

#[test]
fn requests_per_minute_refill_and_say_when() {
    let (t, rules) = tenants("{header: x-tenant, named: {a: {requests_per_minute: 60}}}");
    let a = named(&rules, "a");
    let t0 = Instant::now();
    for _ in 0..60 {
        let admitted = t.arrive(&rules, &a, t0).unwrap();
        assert!(admitted.headers().requests.is_some());
    }
    assert_eq!(retry_ms(t.arrive(&rules, &a, t0).err().unwrap()), 1000);
    let later = t.arrive(&rules, &a, t0 + Duration::from_secs(1)).unwrap();
    assert_eq!(later.headers().requests.unwrap().remaining, 0);
    // `default` has no limit: another tenant is unlimited.
    for _ in 0..100 {
        let b = t.arrive(&rules, &named(&rules, "b"), t0).unwrap();
        assert_eq!(b.headers(), &RateHeaders::default());
    }
}

#[test]
fn a_token_debt_reported_by_the_engine_holds_the_next_request_until_paid() {
    let (t, rules) = tenants("{default: {prompt_tokens_per_minute: 6000}}");
    let anon = rules.identify(None, None).unwrap();
    assert_eq!(&*anon.name, ANONYMOUS);
    let t0 = Instant::now();
    let mut first = t.arrive(&rules, &anon, t0).unwrap();
    first.charge(1000, t0).unwrap();
    // The engine counted 8000: 2000 owed, paid back in 20 s.
    first.correct(8000);
    drop(first);
    let e = t.arrive(&rules, &anon, t0).err().unwrap();
    assert_eq!(retry_ms(e), 20_010);
    // A refused head costs nothing: the same wait after it.
    assert_eq!(retry_ms(t.arrive(&rules, &anon, t0).err().unwrap()), 20_010);
    let mut next = t
        .arrive(&rules, &anon, t0 + Duration::from_secs(21))
        .unwrap();
    // 100 left: a 500-token prompt waits for 400 more (4 s).
    assert_eq!(
        retry_ms(next.charge(500, t0 + Duration::from_secs(21)).unwrap_err()),
        4000
    );
}

#[test]
fn a_refused_charge_gives_its_request_back_once() {
    let (t, rules) = tenants("{default: {requests_per_minute: 2, prompt_tokens_per_minute: 100}}");
    let anon = rules.identify(None, None).unwrap();
    let t0 = Instant::now();
    let mut a = t.arrive(&rules, &anon, t0).unwrap();
    a.charge(90, t0).unwrap();
    let mut b = t.arrive(&rules, &anon, t0).unwrap();
    assert!(b.charge(50, t0).is_err());
    b.refund();
    b.refund();
    drop(b);
    // The refused request's one is back: two more heads fit.
    t.arrive(&rules, &anon, t0).unwrap();
    assert!(t.arrive(&rules, &anon, t0).is_err());
}

#[test]
fn a_key_names_its_tenant_and_only_a_gateway_key_lets_the_header_name_it() {
    let (_, rules) = tenants("{header: x-tenant, named: {gold: {class: priority}}}");
    let digest = |k: &str| {
        use sha2::Digest;
        sha2::Sha256::digest(k.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let keys = ApiKeys::parse(&format!(
        "{} tenant=acme class=standard\n{}\n{} gateway\n",
        digest("k1"),
        digest("k2"),
        digest("gw")
    ))
    .unwrap();
    let (k1, k2, gw) = (keys.find(b"k1"), keys.find(b"k2"), keys.find(b"gw"));
    let t = rules.identify(k1, Some(b"gold")).unwrap();
    assert_eq!(
        (&*t.name, t.class, t.label()),
        ("acme", Class::Standard, "acme")
    );
    // An unnamed key is its own tenant, whatever the header says; its
    // name (its digest) is never shown.
    let t = rules.identify(k2, Some(b"gold")).unwrap();
    assert!(t.name.starts_with("key-") && t.class == Class::Standard);
    assert_eq!(
        (t.label(), t.shown().as_str()),
        (UNNAMED_KEY, "this API key")
    );
    // A gateway's requests are named by the header.
    let t = rules.identify(gw, Some(b"gold")).unwrap();
    assert_eq!(
        (&*t.name, t.class, t.label()),
        ("gold", Class::Priority, "gold")
    );
    let t = rules.identify(gw, Some(b"team-x")).unwrap();
    assert_eq!((&*t.name, t.label()), ("team-x", OTHER));
    assert!(rules.identify(gw, None).unwrap().name.starts_with("key-"));
    for bad in [&b"a b"[..], b"other", b""] {
        assert!(rules.identify(None, Some(bad)).is_none(), "{bad:?}");
    }
    // Without a configured header, a header value names nothing.
    let (_, plain) = tenants("{}");
    assert_eq!(
        &*plain.identify(None, Some(b"gold")).unwrap().name,
        ANONYMOUS
    );
}

#[test]
fn a_limit_of_zero_is_no_limit() {
    let (t, rules) = tenants(
        "{default: {max_concurrent: 0, requests_per_minute: 0, prompt_tokens_per_minute: 0}}",
    );
    let anon = rules.identify(None, None).unwrap();
    let t0 = Instant::now();
    let held: Vec<_> = (0..100)
        .map(|_| {
            let mut a = t.arrive(&rules, &anon, t0).unwrap();
            a.charge(1_000_000, t0).unwrap();
            a
        })
        .collect();
    assert_eq!(held[0].headers(), &RateHeaders::default());
}

#[test]
fn a_limit_set_by_a_reload_starts_full() {
    let (t, before) = tenants("{}");
    let anon = before.identify(None, None).unwrap();
    let t0 = Instant::now();
    drop(t.arrive(&before, &anon, t0).unwrap());
    let (_, after) = tenants("{default: {requests_per_minute: 60}}");
    let a = t
        .arrive(&after, &anon, t0 + Duration::from_secs(1))
        .unwrap();
    assert_eq!(a.headers().requests.unwrap().remaining, 59);
}

#[test]
fn past_max_tracked_idle_tenants_are_let_go_and_then_header_names_share_other() {
    let (t, rules) = tenants("{header: x-tenant, max_tracked: 2, default: {max_concurrent: 1}}");
    let t0 = Instant::now();
    let a = t.arrive(&rules, &named(&rules, "a"), t0).unwrap();
    drop(t.arrive(&rules, &named(&rules, "b"), t0).unwrap());
    // `b` is idle: let go for `c`.
    let _c = t.arrive(&rules, &named(&rules, "c"), t0).unwrap();
    assert_eq!(t.tracked(), 2);
    // Nothing idle: `d` shares `other` and its one request in progress.
    let d = t.arrive(&rules, &named(&rules, "d"), t0).unwrap();
    assert_eq!(d.tenant(), OTHER);
    assert!(t.arrive(&rules, &named(&rules, "e"), t0).is_err());
    drop(a);
}
