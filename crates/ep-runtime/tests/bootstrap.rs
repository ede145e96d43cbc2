//! The bootstrap store across ranks that are threads of this process, on 127.0.0.1.

use ep_runtime::bootstrap::{Store, StoreConfig};
use ep_runtime::Error;
use rand::Rng;
use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

const LOOPBACK: &str = "127.0.0.1";

fn cfg(rank: usize, world: usize, port: u16, timeout: Duration) -> StoreConfig {
    StoreConfig::new(rank, world, LOOPBACK, port)
        .unwrap()
        .with_timeout(timeout)
        .unwrap()
}

/// Starts rank 0 (hosting the server on a free port) and returns it with the port.
fn start_rank0(world: usize, timeout: Duration) -> (Store, u16) {
    let store = Store::connect(cfg(0, world, 0, timeout)).unwrap();
    let port = store.server_addr().expect("rank 0 hosts the server").port();
    (store, port)
}

/// Runs `f(store)` on `world` ranks as threads and returns their results by rank.
fn run_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(Store) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (port_tx, port_rx) = mpsc::channel();
    let mut handles = Vec::new();
    {
        let f = f.clone();
        handles.push(thread::spawn(move || {
            let (store, port) = start_rank0(world, timeout);
            for _ in 1..world {
                port_tx.send(port).unwrap();
            }
            f(store)
        }));
    }
    let port_rx = Arc::new(std::sync::Mutex::new(port_rx));
    for rank in 1..world {
        let f = f.clone();
        let port_rx = port_rx.clone();
        handles.push(thread::spawn(move || {
            let port = port_rx.lock().unwrap().recv().unwrap();
            f(Store::connect(cfg(rank, world, port, timeout)).unwrap())
        }));
    }
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn random_bytes(rng: &mut impl Rng, max_len: usize) -> Vec<u8> {
    let len = rng.random_range(0..=max_len);
    (0..len).map(|_| rng.random()).collect()
}

#[test]
fn four_ranks_set_get_add_barrier_all_gather() {
    const WORLD: usize = 4;
    let mut rng = rand::rng();
    // Per rank: a value to publish, a counter increment, two all-gather contributions (the
    // second one empty for rank 2, to cover empty values).
    let values: Vec<Vec<u8>> = (0..WORLD).map(|_| random_bytes(&mut rng, 5000)).collect();
    let deltas: Vec<i64> = (0..WORLD).map(|_| rng.random_range(-1000..1000)).collect();
    let gathers: Vec<[Vec<u8>; 2]> = (0..WORLD)
        .map(|r| {
            let second = if r == 2 {
                Vec::new()
            } else {
                random_bytes(&mut rng, 300)
            };
            [random_bytes(&mut rng, 70_000), second]
        })
        .collect();
    let (values, deltas, gathers) = (Arc::new(values), Arc::new(deltas), Arc::new(gathers));
    let expected_sum: i64 = deltas.iter().sum();

    let results = run_ranks(WORLD, Duration::from_secs(20), move |store| {
        let r = store.rank();
        assert_eq!(store.world_size(), WORLD);
        assert_eq!(store.config().rank, r);
        assert!(store.local_addr().is_loopback());
        assert_eq!(store.server_addr().is_some(), r == 0);

        store.set(&format!("value/{r}"), &values[r]).unwrap();
        // Read the peers' values in a rank-dependent order; some may not be set yet.
        for i in 0..WORLD {
            let p = (r + i) % WORLD;
            assert_eq!(
                store.get(&format!("value/{p}")).unwrap(),
                values[p],
                "rank {r} <- {p}"
            );
        }
        assert_eq!(store.try_get("never-set").unwrap(), None);

        store.add("sum", deltas[r]).unwrap();
        let ticket = store.add("ticket", 1).unwrap();
        store.barrier("after-add").unwrap();
        let sum = store.try_get("sum").unwrap().expect("counter exists");
        assert_eq!(i64::from_le_bytes(sum.try_into().unwrap()), expected_sum);
        assert_eq!(store.add("sum", 0).unwrap(), expected_sum);

        // All-gather twice under one name: each use is its own generation.
        for (round, contribution) in gathers[r].iter().enumerate() {
            let all = store.all_gather("g", contribution).unwrap();
            let want: Vec<Vec<u8>> = gathers.iter().map(|g| g[round].clone()).collect();
            assert_eq!(all, want, "rank {r}, round {round}");
        }
        // The same barrier name again, several times.
        for _ in 0..3 {
            store.barrier("after-add").unwrap();
        }
        store
            .wait(&["value/0", "value/3"], Duration::from_secs(1))
            .unwrap();
        let both = store
            .multi_get(&["value/1", "value/2"], Duration::from_secs(1))
            .unwrap();
        assert_eq!(both, vec![values[1].clone(), values[2].clone()]);
        // Everyone leaves together, so rank 0 (the server) does not leave first.
        store.barrier("end").unwrap();
        ticket
    });
    let mut tickets = results;
    tickets.sort_unstable();
    assert_eq!(tickets, vec![1, 2, 3, 4], "add must be atomic");
}

#[test]
fn one_store_shared_by_threads_does_not_block_itself() {
    // A get that waits must not hold up a set from another thread on the same Store: were
    // the connection held while waiting, the set would wait for the get's 10 s timeout and the
    // get would fail. The getter says when it is about to wait; whichever comes first, the get
    // or the set, the value must arrive, and over the rounds most gets wait before their set.
    let (store, _port) = start_rank0(1, Duration::from_secs(10));
    let store = Arc::new(store);
    let mut rng = rand::rng();
    for round in 0..20 {
        let key = format!("late-key/{round}");
        let value: Vec<u8> = random_bytes(&mut rng, 1000);
        let (about_to_wait, waiting) = std::sync::mpsc::channel();
        let getter = {
            let (store, key) = (store.clone(), key.clone());
            thread::spawn(move || {
                about_to_wait.send(()).unwrap();
                store.get(&key).unwrap()
            })
        };
        waiting.recv().unwrap();
        let start = Instant::now();
        store.set(&key, &value).unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "round {round}: the set waited {:?} behind the get",
            start.elapsed()
        );
        assert_eq!(getter.join().unwrap(), value);
        assert!(store.delete(&key).unwrap());
        assert!(!store.delete(&key).unwrap());
        assert_eq!(store.try_get(&key).unwrap(), None);
    }
}

#[test]
fn add_on_a_non_counter_value_is_an_error() {
    let (store, _port) = start_rank0(1, Duration::from_secs(10));
    store.set("blob", &[1, 2, 3]).unwrap();
    let err = store.add("blob", 1).unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert!(err.to_string().contains("blob"), "{err}");
    // The connection is still usable afterwards.
    assert_eq!(store.add("fresh", 5).unwrap(), 5);
}

#[test]
fn barrier_names_the_rank_that_never_arrives() {
    const WORLD: usize = 4;
    let limit = Duration::from_millis(400);
    let (rank0, port) = start_rank0(WORLD, Duration::from_secs(10));
    let others: Vec<Store> = (1..WORLD - 1)
        .map(|r| Store::connect(cfg(r, WORLD, port, Duration::from_secs(10))).unwrap())
        .collect();
    let start = Instant::now();
    let waiters: Vec<_> = others
        .into_iter()
        .map(|s| thread::spawn(move || s.barrier_timeout("late", limit).unwrap_err()))
        .collect();
    let err0 = rank0.barrier_timeout("late", limit).unwrap_err();
    let mut errors = vec![err0];
    errors.extend(waiters.into_iter().map(|h| h.join().unwrap()));
    let elapsed = start.elapsed();
    assert!(elapsed >= limit, "gave up early: {elapsed:?}");
    assert!(elapsed < limit + Duration::from_secs(3), "took {elapsed:?}");
    for err in errors {
        match &err {
            Error::Timeout { rank, what, .. } => {
                assert_eq!(*rank, 3, "{err}");
                assert!(what.contains("\"late\""), "{err}");
                assert!(what.contains("[3]"), "{err}");
            }
            other => panic!("expected a timeout naming rank 3, got {other}"),
        }
    }
}

#[test]
fn all_gather_names_every_missing_rank() {
    const WORLD: usize = 5;
    let (rank0, port) = start_rank0(WORLD, Duration::from_secs(10));
    let rank2 = Store::connect(cfg(2, WORLD, port, Duration::from_secs(10))).unwrap();
    let data: Vec<u8> = random_bytes(&mut rand::rng(), 64);
    let h = {
        let data = data.clone();
        thread::spawn(move || rank2.all_gather_timeout("ids", &data, Duration::from_millis(300)))
    };
    let err = rank0
        .all_gather_timeout("ids", &data, Duration::from_millis(300))
        .unwrap_err();
    let err2 = h.join().unwrap().unwrap_err();
    for e in [err, err2] {
        assert_eq!(e.rank(), Some(1), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("[1, 3, 4]"), "{msg}");
        assert!(msg.contains("ids"), "{msg}");
    }
}

#[test]
fn get_of_a_missing_key_times_out_naming_the_key() {
    let (store, _port) = start_rank0(2, Duration::from_millis(300));
    let err = store.get("nobody-writes-this").unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert!(err.to_string().contains("nobody-writes-this"), "{err}");
    // A per-rank key blames its rank.
    let err = store.get("addr/1").unwrap_err();
    assert!(matches!(err, Error::Timeout { rank: 1, .. }), "{err}");
}

#[test]
fn client_notices_the_server_dying() {
    let (rank0, port) = start_rank0(2, Duration::from_secs(30));
    let rank1 = Store::connect(cfg(1, 2, port, Duration::from_secs(30))).unwrap();
    // The server goes once the client says it is about to wait (a server gone before the get
    // fails it the same way).
    let (about_to_wait, started) = std::sync::mpsc::channel();
    let waiting = thread::spawn(move || {
        let start = Instant::now();
        about_to_wait.send(()).unwrap();
        let err = rank1.get("never-set/0").unwrap_err();
        (err, start.elapsed(), rank1)
    });
    started.recv().unwrap();
    drop(rank0);
    let (err, elapsed, rank1) = waiting.join().unwrap();
    assert!(
        elapsed < Duration::from_secs(10),
        "noticed only after {elapsed:?}"
    );
    assert!(matches!(err, Error::PeerLost { rank: 0, .. }), "{err}");
    // Later calls fail too, promptly.
    let start = Instant::now();
    let err = rank1.set("x", &[1]).unwrap_err();
    assert!(matches!(err, Error::PeerLost { rank: 0, .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn server_survives_clients_leaving() {
    let (rank0, port) = start_rank0(3, Duration::from_secs(10));
    let mut rng = rand::rng();
    for round in 0..3 {
        let value = random_bytes(&mut rng, 2000);
        let rank1 = Store::connect(cfg(1, 3, port, Duration::from_secs(10))).unwrap();
        rank1.set(&format!("round/{round}"), &value).unwrap();
        drop(rank1);
        assert_eq!(rank0.get(&format!("round/{round}")).unwrap(), value);
    }
    let rank2 = Store::connect(cfg(2, 3, port, Duration::from_secs(10))).unwrap();
    assert_eq!(rank2.add("n", 2).unwrap(), 2);
}

#[test]
fn mismatched_world_size_is_refused() {
    let (_rank0, port) = start_rank0(4, Duration::from_secs(10));
    let err = Store::connect(cfg(1, 3, port, Duration::from_secs(2))).unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("world_size = 3") && msg.contains("4"), "{msg}");
}

#[test]
fn connecting_to_no_server_times_out_naming_the_address() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind((LOOPBACK, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let err = Store::connect(cfg(1, 2, port, Duration::from_millis(500))).unwrap_err();
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(500) && elapsed < Duration::from_secs(4));
    match &err {
        Error::Timeout { rank: 0, what, .. } => {
            assert!(what.contains(&format!("MASTER_PORT={port}")), "{err}");
            assert!(what.contains(&format!("MASTER_ADDR={LOOPBACK}")), "{err}");
        }
        other => panic!("expected a timeout naming rank 0, got {other}"),
    }
}

fn lookup<'a>(vars: &'a HashMap<&'static str, String>) -> impl Fn(&str) -> Option<String> + 'a {
    move |name| vars.get(name).cloned()
}

fn good_vars() -> HashMap<&'static str, String> {
    let mut rng = rand::rng();
    let world = rng.random_range(2..64usize);
    let rank = rng.random_range(0..world);
    HashMap::from([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", "0".to_string()),
        ("LOCAL_WORLD_SIZE", "1".to_string()),
        ("MASTER_ADDR", "10.1.2.3".to_string()),
        ("MASTER_PORT", rng.random_range(1..=65535u16).to_string()),
    ])
}

#[test]
fn config_from_variables() {
    let vars = good_vars();
    let cfg = StoreConfig::from_lookup(lookup(&vars)).unwrap();
    assert_eq!(cfg.rank.to_string(), vars["RANK"]);
    assert_eq!(cfg.world_size.to_string(), vars["WORLD_SIZE"]);
    assert_eq!(cfg.master_port.to_string(), vars["MASTER_PORT"]);
    assert_eq!(cfg.master_addr, "10.1.2.3");
    assert_eq!(cfg.timeout, ep_runtime::bootstrap::DEFAULT_STORE_TIMEOUT);

    let mut with_timeout = vars.clone();
    with_timeout.insert("EP_STORE_TIMEOUT_SECS", "2.5".into());
    let cfg = StoreConfig::from_lookup(lookup(&with_timeout)).unwrap();
    assert_eq!(cfg.timeout, Duration::from_millis(2500));
}

#[test]
fn config_errors_name_the_variable_and_value() {
    let cases: Vec<(&str, Option<&str>, &str)> = vec![
        ("RANK", None, "<unset>"),
        ("RANK", Some("one"), "\"one\""),
        ("RANK", Some("999"), "999"),
        ("WORLD_SIZE", Some("-4"), "\"-4\""),
        ("WORLD_SIZE", Some("0"), "0"),
        ("LOCAL_RANK", Some("3"), "3"),
        ("LOCAL_WORLD_SIZE", None, "<unset>"),
        ("MASTER_ADDR", None, "<unset>"),
        ("MASTER_ADDR", Some("  "), "\"\""),
        ("MASTER_PORT", Some("70000"), "\"70000\""),
        ("MASTER_PORT", Some("http"), "\"http\""),
        ("EP_STORE_TIMEOUT_SECS", Some("-1"), "\"-1\""),
        ("EP_STORE_TIMEOUT_SECS", Some("soon"), "\"soon\""),
    ];
    for (var, value, shown) in cases {
        let mut vars = good_vars();
        match value {
            None => {
                vars.remove(var);
            }
            Some(v) => {
                vars.insert(var, v.to_string());
            }
        }
        let err = StoreConfig::from_lookup(lookup(&vars)).unwrap_err();
        match &err {
            Error::InvalidArgument { arg, value, .. } => {
                assert_eq!(*arg, var, "{err}");
                assert_eq!(value, shown, "{err}");
            }
            other => panic!("{var}={value:?}: expected InvalidArgument, got {other}"),
        }
    }
}

#[test]
fn config_from_the_process_environment() {
    // The only test in this binary that touches the environment.
    let vars = good_vars();
    for (k, v) in &vars {
        std::env::set_var(k, v);
    }
    std::env::set_var("EP_STORE_TIMEOUT_SECS", "7");
    let cfg = StoreConfig::from_env().unwrap();
    assert_eq!(cfg.rank.to_string(), vars["RANK"]);
    assert_eq!(cfg.timeout, Duration::from_secs(7));
    std::env::set_var("WORLD_SIZE", "many");
    let err = StoreConfig::from_env().unwrap_err();
    assert!(err.to_string().contains("WORLD_SIZE"), "{err}");
    assert!(err.to_string().contains("many"), "{err}");
}

#[test]
fn explicit_config_is_validated() {
    assert!(StoreConfig::new(4, 4, LOOPBACK, 0).is_err());
    assert!(StoreConfig::new(0, 0, LOOPBACK, 0).is_err());
    assert!(StoreConfig::new(1, 4, "", 0).is_err());
    let c = StoreConfig::new(5, 8, LOOPBACK, 0).unwrap();
    assert_eq!((c.local_rank, c.local_world_size), (5, 8));
    let c = c.with_local(1, 4).unwrap();
    assert_eq!((c.local_rank, c.local_world_size), (1, 4));
    let err = c.clone().with_local(4, 4).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                arg: "local_rank",
                ..
            }
        ),
        "{err}"
    );
    assert!(c.with_timeout(Duration::ZERO).is_err());
}

#[test]
fn store_works_when_created_inside_a_tokio_runtime() {
    // Serving programs (the example's HTTP server) may build the store from async code.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let value = random_bytes(&mut rand::rng(), 100);
    let got = rt.block_on(async {
        let (store, _port) = start_rank0(1, Duration::from_secs(5));
        store.set("k", &value).unwrap();
        let got = store.get("k").unwrap();
        drop(store);
        got
    });
    assert_eq!(got, value);
}
