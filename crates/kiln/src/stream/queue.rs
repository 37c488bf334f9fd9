//! The bounded queue between a stream's decoder and its model: the decoder runs ahead by at
//! most `capacity` frames, and when the model falls behind the policy says what happens to a
//! new frame (`DecodeOptions::on_overload`, `kiln bench --on-overload`): wait for room
//! (`block`: every frame is processed, the decoder slows to the model's pace, as for a
//! file) or drop the oldest waiting frame
//! (`drop-oldest`: the model always gets the newest frame, as for a live camera; each drop is
//! counted).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::names::config_names;

/// What a full frame queue does with a new frame (`--on-overload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OverloadPolicy {
    /// The producer waits for room: no frame is lost (files, offline processing).
    Block,
    /// The oldest waiting frame is dropped and counted: the consumer always gets the newest
    /// frames (live cameras, a frame-rate budget).
    DropOldest,
}

config_names!(OverloadPolicy {
    Block => "block",
    DropOldest => "drop-oldest",
});

struct State<T> {
    items: VecDeque<T>,
    /// The producer is done (end of stream or its error).
    closed: bool,
    /// The consumer went away: the producer should stop.
    abandoned: bool,
    dropped: u64,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
    capacity: usize,
    policy: OverloadPolicy,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding the lock cannot leave the queue half-updated (every update is
        // one push or pop), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The producer's end of a [`frame_queue`]; closing it (or dropping it) ends the stream.
pub struct FrameSender<T> {
    shared: Arc<Shared<T>>,
}

/// The consumer's end of a [`frame_queue`]; dropping it tells the producer to stop.
pub struct FrameReceiver<T> {
    shared: Arc<Shared<T>>,
}

/// A queue holding at most `capacity` (≥ 1) frames, with `policy` for a full queue.
pub fn frame_queue<T>(
    capacity: usize,
    policy: OverloadPolicy,
) -> (FrameSender<T>, FrameReceiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::with_capacity(capacity.max(1)),
            closed: false,
            abandoned: false,
            dropped: 0,
        }),
        changed: Condvar::new(),
        capacity: capacity.max(1),
        policy,
    });
    (
        FrameSender {
            shared: Arc::clone(&shared),
        },
        FrameReceiver { shared },
    )
}

impl<T> FrameSender<T> {
    /// Queues `item` under the queue's policy; `false` when the consumer is gone (stop
    /// producing).
    pub fn push(&self, item: T) -> bool {
        let mut s = self.shared.lock();
        loop {
            if s.abandoned {
                return false;
            }
            if s.items.len() < self.shared.capacity {
                break;
            }
            match self.shared.policy {
                OverloadPolicy::DropOldest => {
                    s.items.pop_front();
                    s.dropped += 1;
                    break;
                }
                OverloadPolicy::Block => {
                    s = self
                        .shared
                        .changed
                        .wait(s)
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
        }
        s.items.push_back(item);
        drop(s);
        self.shared.changed.notify_all();
        true
    }

    /// Whether the consumer went away.
    pub fn abandoned(&self) -> bool {
        self.shared.lock().abandoned
    }
}

impl<T> Drop for FrameSender<T> {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.changed.notify_all();
    }
}

impl<T> FrameReceiver<T> {
    /// The next frame, waiting for one; `None` once the producer closed and the queue is
    /// empty.
    pub fn pop(&self) -> Option<T> {
        let mut s = self.shared.lock();
        loop {
            if let Some(item) = s.items.pop_front() {
                drop(s);
                self.shared.changed.notify_all();
                return Some(item);
            }
            if s.closed {
                return None;
            }
            s = self
                .shared
                .changed
                .wait(s)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Frames dropped so far under [`OverloadPolicy::DropOldest`].
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }
}

impl<T> Drop for FrameReceiver<T> {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        s.abandoned = true;
        s.items.clear();
        drop(s);
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn block_keeps_every_frame_in_order() {
        let (tx, rx) = frame_queue(2, OverloadPolicy::Block);
        let producer = std::thread::spawn(move || {
            for i in 0..50 {
                assert!(tx.push(i));
            }
        });
        let mut got = Vec::new();
        while let Some(i) = rx.pop() {
            got.push(i);
            std::thread::sleep(Duration::from_micros(200));
        }
        producer.join().unwrap();
        assert_eq!(got, (0..50).collect::<Vec<_>>());
        assert_eq!(rx.dropped(), 0);
    }

    #[test]
    fn drop_oldest_keeps_the_newest_frames_and_counts_the_rest() {
        let (tx, rx) = frame_queue(3, OverloadPolicy::DropOldest);
        for i in 0..10 {
            assert!(tx.push(i));
        }
        drop(tx);
        let got: Vec<i32> = std::iter::from_fn(|| rx.pop()).collect();
        assert_eq!(got, vec![7, 8, 9]);
        assert_eq!(rx.dropped(), 7);
    }

    #[test]
    fn a_blocked_producer_stops_when_the_consumer_goes_away() {
        let (tx, rx) = frame_queue(1, OverloadPolicy::Block);
        let producer = std::thread::spawn(move || {
            let mut pushed = 0;
            while tx.push(pushed) {
                pushed += 1;
            }
            pushed
        });
        assert_eq!(rx.pop(), Some(0));
        drop(rx);
        // The producer is told instead of waiting forever for room.
        let pushed = producer.join().unwrap();
        assert!(pushed >= 1);
    }

    #[test]
    fn the_policies_have_their_config_names() {
        assert_eq!(
            OverloadPolicy::from_name("drop-oldest"),
            Some(OverloadPolicy::DropOldest)
        );
        assert_eq!(OverloadPolicy::Block.name(), "block");
        assert_eq!(OverloadPolicy::from_name("newest"), None);
    }
}
