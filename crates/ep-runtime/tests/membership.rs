//! Agreeing on lost ranks ([`Membership`]) across ranks that are threads of this process, each
//! with its own bootstrap store client and TCP buffer on 127.0.0.1: a rank that is gone, a rank
//! that stalls, and rank 0 (the store's host) gone.

use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use candle_core::Device;
use ep_runtime::bootstrap::{Store, StoreConfig};
use ep_runtime::{Buffer, BufferConfig, Error, Membership, Topology};

/// Runs `f(store, buffer)` on `world` ranks as threads (rank 0 hosting the store on a free
/// port), buffers timing out after `timeout`; returns the results by rank.
fn run_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(Arc<Store>, Arc<Buffer>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (port_tx, port_rx) = mpsc::channel::<u16>();
    let port_rx = Arc::new(Mutex::new(port_rx));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (f, port_tx, port_rx) = (f.clone(), port_tx.clone(), port_rx.clone());
            thread::spawn(move || {
                let port = if rank == 0 {
                    0
                } else {
                    port_rx.lock().unwrap().recv().unwrap()
                };
                let cfg = StoreConfig::new(rank, world, "127.0.0.1", port)
                    .unwrap()
                    .with_timeout(Duration::from_secs(20))
                    .unwrap();
                let store = Store::connect(cfg).unwrap();
                if rank == 0 {
                    let port = store.server_addr().unwrap().port();
                    for _ in 1..world {
                        port_tx.send(port).unwrap();
                    }
                }
                let topology = Topology::new(rank, world, world).unwrap();
                let config = BufferConfig::default().with_timeout(timeout);
                let buffer = Buffer::from_store(&store, topology, config, &Device::Cpu).unwrap();
                f(Arc::new(store), Arc::new(buffer))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Rank 3 leaves after one all-gather (its sockets close). Rank 2 notices first and agrees
/// while ranks 0 and 1 are still waiting in the next all-gather for rank 2: their wait is
/// cancelled at once (not timed out, not blamed on rank 2), every survivor gets the same
/// decision, and their next all-gathers run without rank 3.
#[test]
fn survivors_agree_on_a_gone_rank_without_waiting_out_the_timeout() {
    let timeout = Duration::from_secs(30);
    let res = run_ranks(4, timeout, move |store, buffer| {
        let me = buffer.topology().rank;
        let mut membership = Membership::new(store, buffer.clone()).unwrap();
        buffer.host_all_gather(&[me as u8]).unwrap();
        if me == 3 {
            return None;
        }
        let start = Instant::now();
        let broke = if me == 2 {
            // Rank 2 saw rank 3 fail in a collective of its own (which masks the peer) and goes
            // straight to the agreement.
            thread::sleep(Duration::from_millis(200));
            buffer.mask_rank(3).unwrap();
            None
        } else {
            Some(buffer.host_all_gather(&[me as u8]).unwrap_err())
        };
        let agreement = membership.agree().unwrap();
        let took = start.elapsed();
        let after = buffer.host_all_gather(&[10 + me as u8]).unwrap();
        Some((broke, agreement, took, after, buffer.active_ranks()))
    });
    for (me, got) in res.into_iter().enumerate() {
        let Some((broke, agreement, took, after, active)) = got else {
            assert_eq!(me, 3);
            continue;
        };
        if let Some(e) = broke {
            assert!(matches!(e, Error::Cancelled { .. }), "rank {me}: {e}");
        }
        assert_eq!(agreement.epoch, 0);
        assert_eq!(agreement.lost, vec![false, false, false, true], "rank {me}");
        assert_eq!(agreement.newly_lost, vec![3], "rank {me}");
        assert!(took < Duration::from_secs(5), "rank {me}: took {took:?}");
        assert_eq!(
            after,
            vec![vec![10], vec![11], vec![12], vec![]],
            "rank {me}"
        );
        assert_eq!(active, vec![true, true, true, false], "rank {me}");
    }
}

/// Rank 2 stalls past the timeout with its sockets open: the others time out on it, agree that
/// it is lost and go on; when it wakes up, its own agreement tells it that it was found lost.
#[test]
fn a_stalled_rank_is_found_lost_and_told_so_when_it_wakes() {
    let timeout = Duration::from_millis(500);
    // Rank 0 keeps the store up until rank 2 has heard the decision.
    let end = Arc::new(std::sync::Barrier::new(3));
    let res = run_ranks(3, timeout, move |store, buffer| {
        let me = buffer.topology().rank;
        let mut membership = Membership::new(store, buffer.clone()).unwrap();
        if me == 2 {
            thread::sleep(timeout * 4);
            let e = membership.agree().unwrap_err();
            end.wait();
            return Err(e);
        }
        let e = buffer.host_all_gather(&[me as u8]).unwrap_err();
        assert_eq!(e.rank(), Some(2), "rank {me}: {e}");
        let agreement = membership.agree().unwrap();
        let after = buffer.host_all_gather(&[me as u8]).unwrap();
        // The second round of agreement numbers (nothing lost this time).
        let again = membership.agree().unwrap();
        end.wait();
        Ok((agreement, after, again))
    });
    for (me, got) in res.into_iter().enumerate() {
        match got {
            Err(e) => {
                assert_eq!(me, 2);
                assert!(matches!(e, Error::FoundLost { rank: 2 }), "{e}");
                assert!(e.to_string().contains("found rank 2 lost"), "{e}");
            }
            Ok((agreement, after, again)) => {
                assert_eq!(agreement.lost, vec![false, false, true], "rank {me}");
                assert_eq!(after, vec![vec![0], vec![1], vec![]], "rank {me}");
                assert_eq!(again.epoch, 1);
                assert!(again.newly_lost.is_empty(), "rank {me}");
                assert_eq!(again.lost, vec![false, false, true], "rank {me}");
            }
        }
    }
}

/// Rank 0 hosts the store: when it is gone, the others cannot agree, and the error names it.
#[test]
fn without_rank_0_the_agreement_fails_naming_it() {
    let timeout = Duration::from_secs(2);
    let res = run_ranks(3, timeout, move |store, buffer| {
        let me = buffer.topology().rank;
        let mut membership = Membership::new(store.clone(), buffer.clone()).unwrap();
        buffer.host_all_gather(&[me as u8]).unwrap();
        if me == 0 {
            drop(membership);
            drop(buffer);
            drop(store);
            return None;
        }
        let e = buffer.host_all_gather(&[me as u8]).unwrap_err();
        Some((e, membership.agree().unwrap_err()))
    });
    for (me, got) in res.into_iter().enumerate().skip(1) {
        let (broke, agree) = got.unwrap();
        assert_eq!(broke.rank(), Some(0), "rank {me}: {broke}");
        assert_eq!(agree.rank(), Some(0), "rank {me}: {agree}");
        assert!(agree.to_string().contains("rank 0"), "{agree}");
    }
}
