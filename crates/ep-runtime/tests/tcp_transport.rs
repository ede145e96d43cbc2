//! The TCP mesh transport across ranks that are threads of this process, on 127.0.0.1.

use ep_runtime::bootstrap::{Store, StoreConfig};
use ep_runtime::transport::{TcpTransport, Transport};
use ep_runtime::Error;
use rand::Rng;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const SETUP: Duration = Duration::from_secs(20);

/// Runs `f(store)` on `world` ranks as threads (rank 0 hosting the store on a free port) and
/// returns the results by rank.
fn run_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Store) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (port_tx, port_rx) = mpsc::channel::<u16>();
    let port_rx = Arc::new(Mutex::new(port_rx));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            let port_tx = port_tx.clone();
            let port_rx = port_rx.clone();
            thread::spawn(move || {
                let port = if rank == 0 {
                    0
                } else {
                    port_rx.lock().unwrap().recv().unwrap()
                };
                let cfg = StoreConfig::new(rank, world, "127.0.0.1", port)
                    .unwrap()
                    .with_timeout(SETUP)
                    .unwrap();
                let store = Store::connect(cfg).unwrap();
                if rank == 0 {
                    let port = store.server_addr().unwrap().port();
                    for _ in 1..world {
                        port_tx.send(port).unwrap();
                    }
                }
                f(store)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn random_payload(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

#[test]
fn four_ranks_exchange_random_payloads_under_several_tags() {
    const WORLD: usize = 4;
    const TAGS: [u64; 4] = [3, 4, 9, 1 << 40];
    let mut rng = rand::rng();
    // payloads[src][dst][t]: empty, small, mid-sized and multi-MB messages mixed over the
    // tags, different for every pair, so a misrouted message shows.
    let payloads: Vec<Vec<Vec<Vec<u8>>>> = (0..WORLD)
        .map(|_| {
            (0..WORLD)
                .map(|_| {
                    (0..TAGS.len())
                        .map(|t| {
                            let len = match (t + rng.random_range(0..4)) % 4 {
                                0 => 0,
                                1 => rng.random_range(1..100),
                                2 => rng.random_range(60_000..70_000),
                                _ => rng.random_range(2_000_000..4_000_000),
                            };
                            random_payload(&mut rng, len)
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let payloads = Arc::new(payloads);
    run_ranks(WORLD, move |store| {
        let r = store.rank();
        let a = TcpTransport::connect(&store, "a", SETUP).unwrap();
        // A second transport on the same store, in another group.
        let b = TcpTransport::connect(&store, "b", SETUP).unwrap();
        assert_eq!((a.rank(), a.num_ranks()), (r, WORLD));
        assert_eq!(b.group(), "b");

        let deadline = Instant::now() + Duration::from_secs(30);
        for (t, &tag) in TAGS.iter().enumerate() {
            for dst in 0..WORLD {
                a.send(dst, tag, payloads[r][dst][t].clone()).unwrap();
            }
        }
        // Group b carries each pair's first payload reversed, under tag 7.
        for dst in 0..WORLD {
            b.send(dst, 7, payloads[r][dst][0].iter().rev().copied().collect())
                .unwrap();
        }
        for (t, &tag) in TAGS.iter().enumerate() {
            for i in 0..WORLD {
                let src = (r + WORLD - i) % WORLD;
                let got = a.recv(src, tag, deadline).unwrap();
                assert!(got == payloads[src][r][t], "rank {r} <- {src}, tag {tag}");
            }
        }
        for src in 0..WORLD {
            let got = b.recv(src, 7, deadline).unwrap();
            let want: Vec<u8> = payloads[src][r][0].iter().rev().copied().collect();
            assert!(got == want, "group b: rank {r} <- {src}");
        }
        store.barrier("done").unwrap();
    });
}

#[test]
fn smaller_tags_are_dropped_and_equal_tags_queue() {
    let mut rng = rand::rng();
    let msgs: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..4)
            .map(|_| {
                let len = rng.random_range(1..1000);
                random_payload(&mut rng, len)
            })
            .collect(),
    );
    run_ranks(2, move |store| {
        let t = TcpTransport::connect(&store, "tags", SETUP).unwrap();
        if store.rank() == 0 {
            t.send(1, 1, msgs[0].clone()).unwrap();
            t.send(1, 2, msgs[1].clone()).unwrap();
            t.send(1, 2, msgs[2].clone()).unwrap();
            t.send(1, 5, msgs[3].clone()).unwrap();
        } else {
            let far = Instant::now() + Duration::from_secs(10);
            // Wait for the last one first: then all four are buffered.
            assert_eq!(t.recv(0, 5, far).unwrap(), msgs[3]);
            // Tags 1 and 2 were never received before tag 5: they are gone.
            let soon = Instant::now() + Duration::from_millis(50);
            assert!(matches!(
                t.recv(0, 2, soon),
                Err(Error::Timeout { rank: 0, .. })
            ));
        }
        store.barrier("mid").unwrap();
        if store.rank() == 0 {
            t.send(1, 6, msgs[1].clone()).unwrap();
            t.send(1, 6, msgs[2].clone()).unwrap();
        } else {
            let far = Instant::now() + Duration::from_secs(10);
            // Two messages under one tag arrive in order.
            assert_eq!(t.recv(0, 6, far).unwrap(), msgs[1]);
            assert_eq!(t.recv(0, 6, far).unwrap(), msgs[2]);
        }
        store.barrier("done").unwrap();
    });
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let results = run_ranks(3, |store| {
        let t = TcpTransport::connect(&store, "silent", SETUP).unwrap();
        let mut out = None;
        if store.rank() == 0 {
            let limit = Duration::from_millis(300);
            let start = Instant::now();
            let err = t.recv(2, 11, start + limit).unwrap_err();
            out = Some((err, start.elapsed()));
        }
        store.barrier("done").unwrap();
        out
    });
    let (err, elapsed) = results.into_iter().next().unwrap().unwrap();
    assert!(matches!(err, Error::Timeout { rank: 2, .. }), "{err}");
    assert!(err.to_string().contains("11"), "{err}");
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
}

#[test]
fn a_peer_that_leaves_is_reported_lost_after_its_last_message() {
    let last: Vec<u8> = {
        let mut rng = rand::rng();
        let len = rng.random_range(100_000..300_000);
        random_payload(&mut rng, len)
    };
    let last = Arc::new(last);
    let results = run_ranks(3, move |store| {
        let t = TcpTransport::connect(&store, "leave", SETUP).unwrap();
        let r = store.rank();
        store.barrier("connected").unwrap();
        if r == 2 {
            // Send a last message to rank 0, then leave.
            t.send(0, 21, last.to_vec()).unwrap();
            drop(t);
            store.barrier("left").unwrap();
            return None;
        }
        store.barrier("left").unwrap();
        let start = Instant::now();
        let far = start + Duration::from_secs(20);
        if r == 0 {
            // The message sent before leaving still arrives.
            assert_eq!(t.recv(2, 21, far).unwrap(), *last);
        }
        let err = t.recv(2, 22, far).unwrap_err();
        let elapsed = start.elapsed();
        // Sending to the lost peer fails soon too (the first writes may still be buffered).
        let mut send_failed = false;
        for _ in 0..100 {
            if t.send(2, 23, vec![r as u8; 1 << 16]).is_err() {
                send_failed = true;
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
        // The surviving ranks still talk to each other.
        let other = 1 - r;
        t.send(other, 30, vec![r as u8; 17]).unwrap();
        assert_eq!(t.recv(other, 30, far).unwrap(), vec![other as u8; 17]);
        Some((err, elapsed, send_failed))
    });
    for (r, res) in results.into_iter().enumerate().take(2) {
        let (err, elapsed, send_failed) = res.unwrap();
        assert!(
            matches!(err, Error::PeerLost { rank: 2, .. }),
            "rank {r}: {err}"
        );
        assert!(elapsed < Duration::from_secs(2), "rank {r}: {elapsed:?}");
        assert!(
            send_failed,
            "rank {r}: sends to the lost peer kept succeeding"
        );
    }
}

#[test]
fn a_message_of_hundreds_of_megabytes_arrives_intact() {
    let mut rng = rand::rng();
    let len = (200 << 20) + rng.random_range(0..4096);
    let big = Arc::new(random_payload(&mut rng, len));
    run_ranks(2, move |store| {
        let t = TcpTransport::connect(&store, "big", SETUP).unwrap();
        let far = Instant::now() + Duration::from_secs(120);
        if store.rank() == 0 {
            t.send(1, 1, big.to_vec()).unwrap();
            assert_eq!(t.recv(1, 2, far).unwrap(), b"ok");
        } else {
            let got = t.recv(0, 1, far).unwrap();
            assert_eq!(got.len(), big.len());
            assert!(got == *big, "payload corrupted");
            t.send(0, 2, b"ok".to_vec()).unwrap();
        }
        store.barrier("done").unwrap();
    });
}

#[test]
fn bad_peer_index_is_an_invalid_argument() {
    run_ranks(2, |store| {
        let t = TcpTransport::connect(&store, "bad", SETUP).unwrap();
        let err = t.send(2, 0, vec![1]).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { arg: "peer", .. }),
            "{err}"
        );
        let err = t.recv(7, 0, Instant::now()).unwrap_err();
        assert!(err.to_string().contains('7'), "{err}");
        store.barrier("done").unwrap();
    });
}
